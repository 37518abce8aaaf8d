"""Stage `report`: every stage's metrics as report/README.md with PNG plots (training curves,
acceptance per position, stage times), and the summary that `make` prints at the end."""
from __future__ import annotations

from eagle3.cli import run_stage
from eagle3.report import REPORT_DIR, collect, summary_lines, write_report


def main() -> None:
    run = collect()
    write_report(run)
    print("report: " + str(REPORT_DIR / "README.md"))
    print("\n".join(summary_lines(run)))


if __name__ == "__main__":
    run_stage("report", __doc__, main)
