"""Soft-target cross-entropy over the draft vocabulary for all TTT steps, chunked over positions.

The drafter learns the target model's next-token distribution p = softmax(target_hidden @
target_head.T) (the target's lm_head rows of the draft vocabulary, so p is renormalised over it)
by minimising CE(p, log_softmax(draft_hidden @ draft_head.T)), at every TTT step k, where step k
of anchor t predicts the distribution of column t+k. With a 32K draft vocabulary and tens of
thousands of positions per batch (times K steps), the [N, Vd] fp32 logits of both models would
dominate training memory. So positions are processed in chunks: each chunk's target logits are
computed once and serve all K steps (they are the same positions, shifted), and the gradients
for the drafter's states and head (dlogits = weight * (softmax(draft_logits) - p), scaled by the
step's weight in the objective) are produced in the forward pass: backward only scales them,
nothing [N, Vd] is kept, peak extra memory is O(chunk_size * Vd), no logits are recomputed, and
the head's gradient of all steps is summed in one fp32 buffer and returned in the master
weights' dtype. Positions with weight 0 are skipped. Matmuls run in the input (or autocast)
dtype, softmax and CE math in fp32; on CUDA the per-row softmax / CE / argmax / dlogits work is
one Triton kernel, and the head gradient is accumulated by cuBLAS directly in fp32; on CPU the
target's softmax and argmax are computed once per chunk for all K steps.

`ttt_soft_cross_entropy_reference` computes the same with plain autograd, one whole step at a time.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs; the CUDA path needs Triton (it ships with CUDA torch)
    triton = None

# Vocabulary tile of the row kernel: 0.14 ms per 1024 x 32000 bf16 chunk on an H200; tiles of
# 1024-8192 with 4-16 warps were within 15% of it.
_TRITON_BLOCK = 4096
_TRITON_WARPS = 8


def ttt_soft_cross_entropy(
    draft_hidden: Sequence[Tensor],
    draft_head: Tensor,
    target_hidden: Tensor,
    target_head: Tensor,
    weight: Tensor,
    step_scale: Tensor,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor, Tensor]:
    """All K TTT steps' soft-target CE: (objective, loss [K], hits [K]).

    draft_hidden: K tensors [B, L, H], the drafter's states of step k at anchors t = 0..L-1;
    draft_head [Vd, H] (differentiable); target_hidden [B, L+K-1, Ht], the states the target's
    head reads at column j (position j+1), and weight [B, L+K-1] their loss weights (no gradient);
    step k pairs anchor t with column t+k. loss[k] = sum_t weight * CE(p, q_k), hits[k] = sum_t
    weight * [argmax q_k == argmax p]; objective = sum_k step_scale[k] * loss[k] carries the
    gradient, loss and hits carry none. Gradients come back in the inputs' dtypes (fp32 master
    weights get an fp32 head gradient, summed over chunks in fp32; on CUDA no rounded bf16 head
    gradient is ever formed, on CPU each chunk's is, as under autocast's autograd).
    """
    steps = len(draft_hidden)
    _check_shapes(draft_hidden, draft_head, target_hidden, target_head, weight, step_scale)
    draft_dtype = _matmul_dtype(draft_hidden[0], draft_head)
    target_dtype = _matmul_dtype(target_hidden, target_head)
    if not torch.is_grad_enabled():  # a custom Function would still build gradients for leaves that want them
        draft_head, draft_hidden = draft_head.detach(), [h.detach() for h in draft_hidden]
    return _ChunkedTTTSoftCE.apply(
        draft_head,
        target_hidden.detach().to(target_dtype),
        target_head.detach().to(target_dtype),
        weight.detach().float(),
        step_scale.detach().float(),
        chunk_size,
        draft_dtype,
        steps,
        *draft_hidden,
    )


def ttt_soft_cross_entropy_reference(
    draft_hidden: Sequence[Tensor],
    draft_head: Tensor,
    target_hidden: Tensor,
    target_head: Tensor,
    weight: Tensor,
    step_scale: Tensor,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same as `ttt_soft_cross_entropy`, each step's [B*L, Vd] logits at once, plain autograd.

    chunk_size is accepted for a drop-in signature and ignored.
    """
    _check_shapes(draft_hidden, draft_head, target_hidden, target_head, weight, step_scale)
    draft_dtype = _matmul_dtype(draft_hidden[0], draft_head)
    target_dtype = _matmul_dtype(target_hidden, target_head)
    anchors = draft_hidden[0].shape[1]
    losses, hits = [], []
    for k, hidden in enumerate(draft_hidden):
        target = target_hidden[:, k : k + anchors].detach().to(target_dtype)
        target_logits = (target @ target_head.detach().to(target_dtype).T).float()
        draft_logits = (hidden.to(draft_dtype) @ draft_head.to(draft_dtype).T).float()
        w = weight[:, k : k + anchors].detach().float()
        p = target_logits.softmax(dim=-1)
        losses.append((w * -(p * draft_logits.log_softmax(dim=-1)).sum(dim=-1)).sum())
        hits.append((w * (draft_logits.argmax(dim=-1) == target_logits.argmax(dim=-1)).float()).sum())
    loss = torch.stack(losses)
    return (step_scale.detach().float() * loss).sum(), loss.detach(), torch.stack(hits).detach()


