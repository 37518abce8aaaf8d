"""vllm-cpu 0.32.0's rejection sampler at T > 0: the defect pinned on the stock kernel, and our plugin's fix.

The rejection sampler expands each request's temperature to its draft tokens with exactly this call
(vllm/v1/sample/rejection_sampler.py, apply_sampling_constraints): a greedy request's 0 becomes 1.
When a vLLM upgrade fixes the stock kernel, the strict xfail turns into a failure that says so; then
eagle3/engine/vllm_cpu_fixes.py (and its version guard) can go.
"""
from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402

from eagle3.engine import vllm_cpu_fixes  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu() or HAS_TRITON,
                                reason="the defect is in the CPU replacement of a Triton kernel")

TEMPERATURES = torch.tensor([0.7, 0.0, 1.3])  # per request; the middle one is greedy
CU_DRAFT_TOKENS = torch.tensor([2, 3, 6], dtype=torch.int32)
EXPECTED = torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])


def expanded_temperatures() -> torch.Tensor:
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    return expand_batch_to_tokens(TEMPERATURES, CU_DRAFT_TOKENS, 6, replace_from=0, replace_to=1)


@pytest.mark.xfail(vllm.__version__ == vllm_cpu_fixes.FIXED_VERSION, strict=True,
                   reason="vllm-cpu 0.32.0's CPU expand_kernel writes an int64 copy of a float output")
def test_stock_cpu_expand_kernel_keeps_float_temperatures() -> None:
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    # what the platform registers for this kernel
    register_kernels({vllm_cpu_fixes.EXPAND_KERNEL: cpu_triton_utils._expand_kernel_impl})
    assert torch.allclose(expanded_temperatures(), EXPECTED)


@pytest.mark.skipif(vllm.__version__ != vllm_cpu_fixes.FIXED_VERSION, reason="the fix is guarded to 0.32.0")
def test_plugin_fixes_the_expansion_after_the_platform_registers_its_kernels() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # through the installed entry point, as every engine process does
    current_platform.register_triton_kernel_overrides()  # the worker's call, after the plugins
    assert vllm_cpu_fixes.status() == "applied"
    assert torch.allclose(expanded_temperatures(), EXPECTED)


def test_fixed_expansion_keeps_every_dtype_and_the_replacement() -> None:
    ints = torch.empty(6, dtype=torch.int64)
    vllm_cpu_fixes.expand_preserving_dtype(ints, torch.tensor([5, -1, 7]), CU_DRAFT_TOKENS, -1, 9)
    assert ints.tolist() == [5, 5, 9, 7, 7, 7]
    floats = torch.full((8,), -3.0)  # the output may be longer than the tokens: the rest is left alone
    vllm_cpu_fixes.expand_preserving_dtype(floats, TEMPERATURES, CU_DRAFT_TOKENS, 0, 1)
    assert torch.allclose(floats, torch.cat([EXPECTED, torch.tensor([-3.0, -3.0])]))


def test_seeded_requests_crash_the_cpu_engine_when_their_prefill_is_chunked() -> None:
    """Why evaluate sends no per-request seed to a CPU server (online.request_seed): the runner rewinds a
    seeded request's generator past each discarded partial-prefill sample, and a CPU generator refuses.
    Seen in the evaluate stage at T=0.7 with 40 concurrent requests: "CPU Generator does not use offset",
    EngineDeadError. When either half of this changes, per-request seeds may be safe on CPU again."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "set_offset" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="does not use offset"):
        generator.set_offset(generator.get_offset() - 4)
