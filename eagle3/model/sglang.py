"""The drafter for SGLang: the same weights, a config.json whose aux layer ids SGLang reads right.

(CLI: python -m tools.export_sglang.)

Read in SGLang's source (sglang 0.5.23, the PyPI wheel; paths below are under python/sglang/srt/),
SGLang loads our checkpoint exactly as vLLM does (architecture, weight names, d2t offsets, embedding
sharing, norms) except for one field: the aux layer ids.
- vLLM's id X is the residual stream entering target layer X (HF hidden_states[X]); SGLang captures
  the stream entering layer c for every c in `layers_to_capture` (models/llama.py LlamaModel.forward),
  and each target class turns the draft config's ids into those c its own way
  (set_eagle3_layers_to_capture): models/llama.py and most others `[val + 1 for val in layer_ids]`;
  models/deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2.5 through models/kimi_k25.py) adds 1 only when
  `layer_ids[0] == 1` (SGLang PR #25454). So the same trained drafter needs ids shifted by one.
- SGLang reads the ids only from `eagle_config.eagle_aux_hidden_state_layer_ids`
  (model_executor/model_runner_components/spec_aux_hidden_state.py); without them it falls back to
  (2, N//2, N-3) silently.
One file cannot carry both: vLLM reads a top-level list before eagle_config's, so vLLM ids at the top and
SGLang ids in eagle_config would load right in both engines, but every other reader (ours, SpecForge,
speculators) takes eagle_config's ids as the trained ones. Hence a second directory: the config differs,
the weights file is a hard link (a copy across file systems), never rewritten.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3.atomic import atomic_dir
from eagle3.errors import PipelineError
from eagle3.model.checkpoint import ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE, target_numbers, validate

DRAFTER_DIR, OUT_DIR, TARGET_DIR = Path("artifacts/drafter"), Path("artifacts/drafter-sglang"), Path("artifacts/target")
# Written into the exported config.json (SGLang ignores unknown keys): which convention its ids are in and
# the ids the drafter was trained with, so nobody serves this directory with vLLM by mistake unnoticed.
EXPORT_KEY = "eagle3_build_export"

# How the target's SGLang class maps a config id s to a capture point c (set_eagle3_layers_to_capture).
SHIFT = "shift"  # c = s + 1: models/llama.py (Llama, Phi3, InternLM3), qwen2.py, qwen3.py, qwen3_moe.py
SHIFT_IF_FIRST_IS_ONE = "shift-if-first-is-1"  # c = s + 1 if ids[0] == 1 else s: models/deepseek_v2.py
SGLANG_ID_RULES = {
    "LlamaForCausalLM": SHIFT,
    "Phi3ForCausalLM": SHIFT,
    "InternLM3ForCausalLM": SHIFT,
    "Qwen2ForCausalLM": SHIFT,
    "Qwen3ForCausalLM": SHIFT,
    "Qwen3MoeForCausalLM": SHIFT,
    "DeepseekV2ForCausalLM": SHIFT_IF_FIRST_IS_ONE,
    "DeepseekV3ForCausalLM": SHIFT_IF_FIRST_IS_ONE,
    "KimiK25ForConditionalGeneration": SHIFT_IF_FIRST_IS_ONE,  # delegates to its DeepSeek language model
}

# Config switches of models/llama_eagle3.py that build another network than ours; all default to false.
# norm_before_residual is not among SGLang's switches at all: its first layer always keeps the fc output
# (before hidden_norm) as the residual, so a drafter trained the other way cannot be served by SGLang.
SGLANG_MUST_BE_FALSE = ("tie_word_embeddings", "bias", "norm_before_fc", "fc_norm", "use_aux_norm",
                        "norm_output", "norm_before_residual")
# LlamaForCausalLMEagle3.load_weights (models/llama_eagle3.py): `midlayer` is renamed `layers.0`, q/k/v
# load into shards of qkv_proj and gate/up into gate_up_proj, a `model.` prefix is added where needed;
# d2t becomes hot_token_id (= d2t + arange), t2d is skipped, and any other unknown name is dropped silently.
STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
           ".gate_proj.": (".gate_up_proj.", "0"), ".up_proj.": (".gate_up_proj.", "1")}
LAYER = "model.layers.0."
SGLANG_PARAMS = {
    "model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
    *(LAYER + name for name in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                                "self_attn.qkv_proj.weight[q]", "self_attn.qkv_proj.weight[k]",
                                "self_attn.qkv_proj.weight[v]", "self_attn.o_proj.weight",
                                "mlp.gate_up_proj.weight[0]", "mlp.gate_up_proj.weight[1]", "mlp.down_proj.weight")),
}


class ExportError(PipelineError, ValueError):
    pass


def id_rule(target_architecture: str) -> str:
    rule = SGLANG_ID_RULES.get(target_architecture)
    if rule is None:
        raise ExportError(
            f"how SGLang reads aux ids for target {target_architecture!r} is not verified here: read its class's "
            f"set_eagle3_layers_to_capture in sglang/srt/models/ and add it to SGLANG_ID_RULES")
    return rule


def capture_points(sglang_ids: list[int], rule: str) -> list[int]:
    """The layers whose input SGLang captures for these config ids (= the vLLM ids they amount to)."""
    shift = rule == SHIFT or (rule == SHIFT_IF_FIRST_IS_ONE and sglang_ids[:1] == [1])
    return [i + 1 if shift else i for i in sglang_ids]


def sglang_ids(vllm_ids: list[int], rule: str, target_num_layers: int) -> list[int]:
    """Config ids that make SGLang capture exactly the states the drafter was trained on."""
    last = target_num_layers - 1
    # SGLang captures inside its layer loop, before layer c runs: the last layer's output (vLLM id N) is
    # never reached. The embeddings (vLLM id 0) are unverified: older releases crash on them (residual None).
    outside = [i for i in vllm_ids if not 1 <= i <= last]
    if outside:
        raise ExportError(f"aux ids {outside} (vLLM convention) cannot be served by SGLang: it captures only the "
                          f"inputs of target layers 1..{last}")
    if rule == SHIFT:
        return [i - 1 for i in vllm_ids]
    # SHIFT_IF_FIRST_IS_ONE: ids starting at vLLM id 2 read the same before and after SGLang PR #25454.
    if vllm_ids[0] != 2:
        raise ExportError(f"aux ids {vllm_ids} (vLLM convention) start at {vllm_ids[0]}: this target's SGLang "
                          "class reads ids that do not start at 1 unshifted since PR #25454 and shifted before, "
                          "so no config is right for every release; train with ids starting at 2 (the default)")
    return [i - 1 for i in vllm_ids]


def sglang_config(cfg: dict[str, Any], rule: str, target_num_layers: int) -> dict[str, Any]:
    """The drafter's config.json with the aux ids SGLang needs; everything else unchanged."""
    trained = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out = copy.deepcopy(cfg)
    out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang_ids(trained, rule, target_num_layers)
    out[EXPORT_KEY] = {"engine": "sglang", "sglang_id_rule": rule, "vllm_aux_layer_ids": trained}
    return out


