"""Refuse a drafter checkpoint that an engine would load wrongly.

    python -m tools.validate DRAFTER_DIR --target TARGET_DIR

Prints OK, or one defect per line and exits 1. The target's layer count, hidden size and vocab
size come from TARGET_DIR/config.json.
"""

import argparse
import sys
from pathlib import Path

from eagle3.model.checkpoint import target_numbers, validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter_dir", type=Path)
    parser.add_argument("--target", type=Path, required=True, help="target model dir with an HF config.json")
    args = parser.parse_args(argv)
    defects = validate(args.drafter_dir, *target_numbers(args.target))
    if defects:
        print(f"{args.drafter_dir}: {len(defects)} defect(s)")
        for defect in defects:
            print(f"  - {defect}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
