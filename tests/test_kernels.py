"""Kernels against their plain-torch references: TTT attention and chunked soft-target CE.

Runs on CPU everywhere; where CUDA is present the same tests also run the CUDA path
(compiled flex_attention), so `pytest tests/test_kernels.py` on a GPU machine checks it.
"""

import pytest
import torch

from kernels.soft_ce import ttt_soft_cross_entropy, ttt_soft_cross_entropy_reference
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


def _ttt_inputs(b, hq, hkv, t, d, steps, dtype, device, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = _leaf((b, hq, t, d), dtype, device, g)
    keys = [_leaf((b, hkv, t, d), dtype, device, g) for _ in range(steps)]
    values = [_leaf((b, hkv, t, dv or d), dtype, device, g) for _ in range(steps)]
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ttt_attention_values_of_another_width_match_reference(device, dtype):
    """MLA: keys nope + rope wide (DeepSeek-V3: 192), values v_head_dim (128); on CUDA the flex kernel
    takes the narrower values as they are."""
    fwd_tol, grad_tol = TOLERANCE[dtype]
    cases = [(2, 8, 8, 300, 192, 128), (1, 4, 4, 37, 48, 32)] if device == "cuda" else [(2, 4, 4, 37, 24, 16)]
    with torch._dynamo.config.patch(recompile_limit=64):
        for b, hq, hkv, t, d, dv in cases:
            for steps in (1, 3):
                q, keys, values = _ttt_inputs(b, hq, hkv, t, d, steps, dtype, device, seed=steps, dv=dv)
                upstream = torch.randn(b, hq, t, dv, generator=torch.Generator().manual_seed(1)).to(device, dtype)
                out, ref = ttt_attention(q, keys, values), ttt_attention_reference(q, keys, values)
                assert out.shape == (b, hq, t, dv)
                torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=fwd_tol)
                inputs = [q, *keys, *values]
                for got, want in zip(_grads(out, inputs, upstream), _grads(ref, inputs, upstream)):
                    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=grad_tol)


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


def _ce_inputs(b, anchors, steps, h, ht, vd, dtype, device, seed=0, zero_cols=0.3):
    """(draft_hidden K x [B, L, H], draft_head, target_hidden [B, L+K-1, Ht], target_head, weight, step_scale)."""
    g = torch.Generator().manual_seed(seed)
    columns = anchors + steps - 1
    draft_hidden = [_leaf((b, anchors, h), dtype, device, g) for _ in range(steps)]
    draft_head = _leaf((vd, h), dtype, device, g, scale=h**-0.5 * 3)
    target_hidden = torch.randn(b, columns, ht, generator=g).to(device, dtype)
    target_head = (torch.randn(vd, ht, generator=g) * ht**-0.5 * 3).to(device, dtype)
    weight = torch.rand(b, columns, generator=g) * 2
    weight[torch.rand(b, columns, generator=g) < zero_cols] = 0
    step_scale = torch.tensor([0.8**k / (k + 2) for k in range(steps)])
    return draft_hidden, draft_head, target_hidden, target_head, weight.to(device), step_scale.to(device)


def _leaves(args):
    return [*args[0], args[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,anchors,steps,chunk", [(1, 1, 1, 64), (1, 37, 3, 64), (2, 150, 1, 64), (2, 150, 3, 64),
                                                   (3, 100, 4, 1024)])
def test_soft_ce_matches_reference(device, dtype, b, anchors, steps, chunk):
    fwd_tol, grad_tol = TOLERANCE[dtype]
    args = _ce_inputs(b, anchors, steps, 32, 48, 500, dtype, device, seed=anchors + steps)
    objective, loss, hits = ttt_soft_cross_entropy(*args, chunk_size=chunk)
    ref_objective, ref_loss, ref_hits = ttt_soft_cross_entropy_reference(*args)
    assert objective.dtype == loss.dtype == torch.float32 and objective.shape == () and loss.shape == (steps,)
    assert not loss.requires_grad and not hits.requires_grad
    torch.testing.assert_close(objective, ref_objective, rtol=fwd_tol, atol=fwd_tol)
    torch.testing.assert_close(loss, ref_loss, rtol=fwd_tol, atol=fwd_tol)
    if dtype == torch.bfloat16:
        # Chunked and whole matmuls may round differently; a near-tie argmax may flip.
        assert (hits - ref_hits).abs().max().item() <= 2.0 + 1e-6
    else:
        torch.testing.assert_close(hits, ref_hits, rtol=0, atol=1e-5)
    upstream = torch.tensor(0.7, device=device)
    for got, want in zip(_grads(objective, _leaves(args), upstream), _grads(ref_objective, _leaves(args), upstream)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=grad_tol, atol=grad_tol)


