"""Every stage's metrics as one page (report/README.md) with PNG plots, and the summary `make` prints
at the end (the report stage writes the page; tools/summary.py prints `summary_lines`, so the two never
disagree).

Reads metrics/<stage>.json, metrics/train_curve.csv and the evaluation's per-position acceptance; a
stage that has not run yet is listed as such, never an error. Plots use matplotlib's Agg backend.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_dir
from eagle3.metrics import METRICS_DIR

STAGE_ORDER = ("target", "prompts", "generate", "vocab", "extract", "train", "evaluate")
REPORT_DIR = Path("report")
DRAFTER_DIR = Path("artifacts/drafter")


@dataclass
class RunMetrics:
    stages: dict[str, dict[str, Any] | None]  # None: the stage has not run
    curve: list[dict[str, float]]  # training rows (train_curve.csv), empty before training

    def ran(self) -> list[tuple[str, dict[str, Any]]]:
        return [(name, m) for name, m in self.stages.items() if m is not None]

    @property
    def total_s(self) -> float:
        return sum(m["wall_s"] for _, m in self.ran())


def read_curve(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def collect(metrics_dir: Path = METRICS_DIR) -> RunMetrics:
    stages = {}
    for name in STAGE_ORDER:
        path = metrics_dir / f"{name}.json"
        stages[name] = json.loads(path.read_text()) if path.is_file() else None
    return RunMetrics(stages, read_curve(metrics_dir / "train_curve.csv"))


# -------------------------------------------------------------------------------------- text


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def machine(m: dict[str, Any]) -> str:
    mach = m.get("machine") or {}
    gpus = f", {mach['gpu_count']}x {mach['gpu_model']}" if mach.get("gpu_count") else ""
    return f"{mach.get('cpu_model', '?')} ({mach.get('cpu_cores', '?')} cores){gpus}"


def acceptance(evaluate: dict[str, Any] | None) -> str:
    if evaluate is None:
        return "acceptance: not measured yet (stage evaluate has not run)"
    k = evaluate.get("num_draft_tokens")
    readings = (("vLLM", "vllm_acceptance_length"), ("offline", "offline_acceptance_length"))
    parts = [f"{name} {evaluate[key]:.2f}" for name, key in readings if evaluate.get(key) is not None]
    return f"acceptance length (tokens per target forward, k={k}, T=0, mean over sets): {', '.join(parts) or 'n/a'}"


def evaluation_sections(evaluate: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(key.removeprefix("temperature_").replace("_", "."), value) for key, value in evaluate.items()
            if key.startswith("temperature_") and isinstance(value, dict)]


def acceptance_table(evaluate: dict[str, Any] | None) -> list[str]:
    """Acceptance length per set, category and temperature, offline and in vLLM."""
    if evaluate is None:
        return []
    lines = ["## Acceptance", "", "| T | set | category | questions | offline | vLLM |", "|---|---|---|---|---|---|"]
    for t, result in evaluation_sections(evaluate):
        offline, vllm = result.get("offline") or {}, result.get("vllm") or {}
        flag = "" if result.get("vllm_reliable", True) else " (unreliable)"
        lines.append(f"| {t} | **mean over sets** | | | {offline.get('acceptance_length', '')} | "
                     f"{vllm.get('acceptance_length', '')}{flag} |")
        for name, figures in (vllm or offline).get("sets", {}).items():
            off = offline.get("sets", {}).get(name, {})
            lines.append(f"| {t} | {name} | all | {figures['questions']} | {off.get('acceptance_length', '')} | "
                         f"{vllm.get('sets', {}).get(name, {}).get('acceptance_length', '')} |")
            for category, value in figures["per_category"].items():
                lines.append(f"| {t} | {name} | {category} | | {off.get('per_category', {}).get(category, '')} | "
                             f"{vllm.get('sets', {}).get(name, {}).get('per_category', {}).get(category, '')} |")
    long = evaluate.get("long_answers")
    if long:
        offline = long.get("offline") or {}
        heads = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in offline.items() if k.endswith("_tokens"))
        lines += ["", f"Long answers (T=0, up to {long['max_new_tokens']} tokens, {long['questions']} questions): "
                      f"offline {offline.get('acceptance_length')} ({heads}), vLLM "
                      f"{(long.get('vllm') or {}).get('acceptance_length')}."]
    return lines + [""]


def summary_lines(run: RunMetrics, report_dir: Path = REPORT_DIR) -> list[str]:
    """What `make` prints at the end."""
    lines = [f"  {name:<9} {duration(m['wall_s']):>10}  {m['items']} items, {m['tokens']} tokens"
             + (f", {m['tokens_per_s']} tok/s" if m.get("tokens") else "") for name, m in run.ran()]
    missing = [name for name, m in run.stages.items() if m is None]
    not_run = f"  (not run yet: {', '.join(missing)})" if missing else ""
    lines.append(f"  {'total':<9} {duration(run.total_s):>10}{not_run}")
    lines.append(f"  {acceptance(run.stages['evaluate'])}")
    drafter = DRAFTER_DIR if run.stages["train"] is not None else "not trained yet"
    lines.append(f"  drafter checkpoint: {drafter}; report: {report_dir / 'README.md'}; metrics: {METRICS_DIR}/")
    return lines


def resumed(m: dict[str, Any]) -> str:
    """A resumed run's wall time covers only the work it did: say so, or its rate reads as a speed."""
    new = m.get("new_tokens", m.get("new_generated_tokens"))
    if new is not None and new < m["tokens"]:
        return f" (resumed: {new:,} tokens new)"
    return f" (resumed at step {m['resumed_from_step']})" if m.get("resumed_from_step") else ""


