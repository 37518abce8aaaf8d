import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3.model.checkpoint import read_checkpoint, save_drafter, validate
from eagle3.model.drafter import Drafter, DrafterConfig, MLAConfig
from tools.validate import main

TARGET_LAYERS, HIDDEN, VOCAB, DRAFT_VOCAB = 6, 64, 100, 40


MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


# Every defect class is checked on the Llama drafter and on the MLA (deepseek_mla) one.
@pytest.fixture(scope="module", params=["llama", "deepseek_mla"])
def valid(request, tmp_path_factory) -> Path:
    mla = request.param == "deepseek_mla"
    config = DrafterConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=4 if mla else 2,
        head_dim=MLA.qk_head_dim if mla else 16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        aux_layer_ids=(1, 3, 5),
        mla=MLA if mla else None,
    )
    target_ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    out = tmp_path_factory.mktemp(request.param) / "drafter"
    save_drafter(out, Drafter(config), target_ids - torch.arange(DRAFT_VOCAB), t2d)
    return out


def broken(valid: Path, tmp_path: Path, edit: Callable[[dict, dict], None]) -> Path:
    """A copy of the valid checkpoint after edit(config, tensors)."""
    cfg, tensors = read_checkpoint(valid)
    edit(cfg, tensors)
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, out / "model.safetensors")
    return out


def check(path: Path) -> list[str]:
    return validate(path, TARGET_LAYERS, HIDDEN, VOCAB)


def test_valid_checkpoint_passes(valid):
    assert check(valid) == []


def move_one_t2d_mark(cfg, t):
    # Same count of marks, but one draft id now maps to a target id t2d does not mark.
    t2d = t["t2d"]
    t2d[t2d.nonzero()[0]] = False
    t2d[(~t2d).nonzero()[-1]] = True


def rename(old, new):
    def edit(cfg, t):
        t[new] = t.pop(old)

    return edit


