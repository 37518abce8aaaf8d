"""Peak matmul FLOP/s and memory bandwidth of this machine, for a planner hardware profile.

Datasheets give these for GPUs; for a CPU box (and to check a datasheet) measure them:
  python benchmarks/machine_peak.py --out benchmarks/results/machine-peak-cpu.json

Matmul: square torch.mm in the given dtype, best of --repeats (the best run is the closest to
the hardware peak; the planner's efficiencies then absorb what real stages lose). Bandwidth: a
large tensor copy, counting read + write bytes, best of --repeats.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle3.metrics import machine_info  # noqa: E402


def best_seconds(fn, repeats: int, sync) -> float:
    fn()  # warm-up: allocations, kernel selection
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="matmul side")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--copy-mb", type=int, default=1024, help="bytes of the copied tensor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    a = torch.randn(args.size, args.size, device=device, dtype=dtype)
    b = torch.randn(args.size, args.size, device=device, dtype=dtype)
    mm_s = best_seconds(lambda: torch.mm(a, b), args.repeats, sync)
    src = torch.empty(args.copy_mb * 2**20 // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), args.repeats, sync)
    record = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": machine_info() | {"torch": torch.__version__, "threads": torch.get_num_threads()},
        "matmul_dtype": args.dtype,
        "matmul_size": args.size,
        "matmul_tflops": round(2 * args.size**3 / mm_s / 1e12, 4),
        "copy_mb": args.copy_mb,
        "memory_tb_s": round(2 * src.numel() * 4 / copy_s / 1e12, 4),  # read + write
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
