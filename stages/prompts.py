"""Stage `prompts`: the training prompts, the conversations kept with their dataset answers, and the
evaluation questions, in artifacts/prompts/{train,answered,eval}.parquet.

Rows come from the embedded ShareGPT package, an HF dataset (through `datasets`) or a local
jsonl/parquet with OpenAI-style `messages` or ShareGPT-style `conversations`; the evaluation
questions from MT-bench (shipped in a package) or a local jsonl. Sampling is deterministic for
`prompts.seed`; every row not kept is counted under a reason with its location.
"""
from __future__ import annotations

import sys
import time

from eagle3.cli import run_stage
from eagle3.data.prompts import PROMPTS_DIR, PromptsParams, build
from eagle3.metrics import write_metrics
from eagle3.params import load_section


def main() -> None:
    start = time.monotonic()
    params = load_section("prompts", PromptsParams)
    stats = build(params)
    wall = time.monotonic() - start
    write_metrics("prompts", wall, items=stats["kept"], tokens=stats["prompt_tokens"], eval_items=stats["eval"],
                  dataset_answers=stats["dataset_answers"], dataset_answer_tokens=stats["dataset_answer_tokens"],
                  dropped=stats["dropped"])
    if stats["kept"] < params.num_samples:
        print(f"prompts: only {stats['kept']} of {params.num_samples} requested prompts are usable", file=sys.stderr)
    if stats["dataset_answers"] < params.dataset_answers:
        print(f"prompts: only {stats['dataset_answers']} of {params.dataset_answers} requested conversations with "
              "dataset answers are usable", file=sys.stderr)
    for reason, examples in stats["examples"].items():
        print(f"prompts: dropped {stats['dropped'][reason]} ({reason}), e.g. {examples[0]}", file=sys.stderr)
    print(f"prompts: kept {stats['kept']} train prompts ({stats['prompt_tokens']} tokens), {stats['dataset_answers']} "
          f"conversations with dataset answers ({stats['dataset_answer_tokens']} tokens) and {stats['eval']} eval "
          f"questions, dropped {sum(stats['dropped'].values())}, {wall:.1f}s -> {PROMPTS_DIR}")


if __name__ == "__main__":
    run_stage("prompts", __doc__, main)