CASES = {
    "drop d2t": (lambda cfg, t: t.pop("d2t"), ["missing tensor d2t"]),
    "d2t int32": (lambda cfg, t: t.update(d2t=t["d2t"].int()), ["d2t dtype is torch.int32"]),
    "d2t inconsistent with t2d": (move_one_t2d_mark, ["d2t inconsistent with t2d"]),
    "d2t out of range": (lambda cfg, t: t.update(d2t=t["d2t"] + VOCAB), ["outside [0, 100)"]),
    "t2d count": (lambda cfg, t: t["t2d"].__setitem__(~t["t2d"], True), ["t2d marks 100 target ids"]),
    "aux ids removed": (lambda cfg, t: cfg.pop("eagle_config"), ["eagle_aux_hidden_state_layer_ids missing"]),
    "aux id out of range": (
        lambda cfg, t: cfg["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 7]),
        ["aux layer ids [7] out of range [0, 6]"],
    ),
    "aux ids unsorted": (
        lambda cfg, t: cfg["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[5, 1, 3]),
        ["strictly increasing"],
    ),
    "top-level aux ids disagree": (
        lambda cfg, t: cfg.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]),
        ["top-level eagle_aux_hidden_state_layer_ids"],
    ),
    "renamed key": (
        rename("fc.weight", "model.fc.weight"),
        ["missing tensor fc.weight", "unexpected tensor model.fc.weight"],
    ),
    # vLLM's loader ignores unexpected ".bias" tensors without a word
    "extra key": (
        lambda cfg, t: t.update({"midlayer.self_attn.o_proj.bias": torch.zeros(64)}),
        ["unexpected tensor midlayer.self_attn.o_proj.bias"],
    ),
    "own embedding": (
        lambda cfg, t: t.update({"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}),
        ["unexpected tensor embed_tokens.weight"],
    ),
    "lm_head shape": (
        lambda cfg, t: t.update({"lm_head.weight": t["lm_head.weight"][:30].contiguous()}),
        ["lm_head.weight shape (30, 64) != expected (40, 64) (rows = draft_vocab_size)"],
    ),
    "draft_vocab_size": (lambda cfg, t: cfg.update(draft_vocab_size=30), ["lm_head.weight shape", "d2t shape"]),
    "architectures": (lambda cfg, t: cfg.update(architectures=["LlamaForCausalLM"]), ["architectures"]),
    "two layers": (lambda cfg, t: cfg.update(num_hidden_layers=2), ["num_hidden_layers is 2"]),
    "target vocab": (lambda cfg, t: cfg.update(vocab_size=120), ["vocab_size is 120, the target's vocab is 100"]),
    "target hidden": (lambda cfg, t: cfg.update(target_hidden_size=32), ["target_hidden_size"]),
    "tied embeddings": (lambda cfg, t: cfg.update(tie_word_embeddings=True), ["tie_word_embeddings is true"]),
    "weight dtype": (lambda cfg, t: t.update({"norm.weight": t["norm.weight"].half()}), ["norm.weight dtype"]),
    "nan": (lambda cfg, t: t["fc.weight"].__setitem__((0, 0), float("nan")), ["fc.weight has non-finite"]),
}


LLAMA_CASES = {
    "missing head_dim": (lambda cfg, t: cfg.pop("head_dim"), ["config.json is missing head_dim"]),
    "MLA sizes on a Llama drafter": (
        lambda cfg, t: cfg.update(kv_lora_rank=32), ["kv_lora_rank set, but architectures"]),
    "the other attention's key": (
        lambda cfg, t: t.update({"midlayer.self_attn.kv_b_proj.weight": torch.zeros(16, 32)}),
        ["unexpected tensor midlayer.self_attn.kv_b_proj.weight"],
    ),
}
MLA_CASES = {
    # transformers would fill in DeepSeek-V2's 1536 and vLLM build a q_a/q_b pair of that rank
    "missing q_lora_rank": (lambda cfg, t: cfg.pop("q_lora_rank"), ["config.json is missing q_lora_rank"]),
    "the other attention's key": (
        lambda cfg, t: t.update({"midlayer.self_attn.k_proj.weight": torch.zeros(16, 128)}),
        ["unexpected tensor midlayer.self_attn.k_proj.weight"],
    ),
    "missing kv_lora_rank": (lambda cfg, t: cfg.pop("kv_lora_rank"), ["config.json is missing kv_lora_rank"]),
    "no q low-rank": (
        lambda cfg, t: cfg.update(q_lora_rank=None),
        ["q_lora_rank is null: vLLM 0.32's deepseek_eagle3 loader", "MLA sizes must be positive integers"],
    ),
    "latent rank": (lambda cfg, t: cfg.update(kv_lora_rank=16), ["midlayer.self_attn.kv_b_proj.weight shape"]),
    "value head dim": (lambda cfg, t: cfg.update(v_head_dim=16), ["midlayer.self_attn.o_proj.weight shape"]),
    "model_type": (lambda cfg, t: cfg.update(model_type="llama"), ["model_type is 'llama', expected 'deepseek_v2'"]),
    "kv heads": (lambda cfg, t: cfg.update(num_key_value_heads=2), ["num_key_value_heads is 2"]),
    "sparse attention": (lambda cfg, t: cfg.update(index_topk=2048), ["index_topk is set"]),
    "rope type": (
        lambda cfg, t: cfg.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        ["not supported for an MLA drafter"],
    ),
    "MLA weights in a Llama config": (
        lambda cfg, t: cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama"),
        ["kv_lora_rank, qk_nope_head_dim", "set, but architectures", "config.json is missing head_dim"],
    ),
}


@pytest.mark.parametrize("case", [*CASES, *LLAMA_CASES, *MLA_CASES])
def test_broken_checkpoint_is_refused_naming_the_defect(valid, tmp_path, case):
    own = MLA_CASES if valid.parent.name.startswith("deepseek_mla") else LLAMA_CASES
    if case not in CASES and case not in own:
        pytest.skip("a defect of the other drafter")
    edit, messages = CASES.get(case) or own[case]
    defects = check(broken(valid, tmp_path, edit))
    text = "\n".join(defects)
    for message in messages:
        assert message in text, f"{case}: {message!r} not in {defects}"


def test_cli(valid, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    target_config = {"num_hidden_layers": TARGET_LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB}
    (target / "config.json").write_text(json.dumps(target_config))
    assert main([str(valid), "--target", str(target)]) == 0
    assert capsys.readouterr().out.strip() == "OK"
    bad = broken(valid, tmp_path, lambda cfg, t: t.pop("d2t"))
    assert main([str(bad), "--target", str(target)]) == 1
    assert "missing tensor d2t" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere"), "--target", str(target)]) == 1
    assert "cannot read" in capsys.readouterr().out


def test_transformers5_spelling_is_read(valid, tmp_path):
    """transformers >= 5 writes rope_parameters and dtype; vLLM reads them, so do we."""
    cfg = json.loads((valid / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    cfg["dtype"] = cfg.pop("torch_dtype")
    out = tmp_path / "t5"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes((valid / "model.safetensors").read_bytes())
    assert check(out) == []
