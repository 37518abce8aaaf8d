"""Stage `extract`: the target's hidden states for every response, into the shard store.

Also for every conversation the prompts stage kept with its dataset answer (all positions context).

One forward of the target over prompt + completion per sample, with forward hooks on exactly
the layers the drafter needs: the aux layers (vLLM's ids: id X = output of decoder layer X-1,
0 = the embedding output) and the last decoder layer's output before the final norm (what an
engine captures; the trainer applies the norm). Samples are batched by length, right-padded
(causal attention never lets a real position see the padding after it). On a GPU the states
go to pinned host memory asynchronously and are compressed in threads while the next batch
runs. Work lands in run/extract/<fingerprint>/ and resumes from its last complete shard;
under torchrun each rank writes its own shards and rank 0 merges the index.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from stages.atomic import atomic_write_json
from stages.hidden_store import (ArraySpec, ShardWriter, StoreWriteError, completed_sample_ids, merge_index,
                                 rank_todo, write_manifest)
from stages.metrics import write_metrics
from stages.params import load_section
from stages.progress import Progress
from stages.server import require_accelerators_free
from stages.target import load_record, sha256_files

RESPONSES = Path("artifacts/responses/responses.parquet")
ANSWERED = Path("artifacts/prompts/answered.parquet")  # conversations that keep the dataset's answer
TARGET_DIR = Path("artifacts/target")
WORK_DIR = Path("run/extract")
OUT = Path("artifacts/hidden")
LAYER_ID_CONVENTION = ("vLLM: id 0 = embedding output, id X = output of decoder layer X-1 = HF hidden_states[X]; "
                       "`last` = output of the last decoder layer before the final norm")
OVER_LENGTH = ("truncate", "skip")


class ExtractError(ValueError):
    pass


@dataclass
class ExtractParams:
    aux_layer_ids: list[int] | None = None  # None: the target's default (2, N//2, N-3)
    max_seq_len: int = 2048
    over_length: str = "truncate"  # truncate | skip
    max_tokens_per_batch: int = 16384  # padded tokens per forward
    zstd_level: int = 1
    shard_mb: float = 512
    compress_threads: int = 2
    device: str = "auto"  # auto | cpu | cuda
    device_map: str | None = None  # "auto": spread a target larger than one GPU over all of them


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on generated tokens


def token_rows(responses: Path, answered: Path | None, tokenizer: Any) -> Iterator[tuple[Path, str, list[int], int]]:
    """(file, sample id, token ids, how many of them were generated) of every response and every
    conversation with a dataset answer, refusing rows rendered with another tokenizer or template."""
    from stages.prompts import render

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
                 params: ExtractParams) -> tuple[list[Sample], dict]:
    """Token sequences with a loss mask on the generated tokens (none for dataset answers)."""
    samples, counts = [], {"truncated": 0, "skipped": 0, "dataset_answer_samples": 0}
    for path, sample_id, token_ids, generated in token_rows(responses, answered, tokenizer):
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.max(initial=0) >= vocab_size:
            raise ExtractError(f"{path}: row {sample_id} has token id {ids.max()} >= vocab size {vocab_size}")
        mask = np.concatenate([np.zeros(len(ids) - generated, np.uint8), np.ones(generated, np.uint8)])
        counts["dataset_answer_samples"] += path == answered
        if len(ids) > params.max_seq_len:
            counts["truncated" if params.over_length == "truncate" else "skipped"] += 1
            if params.over_length == "skip":
                continue
            ids, mask = ids[: params.max_seq_len], mask[: params.max_seq_len]
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


class Capture:
    """Forward hooks that keep the outputs of the needed modules, nothing else."""

    def __init__(self, model: Any, aux_ids: list[int]):
        decoder = model.get_decoder()
        layers = decoder.layers
        self.names = [f"aux{i}" for i in aux_ids] + ["last"]
        modules = [decoder.embed_tokens if i == 0 else layers[i - 1] for i in aux_ids] + [layers[-1]]
        # Under device_map the layers live on several GPUs: the states are gathered on the first.
        self.device = decoder.embed_tokens.weight.device
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._keep(name)) for name, m in zip(self.names, modules)]

    def _keep(self, name: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            self.outputs[name] = (output[0] if isinstance(output, tuple) else output).to(self.device)
        return hook

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux states concatenated in layer order [..., n*H], last state [..., H]) of the last
        forward; forgets them, so the next forward's tensors are the only ones kept."""
        aux = torch.cat([self.outputs[n] for n in self.names[:-1]], dim=-1)
        last = self.outputs["last"]
        self.outputs.clear()
        return aux, last


def pad_batch(batch: list[Sample], device: torch.device) -> torch.Tensor:
    """Token ids right-padded to the longest sample. No attention mask is needed: under causal
    attention a real position never sees the padding after it, and without a mask the attention
    kernels take their causal path (the same states as a masked forward)."""
    ids = np.zeros((len(batch), len(batch[0].input_ids)), np.int64)
    for row, sample in enumerate(batch):
        ids[row, : len(sample.input_ids)] = sample.input_ids
    return torch.from_numpy(ids).to(device)


def forward_batch(model: Any, capture: Capture, batch: list[Sample], device: torch.device) -> tuple[Any, ...]:
    """Runs the decoder (no lm_head) and starts the copies of the captured states to the host."""
    with torch.inference_mode():
        model.get_decoder()(input_ids=pad_batch(batch, device), use_cache=False)
        aux, last = (state.to(torch.bfloat16) for state in capture.take())
    if device.type != "cuda":
        return aux, last, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (aux, last)]
    for dst, src in zip(host, (aux, last)):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host[0], host[1], event


