"""The evaluation questions: which are asked, and the conversation each later turn continues."""
from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3.evaluation.params import EvaluateError, EvaluateParams, agreement_problem


def draw(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """n questions drawn evenly over the categories: each category's questions shuffled (seeded), then
    taken in turn, one per category per pass. Any prefix of the draw is as balanced as it can be, so
    the subsets cut from its front (sampling, long answers) cover every category too."""
    by_category: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row)
    rng = random.Random(seed)
    queues = []
    for category in sorted(by_category):
        queue = list(by_category[category])
        rng.shuffle(queue)
        queues.append(queue)
    drawn = [queue[i] for i in range(max(map(len, queues))) for queue in queues if i < len(queue)]
    return drawn[:n]


def questions(params: EvaluateParams, prompts: Path) -> list[dict[str, Any]]:
    """Each set of evaluate.sets drawn evenly by category, in the params' order of sets."""
    problem = agreement_problem(params)
    if problem:
        raise EvaluateError(problem)
    if params.turns < 1 or params.num_speculative_tokens < 1 or not params.sets:
        raise EvaluateError(f"turns={params.turns} and num_speculative_tokens={params.num_speculative_tokens} must "
                            f"be >= 1 and evaluate.sets={params.sets} must name at least one set")
    by_set: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in pq.read_table(prompts).to_pylist():
        by_set[row["set"]].append(row)
    items = []
    for name, n in params.sets.items():
        if name not in by_set or not 1 <= n <= len(by_set[name]):
            raise EvaluateError(f"evaluate.sets.{name}={n}: {prompts} holds {len(by_set.get(name, []))} questions of "
                                f"set {name!r}; expected 1..that many (sets there: {', '.join(sorted(by_set))}; the "
                                "prompts stage reads prompts.eval_sets)")
        items += [{**item, "turns": item["turns"][: params.turns]} for item in draw(by_set[name], n, params.seed)]
    if params.online and not 1 <= params.concurrency <= len(items):
        raise EvaluateError(f"evaluate.concurrency={params.concurrency} requests in flight are timed over as many "
                            f"questions; expected 1..{len(items)} (the questions of evaluate.sets)")
    return items


def first_of_each_set(items: list[dict[str, Any]], n: int) -> list[int]:
    """Indices of the first n drawn questions of every set (the offline sampling subset)."""
    taken: dict[str, int] = defaultdict(int)
    subset = []
    for index, item in enumerate(items):
        if taken[item["set"]] < n:
            taken[item["set"]] += 1
            subset.append(index)
    return subset


def conversation(turns: list[str], answers: list[str]) -> list[dict[str, str]]:
    """The user's turns with the model's own earlier answers between them."""
    messages = []
    for i, turn in enumerate(turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def timed_first_turns(items: list[dict], prompts: int, concurrency: int) -> list[dict]:
    """The first turns timed at `concurrency`: `prompts` of them, and never fewer than `concurrency`
    (fewer prompts than requests in flight would time a lower concurrency than the figure's name says)."""
    return [{**item, "turns": item["turns"][:1]} for item in items[: max(prompts, concurrency)]]