def stage_table(run: RunMetrics) -> list[str]:
    lines = ["| stage | wall | items | tokens | throughput | machine |", "|---|---|---|---|---|---|"]
    for name, m in run.stages.items():
        if m is None:
            lines.append(f"| {name} | not run yet | | | | |")
            continue
        rate = f"{m['tokens_per_s']:,} tok/s" if m.get("tokens_per_s") else f"{m.get('items_per_s', 0)} items/s"
        lines.append(f"| {name} | {duration(m['wall_s'])}{resumed(m)} | {m['items']:,} | {m['tokens']:,} | {rate} "
                     f"| {machine(m)} |")
    return lines


def details(name: str, m: dict[str, Any]) -> list[str]:
    """A stage's own figures (everything beyond the shared core keys), one line each."""
    core = {"stage", "wall_s", "items", "tokens", "items_per_s", "tokens_per_s", "machine"}
    tabled = {key for key in m if key.startswith("temperature_") or key == "long_answers"}  # in the Acceptance table
    return [f"### {name}", ""] + [f"- `{k}`: {json.dumps(v)}" for k, v in sorted(m.items())
                                  if k not in core | tabled] + [""]


def markdown(run: RunMetrics, plots: list[str]) -> str:
    lines = ["# Build report", "", "```", *summary_lines(run), "```", "", "## Stages", "", *stage_table(run), ""]
    lines += acceptance_table(run.stages["evaluate"])
    lines += [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += ["## Per-stage figures", ""]
    for name, m in run.ran():
        lines += details(name, m)
    lines += ["Projections for other machines and targets: `make plan` (docs/planning.md).", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- plots


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(curve: list[dict[str, float]], path: Path) -> bool:
    if not curve:
        return False
    plt = pyplot()
    steps = [row["step"] for row in curve]
    k = sum(1 for key in curve[0] if key.startswith("top1_"))
    fig, (loss_ax, top1_ax) = plt.subplots(1, 2, figsize=(10, 4))
    loss_ax.plot(steps, [row["loss"] for row in curve], label="objective", color="black")
    for i in range(k):
        loss_ax.plot(steps, [row[f"loss_{i}"] for row in curve], label=f"TTT step {i}", alpha=0.7)
        top1_ax.plot(steps, [row[f"top1_{i}"] for row in curve], label=f"TTT step {i}")
    loss_ax.set(xlabel="optimizer step", ylabel="soft cross-entropy", title="training loss")
    top1_ax.set(xlabel="optimizer step", ylabel="top-1 agreement with the target", title="agreement per TTT step",
                ylim=(0, 1))
    loss_ax.legend(fontsize="small")
    top1_ax.legend(fontsize="small")
    return save(fig, path)


def plot_acceptance(evaluate: dict[str, Any] | None, path: Path) -> bool:
    if evaluate is None:
        return False
    series = {name: evaluate.get(key) for name, key in
              (("offline", "offline_acceptance_per_position"), ("vLLM", "vllm_acceptance_per_position"))}
    series = {name: values for name, values in series.items() if values}
    if not series:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([p + i * width for p in range(len(values))], values, width, label=name)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1),
           title="acceptance per position (T=0, all sets)")
    ax.set_xticks([p + width * (len(series) - 1) / 2 for p in range(len(next(iter(series.values()))))],
                  [str(p) for p in range(len(next(iter(series.values()))))])
    ax.legend()
    return save(fig, path)


