"""The summary printed at the end of `make`: the report stage's summary, from the metrics as they are now."""
from __future__ import annotations

from stages.report import collect, summary_lines


def main() -> None:
    print("\n".join(summary_lines(collect())))


if __name__ == "__main__":
    main()
