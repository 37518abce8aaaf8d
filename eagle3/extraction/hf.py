"""Extraction through HF transformers: one forward of the target's decoder per batch, hooks on the
layers the drafter needs (eagle3/target/capture.py), states into the shard store.

Samples are batched by length, right-padded (causal attention never lets a real position see the
padding after it). On a GPU the states go to pinned host memory asynchronously and are
compressed in threads while the next batch runs. Work lands in run/extract/<fingerprint>/ and
resumes from its last complete shard; under torchrun each rank writes its own shards and rank 0
merges the index. A target larger than one GPU is split by layers (`extract.device_map: auto`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.extraction.forward import forward_batch, load_target, store_batch
from eagle3.extraction.params import ExtractParams
from eagle3.extraction.samples import length_batches
from eagle3.extraction.store import finish_store, plan_work, store_writer
from eagle3.progress import Progress
from eagle3.target.capture import Capture
from eagle3.target.compute import cpu_note, target_dtype

RESPONSES = Path("artifacts/responses/responses.parquet")
ANSWERED = Path("artifacts/prompts/answered.parquet")  # conversations that keep the dataset's answer
WORK_DIR = Path("run/extract")
HIDDEN_DIR = Path("artifacts/hidden")


def distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def pick_device(params: ExtractParams, rank: int) -> torch.device:
    if params.device == "cpu" or (params.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def run_extraction(params: ExtractParams, record: dict, tokenizer: Any, responses: Path = RESPONSES,
                   out: Path = HIDDEN_DIR, work_root: Path = WORK_DIR, answered: Path | None = None) -> dict[str, Any]:
    rank, world = distributed()
    device = pick_device(params, rank)
    own, computes = getattr(torch, record["dtype"]), target_dtype(record, device)
    if computes != own:
        print(f"extract: {cpu_note(own)}", file=sys.stderr)
    # states of another compute dtype never resume into this store
    work = plan_work(params, record, tokenizer, responses, answered, work_root, rank, world,
                     extra_key={"compute_dtype": str(computes)} if computes != own else None)
    todo = work.todo
    progress = Progress(f"extract rank {rank}" if world > 1 else "extract",
                        total=sum(len(s.input_ids) for s in work.share), unit="tokens",
                        done=sum(len(s.input_ids) for s in work.share) - sum(len(s.input_ids) for s in todo))
    print(f"extract: rank {rank}/{world}: {len(work.share)} of {len(work.samples)} samples, "
          f"{len(work.share) - len(todo)} already stored in {work.dir}; aux layers {work.aux_ids}", file=sys.stderr)
    model = load_target(record, device, params.device_map) if todo else None
    capture = Capture(model, work.aux_ids) if model else None
    writer = store_writer(params, work, record, rank)
    start = time.monotonic()
    with writer:
        pending = None
        for batch in length_batches(todo, params.max_tokens_per_batch):
            launched = forward_batch(model, capture, batch, device)
            if pending:  # the previous batch is stored while this one computes
                store_batch(writer, pending[0], *pending[1:])
                progress.update(sum(len(s.input_ids) for s in pending[0]),
                                extra=f"stored/raw {writer.stats.stored_over_raw:.3f}")
            pending = (batch, *launched)
        if pending:
            store_batch(writer, pending[0], *pending[1:])
            progress.update(sum(len(s.input_ids) for s in pending[0]), force=True)
    compute_s = time.monotonic() - start
    new_tokens = torch.tensor([progress.done - progress.start_done], dtype=torch.int64)
    if world > 1:
        torch.distributed.all_reduce(new_tokens)
        torch.distributed.barrier()
    summary = {"new_tokens": int(new_tokens), "new_tokens_per_s": round(int(new_tokens) / max(compute_s, 1e-9), 1),
               **work.counts, "aux_layer_ids": work.aux_ids, "compute_dtype": str(computes).removeprefix("torch.")}
    if rank == 0:
        summary |= finish_store(work, out, record, params,
                                extra={"engine": "hf", "compute_dtype": summary["compute_dtype"]})
    return summary