def plot_categories(evaluate: dict[str, Any] | None, path: Path) -> bool:
    """Acceptance length per set and category at T=0, offline and in vLLM."""
    greedy = dict(evaluation_sections(evaluate or {})).get("0") or {}
    series = {name: greedy.get(key) for name, key in (("offline", "offline"), ("vLLM", "vllm")) if greedy.get(key)}
    if not series:
        return False
    labels = [f"{name}/{category}" for name, figures in next(iter(series.values()))["sets"].items()
              for category in figures["per_category"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.3 * len(labels)))
    height = 0.8 / len(series)
    for i, (name, result) in enumerate(series.items()):
        values = [result["sets"].get(label.split("/")[0], {}).get("per_category", {}).get(label.split("/", 1)[1], 0)
                  for label in labels]
        ax.barh([y + i * height for y in range(len(labels))], values, height, label=name)
    ax.set_yticks([y + height * (len(series) - 1) / 2 for y in range(len(labels))], labels, fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel="acceptance length", xlim=(1, None), title="acceptance length per set and category (T=0)")
    ax.legend(fontsize="small")
    return save(fig, path)


def plot_stage_times(run: RunMetrics, path: Path) -> bool:
    ran = run.ran()
    if not ran:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(ran)))
    names = [name for name, _ in ran][::-1]
    minutes = [m["wall_s"] / 60 for _, m in ran][::-1]
    ax.barh(names, minutes, color="C0")
    for y, value in enumerate(minutes):
        ax.text(value, y, f" {value:.1f}", va="center", fontsize="small")
    ax.set(xlabel="minutes", title=f"stage wall time (total {duration(run.total_s)})")
    ax.margins(x=0.15)
    return save(fig, path)


def save(fig, path: Path) -> bool:
    fig.tight_layout()
    # Without the matplotlib version stamp the PNG bytes depend only on the metrics (and the fonts).
    fig.savefig(path, dpi=100, metadata={"Software": None})
    pyplot().close(fig)
    return True


def write_report(run: RunMetrics, out: Path = REPORT_DIR) -> None:
    with atomic_dir(out) as tmp:
        plots = [name for name, made in (
            ("training.png", plot_training(run.curve, tmp / "training.png")),
            ("acceptance.png", plot_acceptance(run.stages["evaluate"], tmp / "acceptance.png")),
            ("categories.png", plot_categories(run.stages["evaluate"], tmp / "categories.png")),
            ("stage_times.png", plot_stage_times(run, tmp / "stage_times.png")),
        ) if made]
        (tmp / "README.md").write_text(markdown(run, plots), encoding="utf-8")
