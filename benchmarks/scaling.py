"""Scaling of extraction and drafter training from 1 to N GPUs of one host, in one command.

Runs benchmarks/extract_bench.py and benchmarks/train_bench.py under torchrun with 1 and with N
processes (one GPU each; N = --procs, default every GPU), after a disk probe, and writes one
record: per-rank and aggregate tokens/s, scaling efficiency = aggregate(N) / (N x aggregate(1)),
host CPU use (all cores, the store's compression threads) and disk write rates, and a linear
projection of what --project-to GPUs would need from this host's CPUs and disk. The record is
rewritten after every run, so a run cut short still leaves the figures of those that finished.

  python benchmarks/scaling.py --seconds 15 --out benchmarks/results/scaling-h200x2.json   (GPU host)
  python benchmarks/scaling.py --tiny --seconds 2 --procs 2 --disk-probe-gb 0.1             (CPU, gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from eagle3.metrics import machine_info  # noqa: E402

BENCHMARKS = {"extract": ROOT / "benchmarks" / "extract_bench.py", "train": ROOT / "benchmarks" / "train_bench.py"}
# NVLink multicast stays off on the lent multi-GPU machines (it can take a shared host's GPUs down).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun(script: Path, procs: int, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """The record rank 0 wrote, or what went wrong; the job's output goes to our stderr as it comes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               str(script), *args, "--out", str(out)]
    print(f"[scaling] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # its own session, so that a timeout ends torchrun's workers too, not torchrun alone
    # torchrun sets OMP_NUM_THREADS=1 for several processes only; the same for one keeps N=1 comparable
    env = os.environ | NO_MULTICAST | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    job = subprocess.Popen(command, stdout=sys.stderr, env=env, start_new_session=True)
    try:
        status: int | str = job.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        status = f"timed out after {timeout:.0f} s"
    if not out.is_file():  # a job that hung after rank 0 wrote its record still measured
        return {"error": f"exit status {status}"}
    return json.loads(out.read_text()) | {"job_s": round(time.perf_counter() - start, 1), "exit_status": status}


def disk_probe(directory: Path, gib: float, writers: int) -> dict[str, Any]:
    """Sequential write rate of `writers` threads writing `gib` GiB together, fsync'd: the ceiling the
    store's shard writes (one writer per rank) can reach on this disk."""
    block = os.urandom(64 << 20)
    blocks = max(1, int(gib * (1 << 30)) // len(block) // writers)

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(blocks):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    paths = [directory / f"probe-{i}.bin" for i in range(writers)]
    threads = [threading.Thread(target=write, args=(p,)) for p in paths]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for p in paths:
        p.unlink()
    total = blocks * len(block) * writers
    return {"writers": writers, "bytes": total, "seconds": round(seconds, 2),
            "write_mb_per_s": round(total / 1e6 / seconds, 1), **filesystem(directory)}


def filesystem(path: Path) -> dict[str, str]:
    """The mount holding `path` (a tmpfs would make the disk figures memory figures)."""
    mounts = [p for p in psutil.disk_partitions(all=True) if str(path.resolve()).startswith(p.mountpoint)]
    best = max(mounts, key=lambda p: len(p.mountpoint), default=None)
    return {"mount": best.mountpoint, "fstype": best.fstype, "device": best.device} if best else {}


def gpu_topology() -> str | None:
    """`nvidia-smi topo -m`: how the GPUs are linked decides what a gradient all-reduce costs."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def efficiency(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """aggregate(N) / (N x aggregate(1)) for every N that ran next to a 1-process run."""
    base = runs.get("1", {}).get("aggregate_tokens_per_s")
    return {n: round(r["aggregate_tokens_per_s"] / (int(n) * base), 4)
            for n, r in runs.items() if base and n != "1" and "aggregate_tokens_per_s" in r}


def projection(extract: dict[str, Any], disk: dict[str, Any] | None, gpus: int) -> dict[str, Any] | None:
    """What `gpus` ranks would ask of this host, linear in the largest extraction run's per-rank figures."""
    runs = [r for r in extract.values() if "per_rank" in r]
    if not runs:
        return None
    run = max(runs, key=lambda r: r["world_size"])
    ranks = run["per_rank"]
    per_rank_write = run["store_write_mb_per_s"] / len(ranks)
    per_rank_cores = sum(r["process_cores"] for r in ranks) / len(ranks)
    return {
        "gpus": gpus,
        "from_world_size": run["world_size"],
        "store_write_mb_per_s_needed": round(gpus * per_rank_write, 1),
        "disk_probe_write_mb_per_s": disk["write_mb_per_s"] if disk else None,
        "compress_cores_needed": round(gpus * sum(r["compress_cores"] for r in ranks) / len(ranks), 1),
        "process_cores_needed": round(gpus * per_rank_cores, 1),
        "host_cpu_cores_here": psutil.cpu_count(),
    }


def table(record: dict[str, Any]) -> str:
    lines = ["benchmark  N  aggregate tok/s  per-rank tok/s          efficiency"]
    for name, result in record["scaling"].items():
        for n, run in result["runs"].items():
            if "error" in run:
                lines.append(f"{name:9}  {n}  {run['error']}")
                continue
            ranks = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in run["per_rank"])
            eff = result["efficiency"].get(n)
            lines.append(f"{name:9}  {n}  {run['aggregate_tokens_per_s']:>15,.0f}  {ranks:22}  "
                         f"{f'{eff:.1%}' if eff else '-'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=torch.cuda.device_count() or 2, help="the largest process count")
    p.add_argument("--seconds", type=float, default=15.0, help="timed seconds of every run")
    p.add_argument("--tiny", action="store_true", help="tiny geometry on CPU (gloo), for a check of the scripts")
    p.add_argument("--no-compile", action="store_true", help="train the drafter eager")
    p.add_argument("--only", choices=sorted(BENCHMARKS), help="one benchmark only")
    p.add_argument("--disk-probe-gb", type=float, default=8.0, help="GiB the disk probe writes (0: no probe)")
    p.add_argument("--project-to", type=int, default=8, help="GPUs to project host CPU and disk needs to")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one torchrun job may take")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                   help="the store and the disk probe write in a new folder here (a disk, not a tmpfs)")
    p.add_argument("--out", type=Path, help="JSON result file")
    args = p.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eagle3-scaling-", dir=args.workdir))
    common = ["--seconds", str(args.seconds)]
    extra = {"extract": ["--workdir", str(work), *(["--tiny"] if args.tiny else [])],
             "train": [*(["--no-compile"] if args.no_compile else []), *(["--geometry", "tiny"] if args.tiny else [])]}
    disk = disk_probe(work, args.disk_probe_gb, args.procs) if args.disk_probe_gb > 0 else None
    record: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": machine_info() | {"torch": torch.__version__},
        "efficiency_definition": "aggregate tokens/s at N processes / (N x aggregate tokens/s at 1 process)",
        "disk_probe": disk,
        "gpu_topology": gpu_topology(),
        "scaling": {},
    }
    for name in [args.only] if args.only else list(BENCHMARKS):
        runs: dict[str, dict[str, Any]] = {}
        record["scaling"][name] = {"runs": runs, "efficiency": {}}
        for procs in sorted({1, args.procs}):
            out = work / f"{name}-{procs}.json"
            runs[str(procs)] = torchrun(BENCHMARKS[name], procs, common + extra[name], out, args.run_timeout)
            record["scaling"][name]["efficiency"] = efficiency(runs)
            if name == "extract":
                record["projection"] = projection(runs, disk, args.project_to)
            if args.out:  # after every run: a command cut short keeps what finished
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(record.get("projection"), indent=2))
    print(table(record))


if __name__ == "__main__":
    main()