def store_batch(writer: ShardWriter, batch: list[Sample], aux: torch.Tensor, last: torch.Tensor, event: Any) -> None:
    if event is not None:
        event.synchronize()
    for row, sample in enumerate(batch):
        n = len(sample.input_ids)
        writer.put(sample.id, {"input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
                               "aux": aux[row, :n].view(torch.int16).numpy().view(np.uint16),
                               "last": last[row, :n].view(torch.int16).numpy().view(np.uint16)})


def fingerprint(record: dict, aux_ids: list[int], params: ExtractParams, inputs: list[Path]) -> str:
    key = {"weights": record["weights_hash"], "aux": aux_ids, "responses": sha256_files(inputs),
           "max_seq_len": params.max_seq_len, "over_length": params.over_length, "level": params.zstd_level}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def resolve_aux_ids(params: ExtractParams, record: dict) -> list[int]:
    ids = list(params.aux_layer_ids or record["default_aux_layer_ids"])
    n = record["num_layers"]
    if any(not 0 <= i <= n for i in ids) or ids != sorted(set(ids)):
        raise ExtractError(f"extract.aux_layer_ids={ids}: expected increasing ids in 0..{n} "
                           f"(the target has {n} layers; vLLM captures them in layer order)")
    return ids


def load_model(record: dict, params: ExtractParams, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, record["dtype"])  # CPUs too: with AVX512-BF16 a bf16 forward is twice fp32's
    kwargs = {"device_map": params.device_map} if params.device_map else {}
    model = AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=dtype, revision=record.get("revision"),
                                                 **kwargs)
    return (model if params.device_map else model.to(device)).eval()


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
                   out: Path = OUT, work_root: Path = WORK_DIR, answered: Path | None = None) -> dict[str, Any]:
    if params.over_length not in OVER_LENGTH:
        raise ExtractError(f"extract.over_length={params.over_length!r}: expected one of {', '.join(OVER_LENGTH)}")
    rank, world = distributed()
    aux_ids = resolve_aux_ids(params, record)
    samples, counts = load_samples(responses, answered, tokenizer, record["vocab_size"], params)
    work = work_root / fingerprint(record, aux_ids, params, [responses] + ([answered] if answered else []))
    by_id = {s.id: s for s in samples}
    share = rank_todo([s.id for s in samples], set(), rank, world)
    todo = [by_id[i] for i in rank_todo([s.id for s in samples], completed_sample_ids(work), rank, world)]
    progress = Progress(f"extract rank {rank}" if world > 1 else "extract",
                        total=sum(len(by_id[i].input_ids) for i in share), unit="tokens",
                        done=sum(len(by_id[i].input_ids) for i in share) - sum(len(s.input_ids) for s in todo))
    print(f"extract: rank {rank}/{world}: {len(share)} of {len(samples)} samples, {len(share) - len(todo)} already "
          f"stored in {work}; aux layers {aux_ids}", file=sys.stderr)
    device = pick_device(params, rank)
    model = load_model(record, params, device) if todo else None
    capture = Capture(model, aux_ids) if model else None
    writer = ShardWriter(work, rank=rank, level=params.zstd_level, shard_bytes=int(params.shard_mb * (1 << 20)),
                         threads=params.compress_threads)
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
               **counts, "aux_layer_ids": aux_ids}
    if rank == 0:
        totals = merge_index(work)
        hidden = record["hidden_size"]
        arrays = {"input_ids": ArraySpec("int32", ()), "loss_mask": ArraySpec("uint8", ()),
                  "aux": ArraySpec("bfloat16", (len(aux_ids) * hidden,)), "last": ArraySpec("bfloat16", (hidden,))}
        write_manifest(work, model_hash=record["weights_hash"], aux_layer_ids=aux_ids,
                       layer_id_convention=LAYER_ID_CONVENTION, last_state="pre_norm", arrays=arrays,
                       level=params.zstd_level, totals=totals,
                       extra={"num_layers": record["num_layers"], "hidden_size": hidden, "max_seq_len": params.max_seq_len,
                              **counts})
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
        summary |= {"samples": totals.samples, "tokens": totals.tokens, "loss_tokens": totals.loss_tokens,
                    "raw_bytes": totals.raw_bytes, "stored_bytes": totals.stored_bytes, "shards": totals.shards,
                    "bytes_per_token": round(totals.stored_bytes / max(totals.tokens, 1), 1),
                    "stored_over_raw": round(totals.stored_over_raw, 4)}
    return summary


def main() -> None:
    from transformers import AutoTokenizer

    start = time.monotonic()
    require_accelerators_free("extract")
    params = load_section("extract", ExtractParams)
    record = load_record(TARGET_DIR)
    try:
        summary = run_extraction(params, record, AutoTokenizer.from_pretrained(TARGET_DIR), answered=ANSWERED)
    except (ExtractError, StoreWriteError) as err:
        sys.exit(f"extract: {err}")
    if "samples" not in summary:  # not rank 0
        return
    wall = time.monotonic() - start
    summary = write_metrics("extract", wall, items=summary.pop("samples"), tokens=summary.pop("tokens"), **summary)
    print(f"extract: {summary['items']} samples, {summary['tokens']} tokens ({summary['new_tokens']} new at "
          f"{summary['new_tokens_per_s']} tok/s), {summary['raw_bytes'] / 1e6:.1f} MB raw -> "
          f"{summary['stored_bytes'] / 1e6:.1f} MB stored ({summary['stored_over_raw']:.3f}, "
          f"{summary['bytes_per_token']} B/token), {summary['truncated']} truncated, {summary['skipped']} skipped, "
          f"{wall:.0f}s -> {OUT}")


if __name__ == "__main__":
    main()
