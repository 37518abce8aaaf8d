"""The data-budget sweep: reading `dvc exp show --json`, the curve file and its plot."""
from __future__ import annotations

import json

from tools import sweep


def exp_show_tree(points: dict[str, tuple[int, float | None]]) -> list:
    """The layout of DVC 3's `dvc exp show --json`: commits, then experiments, each with revs."""
    def record(name: str, tokens: int, acceptance: float | None) -> dict:
        metrics = {"metrics/generate.json": {"data": {"generated_tokens": tokens, "responses": tokens // 200}},
                   "metrics/extract.json": {"data": {"tokens": 10**6 - tokens}},
                   "metrics/evaluate.json": {"data": {"vllm_acceptance_length": acceptance,
                                                      "offline_acceptance_length": acceptance}}}
        return {"rev": f"r{tokens}", "name": name, "data": {"params": {}, "metrics": metrics}}

    experiments = [{"revs": [record(name, tokens, acc)], "name": name} for name, (tokens, acc) in points.items()]
    return [{"rev": "workspace", "name": None, "data": {"metrics": {}}, "experiments": None},
            {"rev": "abc", "name": "main", "data": {"metrics": {}}, "experiments": experiments}]


def test_collect_reads_finished_experiments_in_token_order():
    tree = exp_show_tree({"sweep-prompts-num_samples-200": (40000, 1.6), "sweep-prompts-num_samples-50": (10000, 1.3),
                          "sweep-prompts-num_samples-100": (20000, None),  # crashed before evaluate
                          "other-experiment": (5, 9.9)})
    rows = sweep.collect("prompts.num_samples", ["50", "100", "200"], tree)
    assert [r["prompts.num_samples"] for r in rows] == ["50", "200"]
    assert [r["generated_tokens"] for r in rows] == [10000, 40000]
    assert rows[1]["vllm_acceptance_length"] == 1.6


def test_plot_and_curve_file(tmp_path):
    rows = sweep.collect("prompts.num_samples", ["50", "200"],
                         exp_show_tree({"sweep-prompts-num_samples-50": (10000, 1.3),
                                        "sweep-prompts-num_samples-200": (40000, 1.6)}))
    out = tmp_path / "acceptance.png"
    sweep.plot(rows, "prompts.num_samples", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(rows)  # the curve file is plain JSON


def test_a_sweep_of_dataset_answers_is_ordered_and_drawn_by_store_tokens(tmp_path):
    # Generated tokens stay put when the dataset answers vary; the store's tokens grow with them.
    rows = sweep.collect("prompts.dataset_answers", ["0", "600"],
                         exp_show_tree({"sweep-prompts-dataset_answers-0": (40000, 1.4),
                                        "sweep-prompts-dataset_answers-600": (30000, 1.5)}))
    assert [r["prompts.dataset_answers"] for r in rows] == ["0", "600"]
    assert [r["store_tokens"] for r in rows] == [960000, 970000]
    sweep.plot(rows, "prompts.dataset_answers", tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