def tensor_meta(weights: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, safetensors dtype) without reading the tensors."""
    with safe_open(weights, framework="pt") as f:
        return {name: (f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()) for name in f.keys()}


def sglang_param(name: str) -> str | None:
    """The SGLang parameter (with its shard) a checkpoint tensor loads into; None: SGLang drops it."""
    name = name.replace("midlayer.", "layers.0.")
    shard = ""
    for ours, (theirs, shard_id) in STACKED.items():
        if ours in name:
            name, shard = name.replace(ours, theirs), f"[{shard_id}]"
            break
    param = (name if name == "lm_head.weight" else f"model.{name}") + shard
    return param if param in SGLANG_PARAMS else None


def required_params(cfg: dict[str, Any]) -> set[str]:
    # SGLang shares the target's embedding table unless the widths differ (models/llama.py set_embed),
    # and then the checkpoint's own table must be there.
    own_embedding = cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]
    return SGLANG_PARAMS - (set() if own_embedding else {"model.embed_tokens.weight"})


def sglang_defects(cfg: dict[str, Any], tensors: dict[str, tuple[list[int], str]], rule: str,
                   target_num_layers: int) -> list[str]:
    """Every way SGLang would load this checkpoint other than as trained; [] = OK."""
    defects = []
    if cfg.get("architectures") != [ARCHITECTURE]:
        defects.append(f"architectures is {cfg.get('architectures')!r}; SGLang's EntryClass is {ARCHITECTURE}")
    if not isinstance(cfg.get("draft_vocab_size"), int):
        # None makes SGLang size lm_head to the full vocab and load it from the target.
        defects.append("draft_vocab_size must be an integer (None: SGLang takes the target's lm_head)")
    defects += [f"{key} is true; SGLang would build another network" for key in SGLANG_MUST_BE_FALSE if cfg.get(key)]
    eagle = cfg.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return defects + ["eagle_config.eagle_aux_hidden_state_layer_ids must be a list of integers "
                          "(SGLang reads no other place and silently falls back to (2, N//2, N-3))"]
    if eagle.get("norm_before_fc") or eagle.get("use_aux_hidden_state") is False:
        defects.append("eagle_config.norm_before_fc / use_aux_hidden_state=false change what SGLang feeds fc")
    if cfg.get("eagle_aux_hidden_state_layer_ids", ids) != ids:
        defects.append("a top-level eagle_aux_hidden_state_layer_ids differs from eagle_config's")
    if cfg.get("num_aux_hidden_states", len(ids)) != len(ids):
        defects.append("num_aux_hidden_states differs from the number of aux ids")
    points = capture_points(ids, rule)
    if any(not 1 <= c < target_num_layers for c in points) or points != sorted(set(points)):
        defects.append(f"aux ids {ids} make SGLang capture layers {points}: not increasing inputs of "
                       f"1..{target_num_layers - 1}")
    fc_in = len(ids) * cfg.get("target_hidden_size", cfg["hidden_size"])
    if "fc.weight" in tensors and tensors["fc.weight"][0][1:] != [fc_in]:
        defects.append(f"fc.weight is {tensors['fc.weight'][0]}; SGLang builds fc with {fc_in} inputs")

    loaded = {name: sglang_param(name) for name in tensors if name not in ("d2t", "t2d")}
    defects += [f"tensor {name} matches no SGLang parameter: it would be dropped silently"
                for name, param in sorted(loaded.items()) if param is None]
    defects += [f"SGLang parameter {param} gets no tensor: it would keep random values"
                for param in sorted(required_params(cfg) - set(loaded.values()))]
    if cfg.get("draft_vocab_size") != cfg.get("vocab_size"):
        shape, dtype = tensors.get("d2t", (None, None))
        if (shape, dtype) != ([cfg.get("draft_vocab_size")], "I64"):
            defects.append(f"d2t is {shape} {dtype}: SGLang needs int64 offsets [draft_vocab_size] "
                           "(hot_token_id = d2t + arange)")
    return defects


def link_or_copy(src: Path, dst: Path) -> None:
    """The same bytes under a second name without rewriting them: a hard link, a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())


def export(drafter_dir: Path = DRAFTER_DIR, out_dir: Path = OUT_DIR, target_dir: Path = TARGET_DIR) -> dict[str, Any]:
    """Validate the drafter (vLLM contract), write the SGLang directory atomically; its config is returned."""
    num_layers, hidden, vocab = target_numbers(target_dir)
    defects = validate(drafter_dir, num_layers, hidden, vocab)
    if defects:
        raise ExportError(f"{drafter_dir} is not a valid drafter for {target_dir}: " + "; ".join(defects))
    target_cfg = json.loads((target_dir / CONFIG_FILE).read_text())
    rule = id_rule((target_cfg.get("architectures") or ["(none)"])[0])
    cfg = sglang_config(json.loads((drafter_dir / CONFIG_FILE).read_text()), rule, num_layers)
    defects = sglang_defects(cfg, tensor_meta(drafter_dir / WEIGHTS_FILE), rule, num_layers)
    if defects:
        raise ExportError(f"{drafter_dir}: SGLang would not serve it as trained: " + "; ".join(defects))
    with atomic_dir(out_dir) as tmp:
        link_or_copy(drafter_dir / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        with open(tmp / CONFIG_FILE, "rb") as f:
            os.fsync(f.fileno())
    return cfg
