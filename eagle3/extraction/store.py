"""What every extraction path shares around its forward passes: which samples are left to store
(resume from the last complete shard), and the finished store (merged index, manifest, the move of
run/extract/<fingerprint>/ to artifacts/hidden). The HF path (hf.py) and the engine path (engine.py)
differ only in how they get the states.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.extraction.params import OVER_LENGTH, STORE_DTYPES, ExtractError, ExtractParams
from eagle3.extraction.samples import LAYER_ID_CONVENTION, Sample, fingerprint, load_samples, resolve_aux_ids
from eagle3.store.layout import (
    StoreTotals,
    completed_sample_ids,
    merge_index,
    rank_todo,
    sample_arrays,
    write_manifest,
)
from eagle3.store.writer import ShardWriter


@dataclass
class Work:
    """One rank's share of an extraction: where it lands and what is left to do."""

    dir: Path
    aux_ids: list[int]
    samples: list[Sample]  # every sample of the store
    share: list[Sample]  # this rank's
    todo: list[Sample]  # this rank's, not yet stored
    counts: dict[str, int]  # truncated / skipped / dataset answers


def plan_work(params: ExtractParams, record: dict, tokenizer: Any, responses: Path, answered: Path | None,
              work_root: Path, rank: int = 0, world: int = 1, max_len: int | None = None,
              extra_key: dict | None = None) -> Work:
    """`max_len`: an engine's own limit below extract.max_seq_len (the over_length rule applies to it
    too). `extra_key` joins the fingerprint: states from another engine never resume into this store."""
    if params.over_length not in OVER_LENGTH:
        raise ExtractError(f"extract.over_length={params.over_length!r}: expected one of {', '.join(OVER_LENGTH)}")
    if params.store_dtype not in STORE_DTYPES:
        raise ExtractError(f"extract.store_dtype={params.store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    aux_ids = resolve_aux_ids(params, record)
    samples, counts = load_samples(responses, answered, tokenizer, record["vocab_size"], params, max_len)
    if not samples:
        raise ExtractError(f"{responses}: no sample to store ({counts['skipped']} skipped as longer than "
                           f"extract.max_seq_len={params.max_seq_len})")
    inputs = [responses] + ([answered] if answered else [])
    if max_len is not None and max_len < params.max_seq_len:  # samples cut there: a resume must cut them there too
        extra_key = {**(extra_key or {}), "engine_max_len": max_len}
    work = work_root / fingerprint(record, aux_ids, params, inputs, extra_key)
    ids = [s.id for s in samples]
    by_id = {s.id: s for s in samples}
    share = [by_id[i] for i in rank_todo(ids, set(), rank, world)]
    todo = [by_id[i] for i in rank_todo(ids, completed_sample_ids(work), rank, world)]
    return Work(work, aux_ids, samples, share, todo, counts)


def fp8_groups(store_dtype: str, hidden_size: int) -> dict[str, int] | None:
    """The writer's float8 scale groups for extract.store_dtype (None: lossless): one scale per token
    and layer, `aux` holding one hidden-wide state per aux layer."""
    return {"aux": hidden_size, "last": hidden_size} if store_dtype == "fp8_e4m3" else None


def store_writer(params: ExtractParams, work: Work, record: dict, rank: int = 0) -> ShardWriter:
    """The writer of one rank's shards, its states coded as extract.store_dtype says."""
    groups = fp8_groups(params.store_dtype, record["hidden_size"])
    return ShardWriter(work.dir, rank=rank, level=params.zstd_level, shard_bytes=int(params.shard_mb * (1 << 20)),
                       threads=params.compress_threads, fp8_groups=groups)


def write_token_store(work: Work, out: Path, record: dict, params: ExtractParams) -> dict:
    """The store without states: each sample's token ids and loss mask (4 bytes a token before zstd),
    what an online or hybrid training run plans its batches from and its capture process reads."""
    with store_writer(params, work, record) as writer:
        for sample in work.todo:
            writer.put(sample.id, {"input_ids": sample.input_ids, "loss_mask": sample.loss_mask})
    return finish_store(work, out, record, params, extra={"engine": None}, states=False)


def index_and_manifest(root: Path, record: dict, aux_ids: list[int], level: int, states: bool,
                       extra: dict, store_dtype: str = "bf16") -> StoreTotals:
    """Merges the index parts of every rank and writes the manifest of a store of this target's
    states (captured by our hooks or the engine: vLLM's layer ids, pre-norm last), or of its tokens."""
    totals = merge_index(root)
    hidden = record["hidden_size"]
    write_manifest(root, model_hash=record["weights_hash"], aux_layer_ids=aux_ids,
                   layer_id_convention=LAYER_ID_CONVENTION, last_state="pre_norm",
                   arrays=sample_arrays(len(aux_ids), hidden, states), level=level, totals=totals,
                   store_dtype=store_dtype,
                   extra={"num_layers": record["num_layers"], "hidden_size": hidden, "states": states, **extra})
    return totals


def finish_store(work: Work, out: Path, record: dict, params: ExtractParams, extra: dict | None = None,
                 states: bool = True) -> dict:
    """Merges the ranks' index parts, writes the manifest and moves the store to `out` (rank 0 only).
    `states` false: a token store (write_token_store), its manifest saying so."""
    totals = index_and_manifest(work.dir, record, work.aux_ids, params.zstd_level, states,
                                {"max_seq_len": params.max_seq_len, **work.counts, **(extra or {})},
                                params.store_dtype if states else "bf16")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(work.dir, out)
    return {"samples": totals.samples, "tokens": totals.tokens, "loss_tokens": totals.loss_tokens,
            "raw_bytes": totals.raw_bytes, "stored_bytes": totals.stored_bytes, "shards": totals.shards,
            "bytes_per_token": round(totals.stored_bytes / max(totals.tokens, 1), 1),
            "stored_over_raw": round(totals.stored_over_raw, 4), "store_dtype": params.store_dtype if states else None}
