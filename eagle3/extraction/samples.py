"""What extraction stores: one sample per response and per conversation with its dataset answer.

A sample is the full token-id sequence (prompt + completion, exactly as stored: nothing is
re-rendered) with a loss mask on the generated tokens, cut or skipped at `max_seq_len`. Rows
rendered with another tokenizer or template than the target's are refused.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from eagle3.extraction.params import ExtractError, ExtractParams
from eagle3.target.chat import render
from eagle3.target.record import sha256_files

LAYER_ID_CONVENTION = ("vLLM: id 0 = embedding output, id X = output of decoder layer X-1 = HF hidden_states[X]; "
                       "`last` = output of the last decoder layer before the final norm")


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on generated tokens


def token_rows(responses: Path, answered: Path | None, tokenizer: Any) -> Iterator[tuple[Path, str, list[int], int]]:
    """(file, sample id, token ids, how many of them were generated) of every response and every
    conversation with a dataset answer, refusing rows rendered with another tokenizer or template."""
    table = pq.read_table(responses, columns=["id", "messages", "prompt_token_ids", "completion_token_ids"])
    for row in table.to_pylist():
        prompt = row["prompt_token_ids"]
        if render(tokenizer, json.loads(row["messages"]), generation_prompt=True) != prompt:
            raise ExtractError(f"{responses}: response {row['id']} was not rendered with artifacts/target's tokenizer "
                               "and chat template (its prompt ids differ); regenerate the responses")
        yield responses, row["id"], prompt + row["completion_token_ids"], len(row["completion_token_ids"])
    if answered is None:
        return
    if not answered.is_file():
        raise ExtractError(f"{answered}: not found; rerun the prompts stage (it writes it, empty without "
                           "prompts.dataset_answers)")
    for row in pq.read_table(answered, columns=["id", "messages", "token_ids"]).to_pylist():
        ids = row["token_ids"]
        if render(tokenizer, json.loads(row["messages"]), generation_prompt=False)[: len(ids)] != ids:
            raise ExtractError(f"{answered}: conversation {row['id']} was not rendered with artifacts/target's "
                               "tokenizer and chat template (its ids differ); rerun the prompts stage")
        yield answered, row["id"], ids, 0


def load_samples(responses: Path, answered: Path | None, tokenizer: Any, vocab_size: int,
                 params: ExtractParams, max_len: int | None = None) -> tuple[list[Sample], dict]:
    """Token sequences with a loss mask on the generated tokens (none for dataset answers).
    Sequences over extract.max_seq_len, or over `max_len` (an engine's limit) when that is lower, are
    truncated or skipped (`over_length`); `engine_limited` counts those only the engine's limit cut."""
    limit = min(params.max_seq_len, max_len or params.max_seq_len)
    samples, counts = [], {"truncated": 0, "skipped": 0, "dataset_answer_samples": 0}
    if limit < params.max_seq_len:
        counts["engine_limited"] = 0
    for path, sample_id, token_ids, generated in token_rows(responses, answered, tokenizer):
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.max(initial=0) >= vocab_size:
            raise ExtractError(f"{path}: row {sample_id} has token id {ids.max()} >= vocab size {vocab_size}")
        mask = np.concatenate([np.zeros(len(ids) - generated, np.uint8), np.ones(generated, np.uint8)])
        counts["dataset_answer_samples"] += path == answered
        if len(ids) > limit:
            counts["truncated" if params.over_length == "truncate" else "skipped"] += 1
            if len(ids) <= params.max_seq_len:
                counts["engine_limited"] += 1
            if params.over_length == "skip":
                continue
            ids, mask = ids[:limit], mask[:limit]
        samples.append(Sample(sample_id, ids.astype(np.int32), mask))
    return samples, counts


def length_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Longest first, each batch as many samples as fit max_tokens once padded to its longest."""
    batches: list[list[Sample]] = []
    for sample in sorted(samples, key=lambda s: -len(s.input_ids)):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= max_tokens:
            batches[-1].append(sample)
        else:
            batches.append([sample])
    return batches


def fingerprint(record: dict, aux_ids: list[int], params: ExtractParams, inputs: list[Path],
                extra: dict | None = None) -> str:
    key = {"weights": record["weights_hash"], "aux": aux_ids, "responses": sha256_files(inputs),
           "max_seq_len": params.max_seq_len, "over_length": params.over_length, "level": params.zstd_level,
           "store_dtype": params.store_dtype, **(extra or {})}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def resolve_aux_ids(params: ExtractParams, record: dict) -> list[int]:
    ids = list(params.aux_layer_ids or record["default_aux_layer_ids"])
    n = record["num_layers"]
    if any(not 0 <= i <= n for i in ids) or ids != sorted(set(ids)):
        raise ExtractError(f"extract.aux_layer_ids={ids}: expected increasing ids in 0..{n} "
                           f"(the target has {n} layers; vLLM captures them in layer order)")
    return ids
