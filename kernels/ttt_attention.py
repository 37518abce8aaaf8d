"""Attention for the drafter's training-time-test (TTT) unrolling.

The drafter is unrolled K steps over the whole sequence. At step k its query at position t may
attend to the step-0 keys at positions s <= t (the causal prefix the real decoder would have in
its KV cache) and to the keys that steps 1..k produced at the same position t (the drafter's own
earlier guesses for that position). Over the keys of all steps laid end to end, that mask is a
causal triangle followed by k diagonals: almost all of it is empty.

- CUDA: one compiled flex_attention call over the concatenated keys with a block-sparse mask, so
  only the causal blocks and the k diagonal blocks per query block are computed, forward and
  backward fused. Measured on an H200 (bf16, 32/8 heads, D 128, K 7, forward + backward of all
  steps) against causal flex_attention plus a log-sum-exp merge of the diagonal scores: 9.8 ms
  and 0.7 GiB against 16-17 ms and 1.0-1.2 GiB at T 2048 (the dense reference: 212 ms and
  27 GiB); 63 ms and 2.7 GiB against 67-75 ms and 3.9-4.7 GiB at T 8192.
- CPU (flex_attention has no backward there): step 0's causal part through PyTorch's fused CPU
  flash-attention kernel, which also returns its log-sum-exp; the k diagonal scores q_t . k_j[t]
  join it under one softmax by that log-sum-exp, and the backward hands the kernel's own backward
  the causal part's share of the gradient. fp32 throughout, nothing [T, T] kept. Measured on this
  project's 2-core CPU (B 2, T 512, 9/3 heads, D 64, forward + backward): 16.5 / 22.6 / 27.0 ms
  for 1 / 2 / 3 steps, against 28.3 / 43.9 / 56.8 ms for materialised fp32 scores, which remain
  the path for an inference prefix and for values of another width (the kernel needs one head size).

Values may be narrower or wider than keys (MLA: keys nope + rope = 192, values 128 at DeepSeek-V3
sizes); every path takes them as they are (flex_attention only needs q and k to match), no padding.

`ttt_attention_reference` applies the dense mask over the concatenated keys; tests compare.
"""

