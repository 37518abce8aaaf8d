"""The evaluate stage's figures: each temperature's acceptance offline and in vLLM, per set and
category, the agreement check at every temperature both ran, the long answers; and the DVC plots."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_json
from eagle3.evaluation.acceptance import agreement_failure, figures, pooled, summary
from eagle3.evaluation.online import EngineAnswers
from eagle3.evaluation.params import EvaluateParams
from eagle3.evaluation.speculative import DecodeStats


def temperature_key(t: float) -> str:
    return f"temperature_{t:g}".replace(".", "_")


def pick(values: list, indices: list[int]) -> list:
    return [values[i] for i in indices]


def tolerance(params: EvaluateParams, t: float) -> float:
    """At T=0 the offline counts follow vLLM's own answers (stages/evaluate.py): one text, only the
    drafts differ, so the bound is tight. At T > 0 each samples its own answers to the same questions."""
    return params.replay_tolerance if t == 0 else params.agreement_tolerance


def temperature_figures(params: EvaluateParams, items: list[dict], t: float, offline: list[DecodeStats] | None,
                        online: EngineAnswers | None, offline_indices: list[int], fix_status: str
                        ) -> tuple[dict[str, Any], str | None]:
    """One temperature: offline on its questions (a subset of each set, or all of them at T=0), vLLM on
    all and on the offline's questions (the agreement check compares the same questions)."""
    result: dict[str, Any] = {"offline": summary(pick(items, offline_indices), offline) if offline else None,
                              "vllm": summary(items, online.stats) if online else None}
    failure = None
    if offline and online:
        same = summary(pick(items, offline_indices), pick(online.stats, offline_indices))
        result["vllm_on_offline_questions"] = same["acceptance_length"]
        result["agreement_gap"], failure = agreement_failure(result["offline"], same, tolerance(params, t),
                                                             f"T={t:g}")
        result["agreement"] = failure is None
    if online and t > 0 and not fix_status.startswith(("applied", "not_needed")):
        result["vllm_reliable"] = False
        result["vllm_unreliable_reason"] = ("vLLM's rejection sampler on this CPU build: "
                                            f"eagle3/engine/vllm_cpu_fixes.py {fix_status}")
    return result, failure


def long_answer_figures(params: EvaluateParams, items: list[dict], offline: tuple | None,
                        online: EngineAnswers | None) -> tuple[dict[str, Any], str | None]:
    """Acceptance along answers of up to long_max_new_tokens at T=0: over the whole answer, and offline
    over its first max_new_tokens tokens and the rest (does it hold along an answer?)."""
    result: dict[str, Any] = {"max_new_tokens": params.long_max_new_tokens, "questions": len(items)}
    if offline:
        whole, heads = pooled(offline[0]), pooled(offline[1])
        tail = DecodeStats(rounds=whole.rounds - heads.rounds, generated=whole.generated - heads.generated,
                           accepted_per_pos=[a - b for a, b in zip(whole.accepted_per_pos, heads.accepted_per_pos)])
        result["offline"] = {**figures(whole), f"first_{params.max_new_tokens}_tokens":
                             round(heads.acceptance_length(), 4), f"after_{params.max_new_tokens}_tokens":
                             round(tail.acceptance_length(), 4)}
    if online:
        result["vllm"] = figures(pooled(online.stats))
    failure = None
    if offline and online:
        result["agreement_gap"], failure = agreement_failure(result["offline"], result["vllm"], tolerance(params, 0.0),
                                                             "long answers, T=0")
    return result, failure


