"""Where a generation stands, for `make status` while it runs and after it stopped."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_json
from eagle3.engine.state import pid_alive
from eagle3.progress import Progress, format_duration

WORK_DIR = Path("run/generate")


def write_progress(path: Path, progress: Progress, counters: Any, started_at: float) -> None:
    atomic_write_json(path, {"pid": os.getpid(), "total": progress.total, "done": progress.done,
                             "errors": counters.errors, "retries": counters.retries,
                             "skipped": sum(counters.skipped.values()), "generated_tokens": counters.generated_tokens,
                             "rate_per_s": round(progress.rate(), 4), "eta_s": progress.eta_s(),
                             "started_at": started_at, "updated_at": time.time()})


def progress_lines(root: Path = WORK_DIR) -> list[str]:
    """For `make status`: the newest generation's progress, running or interrupted."""
    files = sorted(root.glob("*/progress.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return ["generate: no generation has run yet"]
    p = json.loads(files[-1].read_text())
    finished = p["done"] >= p["total"]
    state = "running" if pid_alive(p["pid"]) and not finished else ("finished" if finished else "interrupted")
    eta = f", ETA {format_duration(p['eta_s'])}" if state == "running" and p["eta_s"] is not None else ""
    return [f"generate: {state}: {p['done']}/{p['total']} prompts, {p['rate_per_s']:.2f} prompts/s, "
            f"{p['generated_tokens']} tokens this run, {p['errors']} errors, {p['retries']} retries, "
            f"{p['skipped']} skipped{eta} ({files[-1].parent})"]
