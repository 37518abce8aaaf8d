"""glibc malloc kept from handing large freed blocks back to the kernel between training steps.

By default glibc serves a block over its (adaptive) mmap threshold with a fresh mapping and trims
the heap's free top, so a step's many [chunk, vocab] and [B, heads, T, D] temporaries, freed and
allocated again every step, page-fault on every first touch. Kept on the heap they are reused:
1.08x the training tokens/s on this project's 2-core CPU (docs/experiments.md). The cost is that the
process keeps its peak heap instead of shrinking between steps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for 64-bit (4 * 1 MiB * sizeof(long))


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and never trim it; False where libc is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return all([mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), mallopt(_M_TOP_PAD, 256 * 2**20),
                mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)])