def _check_shapes(
    draft_hidden: Sequence[Tensor], draft_head: Tensor, target_hidden: Tensor, target_head: Tensor, weight: Tensor,
    step_scale: Tensor,
) -> None:
    steps = len(draft_hidden)
    if steps == 0 or any(h.shape != draft_hidden[0].shape for h in draft_hidden) or draft_hidden[0].dim() != 3:
        raise ValueError(f"draft_hidden: expected K >= 1 tensors of one [B, L, H] shape, got "
                         f"{[tuple(h.shape) for h in draft_hidden]}")
    b, anchors, h = draft_hidden[0].shape
    vd = draft_head.shape[0]
    if draft_head.shape != (vd, h):
        raise ValueError(f"draft_head {tuple(draft_head.shape)} does not match hidden size {h}")
    columns = anchors + steps - 1
    if target_hidden.shape[:2] != (b, columns) or weight.shape != (b, columns):
        raise ValueError(f"target_hidden {tuple(target_hidden.shape)} and weight {tuple(weight.shape)}: expected "
                         f"[{b}, {columns}, ...] for {steps} steps over {anchors} anchors")
    if target_head.shape != (vd, target_hidden.shape[2]):
        raise ValueError(f"target_head {tuple(target_head.shape)} != {(vd, target_hidden.shape[2])}")
    if step_scale.shape != (steps,):
        raise ValueError(f"step_scale {tuple(step_scale.shape)}: expected [{steps}]")


def _matmul_dtype(hidden: Tensor, head: Tensor) -> torch.dtype:
    # Under autocast the caller expects autocast's matmul dtype, even for fp32 master weights.
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, head.dtype)


# exp() of anything below about -87.3 is an fp32 denormal (or, past -103, zero), and x86 CPUs take
# microcode assists on denormal results and operands: on this project's CPU exp over a
# [1024, 2048] chunk took 36 ms instead of 0.3 ms, and every later op on the denormal probabilities
# was 10-20x slower too. Logits this far below their row's maximum carry a probability under
# e^-70 = 4e-31, so they are raised to it before exp: every probability stays a normal float.
_EXP_FLOOR = -70.0


