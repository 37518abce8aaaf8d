"""Extraction throughput: our capture + store against the naive path, at real model geometry.

Variants, each time-boxed, on random bf16 weights (weights decide nothing about speed):
  (a) forward only: the decoder, no capture, no lm_head (the ceiling);
  (b) naive: output_hidden_states=True, pick the 3 aux + last states, .cpu(), one torch.save file
      per sample, uncompressed (what per-sample pipelines do);
  (c) naive + gzip level 6 (SpecForge's --compress);
  (d) ours end to end: hooks on the needed layers, pinned async copies, byte planes + zstd in
      threads, shards on disk.
Usage: python benchmarks/extract_bench.py --out benchmarks/results/extract-h200.json  (GPU)
       python benchmarks/extract_bench.py --tiny                                    (CPU smoke)
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stages.extract import Capture, Sample, forward_batch, store_batch  # noqa: E402
from stages.hidden_store import ShardWriter  # noqa: E402
from stages.metrics import machine_info  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="small geometry, for a CPU check of the script")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured dense bf16 peak of the GPU")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
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
    batch = [Sample(f"s{i}", ids[i].cpu().numpy().astype(np.int32), np.ones(seq, np.uint8)) for i in range(args.batch)]
    writer = ShardWriter(work / "ours", level=args.level, threads=args.threads)
    counter = [0]

    def ours_step() -> None:  # one batch in flight while the previous one is stored, as the stage runs
        launched = forward_batch(model, capture, batch, device)
        if counter[0]:
            store_batch(writer, *ours_step.pending)
        ours_step.pending = ([Sample(f"{s.id}-{counter[0]}", s.input_ids, s.loss_mask) for s in batch], *launched)
        counter[0] += 1

    start = time.perf_counter()
    ours_step()
    while time.perf_counter() - start < args.seconds:
        ours_step()
    store_batch(writer, *ours_step.pending)
    stats = writer.close()
    elapsed = time.perf_counter() - start
    results["ours_tokens_per_s"] = counter[0] * tokens / elapsed
    results["ours_stored_over_raw"] = stats.stored_over_raw
    results["ours_bytes_per_token"] = stats.stored_bytes / stats.tokens
    shutil.rmtree(work, ignore_errors=True)

    non_embedding = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    flops_per_token = 2 * non_embedding + n * 2 * seq * geometry["hidden_size"]  # matmuls + causal attention
    results["roofline_fraction"] = results["forward_only_tokens_per_s"] * flops_per_token / (args.peak_tflops * 1e12)
    results["ours_over_forward_only"] = results["ours_tokens_per_s"] / results["forward_only_tokens_per_s"]
    results["ours_over_naive"] = results["ours_tokens_per_s"] / results["naive_tokens_per_s"]
    record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": machine_info() | {"torch": torch.__version__}, "geometry": geometry, "batch": args.batch,
              "seq": seq, "seconds_per_variant": args.seconds, "compress_threads": args.threads,
              "zstd_level": args.level, **{k: round(v, 4) for k, v in results.items()}}
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
