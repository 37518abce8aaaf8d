"""Kernels against their plain-torch references: TTT attention and chunked soft-target CE.

Runs on CPU everywhere; where CUDA is present the same tests also run the CUDA path
(compiled flex_attention), so `pytest tests/test_kernels.py` on a GPU machine checks it.
"""

import pytest
import torch

from kernels.soft_ce import soft_target_cross_entropy, soft_target_cross_entropy_reference
from kernels.ttt_attention import ttt_attention, ttt_attention_reference

# The CUDA path must run the compiled kernel: fail, don't pass slowly, if flex_attention falls
# back to its unfused eager implementation (e.g. after torch.compile's recompile limit).
pytestmark = pytest.mark.filterwarnings("error:flex_attention called without torch.compile:UserWarning")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (forward atol, gradient atol) of the kernel in this dtype against the fp32 reference.
TOLERANCE = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (2e-2, 5e-2)}


def _leaf(shape, dtype, device, generator, scale=1.0):
    x = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return x.to(device=device, dtype=dtype).requires_grad_()


def _grads(out, inputs, upstream):
    return torch.autograd.grad(out, inputs, upstream)


# ---------------------------------------------------------------- TTT attention


def _ttt_inputs(b, hq, hkv, t, d, steps, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = _leaf((b, hq, t, d), dtype, device, g)
    keys = [_leaf((b, hkv, t, d), dtype, device, g) for _ in range(steps)]
    values = [_leaf((b, hkv, t, d), dtype, device, g) for _ in range(steps)]
    return q, keys, values


def test_reference_matches_brute_force_definition():
    # Guards the reference itself: position t of step k sees step 0 at s <= t and steps 1..k at t.
    q, keys, values = _ttt_inputs(2, 4, 2, 6, 8, 3, torch.float32, "cpu")
    out = ttt_attention_reference(q, keys, values)
    for b in range(2):
        for h in range(4):
            kv = h // 2
            for t in range(6):
                k_seen = torch.cat([keys[0][b, kv, : t + 1]] + [k[b, kv, t : t + 1] for k in keys[1:]])
                v_seen = torch.cat([values[0][b, kv, : t + 1]] + [v[b, kv, t : t + 1] for v in values[1:]])
                p = (k_seen @ q[b, h, t] * 8**-0.5).softmax(dim=0)
                torch.testing.assert_close(out[b, h, t], p @ v_seen, rtol=0, atol=1e-6)


def _ttt_cases(device):
    # (B, Hq, Hkv, T, D). On CUDA lengths cross several 128-wide flex blocks and step boundaries
    # fall inside blocks; D stays fixed there, as in training, so compiled graphs are reused.
    if device == "cuda":
        return [(1, 4, 4, 1, 64), (1, 4, 4, 37, 64), (2, 8, 2, 300, 64), (2, 4, 1, 129, 64)]
    return [(1, 4, 4, 1, 16), (1, 4, 4, 37, 16), (2, 8, 2, 70, 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_ttt_attention_matches_reference(device, dtype, steps):
    # Across these tests dtypes, batch sizes of 1 and 2 and T = 1 each need their own compiled
    # graph; the recompile-limit behaviour of one training run is checked separately below.
    with torch._dynamo.config.patch(recompile_limit=64):
        _check_ttt_against_reference(device, dtype, steps)


def _check_ttt_against_reference(device, dtype, steps):
    fwd_tol, grad_tol = TOLERANCE[dtype]
    for b, hq, hkv, t, d in _ttt_cases(device):
        q, keys, values = _ttt_inputs(b, hq, hkv, t, d, steps, dtype, device, seed=t + steps)
        inputs = [q, *keys, *values]
        upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        out = ttt_attention(q, keys, values)
        ref = ttt_attention_reference(q, keys, values)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=fwd_tol)
        for name, got, want in zip(
            ["q"] + [f"k{j}" for j in range(steps)] + [f"v{j}" for j in range(steps)],
            _grads(out, inputs, upstream),
            _grads(ref, inputs, upstream),
        ):
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=grad_tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex path is CUDA-only")
def test_ttt_attention_cuda_new_lengths_and_steps_do_not_recompile():
    # Training sees a new T most batches and K step counts: after the first graphs, no compiles.
    torch._dynamo.reset()
    compiles = []
    for t in [256, 300, 517, 1000, 1999]:
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for steps in range(1, 8):
            q, keys, values = _ttt_inputs(2, 8, 2, t, 64, steps, torch.bfloat16, "cuda", seed=steps)
            ttt_attention(q, keys, values).float().sum().backward()
        compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert compiles[0] >= 1 and sum(compiles[2:]) == 0, compiles


@pytest.mark.parametrize("device", DEVICES)
def test_ttt_attention_explicit_scale(device):
    q, keys, values = _ttt_inputs(1, 2, 1, 20, 16, 3, torch.float32, device)
    out = ttt_attention(q, keys, values, scale=0.3)
    torch.testing.assert_close(out, ttt_attention_reference(q, keys, values, scale=0.3), rtol=0, atol=2e-5)
    assert not torch.allclose(out, ttt_attention(q, keys, values))


def test_ttt_attention_rejects_bad_shapes():
    q, keys, values = _ttt_inputs(1, 3, 2, 5, 8, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple"):
        ttt_attention(q, keys, values)
    q, keys, values = _ttt_inputs(1, 4, 2, 5, 8, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one value per key"):
        ttt_attention(q, keys, values[:1])
    with pytest.raises(ValueError, match="shape"):
        ttt_attention(q, keys, [values[0], values[1][:, :, :4]])


# ---------------------------------------------------------------- soft-target CE


def _ce_inputs(n, h, ht, vd, dtype, device, seed=0, zero_rows=0.3):
    g = torch.Generator().manual_seed(seed)
    draft_hidden = _leaf((n, h), dtype, device, g)
    draft_head = _leaf((vd, h), dtype, device, g, scale=h**-0.5 * 3)
    target_hidden = torch.randn(n, ht, generator=g).to(device, dtype)
    target_head = (torch.randn(vd, ht, generator=g) * ht**-0.5 * 3).to(device, dtype)
    mask = torch.rand(n, generator=g) * 2
    mask[torch.rand(n, generator=g) < zero_rows] = 0
    return draft_hidden, draft_head, target_hidden, target_head, mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,chunk", [(1, 64), (37, 64), (300, 64), (300, 1024)])
def test_soft_ce_matches_reference(device, dtype, n, chunk):
    fwd_tol, grad_tol = TOLERANCE[dtype]
    draft_hidden, draft_head, target_hidden, target_head, mask = _ce_inputs(n, 32, 48, 500, dtype, device, seed=n)
    args = (draft_hidden, draft_head, target_hidden, target_head, mask)
    loss, correct = soft_target_cross_entropy(*args, chunk_size=chunk)
    ref_loss, ref_correct = soft_target_cross_entropy_reference(*args)
    assert loss.dtype == torch.float32 and loss.shape == () and not correct.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=fwd_tol, atol=fwd_tol)
    if dtype == torch.bfloat16:
        # Chunked and whole matmuls may round differently; a near-tie argmax may flip.
        assert abs(correct.item() - ref_correct.item()) <= 2.0 + 1e-6
    else:
        torch.testing.assert_close(correct, ref_correct, rtol=0, atol=1e-5)
    upstream = torch.tensor(0.7, device=device)
    for got, want in zip(_grads(loss, [draft_hidden, draft_head], upstream), _grads(ref_loss, [draft_hidden, draft_head], upstream)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=grad_tol, atol=grad_tol)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_ce_masked_rows_get_zero_gradient(device):
    draft_hidden, draft_head, target_hidden, target_head, mask = _ce_inputs(
        100, 16, 16, 200, torch.float32, device, zero_rows=0.0
    )
    mask[::2] = 0
    loss, _ = soft_target_cross_entropy(draft_hidden, draft_head, target_hidden, target_head, mask, chunk_size=16)
    grad_hidden, grad_head = torch.autograd.grad(loss, [draft_hidden, draft_head])
    assert torch.count_nonzero(grad_hidden[::2]) == 0
    assert torch.count_nonzero(grad_hidden[1::2].abs().sum(dim=1)) == 50
    # Masked rows neither count in the loss nor move the head: only supervised rows matter.
    kept = mask != 0
    sub_loss, _ = soft_target_cross_entropy(
        draft_hidden[kept], draft_head, target_hidden[kept], target_head, mask[kept], chunk_size=16
    )
    torch.testing.assert_close(loss, sub_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad_head, torch.autograd.grad(sub_loss, draft_head)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_ce_all_rows_masked(device):
    args = _ce_inputs(10, 8, 8, 50, torch.float32, device, zero_rows=1.0)
    loss, correct = soft_target_cross_entropy(*args)
    assert loss.item() == 0 and correct.item() == 0
    grad_hidden, grad_head = torch.autograd.grad(loss, args[:2])
    assert torch.count_nonzero(grad_hidden) == 0 and torch.count_nonzero(grad_head) == 0


def test_soft_ce_keeps_nothing_of_size_n_by_vocab_for_backward():
    # Everything autograd keeps for backward, recorded at save time: only O(N*H + Vd*H) tensors
    # (the precomputed input gradients), never the [N, Vd] logits or probabilities.
    n, h, vd = 512, 16, 1000
    args = _ce_inputs(n, h, h, vd, torch.float32, "cpu", zero_rows=0.0)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = soft_target_cross_entropy(*args, chunk_size=64)
    assert saved and max(saved) <= max(n, vd) * h
    assert sum(saved) <= (n + vd) * h < n * vd // 10
    # The reference, by contrast, does keep [N, Vd] tensors: the hook sees them.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        soft_target_cross_entropy_reference(*args)
    assert max(saved) >= n * vd
    loss.backward()


def test_soft_ce_gradient_only_for_inputs_that_need_it():
    draft_hidden, draft_head, target_hidden, target_head, mask = _ce_inputs(40, 8, 8, 30, torch.float32, "cpu")
    hidden = draft_hidden.detach()
    loss, _ = soft_target_cross_entropy(hidden, draft_head, target_hidden, target_head, mask, chunk_size=16)
    ref_loss, _ = soft_target_cross_entropy_reference(hidden, draft_head, target_hidden, target_head, mask)
    torch.testing.assert_close(
        torch.autograd.grad(loss, draft_head)[0], torch.autograd.grad(ref_loss, draft_head)[0], rtol=1e-5, atol=1e-6
    )
    with torch.no_grad():
        loss, _ = soft_target_cross_entropy(draft_hidden, draft_head, target_hidden, target_head, mask)
    assert not loss.requires_grad


def test_soft_ce_under_autocast_uses_bf16_matmuls_and_fp32_master_grads():
    args = _ce_inputs(70, 16, 24, 300, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, correct = soft_target_cross_entropy(*args, chunk_size=32)
        ref_loss, _ = soft_target_cross_entropy_reference(*args)
    bf16_args = [a.detach().bfloat16() for a in args[:4]] + [args[4]]
    bf16_loss, _ = soft_target_cross_entropy_reference(*bf16_args)
    torch.testing.assert_close(loss, bf16_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    grads = torch.autograd.grad(loss, args[:2])
    ref_grads = torch.autograd.grad(ref_loss, args[:2])
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton row kernel is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_ce_cuda_row_kernel_matches_torch(dtype):
    from kernels.soft_ce import _chunk_terms, _chunk_terms_triton

    g = torch.Generator().manual_seed(0)
    rows, vocab = 300, 10000  # several 4096-wide blocks, the last one partial
    target = torch.randn(rows, vocab, generator=g) * 3
    draft = torch.randn(rows, vocab, generator=g) * 3
    target[1, -1] = draft[1, -1] = 100  # agreeing maximum in the partial last block
    target[2, 5] = draft[2, 5] = draft[2, 9000] = 100  # a tie: the first index wins, a hit
    weight = torch.rand(rows, generator=g)
    weight[::3] = 0
    args = (target.to("cuda", dtype), draft.to("cuda", dtype), weight.cuda())
    loss, hits, dlogits = _chunk_terms_triton(*args)
    want_loss, want_hits, want_dlogits = _chunk_terms(*args)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    assert hits.item() == pytest.approx(want_hits.item()) and want_hits.item() >= weight[1] + weight[2] - 1e-6
    assert dlogits.dtype == dtype
    torch.testing.assert_close(dlogits.float(), want_dlogits.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on CUDA")
def test_soft_ce_peak_memory_is_per_chunk():
    n, h, vd, chunk = 16384, 256, 32000, 1024
    args = _ce_inputs(n, h, h, vd, torch.bfloat16, "cuda", zero_rows=0.0)
    soft_target_cross_entropy(*args, chunk_size=chunk)[0].backward()  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, _ = soft_target_cross_entropy(*args, chunk_size=chunk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # Gradients and their fp32 accumulator are O((N + Vd) * H); the rest must be a few
    # [chunk, Vd] buffers. One fp32 [N, Vd] tensor alone would be 2 GB here.
    per_chunk_budget = 6 * chunk * vd * 4 + 4 * (n + vd) * h * 4
    assert extra < per_chunk_budget < n * vd * 4 // 2, (extra, per_chunk_budget)
