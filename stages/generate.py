"""Stage `generate`: the target answers every training prompt through an OpenAI-compatible server.

Token-exact: each prompt is rendered once with the target's chat template and the server's own
prompt and completion token ids are stored, so the drafter learns exactly the stream the target
emitted (wrapper and thinking tokens included). Starts vLLM (`serve` params) unless one is running
or `generate.server_url` names an external server, and stops what it started. Parts of finished
prompts land atomically in run/generate/<fingerprint>/: a rerun after a crash skips them, so
nothing is redone or duplicated. Writes artifacts/responses/ and metrics/generate.json.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow.parquet as pq

from eagle3.atomic import atomic_write_json
from eagle3.cli import run_stage
from eagle3.engine import server
from eagle3.engine.client import check_served_model
from eagle3.generation.parts import assemble, read_parts, response_stats
from eagle3.generation.requests import (
    Counters,
    GenerateError,
    GenerateParams,
    check_params,
    connect,
    run,
    run_fingerprint,
)
from eagle3.generation.status import WORK_DIR
from eagle3.metrics import write_metrics
from eagle3.params import load_section
from eagle3.target.record import TARGET_DIR, load_record, load_tokenizer

OUT = Path("artifacts/responses")
PROMPTS = Path("artifacts/prompts/train.parquet")


def main() -> None:
    start = time.monotonic()
    params = load_section("generate", GenerateParams)
    serve = load_section("serve", server.ServeParams)
    check_params(params)
    record = load_record(TARGET_DIR)
    tokenizer = load_tokenizer(TARGET_DIR)
    prompts = pq.read_table(PROMPTS).to_pylist()
    work = WORK_DIR / run_fingerprint(record, tokenizer, params)
    work.mkdir(parents=True, exist_ok=True)
    stored = set(read_parts(work / "parts")["prompt_id"].to_pylist())
    todo = [(i, p) for i, p in enumerate(prompts) if p["id"] not in stored]
    print(f"generate: {len(prompts)} prompts, {len(prompts) - len(todo)} already answered in {work}, "
          f"{len(todo)} to go", file=sys.stderr)
    started, counters = False, Counters()
    try:
        if todo:  # all answered already (a resumed run): no server needed
            url, entry, started = connect(params, serve, record)
            check_served_model(url, entry, record, tokenizer)
            counters = asyncio.run(run(params, url, entry, tokenizer, todo, work, len(prompts),
                                       len(prompts) - len(todo)))
    finally:
        if started:
            server.stop()
    failed_ratio = counters.errors / max(len(prompts), 1)
    if failed_ratio > params.max_error_ratio:
        raise GenerateError(f"{counters.errors} of {len(prompts)} prompts failed ({failed_ratio:.1%} > "
                            f"generate.max_error_ratio={params.max_error_ratio}); reasons in {work / 'errors.jsonl'}. "
                            "Finished responses are kept: `dvc repro generate` retries just the failed ones.")
    table = assemble(work, prompts, OUT)
    if table.num_rows == 0:
        raise GenerateError(f"none of the {len(prompts)} prompts was answered (skipped: {dict(counters.skipped)}, "
                            f"errors in {work / 'errors.jsonl'})")
    stats = response_stats(table)
    wall = time.monotonic() - start
    this_run = {"requests": counters.requests, "retries": counters.retries, "errors": counters.errors,
                "skipped": dict(counters.skipped), "new_generated_tokens": counters.generated_tokens,
                "generated_tokens_per_s": round(counters.generated_tokens / wall, 1),
                "requests_per_s": round((counters.requests - counters.retries) / wall, 3)}
    atomic_write_json(OUT / "stats.json", {**stats, **this_run, "sampling": asdict(params)})
    write_metrics("generate", wall, items=stats["responses"], tokens=stats["generated_tokens"], **stats, **this_run)
    print(f"generate: {stats['responses']} responses ({len(todo) - counters.errors - sum(counters.skipped.values())} "
          f"new), {stats['generated_tokens']} tokens generated (mean {stats['mean_completion_tokens']}, max "
          f"{stats['max_completion_tokens']}), {this_run['requests_per_s']} req/s, "
          f"{this_run['generated_tokens_per_s']} gen tok/s, {counters.errors} errors, {counters.retries} retries, "
          f"skipped {dict(counters.skipped)}, finish {stats['finish_reasons']}, template mismatches "
          f"{stats['template_mismatches']}, {wall:.0f}s -> {OUT}")


if __name__ == "__main__":
    run_stage("generate", __doc__, main)
