import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3.model.checkpoint import load_drafter, save_drafter, validate
from eagle3.model.drafter import Drafter, DrafterConfig, TTTCache, rotate
from tests.conftest import run_vllm_check

TARGET_LAYERS = 6
B, T, K = 2, 10, 3


def target_config(**overrides) -> LlamaConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=16,
        vocab_size=100,
        max_position_embeddings=256,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
    )
    return LlamaConfig(**(fields | overrides))


def make_drafter(seed: int = 0, **overrides) -> Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(target_config(), draft_vocab_size=40, aux_layer_ids=(1, 3, 5), **overrides)
    model = Drafter(config)
    with torch.no_grad():  # non-trivial norms, so a norm loaded into the wrong slot shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model


def vocab_map(draft: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft), t2d


def inputs(model: Drafter, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = model.config
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.target_hidden_size, generator=g)
    embeds = [torch.randn(B, T, c.hidden_size, generator=g) for _ in range(K)]
    return aux, embeds, torch.arange(T).expand(B, T)


def unroll(model: Drafter, aux, embeds, position_ids) -> tuple[list[torch.Tensor], TTTCache]:
    cache = TTTCache()
    h = model.fuse(aux)
    hiddens = []
    for k, e in enumerate(embeds):
        h = model.step(e, h, position_ids + k, cache)
        hiddens.append(h)
    return hiddens, cache


def test_shapes_through_k_steps_with_gqa():
    model = make_drafter()
    aux, embeds, pos = inputs(model)
    hiddens, cache = unroll(model, aux, embeds, pos)
    assert len(cache.keys) == len(cache.values) == K
    assert cache.keys[0].shape == (B, 2, T, 16)  # kv heads, not query heads
    for h in hiddens:
        assert h.shape == (B, T, 64)
        assert model.head_hidden(h).shape == (B, T, 64)
        assert model.logits(h).shape == (B, T, 40)
    last = hiddens[-1]
    assert torch.allclose(model.logits(last), model.head_hidden(last) @ model.lm_head.weight.T, atol=1e-5)
    # forward() is the same unrolling, in one call
    for a, b in zip(model(aux, embeds, pos), hiddens):
        assert torch.allclose(a, model.head_hidden(b), atol=1e-6)


def test_dropout_acts_in_training_mode_only_and_adds_no_weights():
    model = make_drafter()
    aux, embeds, pos = inputs(model)
    with torch.no_grad():
        plain = model(aux, embeds, pos)
        model.midlayer.dropout.p = 0.5
        dropped = model(aux, embeds, pos)
        model.eval()
        evaluated = model(aux, embeds, pos)
    assert not torch.allclose(plain[0], dropped[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated))
    assert set(model.state_dict()) == set(make_drafter().state_dict())


def test_step_k_at_position_t_ignores_everything_after_t():
    model = make_drafter()
    aux, embeds, pos = inputs(model)
    base, _ = unroll(model, aux, embeds, pos)
    t = 4
    aux2 = aux.clone()
    aux2[:, t + 1 :] = torch.randn_like(aux2[:, t + 1 :])
    embeds2 = [e.clone() for e in embeds]
    for e in embeds2:
        e[:, t + 1 :] = torch.randn_like(e[:, t + 1 :])
    changed, _ = unroll(model, aux2, embeds2, pos)
    for k in range(K):
        assert torch.allclose(base[k][:, : t + 1], changed[k][:, : t + 1], atol=1e-5), f"step {k} saw the future"
        assert not torch.allclose(base[k][:, t + 1 :], changed[k][:, t + 1 :])


