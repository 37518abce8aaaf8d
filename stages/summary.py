"""The summary printed at the end of `make`: what each stage did, from its metrics file."""
from __future__ import annotations

import json
from pathlib import Path

from stages.metrics import METRICS_DIR

STAGE_ORDER = ("target", "prompts", "generate", "vocab", "extract", "train", "evaluate", "report")


def main() -> None:
    total = 0.0
    for stage in STAGE_ORDER:
        path = METRICS_DIR / f"{stage}.json"
        if not path.is_file():
            continue
        m = json.loads(path.read_text())
        total += m["wall_s"]
        rate = f", {m['tokens_per_s']} tok/s" if m.get("tokens") else ""
        print(f"  {stage:<9} {m['wall_s']:>9.1f}s  {m['items']} items, {m['tokens']} tokens{rate}")
    print(f"  {'total':<9} {total:>9.1f}s   (artifacts in artifacts/, metrics in metrics/)")


if __name__ == "__main__":
    main()
