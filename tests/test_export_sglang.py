"""The SGLang export against what SGLang's loader requires, read in sglang 0.5.23 (python/sglang/srt/):
models/llama_eagle3.py (LlamaForCausalLMEagle3: config keys, load_weights names, d2t), models/llama.py and
models/deepseek_v2.py (set_eagle3_layers_to_capture: how config ids become capture points),
model_executor/model_runner_components/spec_aux_hidden_state.py (ids read from eagle_config only).
sglang is not installed here (it needs CUDA), so these tests check the files, not a running SGLang."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from eagle3.model.checkpoint import read_checkpoint, save_drafter
from eagle3.model.drafter import Drafter, DrafterConfig
from eagle3.model.sglang import (
    EXPORT_KEY,
    SHIFT,
    SHIFT_IF_FIRST_IS_ONE,
    ExportError,
    capture_points,
    export,
    sglang_defects,
    sglang_ids,
    sglang_param,
    tensor_meta,
)
from tools.export_sglang import main

TARGET_LAYERS, HIDDEN, VOCAB, DRAFT_VOCAB = 6, 64, 100, 40


def write_target(folder: Path, architecture: str = "LlamaForCausalLM") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": [architecture], "num_hidden_layers": TARGET_LAYERS, "hidden_size": HIDDEN,
        "vocab_size": VOCAB}))
    return folder


def write_drafter(folder: Path, aux_ids: tuple[int, ...] = (1, 3, 5), hidden: int = HIDDEN) -> Path:
    config = DrafterConfig(hidden_size=hidden, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                           vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN,
                           aux_layer_ids=aux_ids)
    target_ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    torch.manual_seed(0)
    save_drafter(folder, Drafter(config), target_ids - torch.arange(DRAFT_VOCAB), t2d)
    return folder


def test_export_shifts_only_the_aux_ids_and_links_the_weights(tmp_path):
    drafter, target = write_drafter(tmp_path / "drafter"), write_target(tmp_path / "target")
    weights_before = (drafter / "model.safetensors").read_bytes()
    config_before = (drafter / "config.json").read_text()

    cfg = export(drafter, tmp_path / "sglang", target)

    vllm_cfg, tensors = read_checkpoint(drafter)
    # Llama targets: SGLang captures the input of layer id+1 (models/llama.py `[val + 1 for val in layer_ids]`).
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert capture_points([0, 2, 4], SHIFT) == [1, 3, 5]
    assert cfg[EXPORT_KEY] == {"engine": "sglang", "sglang_id_rule": SHIFT, "vllm_aux_layer_ids": [1, 3, 5]}
    rest = {k: v for k, v in cfg.items() if k not in ("eagle_config", EXPORT_KEY)}
    assert rest == {k: v for k, v in json.loads(config_before).items() if k != "eagle_config"}
    assert json.loads((tmp_path / "sglang" / "config.json").read_text()) == cfg

    # Weights: the same file, untouched; the source directory unchanged.
    out_weights = tmp_path / "sglang" / "model.safetensors"
    assert os.stat(out_weights).st_ino == os.stat(drafter / "model.safetensors").st_ino
    assert (drafter / "model.safetensors").read_bytes() == weights_before
    assert (drafter / "config.json").read_text() == config_before
    assert sorted(p.name for p in (tmp_path / "sglang").iterdir()) == ["config.json", "model.safetensors"]
    assert sglang_defects(cfg, tensor_meta(out_weights), SHIFT, TARGET_LAYERS) == []
    assert vllm_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and "d2t" in tensors


def test_every_tensor_lands_on_an_sglang_parameter(tmp_path):
    # LlamaForCausalLMEagle3.load_weights: midlayer -> layers.0, q/k/v -> qkv_proj shards, model. prefix.
    meta = tensor_meta(write_drafter(tmp_path / "d") / "model.safetensors")
    params = {name: sglang_param(name) for name in meta if name not in ("d2t", "t2d")}
    assert params["midlayer.self_attn.k_proj.weight"] == "model.layers.0.self_attn.qkv_proj.weight[k]"
    assert params["midlayer.mlp.up_proj.weight"] == "model.layers.0.mlp.gate_up_proj.weight[1]"
    assert params["lm_head.weight"] == "lm_head.weight" and params["fc.weight"] == "model.fc.weight"
    assert None not in params.values() and len(set(params.values())) == len(params)
    assert meta["d2t"] == ([DRAFT_VOCAB], "I64")  # hot_token_id = d2t + arange: offsets, int64


def test_a_narrow_drafter_must_bring_its_embedding(tmp_path):
    # SGLang's set_embed keeps the drafter's own table when target_hidden_size != hidden_size.
    drafter = write_drafter(tmp_path / "d", hidden=32)
    cfg = export(drafter, tmp_path / "sglang", write_target(tmp_path / "target"))
    meta = tensor_meta(drafter / "model.safetensors")
    assert sglang_defects(cfg, meta, SHIFT, TARGET_LAYERS) == []
    meta.pop("embed_tokens.weight")
    assert sglang_defects(cfg, meta, SHIFT, TARGET_LAYERS) == [
        "SGLang parameter model.embed_tokens.weight gets no tensor: it would keep random values"]


@pytest.mark.parametrize("edit, message", [
    (lambda c, m: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"), "SGLang reads no other place"),
    (lambda c, m: c.update(draft_vocab_size=None), "draft_vocab_size must be an integer"),
    (lambda c, m: c.update(norm_before_residual=True), "norm_before_residual is true"),
    (lambda c, m: c.update(architectures=["Eagle3Speculator"]), "architectures is ['Eagle3Speculator']"),
    (lambda c, m: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 5]), "capture layers [1, 3, 6]"),
    (lambda c, m: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "top-level"),
    (lambda c, m: m.update({"midlayer.hnorm.weight": m.pop("midlayer.hidden_norm.weight")}),
     "hidden_norm.weight gets no tensor"),
    (lambda c, m: m.update(extra=([1], "F32")), "tensor extra matches no SGLang parameter"),
    (lambda c, m: m.pop("d2t"), "d2t is None None"),
    (lambda c, m: m.update(d2t=([DRAFT_VOCAB], "I32")), "int64 offsets"),
])
def test_defects_name_what_sglang_would_load_wrongly(tmp_path, edit, message):
    drafter = write_drafter(tmp_path / "d")
    cfg = export(drafter, tmp_path / "sglang", write_target(tmp_path / "target"))
    meta = tensor_meta(drafter / "model.safetensors")
    edit(cfg, meta)
    defects = sglang_defects(cfg, meta, SHIFT, TARGET_LAYERS)
    assert any(message in d for d in defects), defects


def test_ids_sglang_cannot_capture_are_refused(tmp_path):
    target = write_target(tmp_path / "target")
    # vLLM id N is the last layer's output: SGLang's capture loop never reaches it.
    with pytest.raises(ExportError, match=r"aux ids \[6\].*inputs of target layers 1..5"):
        export(write_drafter(tmp_path / "last", aux_ids=(1, 3, 6)), tmp_path / "out", target)
    with pytest.raises(ExportError, match=r"aux ids \[0\]"):
        export(write_drafter(tmp_path / "embed", aux_ids=(0, 3, 5)), tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
    assert main(["--drafter", str(tmp_path / "last"), "--out", str(tmp_path / "out"), "--target", str(target)]) == 1


def test_deepseek_targets_shift_only_ids_starting_at_one(tmp_path):
    # models/deepseek_v2.py (also Kimi-K2.5): `+1` only when layer_ids[0] == 1 (SGLang PR #25454).
    assert capture_points([1, 29, 57], SHIFT_IF_FIRST_IS_ONE) == [2, 30, 58]
    assert capture_points([2, 30, 58], SHIFT_IF_FIRST_IS_ONE) == [2, 30, 58]
    assert sglang_ids([2, 30, 58], SHIFT_IF_FIRST_IS_ONE, 61) == [1, 29, 57]
    with pytest.raises(ExportError, match="start at 3"):
        sglang_ids([3, 30, 58], SHIFT_IF_FIRST_IS_ONE, 61)
    drafter = write_drafter(tmp_path / "d", aux_ids=(2, 3, 5))
    cfg = export(drafter, tmp_path / "sglang", write_target(tmp_path / "t", "KimiK25ForConditionalGeneration"))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]


def test_unverified_target_architectures_are_refused(tmp_path):
    with pytest.raises(ExportError, match="'GptOssForCausalLM' is not verified"):
        export(write_drafter(tmp_path / "d"), tmp_path / "out", write_target(tmp_path / "t", "GptOssForCausalLM"))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (it needs CUDA)")
def test_sglang_maps_the_ids_as_encoded_here():
    # Where sglang is installed, its own Llama class must turn the exported ids into the trained ones.
    from types import SimpleNamespace

    from sglang.srt.models.llama import LlamaForCausalLM

    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace(),
                            config=SimpleNamespace(num_hidden_layers=TARGET_LAYERS))
    LlamaForCausalLM.set_eagle3_layers_to_capture(model, [0, 2, 4])
    assert model.model.layers_to_capture == capture_points([0, 2, 4], SHIFT)
