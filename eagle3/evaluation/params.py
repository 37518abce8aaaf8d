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
    temperature: float
    max_new_tokens: int
    num_questions: int  # MT-bench questions
    turns: int  # turns per question; turn 2 continues the model's own first answer
    offline: bool
    online: bool
    concurrency: int  # requests in flight for the throughput figure
    answer_concurrency: int  # requests in flight while vLLM answers the questions (acceptance)
    offline_batch_size: int  # prompts per batched greedy generate (offline, T=0)
    throughput_prompts: int  # prompts timed at batch 1 and at `concurrency`, with and without the drafter
    measure_baseline: bool  # also serve the target alone for the throughput comparison
    agreement_tolerance: float  # |offline - vLLM| / vLLM acceptance length, at temperature 0
    seed: int
    port: int


@dataclass(frozen=True)
class EvalPaths:
    target: Path = Path("artifacts/target")
    drafter: Path = Path("artifacts/drafter")  # what the engine serves: the export under test
    prompts: Path = Path("artifacts/prompts/eval.parquet")
    vocab: Path = Path("artifacts/vocab")  # the vocabulary map the drafter was trained with
    manifest: Path = Path("artifacts/hidden/manifest.json")  # the aux layer ids it was trained with
    server_state: Path = Path("run/server-eval")
