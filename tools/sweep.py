"""`make sweep`: how much acceptance does more data buy? One DVC experiment per data budget.

    python -m tools.sweep --param prompts.num_samples --values 50 100 200

Each value runs the whole pipeline as `dvc exp run --temp -S <param>=<value>` (a temporary copy:
the workspace is never touched; stages whose inputs did not change come from the run cache),
named sweep-<param>-<value>, so a rerun skips the values already done. Then it reads every
experiment's generated tokens and acceptance lengths from `dvc exp show --json` and writes
sweep/sweep.json and sweep/acceptance_vs_tokens.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_bytes, atomic_write_json

OUT_DIR = Path("sweep")


def x_axis(param: str) -> tuple[str, str]:
    """(point key, label) the curve is drawn against: generated tokens when the sweep varies them,
    else every token of the hidden-state store (e.g. prompts.dataset_answers)."""
    if param == "prompts.num_samples":
        return "generated_tokens", "generated training tokens"
    return "store_tokens", "training tokens in the hidden-state store"


def experiment_name(param: str, value: str) -> str:
    return f"sweep-{param.replace('.', '-')}-{value}"


def find_experiments(tree: Any, names: set[str]) -> dict[str, dict[str, Any]]:
    """name -> its "data" record, wherever `dvc exp show --json` nests it (the layout varies by version)."""
    found: dict[str, dict[str, Any]] = {}
    if isinstance(tree, dict):
        if tree.get("name") in names and isinstance(tree.get("data"), dict):
            found[tree["name"]] = tree["data"]
        for value in tree.values():
            found |= find_experiments(value, names)
    elif isinstance(tree, list):
        for value in tree:
            found |= find_experiments(value, names)
    return found


def point(data: dict[str, Any]) -> dict[str, Any] | None:
    """The figures of one finished experiment; None when it has no evaluation yet."""
    metrics = {path: (entry or {}).get("data") or {} for path, entry in (data.get("metrics") or {}).items()}
    evaluate, generate = metrics.get("metrics/evaluate.json", {}), metrics.get("metrics/generate.json", {})
    if evaluate.get("vllm_acceptance_length") is None and evaluate.get("offline_acceptance_length") is None:
        return None
    return {"generated_tokens": generate.get("generated_tokens"), "responses": generate.get("responses"),
            "dataset_answer_tokens": metrics.get("metrics/prompts.json", {}).get("dataset_answer_tokens", 0),
            "store_tokens": metrics.get("metrics/extract.json", {}).get("tokens"),
            "train_tokens": metrics.get("metrics/train.json", {}).get("total_tokens"),
            "offline_acceptance_length": evaluate.get("offline_acceptance_length"),
            "vllm_acceptance_length": evaluate.get("vllm_acceptance_length"),
            "offline_acceptance_per_position": evaluate.get("offline_acceptance_per_position"),
            "vllm_acceptance_per_position": evaluate.get("vllm_acceptance_per_position")}


def exp_show() -> Any:
    out = subprocess.run(["dvc", "exp", "show", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def collect(param: str, values: list[str], tree: Any) -> list[dict[str, Any]]:
    names = {experiment_name(param, v): v for v in values}
    found = find_experiments(tree, set(names))
    rows = []
    for name, value in names.items():
        figures = point(found[name]) if name in found else None
        if figures:
            rows.append({"experiment": name, param: value, **figures})
    key = x_axis(param)[0]
    return sorted(rows, key=lambda r: r[key] or 0)


def plot(rows: list[dict[str, Any]], param: str, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, x_label = x_axis(param)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("vllm_acceptance_length", "vLLM"), ("offline_acceptance_length", "offline")):
        xs = [r[x] for r in rows if r[key] is not None]
        ax.plot(xs, [r[key] for r in rows if r[key] is not None], marker="o", label=label)
    for r in rows:
        ax.annotate(f"{param.split('.')[-1]}={r[param]}", (r[x], r["vllm_acceptance_length"] or
                                                           r["offline_acceptance_length"]), fontsize=7)
    ax.set_xlabel(x_label)
    ax.set_ylabel("acceptance length (tokens per target forward)")
    ax.set_title("Acceptance against data budget")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--param", default="prompts.num_samples", help="the data-budget param to sweep")
    parser.add_argument("--values", nargs="+", required=True, help="at least 3 values")
    args = parser.parse_args()
    if len(args.values) < 3:
        sys.exit(f"sweep: --values needs at least 3 values to show a curve, got {args.values}")
    done = {r[args.param] for r in collect(args.param, args.values, exp_show())}
    for number, value in enumerate(args.values, start=1):
        name = experiment_name(args.param, value)
        if value in done:
            print(f"[sweep] {number}/{len(args.values)} {name}: done earlier, kept", file=sys.stderr)
            continue
        print(f"[sweep] {number}/{len(args.values)} {name}: dvc exp run --temp -S {args.param}={value}",
              file=sys.stderr, flush=True)
        result = subprocess.run(["dvc", "exp", "run", "--temp", "--name", name, "-S", f"{args.param}={value}"])
        if result.returncode:
            sys.exit(f"sweep: experiment {name} failed (exit {result.returncode}); rerun `make sweep` to resume")
    rows = collect(args.param, args.values, exp_show())
    atomic_write_json(OUT_DIR / "sweep.json", {"param": args.param, "points": rows})
    plot(rows, args.param, OUT_DIR / "acceptance_vs_tokens.png")
    for r in rows:
        print(f"sweep: {args.param}={r[args.param]}: {r['generated_tokens']} generated tokens, {r['store_tokens']} "
              f"in the store -> acceptance "
              f"length vLLM {r['vllm_acceptance_length']}, offline {r['offline_acceptance_length']}")
    print(f"sweep: {len(rows)} points -> {OUT_DIR / 'sweep.json'}, {OUT_DIR / 'acceptance_vs_tokens.png'}")


if __name__ == "__main__":
    main()
