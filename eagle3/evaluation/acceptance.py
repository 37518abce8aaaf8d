"""Acceptance figures, and whether the engine serves the drafter that was trained.

The offline evaluator uses the aux layer ids and vocabulary map the drafter was trained with,
while vLLM reads what the exported checkpoint says. The two agree only if the export is right: a
checkpoint with shifted aux ids or without its d2t is served badly by vLLM and the agreement check
fails loudly, before anyone deploys it.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import numpy as np

from eagle3.evaluation.params import EvalPaths
from eagle3.evaluation.speculative import DecodeStats
from eagle3.model.checkpoint import read_checkpoint


def histogram(accepted_per_pos: list[float], rounds: float) -> list[float]:
    """Share of rounds that accepted exactly n = 0..k drafts. In chain drafting position i is
    accepted only if all before it were, so "at least i+1 accepted" counts are the per-position counts."""
    at_least = [rounds, *accepted_per_pos, 0]
    return [round((at_least[n] - at_least[n + 1]) / rounds, 4) if rounds else 0.0 for n in range(len(at_least) - 1)]


def pooled(stats: list[DecodeStats]) -> DecodeStats:
    total = DecodeStats()
    for s in stats:
        total.add(s)
    return total


def figures(stats: DecodeStats) -> dict[str, Any]:
    rounds = stats.rounds
    return {"acceptance_length": round(stats.acceptance_length(), 4),
            "per_position": [round(a / rounds, 4) if rounds else 0.0 for a in stats.accepted_per_pos],
            "histogram": histogram(stats.accepted_per_pos, rounds), "rounds": rounds, "generated": stats.generated}


def summary(items: list[dict], per_item: list[DecodeStats]) -> dict[str, Any]:
    """The figures pooled over all items, per set and per set's category; the headline acceptance
    length is the mean over sets (each set counts once, whatever its size or answer lengths)."""
    by_set: dict[str, list[DecodeStats]] = defaultdict(list)
    by_category: dict[str, dict[str, list[DecodeStats]]] = defaultdict(lambda: defaultdict(list))
    for item, stats in zip(items, per_item):
        by_set[item["set"]].append(stats)
        by_category[item["set"]][item["category"]].append(stats)
    sets = {name: {**figures(pooled(stats)), "questions": len(stats),
                   "per_category": {c: round(pooled(s).acceptance_length(), 4)
                                    for c, s in sorted(by_category[name].items())}}
            for name, stats in by_set.items()}
    return {**figures(pooled(per_item)), "pooled_acceptance_length": round(pooled(per_item).acceptance_length(), 4),
            "acceptance_length": round(sum(s["acceptance_length"] for s in sets.values()) / len(sets), 4), "sets": sets}


def agreement_failure(offline: dict, online: dict, tolerance: float, what: str) -> tuple[float, str | None]:
    """(relative gap, the failure if it exceeds the tolerance) of two summaries of the same questions."""
    gap = abs(offline["acceptance_length"] - online["acceptance_length"]) / max(online["acceptance_length"], 1e-9)
    if gap <= tolerance:
        return round(gap, 4), None
    curves = "\n".join(f"  position {i}: offline {o:.3f}  vLLM {v:.3f}"
                       for i, (o, v) in enumerate(zip(offline["per_position"], online["per_position"])))
    return round(gap, 4), (
        f"{what}: offline acceptance length {offline['acceptance_length']:.3f} and vLLM's "
        f"{online['acceptance_length']:.3f} differ by {gap:.1%} (> {tolerance:.0%}): the engine does not serve the "
        f"drafter that was trained (aux layer ids, vocab map or weights in the export), or samples otherwise. "
        f"Per position:\n{curves}")


def export_mismatches(paths: EvalPaths) -> list[str]:
    """What the engine reads from the export against what the drafter was trained with.

    Acceptance alone misses some defects: on the embedded target, replaying the default drafter
    with aux ids shifted by one gave 1.160 against 1.163 (adjacent layers' states are that alike),
    far inside any tolerance. So the ids and the vocabulary map are compared directly as well.
    """
    config, tensors = read_checkpoint(paths.drafter)
    trained = json.loads(paths.manifest.read_text())["aux_layer_ids"]
    # vLLM prefers a top-level list to eagle_config's (vllm/v1/worker/gpu_model_runner.py).
    served = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    problems = []
    if served != trained:
        problems.append(f"{paths.drafter}/config.json serves aux layer ids {served}; the drafter was trained on "
                        f"{trained} ({paths.manifest})")
    d2t = np.load(paths.vocab / "d2t.npy", allow_pickle=False)
    if "d2t" not in tensors:
        problems.append(f"{paths.drafter}/model.safetensors has no d2t: vLLM would read draft id i as target id i")
    elif not np.array_equal(tensors["d2t"].numpy(), d2t):
        problems.append(f"{paths.drafter}/model.safetensors: d2t differs from the map it was trained with "
                        f"({paths.vocab / 'd2t.npy'})")
    return problems
