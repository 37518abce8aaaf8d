"""Per-stage metrics JSON (tracked by DVC as metrics) with the machine that produced them."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_json

METRICS_DIR = Path("metrics")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    """GPU names from nvidia-smi; empty on CPU-only machines. No torch import: it is slow."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine_info() -> dict[str, Any]:
    names = gpus()
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "gpu_model": names[0] if names else None,
        "gpu_count": len(names),
    }


def write_metrics(stage: str, wall_s: float, items: int, tokens: int, **extra: Any) -> dict[str, Any]:
    """Every stage reports the same core figures so the report and planner can compare them."""
    record = {
        "stage": stage,
        "wall_s": round(wall_s, 3),
        "items": items,
        "tokens": tokens,
        "items_per_s": round(items / wall_s, 3) if wall_s > 0 else None,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "machine": machine_info(),
        **extra,
    }
    atomic_write_json(METRICS_DIR / f"{stage}.json", record)
    return record
