"""Extraction throughput: our capture + store against the naive path, at real model geometry.

Variants, each time-boxed, on random bf16 weights (weights decide nothing about speed):
  (a) forward only: the decoder, no capture, no lm_head (the ceiling);
  (b) naive: output_hidden_states=True, pick the 3 aux + last states, .cpu(), one torch.save file
      per sample, uncompressed (what per-sample pipelines do);
  (c) naive + gzip level 6 (SpecForge's --compress);
  (d) ours end to end: hooks on the needed layers, pinned async copies, byte planes + zstd in
      threads, shards on disk.
Then the training side reads (d)'s store back the way the train stage does (batch_loader: read,
decode and collate of one 2048-token sample per batch in reader threads, into pinned memory, the
states decoded to bf16 on the GPU: byte planes joined, or float8 codes times their scales), with 1 and with --reader-workers threads, for --seconds
each; compared with the trainer's rate in benchmarks/results/train-h200.json when that file exists.
Usage: python benchmarks/extract_bench.py --out benchmarks/results/extract-h200.json  (GPU)
       python benchmarks/extract_bench.py --tiny                                    (CPU smoke)

Under torchrun (`torchrun --nproc_per_node N benchmarks/extract_bench.py --workdir DIR`) only (d)
runs, as the extract stage runs it on N GPUs: every rank builds its own model on its GPU, takes its
own share of the sample ids (rank_todo) and writes its own shards into one store directory; rank 0
then merges the index (timed too) and writes one record with per-rank and aggregate tokens/s and
the host's CPU and disk use. benchmarks/scaling.py runs it at 1 and N GPUs.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.ranks import (  # noqa: E402
    HostSnapshot,
    barrier,
    broadcast_str,
    finish,
    gather,
    host_usage,
    local_world,
    process_cores,
    thread_cpu_seconds,
    under_torchrun,
)
from eagle3.extraction.forward import forward_batch, store_batch
from eagle3.extraction.hf import distributed, pick_device
from eagle3.extraction.params import ExtractParams
from eagle3.extraction.samples import Sample
from eagle3.extraction.store import fp8_groups
from eagle3.metrics import machine_info  # noqa: E402
from eagle3.params import load_section  # noqa: E402
from eagle3.store.codec import ArraySpec  # noqa: E402
from eagle3.store.layout import merge_index, rank_todo, write_manifest  # noqa: E402
from eagle3.store.reader import HiddenStore  # noqa: E402
from eagle3.store.writer import ShardWriter  # noqa: E402
from eagle3.target.capture import Capture
from eagle3.training.data import batch_loader  # noqa: E402

TRAIN_RESULT = Path(__file__).resolve().parent / "results" / "train-h200.json"

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)


def build_model(geometry: dict, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**geometry, attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device: torch.device, tokens_per_step: int, seconds: float) -> float:
    """Tokens/s over whole steps until `seconds` have passed, after one warm-up step."""
    step()
    sync(device)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    sync(device)
    return steps * tokens_per_step / (time.perf_counter() - start)


def naive_step(model, ids, aux_ids, out_dir: Path, compress: bool, counter: list[int]) -> None:
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in aux_ids], dim=-1).cpu()
    last = hidden[-1].cpu()
    for row in range(ids.shape[0]):
        buffer = io.BytesIO()
        torch.save({"aux": aux[row].clone(), "last": last[row].clone()}, buffer)
        data = gzip.compress(buffer.getvalue(), compresslevel=6) if compress else buffer.getvalue()
        (out_dir / f"{counter[0]}.pt{'.gz' if compress else ''}").write_bytes(data)
        counter[0] += 1


def template_batch(ids: torch.Tensor) -> list[Sample]:
    """One batch of samples (all tokens generated) from a [batch, seq] id tensor."""
    return [Sample(f"t{row}", r.cpu().numpy().astype(np.int32), np.ones(len(r), np.uint8)) for row, r in enumerate(ids)]


def store_for(model, capture: Capture, template: list[Sample], writer: ShardWriter, device: torch.device,
              seconds: float, sample_ids: Iterator[str]) -> int:
    """Runs `template` under fresh sample ids through forward + store for `seconds`, one batch in flight
    while the previous one is stored, as the stage runs; returns the tokens put (close the writer after)."""
    start, pending, tokens = time.perf_counter(), None, 0
    while pending is None or time.perf_counter() - start < seconds:
        batch = [Sample(next(sample_ids), s.input_ids, s.loss_mask) for s in template]
        launched = forward_batch(model, capture, batch, device)
        if pending:
            store_batch(writer, *pending)
        pending = (batch, *launched)
        tokens += sum(len(s.input_ids) for s in batch)
    store_batch(writer, *pending)
    return tokens


def reader_tokens_per_s(store: HiddenStore, workers: int, seconds: float, ttt_steps: int, seq: int,
                        device: torch.device, pin: bool = True) -> float:
    """Tokens/s the train stage's loader reads, decodes and collates from `store` and hands to
    `device` as bf16 batches (decoded there, as the trainer gets them), over whole batches."""
    order = np.random.default_rng(0).permutation(len(store))
    loader = batch_loader(store, [[int(row)] for row in order], ttt_steps=ttt_steps, max_seq_len=seq,
                          prompt_loss_weight=1.0, num_workers=workers, pin_memory=pin and device.type == "cuda")
    with contextlib.closing(loader):
        next(loader)  # threads started and the batches ahead under way, outside the window
        start, tokens = time.perf_counter(), 0
        for stored in loader:
            stored.to(device, torch.bfloat16)
            tokens += stored.tokens
            if time.perf_counter() - start >= seconds:
                break
        sync(device)
        return tokens / (time.perf_counter() - start)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="small geometry, for a CPU check of the script")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None,
                        help="compression threads per process; default: the cores less 4, shared among local ranks")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--store-dtype", choices=("bf16", "fp8_e4m3"), default="bf16",
                        help="extract.store_dtype of (d)'s store: lossless planes or float8 with a scale per token")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured dense bf16 peak of the GPU")
    parser.add_argument("--reader-workers", type=int, default=None,
                        help="reader threads of the read-back measurement; default: the cores less 4")
    parser.add_argument("--ttt-steps", type=int, default=7, help="TTT steps the reader collates for")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads is None:  # 4 cores stay for the ranks' own threads (launching, writing, Python)
        args.threads = max(1, ((os.cpu_count() or 2) - 4) // local_world())
    return args


def write_record(record: dict, out: str | None) -> None:
    print(json.dumps(record, indent=2))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    args = parse_args()
    if under_torchrun():
        return main_ranks(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    geometry = TINY if args.tiny else LLAMA_8B
    seq = min(args.seq, geometry["max_position_embeddings"])
    model = build_model(geometry, device, dtype)
    n = geometry["num_hidden_layers"]
    aux_ids = [2, n // 2, n - 3]
    ids = torch.randint(0, geometry["vocab_size"], (args.batch, seq), device=device)
    tokens = args.batch * seq
    work = Path(args.workdir or tempfile.mkdtemp(prefix="extract-bench-"))
    results: dict[str, float] = {}

    with torch.inference_mode():
        results["forward_only_tokens_per_s"] = timed(lambda: model.model(input_ids=ids), device, tokens, args.seconds)
    for key, compress in (("naive_tokens_per_s", False), ("naive_gzip_tokens_per_s", True)):
        out_dir = work / key
        out_dir.mkdir(parents=True)
        counter = [0]
        results[key] = timed(lambda: naive_step(model, ids, aux_ids, out_dir, compress, counter), device, tokens,
                             args.seconds)
        stored = sum(p.stat().st_size for p in out_dir.iterdir())
        results[key.replace("tokens_per_s", "bytes_per_token")] = stored / (counter[0] * seq)
        shutil.rmtree(out_dir)

    capture = Capture(model, aux_ids)
    writer = ShardWriter(work / "ours", level=args.level, threads=args.threads,
                         fp8_groups=fp8_groups(args.store_dtype, geometry["hidden_size"]))
    start = time.perf_counter()
    stored = store_for(model, capture, template_batch(ids), writer, device, args.seconds, (f"s{i}" for i in count()))
    stats = writer.close()
    elapsed = time.perf_counter() - start
    results["ours_tokens_per_s"] = stored / elapsed
    results["ours_stored_over_raw"] = stats.stored_over_raw
    results["ours_bytes_per_token"] = stats.stored_bytes / stats.tokens

    hidden = geometry["hidden_size"]
    write_manifest(work / "ours", model_hash="random", aux_layer_ids=aux_ids, layer_id_convention="bench",
                   last_state="pre_norm", level=args.level, totals=merge_index(work / "ours"),
                   store_dtype=args.store_dtype,
                   arrays={"input_ids": ArraySpec("int32", ()), "loss_mask": ArraySpec("uint8", ()),
                           "aux": ArraySpec("bfloat16", (3 * hidden,)), "last": ArraySpec("bfloat16", (hidden,))})
    store = HiddenStore(work / "ours")
    reader_workers = args.reader_workers or max(1, (os.cpu_count() or 2) - 4)
    read = functools.partial(reader_tokens_per_s, store, seconds=args.seconds, ttt_steps=args.ttt_steps, seq=seq,
                             device=device)
    results["reader_tokens_per_s_1_worker"] = read(1)
    results["reader_tokens_per_s"] = read(reader_workers)
    # The same collated into pageable memory: what page-locking buys the host-to-device copies
    results["reader_unpinned_tokens_per_s"] = read(reader_workers, pin=False)
    if TRAIN_RESULT.exists() and not args.tiny:  # the trainer's rate at 8B geometry
        trainer = json.loads(TRAIN_RESULT.read_text())["ours_tokens_per_s"]
        results["reader_over_trainer"] = results["reader_tokens_per_s"] / trainer
    shutil.rmtree(work, ignore_errors=True)

    non_embedding = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    flops_per_token = 2 * non_embedding + n * 2 * seq * geometry["hidden_size"]  # matmuls + causal attention
    results["roofline_fraction"] = results["forward_only_tokens_per_s"] * flops_per_token / (args.peak_tflops * 1e12)
    results["ours_over_forward_only"] = results["ours_tokens_per_s"] / results["forward_only_tokens_per_s"]
    results["ours_over_naive"] = results["ours_tokens_per_s"] / results["naive_tokens_per_s"]
    record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": machine_info() | {"torch": torch.__version__}, "geometry": geometry, "batch": args.batch,
              "seq": seq, "seconds_per_variant": args.seconds, "compress_threads": args.threads,
              "reader_workers": reader_workers,
              "zstd_level": args.level, "store_dtype": args.store_dtype, **{k: round(v, 4) for k, v in results.items()}}
    write_record(record, args.out)


def main_ranks(args: argparse.Namespace) -> None:
    """Variant (d) on every rank of a torchrun job: own model, own samples, own shards, one store."""
    rank, world = distributed()
    device = pick_device(load_section("extract", ExtractParams, REPO / "profiles/llama-3.1-8b.yaml"), rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    geometry = TINY if args.tiny else LLAMA_8B
    seq = min(args.seq, geometry["max_position_embeddings"])
    model = build_model(geometry, device, dtype)
    n = geometry["num_hidden_layers"]
    capture = Capture(model, [2, n // 2, n - 3])
    generator = torch.Generator().manual_seed(rank)  # each rank its own tokens
    template = template_batch(torch.randint(0, geometry["vocab_size"], (args.batch, seq), generator=generator))
    # The stage deals sample ids round robin (rank_todo); 65536 per rank last an hour at 8B speed.
    sample_ids = iter(rank_todo([f"s{i}" for i in range(world << 16)], set(), rank, world))
    work = Path(broadcast_str((args.workdir or tempfile.mkdtemp(prefix="extract-bench-")) if rank == 0 else ""))
    store = work / f"store-{world}"
    if rank == 0:  # shards of an earlier run would be merged too
        shutil.rmtree(store, ignore_errors=True)
    barrier()
    writer = ShardWriter(store, rank=rank, level=args.level, threads=args.threads,
                         fp8_groups=fp8_groups(args.store_dtype, geometry["hidden_size"]))
    forward_batch(model, capture, template, device)  # warm-up (kernels, allocator), outside the window
    sync(device)

    barrier()
    before = HostSnapshot.take()
    tokens = store_for(model, capture, template, writer, device, args.seconds, sample_ids)
    compress_cpu_s = thread_cpu_seconds("hidden-compress")  # before close ends the pool's threads
    stats = writer.close()
    after = HostSnapshot.take()
    barrier()
    window = HostSnapshot.take()  # the slowest rank's end, writer drained and shards fsync'd
    seconds = after.at - before.at
    per_rank = gather({"rank": rank, "tokens": tokens, "seconds": round(seconds, 3),
                       "tokens_per_s": round(tokens / seconds, 1), "samples": stats.samples, "shards": stats.shards,
                       "stored_bytes": stats.stored_bytes, "raw_bytes": stats.raw_bytes,
                       "process_cores": process_cores(before, after), "compress_threads": args.threads,
                       "compress_cores": round(compress_cpu_s / seconds, 2)})
    if rank == 0:
        merge_start = time.perf_counter()
        totals = merge_index(store)
        merge_s = time.perf_counter() - merge_start
        if totals.samples != sum(r["samples"] for r in per_rank):
            raise RuntimeError(f"merged index has {totals.samples} samples, the ranks stored "
                               f"{sum(r['samples'] for r in per_rank)}")
        wall = window.at - before.at
        record = {"benchmark": "extract", "world_size": world, "command": " ".join(sys.argv),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": machine_info() | {"torch": torch.__version__},
                  "geometry": geometry, "batch": args.batch, "seq": seq, "seconds": args.seconds,
                  "zstd_level": args.level, "compress_threads_per_rank": args.threads,
                  "aggregate_tokens_per_s": round(totals.tokens / wall, 1), "window_s": round(wall, 3),
                  "merge_index_s": round(merge_s, 3), "samples": totals.samples, "shards": totals.shards,
                  "stored_over_raw": round(totals.stored_over_raw, 4),
                  "store_write_mb_per_s": round(totals.stored_bytes / 1e6 / wall, 1),
                  **host_usage(before, window), "per_rank": per_rank}
        write_record(record, args.out)
        shutil.rmtree(store, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    barrier()
    finish()


if __name__ == "__main__":
    main()