import functools
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float | None = None,
                  prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention of step k = len(keys) - 1 queries over the TTT key set.

    q: [B, Hq, T, D]; keys[j]: [B, Hkv, T, D], values[j]: [B, Hkv, T, Dv] (step j, rotary applied);
    Hq % Hkv == 0. prefix: step-0 (keys, values) [B, Hkv, P, D / Dv] of P earlier positions every
    query sees: an incremental decoder's cache (inference only, so it takes the dense path on any
    device). Returns [B, Hq, T, Dv] in q's dtype.
    """
    _check_shapes(q, keys, values)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if prefix is not None:
        return _ttt_dense(q, keys, values, scale, prefix)
    if q.is_cuda:
        return _ttt_flex(q, keys, values, scale)
    if values[0].shape[-1] == q.shape[-1]:
        return _TTTFlashCPU.apply(scale, len(keys), q, *keys, *values)
    return _ttt_dense(q, keys, values, scale)


def ttt_attention_reference(
    q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float | None = None
) -> Tensor:
    """Same result as `ttt_attention`, from a dense [T, T*(k+1)] mask over all keys, in fp32."""
    _check_shapes(q, keys, values)
    t, d = q.shape[2:]
    group = q.shape[1] // keys[0].shape[1]
    scale = d**-0.5 if scale is None else scale
    k_all = torch.cat(keys, dim=2).float().repeat_interleave(group, dim=1)
    v_all = torch.cat(values, dim=2).float().repeat_interleave(group, dim=1)
    scores = q.float() @ k_all.transpose(-1, -2) * scale
    query_pos = torch.arange(t, device=q.device)[:, None]
    key_pos = torch.arange(t, device=q.device).repeat(len(keys))[None, :]
    key_step = torch.arange(len(keys), device=q.device).repeat_interleave(t)[None, :]
    allowed = torch.where(key_step == 0, key_pos <= query_pos, key_pos == query_pos)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ v_all).to(q.dtype)


def _check_shapes(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> None:
    if not keys or len(keys) != len(values):
        raise ValueError(f"need one value per key and at least one step, got {len(keys)} keys, {len(values)} values")
    b, hq, t, d = q.shape
    hkv, dv = keys[0].shape[1], values[0].shape[-1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of key/value heads {hkv}")
    for tensor in keys:
        if tensor.shape != (b, hkv, t, d):
            raise ValueError(f"key shape {tuple(tensor.shape)} != {(b, hkv, t, d)}")
    for tensor in values:
        if tensor.shape != (b, hkv, t, dv):
            raise ValueError(f"value shape {tuple(tensor.shape)} != {(b, hkv, t, dv)}")


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TTTFlashCPU(torch.autograd.Function):
    """CPU path: o_c, lse = causal attention of step 0 (fused kernel); with diagonal scores s_j,
    the weights [a, b_1..b_k] = softmax([lse, s_1..s_k]) give out = a * o_c + sum_j b_j v_j[t].

    Backward: the causal keys' score gradient is a * p * (v . dO - out . dO), which is the kernel's
    own backward given grad a * dO and `out` in place of o_c (it subtracts rowsum(grad * out));
    the diagonal ones are b_j * (v_j . dO - out . dO). GQA: keys and values are repeated per query
    head for the kernel and their gradients summed back."""

    @staticmethod
    def forward(ctx: Any, scale: float, steps: int, q: Tensor, *kv: Tensor) -> Tensor:
        keys, values = kv[:steps], kv[steps:]
        group = q.shape[1] // keys[0].shape[1]
        q32 = q.float()
        k0, v0 = (x.float().repeat_interleave(group, dim=1) for x in (keys[0], values[0]))
        causal, lse = _flash_cpu(q32, k0, v0, 0.0, True, scale=scale)
        kd = vd = weights = None
        out = causal
        if steps > 1:
            kd, vd = (torch.stack([x.float() for x in xs[1:]], dim=2).repeat_interleave(group, dim=1)
                      for xs in (keys, values))  # [B, Hq, k, T, D]
            diag = torch.einsum("bhtd,bhjtd->bhtj", q32, kd) * scale
            weights = torch.cat([lse.unsqueeze(-1), diag], dim=-1).softmax(dim=-1)  # [B, Hq, T, 1 + k]
            out = weights[..., :1] * causal + torch.einsum("bhtj,bhjtd->bhtd", weights[..., 1:], vd)
        ctx.save_for_backward(q32, k0, v0, out, lse, kd, vd, weights)
        ctx.scale, ctx.group, ctx.dtypes = scale, group, [x.dtype for x in (q, *kv)]
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q32, k0, v0, out, lse, kd, vd, weights = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        g = grad.float()
        causal_grad = g if weights is None else weights[..., :1] * g
        dq, dk0, dv0 = _flash_cpu_backward(causal_grad.contiguous(), q32, k0, v0, out, lse, 0.0, True, scale=scale)
        dks, dvs = [dk0], [dv0]
        if weights is not None:
            b = weights[..., 1:]
            dscores = b * (torch.einsum("bhjtd,bhtd->bhtj", vd, g) - (out * g).sum(-1, keepdim=True))
            dq = dq + torch.einsum("bhtj,bhjtd->bhtd", dscores, kd) * scale
            dkd = torch.einsum("bhtj,bhtd->bhjtd", dscores, q32) * scale
            dvd = torch.einsum("bhtj,bhtd->bhjtd", b, g)
            dks += list(dkd.unbind(2))
            dvs += list(dvd.unbind(2))

        def per_kv_head(x: Tensor) -> Tensor:
            return x.unflatten(1, (-1, group)).sum(2) if group > 1 else x

        grads = [dq] + [per_kv_head(x) for x in dks + dvs]
        return (None, None, *(x.to(dtype) for x, dtype in zip(grads, ctx.dtypes)))


def _ttt_dense(q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float,
               prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """CPU path: [prefix,] causal step-0 and diagonal scores under one fp32 softmax."""
    t = q.shape[2]
    hkv = keys[0].shape[1]
    # Query heads grouped under their KV head, so keys broadcast instead of being repeated.
    q_grouped = q.float().unflatten(1, (hkv, -1))  # [B, Hkv, G, T, D]
    causal = q_grouped @ keys[0].float().unsqueeze(2).transpose(-1, -2) * scale  # [B, Hkv, G, T, T]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = causal.masked_fill(future, float("-inf"))
    p = 0 if prefix is None else prefix[0].shape[2]
    if prefix is not None:
        scores = torch.cat([q_grouped @ prefix[0].float().unsqueeze(2).transpose(-1, -2) * scale, scores], dim=-1)
    if len(keys) > 1:
        k_diag = torch.stack(keys[1:], dim=2).float()  # [B, Hkv, k, T, D]
        diag = torch.einsum("bhgtd,bhjtd->bhgtj", q_grouped, k_diag) * scale
        scores = torch.cat([scores, diag], dim=-1)
    probs = scores.softmax(dim=-1)
    out = probs[..., p : p + t] @ values[0].float().unsqueeze(2)
    if prefix is not None:
        out = out + probs[..., :p] @ prefix[1].float().unsqueeze(2)
    if len(keys) > 1:
        v_diag = torch.stack(values[1:], dim=2).float()
        out = out + torch.einsum("bhgtj,bhjtd->bhgtd", probs[..., p + t :], v_diag)
    return out.flatten(1, 2).to(q.dtype)


def _ttt_mask_mod(seq_len: int):
    # Key index j * seq_len + s is position s of step j. Step 0 is causal (kv_idx <= q_idx also
    # covers the diagonal of step 0); later steps only at the query's own position.
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx % seq_len == q_idx)

    return mask_mod


@functools.lru_cache(maxsize=256)
def _ttt_block_mask(seq_len: int, steps: int, device: torch.device) -> BlockMask:
    # Same for every batch row and head; built once per (length, step count) and reused.
    return create_block_mask(_ttt_mask_mod(seq_len), None, None, seq_len, seq_len * steps, device=device)


@functools.cache
def _compiled_flex():
    # Uncompiled flex_attention is a dense fallback; compiled it is the block-sparse kernel.
    # dynamic=True: one graph serves every sequence length and step count, instead of a
    # recompile per shape until torch.compile's recompile limit silently falls back to eager.
    return torch.compile(flex_attention, dynamic=True)


def _ttt_flex(q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float) -> Tensor:
    """CUDA path: one block-sparse flex_attention over the keys of all steps."""
    block_mask = _ttt_block_mask(q.shape[2], len(keys), q.device)
    return _compiled_flex()(
        q,
        torch.cat(keys, dim=2),
        torch.cat(values, dim=2),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
    )
