"""Acceptance figures, and whether the engine serves the drafter that was trained.

The offline evaluator uses the aux layer ids and vocabulary map the drafter was trained with,
while vLLM reads what the exported checkpoint says. The two agree only if the export is right: a
checkpoint with shifted aux ids or without its d2t is served badly by vLLM and the agreement check
fails loudly, before anyone deploys it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle3.atomic import atomic_write_json
from eagle3.evaluation.params import EvalPaths
from eagle3.model.checkpoint import read_checkpoint


def histogram(accepted_per_pos: list[float], rounds: float) -> list[float]:
    """Share of rounds that accepted exactly n = 0..k drafts. In chain drafting position i is
    accepted only if all before it were, so "at least i+1 accepted" counts are the per-position counts."""
    at_least = [rounds, *accepted_per_pos, 0]
    return [round((at_least[n] - at_least[n + 1]) / rounds, 4) if rounds else 0.0 for n in range(len(at_least) - 1)]


def agreement_failure(offline: dict, online: dict, tolerance: float) -> str | None:
    gap = abs(offline["acceptance_length"] - online["acceptance_length"]) / max(online["acceptance_length"], 1e-9)
    if gap <= tolerance:
        return None
    curves = "\n".join(f"  position {i}: offline {o:.3f}  vLLM {v:.3f}"
                        for i, (o, v) in enumerate(zip(offline["per_position"], online["per_position"])))
    return (f"offline acceptance length {offline['acceptance_length']:.3f} and vLLM's {online['acceptance_length']:.3f} "
            f"differ by {gap:.1%} (> {tolerance:.0%}): the engine does not serve the drafter that was trained "
            f"(aux layer ids, vocab map or weights in the export). Per position:\n{curves}")


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


def write_plots(k: int, offline: dict | None, online: dict | None) -> None:
    """DVC plots: acceptance per draft position and the accepted-drafts histogram, offline vs vLLM."""
    def column(result: dict | None, key: str, n: int) -> list[float | None]:
        return [round(x, 4) for x in result[key]] if result else [None] * n

    for name, key, n, x in (("evaluate_positions", "per_position", k, "position"),
                            ("evaluate_histogram", "histogram", k + 1, "accepted")):
        rows = zip(column(offline, key, n), column(online, key, n))
        atomic_write_json(Path(f"metrics/{name}.json"), [{x: i, "offline": o, "vllm": v} for i, (o, v) in enumerate(rows)])