def decode_like_vllm(model: Drafter, aux, embeds, t: int) -> list[torch.Tensor]:
    """The drafter as vLLM runs it from anchor t: one pass over positions 0..t with the target's
    states, then one token per draft step at position t + k, attending to everything cached."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    keys, values = [], []

    def run(e, h, positions, causal):
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], -1)
        b, n, _ = x.shape
        cos, sin = model.rotary(positions, x.dtype)
        q = rotate(attn.q_proj(x).view(b, n, 4, 16).transpose(1, 2), cos, sin)
        keys.append(rotate(attn.k_proj(x).view(b, n, 2, 16).transpose(1, 2), cos, sin))
        values.append(attn.v_proj(x).view(b, n, 2, 16).transpose(1, 2))
        k, v = torch.cat(keys, 2), torch.cat(values, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    h = run(embeds[0][:, : t + 1], model.fuse(aux[:, : t + 1]), torch.arange(t + 1), causal=True)[:, -1:]
    out = [h]
    for k in range(1, len(embeds)):
        h = run(embeds[k][:, t : t + 1], h, torch.tensor([t + k]), causal=False)
        out.append(h)
    return out


def test_ttt_unrolling_equals_sequential_drafting():
    model = make_drafter()
    aux, embeds, pos = inputs(model)
    hiddens, _ = unroll(model, aux, embeds, pos)
    for t in (0, 4, T - 1):
        for k, h in enumerate(decode_like_vllm(model, aux, embeds, t)):
            assert torch.allclose(hiddens[k][:, t : t + 1], h, atol=1e-5), f"anchor {t}, step {k}"


def test_embed_shares_the_target_table_or_owns_one():
    table = torch.randn(100, 64)
    ids = torch.tensor([[3, 7]])
    model = make_drafter()
    assert model.embed_tokens is None
    assert torch.equal(model.embed(ids, table), table[ids])
    narrow = make_drafter(hidden_size=32, intermediate_size=48)
    assert narrow.embed_tokens is not None and narrow.embed(ids, table).shape == (1, 2, 32)
    assert narrow.fc.weight.shape == (32, 3 * 64)


def test_rope_matches_transformers_llama3_scaling():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    target = target_config(rope_scaling=scaling)
    model = Drafter(DrafterConfig.from_target(target, draft_vocab_size=40, aux_layer_ids=(1, 3, 5)))
    assert model.config.rope_scaling["rope_type"] == "llama3"
    pos = torch.arange(200)[None]
    cos, sin = model.rotary(pos, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(target)(torch.zeros(1), pos)
    assert torch.allclose(cos[0], ref_cos, atol=1e-6) and torch.allclose(sin[0], ref_sin, atol=1e-6)


def test_save_load_roundtrip_gives_identical_outputs(tmp_path):
    model = make_drafter()
    d2t, t2d = vocab_map(40, 100)
    save_drafter(tmp_path / "drafter", model, d2t, t2d)
    assert validate(tmp_path / "drafter", TARGET_LAYERS, 64, 100) == []
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert cfg["rope_theta"] == 50000.0 and cfg["head_dim"] == 16 and cfg["torch_dtype"] == "float32"

    expect = dict(target_hidden_size=64, target_vocab_size=100, aux_layer_ids=[1, 3, 5])
    loaded = load_drafter(tmp_path / "drafter", **expect)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)
    aux, embeds, pos = inputs(model)
    for a, b in zip(model(aux, embeds, pos), loaded.model(aux, embeds, pos)):
        assert torch.equal(a, b)

    # overwriting an existing checkpoint swaps it whole and leaves no temporary behind
    save_drafter(tmp_path / "drafter", make_drafter(seed=1), d2t, t2d, dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    assert load_drafter(tmp_path / "drafter").model.fc.weight.dtype == torch.float32


def test_load_names_the_mismatched_field(tmp_path):
    d2t, t2d = vocab_map(40, 100)
    save_drafter(tmp_path / "d", make_drafter(), d2t, t2d)
    for kwargs, field in [
        (dict(target_hidden_size=128), "target_hidden_size"),
        (dict(target_vocab_size=200), "vocab_size"),
        (dict(aux_layer_ids=[2, 3, 5]), "eagle_aux_hidden_state_layer_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            load_drafter(tmp_path / "d", **kwargs)


def test_own_embedding_and_full_vocab_checkpoints(tmp_path):
    narrow = make_drafter(hidden_size=32, intermediate_size=48)
    d2t, t2d = vocab_map(40, 100)
    save_drafter(tmp_path / "narrow", narrow, d2t, t2d)
    assert validate(tmp_path / "narrow", TARGET_LAYERS, 64, 100) == []
    loaded = load_drafter(tmp_path / "narrow").model
    assert torch.equal(loaded.embed_tokens.weight, narrow.embed_tokens.weight)

    torch.manual_seed(0)
    full = Drafter(DrafterConfig.from_target(target_config(), draft_vocab_size=100, aux_layer_ids=(1, 3, 5)))
    save_drafter(tmp_path / "full", full, torch.zeros(100, dtype=torch.int64), torch.ones(100, dtype=torch.bool))
    assert validate(tmp_path / "full", TARGET_LAYERS, 64, 100) == []
    assert torch.equal(load_drafter(tmp_path / "full").d2t, torch.zeros(100, dtype=torch.int64))


def test_config_refuses_unusable_aux_ids():
    with pytest.raises(ValueError, match="strictly increasing"):
        DrafterConfig.from_target(target_config(), draft_vocab_size=40, aux_layer_ids=(5, 1, 3))
    with pytest.raises(ValueError, match="out of range"):
        DrafterConfig.from_target(target_config(), draft_vocab_size=40, aux_layer_ids=(1, 3, 7))


def test_vllm_loads_the_checkpoint_and_computes_the_same_step(tmp_path):
    """vLLM's own Eagle3LlamaForCausalLM loads what save_drafter writes and, with plain causal
    attention in place of its paged backend, gives the same step-0 state and draft logits."""
    pytest.importorskip("vllm")
    assert "vllm-match" in run_vllm_check(__file__, tmp_path)


def _vllm_step0(tmp: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    target = target_config(rope_scaling=scaling, architectures=["LlamaForCausalLM"])
    target.save_pretrained(tmp / "target")
    model = make_drafter()
    d2t, t2d = vocab_map(40, 100)
    save_drafter(tmp / "drafter", model, d2t, t2d)
    engine = EngineArgs(
        model=str(tmp / "target"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        speculative_config={"method": "eagle3", "model": str(tmp / "drafter"), "num_speculative_tokens": 3},
    ).create_engine_config()
    with set_current_vllm_config(engine), torch.no_grad():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/dist", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        served = Eagle3LlamaForCausalLM(vllm_config=engine)
        served.load_weights(safetensors.torch.load_file(tmp / "drafter" / "model.safetensors").items())
        process_weights_after_loading(served, engine.speculative_config.draft_model_config, torch.device("cpu"))
        assert torch.equal(served.draft_id_to_target_id, d2t)

        g = torch.Generator().manual_seed(3)
        aux, embeds = torch.randn(T, 3 * 64, generator=g), torch.randn(T, 64, generator=g)
        positions = torch.arange(T) + 5
        layer, attn = served.model.layers[0], served.model.layers[0].self_attn
        hidden = served.combine_hidden_states(aux)
        qkv, _ = attn.qkv_proj(torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q, k = attn.rotary_emb(positions, q, k)
        q, k, v = (x.view(T, -1, 16).transpose(0, 1) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out, _ = attn.o_proj(out.transpose(0, 1).reshape(T, -1))
        out, residual = layer.post_attention_layernorm(out, hidden.clone())
        normed, prenorm = served.model.norm(layer.mlp(out), residual)
        served_logits = served.compute_logits(normed)

        ours = model.step(embeds[None], model.fuse(aux[None]), positions[None], TTTCache())[0]
        our_logits = torch.full((T, 100), float("-inf"))
        our_logits[:, torch.arange(40) + d2t] = model.logits(ours)
    assert torch.allclose(prenorm, ours, atol=1e-5)
    assert torch.allclose(served_logits, our_logits, atol=1e-5)
    print("vllm-match")


if __name__ == "__main__":
    _vllm_step0(Path(sys.argv[1]))
