"""The summary printed at the end of `make`: the report stage's summary, from the metrics as they are now.

    python -m tools.summary
"""
from __future__ import annotations

import argparse

from eagle3.report import collect, summary_lines


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m tools.summary", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print("\n".join(summary_lines(collect())))


if __name__ == "__main__":
    main()
