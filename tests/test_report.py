"""The report stage and the end-of-`make` summary: partial runs, plots, determinism."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from eagle3 import report
from tools import summary

MACHINE = {"cpu_model": "AMD EPYC", "cpu_cores": 2, "gpu_model": None, "gpu_count": 0}


def write_stage(metrics: Path, stage: str, wall_s: float, items: int, tokens: int, **extra) -> None:
    metrics.mkdir(parents=True, exist_ok=True)
    record = {"stage": stage, "wall_s": wall_s, "items": items, "tokens": tokens, "items_per_s": items / wall_s,
              "tokens_per_s": round(tokens / wall_s, 1), "machine": MACHINE, **extra}
    (metrics / f"{stage}.json").write_text(json.dumps(record))


def full_run(metrics: Path) -> None:
    write_stage(metrics, "target", 95.0, 1, 0)
    write_stage(metrics, "extract", 1460.0, 320, 169309, new_tokens=169309, stored_over_raw=0.687)
    write_stage(metrics, "train", 1300.0, 304, 162145, resumed_from_step=0)
    def figures(al: float, categories: dict[str, float]) -> dict:
        return {"acceptance_length": al, "sets": {"mtbench": {"acceptance_length": al, "questions": 40,
                                                              "per_category": categories}}}

    write_stage(metrics, "evaluate", 600.0, 80, 20000, num_draft_tokens=3, temperatures=[0.0, 0.7],
                offline_acceptance_length=1.42, vllm_acceptance_length=1.38,
                offline_acceptance_per_position=[0.3, 0.1, 0.02], vllm_acceptance_per_position=[0.28, 0.08, 0.02],
                temperature_0={"offline": figures(1.42, {"coding": 1.6, "writing": 1.3}),
                               "vllm": figures(1.38, {"coding": 1.55, "writing": 1.25})},
                temperature_0_7={"offline": figures(1.3, {"coding": 1.4, "writing": 1.2}),
                                 "vllm": figures(1.01, {"coding": 1.0, "writing": 1.02}), "vllm_reliable": False},
                long_answers={"max_new_tokens": 512, "questions": 8, "vllm": {"acceptance_length": 1.4},
                              "offline": {"acceptance_length": 1.41, "first_128_tokens": 1.38,
                                          "after_128_tokens": 1.43}})
    rows = [{"step": s, "epoch": s / 20, "lr": 1e-4, "grad_norm": 1.0, "tokens": 6000 * s, "loss": 20 - s / 10,
             "loss_0": 8 - s / 30, "loss_1": 8.1 - s / 30, "loss_2": 8.2 - s / 30,
             "top1_0": s / 100, "top1_1": s / 150, "top1_2": s / 200} for s in (10, 20, 27)]
    with open(metrics / "train_curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_partial_run_says_what_has_not_run(tmp_path):
    metrics = tmp_path / "metrics"
    write_stage(metrics, "target", 95.2, 1, 0)
    write_stage(metrics, "generate", 2172.2, 320, 71310)
    run = report.collect(metrics)
    text = "\n".join(report.summary_lines(run))
    assert "generate" in text and "36.2 min" in text
    assert "not run yet: prompts, vocab, extract, train, evaluate" in text
    assert "not measured yet" in text and "not trained yet" in text
    report.write_report(run, tmp_path / "report")
    page = (tmp_path / "report" / "README.md").read_text()
    assert "| train | not run yet |" in page
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["README.md", "stage_times.png"]


def test_full_run_has_every_plot_and_the_acceptance(tmp_path):
    metrics = tmp_path / "metrics"
    full_run(metrics)
    run = report.collect(metrics)
    assert run.total_s == 95.0 + 1460.0 + 1300.0 + 600.0
    lines = report.summary_lines(run)
    assert any("vLLM 1.38, offline 1.42" in line for line in lines)
    assert any("drafter checkpoint: artifacts/drafter" in line and "report/README.md" in line for line in lines)
    report.write_report(run, tmp_path / "report")
    names = sorted(p.name for p in (tmp_path / "report").iterdir())
    assert names == ["README.md", "acceptance.png", "categories.png", "stage_times.png", "training.png"]
    page = (tmp_path / "report" / "README.md").read_text()
    for png in ("training.png", "acceptance.png", "categories.png", "stage_times.png"):
        assert f"]({png})" in page
    assert "| 0 | mtbench | coding | | 1.6 | 1.55 |" in page
    assert "| 0.7 | **mean over sets** | | | 1.3 | 1.01 (unreliable) |" in page
    assert "first 128 tokens 1.38, after 128 tokens 1.43" in page
    assert "temperature_0" not in page  # the nested figures are in the table, not dumped
    assert "| extract | 24.3 min | 320 | 169,309 |" in page


def test_report_is_deterministic(tmp_path):
    metrics = tmp_path / "metrics"
    full_run(metrics)
    run = report.collect(metrics)
    report.write_report(run, tmp_path / "a")
    report.write_report(run, tmp_path / "b")
    for name in ("README.md", "training.png", "acceptance.png", "stage_times.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_resumed_stage_is_flagged(tmp_path):
    metrics = tmp_path / "metrics"
    write_stage(metrics, "extract", 2.3, 320, 169309, new_tokens=0)
    page = report.markdown(report.collect(metrics), [])
    assert "2.3 s (resumed: 0 tokens new)" in page


def test_make_summary_prints_the_report_summary(tmp_path, monkeypatch, capsys):
    full_run(tmp_path / "metrics")
    monkeypatch.chdir(tmp_path)
    summary.main([])
    out = capsys.readouterr().out
    assert out.splitlines() == report.summary_lines(report.collect(Path("metrics")))
    assert "total" in out and "acceptance length" in out
