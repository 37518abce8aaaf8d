"""Stage `extract`: the target's hidden states for every response and every conversation with its
dataset answer, into the shard store artifacts/hidden (eagle3/store/).

Per sample: its token ids, the loss mask (generated tokens), the target's states at the aux layer
ids (vLLM's convention: id X = output of decoder layer X-1, 0 = the embeddings) and the last
decoder layer's output before the final norm. bf16, sharded, zstd on byte planes, an index with a
CRC per sample and a manifest. Resumes from the last complete shard after a crash; under torchrun
each rank extracts every world-size-th sample. `extract.engine: vllm` has the serving engine compute
the states (the `serve` section's parallel sizes; it starts and stops the server unless a capturing
one is running), into the same store. With `train.source: online` or `hybrid` the training run
captures its own states: the store then holds only the token ids and loss masks it plans from.
"""
from __future__ import annotations

import time

from eagle3.cli import run_stage
from eagle3.engine.server import ServeParams
from eagle3.engine.state import require_accelerators_free
from eagle3.extraction.engine import run_engine_extraction
from eagle3.extraction.hf import ANSWERED, HIDDEN_DIR, RESPONSES, WORK_DIR, run_extraction
from eagle3.extraction.params import ENGINES, TRAIN_SOURCES, ExtractError, ExtractParams
from eagle3.extraction.store import plan_work, write_token_store
from eagle3.metrics import write_metrics
from eagle3.params import load_section, read_params
from eagle3.target.record import TARGET_DIR, load_record, load_tokenizer


def main() -> None:
    start = time.monotonic()
    params = load_section("extract", ExtractParams)
    if params.engine not in ENGINES:
        raise ExtractError(f"extract.engine={params.engine!r}: expected one of {', '.join(ENGINES)}")
    record = load_record(TARGET_DIR)
    tokenizer = load_tokenizer(TARGET_DIR)
    train = read_params().get("train", {})
    source = train.get("source")
    if source not in TRAIN_SOURCES:
        raise ExtractError(f"params.yaml: train.source={source!r}: expected one of {', '.join(TRAIN_SOURCES)}")
    if source != "store":  # the trainer's capture process computes the states
        # the capture server will see these samples: its length limit applies, as it does to extract.engine: vllm
        engine = train.get("capture_engine") == "vllm"
        work = plan_work(params, record, tokenizer, RESPONSES, ANSWERED, WORK_DIR, extra_key={"states": False},
                         max_len=load_section("serve", ServeParams).max_model_len - 1 if engine else None)
        summary = {"new_tokens": sum(len(s.input_ids) for s in work.todo), "new_tokens_per_s": None, **work.counts,
                   "aux_layer_ids": work.aux_ids, **write_token_store(work, HIDDEN_DIR, record, params)}
    elif params.engine == "vllm":  # the server holds the accelerators, and is what computes
        summary = run_engine_extraction(params, load_section("serve", ServeParams), record, tokenizer,
                                        RESPONSES, HIDDEN_DIR, WORK_DIR, answered=ANSWERED)
    else:
        require_accelerators_free("extract")
        summary = run_extraction(params, record, tokenizer, answered=ANSWERED)
    if "samples" not in summary:  # not rank 0
        return
    wall = time.monotonic() - start
    summary = write_metrics("extract", wall, items=summary.pop("samples"), tokens=summary.pop("tokens"), **summary)
    print(f"extract: {summary['items']} samples, {summary['tokens']} tokens ({summary['new_tokens']} new at "
          f"{summary['new_tokens_per_s']} tok/s), {summary['raw_bytes'] / 1e6:.1f} MB raw -> "
          f"{summary['stored_bytes'] / 1e6:.1f} MB stored ({summary['stored_over_raw']:.3f}, "
          f"{summary['bytes_per_token']} B/token), {summary['truncated']} truncated, {summary['skipped']} skipped, "
          f"{wall:.0f}s ({params.engine if source == 'store' else 'token ids only, train.source: ' + source}) -> "
          f"{HIDDEN_DIR}")


if __name__ == "__main__":
    run_stage("extract", __doc__, main)