def test_soft_ce_pairs_anchor_t_of_step_k_with_column_t_plus_k():
    # Hand-built: with one supervised column j, only anchor j-k of each step k learns, and
    # step k's loss is the CE against column j's distribution.
    anchors, steps = 5, 3
    args = _ce_inputs(1, anchors, steps, 8, 8, 40, torch.float32, "cpu", zero_cols=0.0)
    weight = torch.zeros(1, anchors + steps - 1)
    weight[0, 4] = 1.0
    args = (*args[:4], weight, args[5])
    objective, loss, _ = ttt_soft_cross_entropy(*args, chunk_size=2)
    grads = torch.autograd.grad(objective, args[0])
    for k, grad in enumerate(grads):
        learning = grad[0].abs().sum(dim=1).nonzero().flatten().tolist()
        assert learning == [4 - k]
        p = (args[2][0, 4] @ args[3].T).softmax(-1)
        q = (args[0][k][0, 4 - k] @ args[1].T).log_softmax(-1)
        torch.testing.assert_close(loss[k], -(p * q).sum().detach())


@pytest.mark.parametrize("device", DEVICES)
def test_soft_ce_masked_columns_get_zero_gradient(device):
    args = _ce_inputs(2, 60, 3, 16, 16, 200, torch.float32, device, zero_cols=0.0)
    args[4][:, ::2] = 0
    objective, loss, _ = ttt_soft_cross_entropy(*args, chunk_size=16)
    grads = torch.autograd.grad(objective, _leaves(args))
    for k, grad in enumerate(grads[:-1]):
        # anchor t of step k reads column t+k: zero-weight columns give zero gradient
        dead = args[4][:, k : k + 60] == 0
        assert torch.count_nonzero(grad[dead]) == 0
        assert torch.count_nonzero(grad[~dead].abs().sum(dim=-1)) == int((~dead).sum())
    # Columns of weight 0 neither count in the loss nor move the head.
    ref_objective, ref_loss, _ = ttt_soft_cross_entropy_reference(*args)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[-1], torch.autograd.grad(ref_objective, args[1])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_ce_all_columns_masked(device):
    args = _ce_inputs(1, 10, 2, 8, 8, 50, torch.float32, device, zero_cols=1.0)
    objective, loss, hits = ttt_soft_cross_entropy(*args)
    assert objective.item() == 0 and loss.abs().sum().item() == 0 and hits.sum().item() == 0
    for grad in torch.autograd.grad(objective, _leaves(args)):
        assert torch.count_nonzero(grad) == 0


def test_soft_ce_keeps_nothing_of_size_n_by_vocab_for_backward():
    # Everything autograd keeps for backward, recorded at save time: only O(K*N*H + Vd*H) tensors
    # (the precomputed input gradients), never the [N, Vd] logits or probabilities.
    n, steps, h, vd = 512, 2, 16, 1000
    args = _ce_inputs(1, n, steps, h, h, vd, torch.float32, "cpu", zero_cols=0.0)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        objective, _, _ = ttt_soft_cross_entropy(*args, chunk_size=64)
    assert saved and max(saved) <= max(n + 1, vd) * h
    assert sum(saved) <= (steps * (n + 1) + vd) * h < n * vd // 10
    # The reference, by contrast, does keep [N, Vd] tensors: the hook sees them.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ttt_soft_cross_entropy_reference(*args)
    assert max(saved) >= n * vd
    objective.backward()


