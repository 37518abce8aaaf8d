"""Online training at Llama-3.1-8B geometry: how long the trainer waits for its capture process.

A random-weights target at Llama-3.1-8B geometry (32 layers, hidden 4096, vocab 128256, bf16) is
written to disk, with a token store of random ids (--samples x --seq tokens, the second half of
each sample "generated") and a draft vocabulary of 32000; then the train stage's own code
(eagle3.training.loop.train) trains with train.source: online (one epoch) or hybrid (--source
hybrid --epochs 2: the first epoch online, the second from the store it filled, the same batches)
and the llama-3.1-8b profile's train params, the capture process (the HF forward of the extract
stage) on the same GPU as the trainer. Printed and written (--out): the train metrics' `states`
(stall share, with and without the capture's start-up, capture tokens/s, prefetch peak, both
processes' peak RSS), the training tokens/s, and per epoch and per step the tokens, seconds and
seconds waiting for states (the curve's loop_s / wait_s at every step). Random weights: the time
of each forward is the real one, the states are not.

  python benchmarks/online_bench.py --out benchmarks/results/online-h200.json
  python benchmarks/online_bench.py --source hybrid --epochs 2 --samples 192 --out benchmarks/results/hybrid-h200.json
  python benchmarks/online_bench.py --geometry tiny --samples 16 --seq 64     (CPU smoke run)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere
from eagle3.metrics import machine_info  # noqa: E402
from eagle3.params import load_section  # noqa: E402
from eagle3.store.layout import merge_index, sample_arrays, write_manifest  # noqa: E402
from eagle3.store.writer import ShardWriter  # noqa: E402
from eagle3.training.loop import train  # noqa: E402
from eagle3.training.params import Paths, TrainParams  # noqa: E402

GEOMETRIES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, draft_vocab=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, draft_vocab=128),
}


def write_target(folder: Path, geometry: dict, device: torch.device) -> dict:
    config = LlamaConfig(**{k: v for k, v in geometry.items() if k != "draft_vocab"}, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # random init: the timing is real, the states are not
    model.save_pretrained(folder)
    n = config.num_hidden_layers
    aux = [1, n // 2, n - 1] if n < 8 else [2, n // 2, n - 3]
    record = {"architecture": "LlamaForCausalLM", "num_layers": n, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
              "max_position_embeddings": config.max_position_embeddings, "default_aux_layer_ids": aux,
              "chat_template": False, "dtype": "bfloat16", "source": str(folder), "source_kind": "local",
              "model_path": str(folder), "revision": None,
              "parameter_count": sum(p.numel() for p in model.parameters()), "weights_hash": "sha256:random-bench"}
    (folder / "target.json").write_text(json.dumps(record))
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return record


def write_tokens(root: Path, record: dict, samples: int, seq: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(root) as writer:
        for i in range(samples):
            writer.put(f"s{i:06d}", {"input_ids": rng.integers(0, record["vocab_size"], seq).astype(np.int32),
                                     "loss_mask": (np.arange(seq) >= seq // 2).astype(np.uint8)})
    aux = record["default_aux_layer_ids"]
    write_manifest(root, model_hash=record["weights_hash"], aux_layer_ids=aux, layer_id_convention="vLLM",
                   last_state="pre_norm", arrays=sample_arrays(len(aux), record["hidden_size"], states=False), level=1,
                   totals=merge_index(root), extra={"states": False, "num_layers": record["num_layers"],
                                                    "hidden_size": record["hidden_size"]})


def write_vocab(folder: Path, vocab: int, draft: int) -> None:
    folder.mkdir(parents=True)
    ids = np.arange(draft)  # the first ids: which ones does not change the time
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    np.save(folder / "d2t.npy", (ids - np.arange(draft)).astype(np.int64))
    np.save(folder / "t2d.npy", t2d)


def per_epoch(curve: list[dict[str, str]]) -> dict:
    """Tokens/s and the share of time waiting for states of each epoch, and every step's
    (epoch, tokens, seconds, seconds waiting), from a curve logged at every step."""
    steps, before = [], {"tokens": 0.0, "loop_s": 0.0, "wait_s": 0.0}
    for row in curve:
        now = {key: float(row[key]) for key in before}
        steps.append({"epoch": math.ceil(float(row["epoch"])) - 1, "tokens": int(now["tokens"] - before["tokens"]),
                      "s": round(now["loop_s"] - before["loop_s"], 3),
                      "wait_s": round(now["wait_s"] - before["wait_s"], 3)})
        before = now
    epochs = []
    for epoch in sorted({s["epoch"] for s in steps}):
        mine = [s for s in steps if s["epoch"] == epoch]
        seconds, waited, tokens = (sum(s[k] for s in mine) for k in ("s", "wait_s", "tokens"))
        epochs.append({"epoch": epoch, "steps": len(mine), "tokens_per_s": round(tokens / seconds),
                       "stall_share": round(waited / seconds, 4),
                       "median_step_s": round(statistics.median(s["s"] for s in mine), 3),
                       "median_wait_s": round(statistics.median(s["wait_s"] for s in mine), 3)})
    return {"epochs": epochs, "per_step": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=GEOMETRIES, default="llama-3.1-8b")
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--source", choices=("online", "hybrid"), default="online")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the drafter (its time counts in the loop)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    geometry = GEOMETRIES[args.geometry]
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="online-bench-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        record = write_target(root / "target", geometry, device)
        write_tokens(root / "tokens", record, args.samples, args.seq)
        write_vocab(root / "vocab", geometry["vocab_size"], geometry["draft_vocab"])
        setup_s = time.monotonic() - started
        profile = load_section("train", TrainParams, REPO / "profiles/llama-3.1-8b.yaml")
        small = args.geometry == "tiny"
        params = dataclasses.replace(
            profile, source=args.source, epochs=args.epochs, eval_fraction=0.0, checkpoint_every=10**9, log_every=1,
            compile=args.compile,
            prefetch_batches=args.prefetch, warmup_steps=2, max_seq_len=args.seq,
            max_tokens_per_batch=256 if small else profile.max_tokens_per_batch,
            capture_max_tokens=256 if small else profile.capture_max_tokens,
            # a tmpfs keeps the buffer in RAM; a container's small /dev/shm would not hold it
            prefetch_dir=str(shm / root.name) if shm.is_dir() and shutil.disk_usage(shm).free > 16 << 30 else None)
        paths = Paths(hidden=root / "tokens", vocab=root / "vocab", target=root / "target", out=root / "drafter",
                      run=root / "run", curve=root / "curve.csv", heldout_curve=root / "heldout.csv")
        cwd = os.getcwd()
        os.chdir(root)  # metrics/ lands in the temporary directory
        try:
            metrics = train(params, paths)
            with open(paths.curve) as f:
                curve = list(csv.DictReader(f))
        finally:
            os.chdir(cwd)
    result = {"benchmark": "online", "prefetch_dir": params.prefetch_dir or "run/ (disk)",
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine_info(), "geometry": args.geometry, "samples": args.samples, "seq": args.seq,
              "max_tokens_per_batch": params.max_tokens_per_batch, "prefetch_batches": params.prefetch_batches,
              "ttt_steps": params.ttt_steps, "compile": params.compile, "setup_s": round(setup_s, 1),
              "steps": metrics["steps"], "train_tokens_per_s": metrics["train_tokens_per_s"],
              "wall_s": metrics["wall_s"], "states": metrics["states"], **per_epoch(curve)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