def evaluation_metrics(params: EvaluateParams, items: list[dict], offline: dict | None, online: dict | None,
                       offline_indices: dict[float, list[int]], long_items: list[dict], fix_status: str
                       ) -> tuple[dict[str, Any], list[str]]:
    """(the metrics, the agreement failures). Headline: T=0, mean over the sets."""
    metrics: dict[str, Any] = {"num_draft_tokens": params.num_speculative_tokens,
                               "max_new_tokens": params.max_new_tokens, "turns": params.turns,
                               "questions": dict(params.sets), "temperatures": list(params.temperatures),
                               "vllm_sampling_fix": fix_status}
    failures = []
    for t in params.temperatures:
        result, failure = temperature_figures(params, items, t, offline and offline[t],
                                              online and online[t], offline_indices[t], fix_status)
        metrics[temperature_key(t)] = result
        if failure and result.get("vllm_reliable", True):
            failures.append(failure)
    if long_items:
        metrics["long_answers"], failure = long_answer_figures(params, long_items, offline and offline["long"],
                                                               online and online["long"])
        failures += [failure] if failure else []
    greedy = metrics.get(temperature_key(0.0), {})
    for path in ("offline", "vllm"):
        headline = greedy.get(path)
        metrics[f"{path}_acceptance_length"] = headline["acceptance_length"] if headline else None
        metrics[f"{path}_acceptance_per_position"] = headline["per_position"] if headline else None
    metrics["offline_draft_vocab_coverage"] = offline["draft_vocab_coverage"] if offline else None
    metrics["throughput_with_drafter"] = online["throughput_with_drafter"] if online else None
    metrics["throughput_without_drafter"] = (online or {}).get("throughput_without_drafter")
    metrics["agreement"] = not failures
    return metrics, failures


def write_plots(metrics: dict[str, Any]) -> None:
    """DVC plots at T=0, offline vs vLLM: acceptance per draft position, the accepted-drafts histogram,
    and the acceptance length per set and category."""
    greedy = metrics.get(temperature_key(0.0)) or {}
    offline, vllm = greedy.get("offline"), greedy.get("vllm")
    k = metrics["num_draft_tokens"]

    def column(result: dict | None, key: str, n: int) -> list[float | None]:
        return list(result[key]) if result else [None] * n

    for name, key, n, x in (("evaluate_positions", "per_position", k, "position"),
                            ("evaluate_histogram", "histogram", k + 1, "accepted")):
        rows = zip(column(offline, key, n), column(vllm, key, n))
        atomic_write_json(Path(f"metrics/{name}.json"),
                          [{x: i, "offline": o, "vllm": v} for i, (o, v) in enumerate(rows)])
    sets = (offline or vllm or {}).get("sets", {})
    rows = [{"category": f"{name}/{category}",
             **{path: ((result or {}).get("sets", {}).get(name, {}).get("per_category", {}).get(category))
                for path, result in (("offline", offline), ("vllm", vllm))}}
            for name, figures_of_set in sets.items() for category in figures_of_set["per_category"]]
    atomic_write_json(Path("metrics/evaluate_categories.json"), rows)


def summary_lines(metrics: dict[str, Any]) -> list[str]:
    """What the stage prints: each temperature's headline and per-set figures, and the long answers."""
    lines = []
    for t in metrics["temperatures"]:
        result = metrics[temperature_key(t)]
        offline, vllm = result["offline"] or {}, result["vllm"] or {}
        per_set = ", ".join(f"{name} {f['acceptance_length']}" for name, f in (vllm or offline)["sets"].items())
        unreliable = ("" if result.get("vllm_reliable", True)
                      else f"; vLLM UNRELIABLE: {result['vllm_unreliable_reason']}")
        lines.append(f"evaluate: T={t:g}, k={metrics['num_draft_tokens']}: acceptance length (mean over sets) offline "
                     f"{offline.get('acceptance_length')}, vLLM {vllm.get('acceptance_length')} ({per_set}); agreement "
                     f"gap {result.get('agreement_gap')}{unreliable}")
    long = metrics.get("long_answers")
    if long:
        offline = {key: value for key, value in (long.get("offline") or {}).items()
                   if "acceptance" in key or "tokens" in key}
        lines.append(f"evaluate: long answers ({long['questions']} questions, up to {long['max_new_tokens']} tokens, "
                     f"T=0): offline {offline}, vLLM {(long.get('vllm') or {}).get('acceptance_length')}; agreement "
                     f"gap {long.get('agreement_gap')}")
    return lines
