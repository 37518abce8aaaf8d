"""What extract_bench.py and train_bench.py share when torchrun runs them on several GPUs.

Each rank measures itself; rank 0 gathers the per-rank records and writes one. Besides tokens/s
the records say how busy the host was over the timed window (all cores, this process, the
store's compression threads) and how fast the disk was written, because at 8 GPUs the host CPUs
or the storage, not the GPUs, may set the pace.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch


def under_torchrun() -> bool:
    """torchrun sets WORLD_SIZE, also for one process: then the multi-rank code path runs alone."""
    return "WORLD_SIZE" in os.environ


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


@dataclass(frozen=True)
class HostSnapshot:
    at: float  # perf_counter seconds
    busy_cpu_s: float  # non-idle CPU seconds of all cores of the host
    disk_write_bytes: int  # bytes the host's disks were sent (what fsync'd shards really cost)
    process_cpu_s: float  # CPU seconds of this process, all its threads

    @classmethod
    def take(cls) -> HostSnapshot:
        times = psutil.cpu_times()
        # guest time is already inside user time on Linux; iowait is idle; steal is another VM's
        busy = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
        disks = psutil.disk_io_counters()
        return cls(time.perf_counter(), busy, disks.write_bytes if disks else 0, time.process_time())


def host_usage(before: HostSnapshot, after: HostSnapshot) -> dict[str, float]:
    """Host-wide use over a window: busy cores (of all), disk write rate."""
    seconds = max(after.at - before.at, 1e-9)
    return {"host_cpu_cores": psutil.cpu_count(),
            "host_busy_cores": round((after.busy_cpu_s - before.busy_cpu_s) / seconds, 2),
            "disk_write_mb_per_s": round((after.disk_write_bytes - before.disk_write_bytes) / 1e6 / seconds, 1)}


def process_cores(before: HostSnapshot, after: HostSnapshot) -> float:
    """Cores this process kept busy over the window (main thread + all others)."""
    return round((after.process_cpu_s - before.process_cpu_s) / max(after.at - before.at, 1e-9), 2)


def thread_cpu_seconds(prefix: str) -> float:
    """CPU seconds of this process's live threads named `prefix`*; read it before a pool shuts down."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith(prefix)}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (rank 0 uses it; the others get it too, all_gather is simplest)."""
    if not torch.distributed.is_initialized():
        return [record]
    records: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    return records


def all_agree(yes: bool, device: torch.device) -> bool:
    """True only where every rank says yes: ranks that loop until their own clock runs out stop together."""
    if not torch.distributed.is_initialized():
        return yes
    flag = torch.tensor([int(yes)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def broadcast_str(value: str) -> str:
    """Rank 0's value on every rank (e.g. a work directory only rank 0 created)."""
    if not torch.distributed.is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def finish() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
