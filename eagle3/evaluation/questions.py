"""The evaluation questions: which are asked, and the conversation each later turn continues."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3.evaluation.params import EvaluateError, EvaluateParams


def questions(params: EvaluateParams, prompts: Path) -> list[dict[str, Any]]:
    if params.num_questions < 1 or params.turns < 1 or params.num_speculative_tokens < 1:
        raise EvaluateError(f"num_questions={params.num_questions}, turns={params.turns} and "
                         f"num_speculative_tokens={params.num_speculative_tokens} must all be >= 1")
    items = pq.read_table(prompts).to_pylist()[: params.num_questions]
    if params.online and not 1 <= params.concurrency <= len(items):
        raise EvaluateError(f"evaluate.concurrency={params.concurrency} requests in flight are timed over as many "
                         f"questions; expected 1..{len(items)} (questions in {prompts}, num_questions="
                         f"{params.num_questions})")
    return [{**item, "turns": item["turns"][: params.turns]} for item in items]


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