def test_soft_ce_gradient_only_for_inputs_that_need_it():
    draft_hidden, *rest = _ce_inputs(1, 40, 2, 8, 8, 30, torch.float32, "cpu")
    detached = [h.detach() for h in draft_hidden]
    objective, _, _ = ttt_soft_cross_entropy(detached, *rest, chunk_size=16)
    ref_objective, _, _ = ttt_soft_cross_entropy_reference(detached, *rest)
    torch.testing.assert_close(torch.autograd.grad(objective, rest[0])[0],
                               torch.autograd.grad(ref_objective, rest[0])[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        objective, _, _ = ttt_soft_cross_entropy(draft_hidden, *rest)
    assert not objective.requires_grad


def test_soft_ce_under_autocast_uses_bf16_matmuls_and_fp32_master_grads():
    args = _ce_inputs(1, 70, 2, 16, 24, 300, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        objective, _, _ = ttt_soft_cross_entropy(*args, chunk_size=32)
        ref_objective, _, _ = ttt_soft_cross_entropy_reference(*args)
    bf16_args = ([h.detach().bfloat16() for h in args[0]], *[a.detach().bfloat16() for a in args[1:4]], *args[4:])
    bf16_objective, _, _ = ttt_soft_cross_entropy_reference(*bf16_args)
    torch.testing.assert_close(objective, bf16_objective, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(objective, ref_objective, rtol=1e-2, atol=1e-2)
    grads = torch.autograd.grad(objective, _leaves(args))
    ref_grads = torch.autograd.grad(ref_objective, _leaves(args))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_soft_ce_cpu_rows_make_no_denormals_at_wide_logit_spreads():
    """Logits 100+ below their row's maximum would give denormal probabilities (10-100x slower
    arithmetic on x86); they are floored at e^-70 instead, which no loss or gradient can notice."""
    from kernels.soft_ce import _chunk_terms, _target_rows

    g = torch.Generator().manual_seed(0)
    target = torch.randn(64, 512, generator=g) * 60  # spreads of several hundred
    draft = torch.randn(64, 512, generator=g) * 60
    weight = torch.rand(64, generator=g)
    p, argmax = _target_rows(target)
    loss, hits, dlogits = _chunk_terms((p, argmax), draft, weight, torch.tensor([0.5]))
    tiny = torch.finfo(torch.float32).tiny
    assert p.min() >= tiny  # no probability is denormal, none is 0
    assert torch.equal(argmax, target.argmax(-1))
    exact_p, log_q = target.softmax(-1), draft.log_softmax(-1)
    torch.testing.assert_close(loss, (weight * -(exact_p * log_q).sum(-1)).sum(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(dlogits, (0.5 * weight)[:, None] * (log_q.exp() - exact_p), rtol=0, atol=1e-7)
    assert hits == (weight * (draft.argmax(-1) == argmax).float()).sum()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton row kernel is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_ce_cuda_row_kernel_matches_torch(dtype):
    from kernels.soft_ce import _chunk_terms, _chunk_terms_triton, _target_rows

    g = torch.Generator().manual_seed(0)
    rows, vocab = 300, 10000  # several 4096-wide blocks, the last one partial
    target = torch.randn(rows, vocab, generator=g) * 3
    draft = torch.randn(rows, vocab, generator=g) * 3
    target[1, -1] = draft[1, -1] = 100  # agreeing maximum in the partial last block
    target[2, 5] = draft[2, 5] = draft[2, 9000] = 100  # a tie: the first index wins, a hit
    weight = torch.rand(rows, generator=g)
    weight[::3] = 0
    args = (target.to("cuda", dtype), draft.to("cuda", dtype), weight.cuda(), torch.tensor([0.3], device="cuda"))
    loss, hits, dlogits = _chunk_terms_triton(*args)
    want_loss, want_hits, want_dlogits = _chunk_terms(_target_rows(args[0]), *args[1:])
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    assert hits.item() == pytest.approx(want_hits.item()) and want_hits.item() >= weight[1] + weight[2] - 1e-6
    assert dlogits.dtype == dtype
    torch.testing.assert_close(dlogits.float(), want_dlogits.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on CUDA")
def test_soft_ce_peak_memory_is_per_chunk():
    n, steps, h, vd, chunk = 16384, 2, 256, 32000, 1024
    args = _ce_inputs(1, n, steps, h, h, vd, torch.bfloat16, "cuda", zero_cols=0.0)
    ttt_soft_cross_entropy(*args, chunk_size=chunk)[0].backward()  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    objective, _, _ = ttt_soft_cross_entropy(*args, chunk_size=chunk)
    objective.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # Gradients and their fp32 accumulator are O((K*N + Vd) * H); the rest must be a few
    # [chunk, Vd] buffers. One fp32 [N, Vd] tensor alone would be 2 GB here.
    per_chunk_budget = 6 * chunk * vd * 4 + 2 * (steps * n + vd) * h * 4
    assert extra < per_chunk_budget < n * vd * 4 // 2, (extra, per_chunk_budget)