def _shifted_exp(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(logits - row max, exp of that floored at _EXP_FLOOR), in fp32."""
    shifted = logits.float()
    shifted = shifted - shifted.amax(dim=-1, keepdim=True)
    return shifted, shifted.clamp(min=_EXP_FLOOR).exp_()


def _target_rows(target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """(p, argmax p) of one chunk in fp32: computed once, they serve all K steps."""
    shifted, p = _shifted_exp(target_logits)
    p /= p.sum(dim=-1, keepdim=True)
    return p, shifted.argmax(dim=-1)


def _chunk_terms(
    target: tuple[Tensor, Tensor], draft_logits: Tensor, weight: Tensor, grad_scale: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(weighted CE sum, weighted hit count) in fp32 and grad_scale * dlogits in the logits' dtype,
    one chunk; `target` is `_target_rows` of the chunk; grad_scale is a one-element tensor."""
    p, target_argmax = target
    shifted, q = _shifted_exp(draft_logits)
    # A hit: the draft's top logit (0 once shifted) sits at the target's argmax. A gather, because
    # a CPU argmax over [chunk, Vd] costs 25x an amax (bf16: 60x); they differ only on exact draft ties.
    hit = shifted.gather(1, target_argmax[:, None]).squeeze(1) >= 0
    hits = (weight * hit.float()).sum()
    total = q.sum(dim=-1, keepdim=True)
    log_q = shifted.sub_(total.log())
    loss = (weight * -torch.linalg.vecdot(p, log_q)).sum()
    dlogits = q.div_(total).sub_(p).mul_((weight * grad_scale)[:, None])
    return loss, hits, dlogits.to(draft_logits.dtype)


if triton is not None:

    @triton.jit
    def _soft_ce_rows_kernel(
        target_ptr, draft_ptr, weight_ptr, scale_ptr, dlogits_ptr, loss_ptr, hit_ptr,
        vocab, target_stride, draft_stride, dlogits_stride, BLOCK: tl.constexpr,
    ):
        # One program per row. Pass 1: online max / sum-exp and argmax of both logit rows.
        row = tl.program_id(0).to(tl.int64)
        target_row = target_ptr + row * target_stride
        draft_row = draft_ptr + row * draft_stride
        cols = tl.arange(0, BLOCK)
        t_max = float("-inf")
        t_sum = 0.0
        t_arg = 0
        d_max = float("-inf")
        d_sum = 0.0
        d_arg = 0
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            inside = idx < vocab
            t = tl.load(target_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
            d = tl.load(draft_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
            t_block_max = tl.max(t, axis=0)
            d_block_max = tl.max(d, axis=0)
            # Strictly greater: the first maximal index wins, as in torch.argmax.
            t_arg = tl.where(t_block_max > t_max, start + tl.argmax(t, axis=0), t_arg)
            d_arg = tl.where(d_block_max > d_max, start + tl.argmax(d, axis=0), d_arg)
            t_new = tl.maximum(t_max, t_block_max)
            d_new = tl.maximum(d_max, d_block_max)
            t_sum = t_sum * tl.exp(t_max - t_new) + tl.sum(tl.exp(t - t_new), axis=0)
            d_sum = d_sum * tl.exp(d_max - d_new) + tl.sum(tl.exp(d - d_new), axis=0)
            t_max = t_new
            d_max = d_new
        t_lse = t_max + tl.log(t_sum)
        d_lse = d_max + tl.log(d_sum)
        # Pass 2: CE = -sum p * log q, and dlogits = scale * w * (q - p), written once.
        w = tl.load(weight_ptr + row)
        grad_w = w * tl.load(scale_ptr)
        dlogits_row = dlogits_ptr + row * dlogits_stride
        cross = 0.0
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            inside = idx < vocab
            t = tl.load(target_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
            d = tl.load(draft_row + idx, mask=inside, other=0.0).to(tl.float32)
            p = tl.exp(t - t_lse)
            log_q = d - d_lse
            cross += tl.sum(p * log_q, axis=0)
            grad = grad_w * (tl.exp(log_q) - p)
            tl.store(dlogits_row + idx, grad.to(dlogits_ptr.dtype.element_ty), mask=inside)
        tl.store(loss_ptr + row, -w * cross)
        tl.store(hit_ptr + row, tl.where(t_arg == d_arg, w, 0.0))


def _chunk_terms_triton(
    target_logits: Tensor, draft_logits: Tensor, weight: Tensor, grad_scale: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`_chunk_terms` on CUDA in one kernel reading each logit twice and writing dlogits once.

    (torch.compile of `_chunk_terms` made several passes per row: 0.77 ms per 1024 x 32000 bf16
    chunk on an H200, against 0.14 ms for this kernel.)
    """
    rows, vocab = draft_logits.shape
    dlogits = torch.empty_like(draft_logits)
    row_loss = torch.empty(rows, dtype=torch.float32, device=draft_logits.device)
    row_hit = torch.empty_like(row_loss)
    _soft_ce_rows_kernel[(rows,)](
        target_logits, draft_logits, weight, grad_scale, dlogits, row_loss, row_hit,
        vocab, target_logits.stride(0), draft_logits.stride(0), dlogits.stride(0),
        BLOCK=_TRITON_BLOCK, num_warps=_TRITON_WARPS,
    )
    return row_loss.sum(), row_hit.sum(), dlogits


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b possibly bf16/fp16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        # cuBLAS accumulates straight into the fp32 buffer: no rounded [Vd, H] bf16 product and
        # no separate add pass (H200, Vd 32000, H 4096, 1024 rows: 0.55 ms against 0.83 ms).
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        # CPUs have no fp32-output bf16 matmul, and an fp32 one costs 2x a bf16 one: each chunk's
        # product is rounded to bf16 before the fp32 sum, as autocast's autograd does for every weight.
        acc.add_(a @ b)


class _ChunkedTTTSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        draft_head: Tensor,
        target_hidden: Tensor,
        target_head: Tensor,
        weight: Tensor,
        step_scale: Tensor,
        chunk_size: int,
        draft_dtype: torch.dtype,
        steps: int,
        *draft_hidden: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        need_head_grad = ctx.needs_input_grad[0]
        need_hidden_grad = ctx.needs_input_grad[8:]
        batch, anchors, _ = draft_hidden[0].shape
        columns = target_hidden.shape[1]
        device = draft_head.device
        head = draft_head.to(draft_dtype)
        hidden = [h.to(draft_dtype).flatten(0, 1) for h in draft_hidden]
        targets = target_hidden.flatten(0, 1)
        weights = weight.flatten()
        losses = torch.zeros(steps, dtype=torch.float32, device=device)
        hits = torch.zeros(steps, dtype=torch.float32, device=device)
        # One spare last row takes the (zero) gradients of pairs whose anchor lies outside the sample.
        grad_hidden = [torch.zeros(batch * anchors + 1, h.shape[1], dtype=draft_dtype, device=device) if need else None
                       for h, need in zip(hidden, need_hidden_grad)]
        # fp32 so that summing many chunks' contributions does not round away small ones.
        grad_head = torch.zeros(draft_head.shape, dtype=torch.float32, device=device) if need_head_grad else None
        # Unsupervised columns contribute nothing to loss, hits or gradients: skip their matmuls
        # (worth the one host sync nonzero() costs: prompt rows are often half of a batch).
        supervised = weights.nonzero().squeeze(1)
        on_cuda = device.type == "cuda"
        chunk_terms = _chunk_terms_triton if on_cuda else _chunk_terms
        for start in range(0, supervised.numel(), chunk_size):
            cols = supervised[start : start + chunk_size]
            # The target's distribution at these columns, computed once for all K steps (the
            # Triton kernel reads the logits; its per-row softmax is cheaper than a stored p).
            target_logits = targets[cols] @ target_head.T
            target = target_logits if on_cuda else _target_rows(target_logits)
            row, col = cols // columns, cols % columns
            for k in range(steps):
                anchor = col - k
                inside = (anchor >= 0) & (anchor < anchors)
                read = row * anchors + anchor.clamp(0, anchors - 1)
                pair_hidden = hidden[k][read]
                # dlogits come scaled by step_scale[k]: one fp32 head gradient sums all steps
                step_loss, step_hits, dlogits = chunk_terms(
                    target, pair_hidden @ head.T, weights[cols] * inside, step_scale[k : k + 1]
                )
                losses[k] += step_loss
                hits[k] += step_hits
                if grad_hidden[k] is not None:
                    grad_hidden[k][torch.where(inside, read, batch * anchors)] = dlogits @ head
                if need_head_grad:
                    _accumulate_matmul(grad_head, dlogits.T, pair_hidden)
        ctx.save_for_backward(grad_head, *[g for g in grad_hidden if g is not None])
        ctx.layout = (draft_head.dtype, [(h.dtype, h.shape, g is not None) for h, g in zip(draft_hidden, grad_hidden)])
        objective = (losses * step_scale).sum()
        ctx.mark_non_differentiable(losses, hits)
        return objective, losses, hits

    @staticmethod
    def backward(ctx, grad_objective: Tensor, _grad_losses: Tensor, _grad_hits: Tensor):
        head_dtype, layout = ctx.layout
        grad_head, *saved = ctx.saved_tensors
        if grad_head is not None:
            grad_head = (grad_head * grad_objective).to(head_dtype)
        saved_iter = iter(saved)
        grad_hidden = []
        for dtype, shape, present in layout:
            if present:
                grad = next(saved_iter)[:-1]
                grad_hidden.append((grad * grad_objective.to(grad.dtype)).to(dtype).view(shape))
            else:
                grad_hidden.append(None)
        return grad_head, None, None, None, None, None, None, None, *grad_hidden
