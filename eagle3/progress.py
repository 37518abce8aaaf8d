"""Progress lines on stderr for long work: done/total, rate, ETA, plus stage-specific counters."""
from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    def __init__(self, label: str, total: int, unit: str = "items", every_s: float = 5.0, done: int = 0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.start_done = self.done = done
        self.start = self.last_print = time.monotonic()

    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate()
        return (self.total - self.done) / rate if rate > 0 else None

    def line(self, extra: str = "") -> str:
        eta = self.eta_s()
        eta_text = format_duration(eta) if eta is not None else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"[{self.label}] {self.done}/{self.total} {self.unit} ({pct:.1f}%) "
                f"{self.rate():.2f} {self.unit}/s ETA {eta_text}")
        return f"{text} {extra}".rstrip()

    def update(self, n: int = 1, extra: str = "", force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if force or now - self.last_print >= self.every_s or self.done >= self.total:
            self.last_print = now
            print(self.line(extra), file=sys.stderr, flush=True)
