"""Stage `vocab`: the draft vocabulary, the `vocab.draft_vocab_size` target tokens generated most
often (ties and unused ids go to the rest of the training text), as artifacts/vocab/{d2t,t2d}.npy
in the form vLLM and SGLang read; or, for fine-tuning, the map of `vocab.from_drafter`.
"""
from __future__ import annotations

import time

from eagle3.cli import run_stage
from eagle3.metrics import write_metrics
from eagle3.params import load_section
from eagle3.target.record import load_record
from eagle3.vocab import VOCAB_DIR, VocabParams, build


def main() -> None:
    start = time.monotonic()
    params = load_section("vocab", VocabParams)
    stats = build(params, load_record()["vocab_size"])
    wall = time.monotonic() - start
    write_metrics("vocab", wall, items=stats["draft_vocab_size"], tokens=stats["generated_tokens"], **stats)
    print(f"vocab: {stats['draft_vocab_size']} of {stats['target_vocab_size']} target tokens cover "
          f"{stats['coverage']:.2%} of {stats['generated_tokens']} generated tokens "
          f"({stats['distinct_generated']} distinct), {wall:.1f}s -> {VOCAB_DIR}")


if __name__ == "__main__":
    run_stage("vocab", __doc__, main)
