"""MLA drafter (train.drafter: deepseek_mla) against the MHA (Llama) drafter at Kimi-K2.5 geometry.

Both are the train stage's own step (benchmarks/train_bench.py `ours`: DraftLoss with the TTT
attention kernel and chunked soft-CE, AdamW, grad clip; fp32 master weights, bf16 autocast on a
GPU), on the same random 2048-token sample, K = 7 TTT steps, draft vocab 32000, target vocab 163840,
H = Ht = 7168, intermediate 18432, 64 heads, eager and (on a GPU) torch.compile'd, in one process.
MHA: 64 query and 64 KV heads of 112 (7168 / 64; train_bench's kimi-k2.5 geometry). MLA: Kimi-K2.5's
own sizes: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, and its DeepSeek YaRN
RoPE (factor 32 of 4096).

MFU counts each drafter's own model FLOPs per step: fc once (6 * 3Ht * H per token), per TTT step
the layer's matmuls and the draft lm_head forward + backward (6 * params), the target head over the
draft vocabulary once (2 * Ht * Vd), and attention: 2 * heads * (qk dim + v dim) FLOPs per visible
key per query forward, x3 with backward (step k: query t sees t + 1 causal keys and k diagonal ones).

  python benchmarks/mla_bench.py --seconds 10 --out benchmarks/results/mla-h200.json
  python benchmarks/mla_bench.py --geometry tiny --seconds 2          (CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import DeepseekV3Config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere
from benchmarks.train_bench import (  # noqa: E402
    AUX_IDS,
    KIMI,
    TINY,
    Geometry,
    ours,
    random_data,
    release,
    run_variant,
    write_record,
)
from eagle3.metrics import machine_info  # noqa: E402
from eagle3.model.drafter import DrafterConfig, MLAConfig  # noqa: E402

KIMI_MLA = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
TINY_MLA = MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
KIMI_YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
GEOMETRIES = {"kimi-k2.5": (KIMI, KIMI_MLA), "tiny": (TINY, TINY_MLA)}


def mla_target(g: Geometry, mla: MLAConfig) -> DeepseekV3Config:
    """A DeepSeek-V3-style target of this geometry (Kimi-K2.5's text model: 61 layers, theta 50000)."""
    return DeepseekV3Config(
        hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=61, num_attention_heads=g.heads,
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, vocab_size=g.vocab,
        max_position_embeddings=4096 * 32, rope_theta=50000.0, rms_norm_eps=1e-6, rope_scaling=KIMI_YARN,
    )  # fmt: skip


def drafter_configs(g: Geometry, mla: MLAConfig) -> dict[str, DrafterConfig]:
    mha = DrafterConfig.from_target(g.llama_config(), draft_vocab_size=g.draft_vocab, aux_layer_ids=AUX_IDS)
    latent = DrafterConfig.from_target(mla_target(g, mla), draft_vocab_size=g.draft_vocab, aux_layer_ids=AUX_IDS,
                                       drafter="deepseek_mla")
    return {"mha": mha, "mla": latent}


def attention_params(c: DrafterConfig) -> int:
    h, n = c.hidden_size, c.num_attention_heads
    if c.mla is None:
        return 2 * h * (n + 2 * c.num_key_value_heads) * c.head_dim + n * c.head_dim * h
    m = c.mla
    return (2 * h * m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim + 2 * h * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim * h)


def model_flops(g: Geometry, c: DrafterConfig) -> float:
    """Model FLOPs of one training step of drafter `c` (see the module docstring)."""
    t, h = g.seq, c.hidden_size
    layer = attention_params(c) + 3 * h * c.intermediate_size
    per_token = 6 * 3 * h * h + g.ttt_steps * 6 * (layer + h * g.draft_vocab) + 2 * h * g.draft_vocab
    v_dim = c.head_dim if c.mla is None else c.mla.v_head_dim
    visible = sum(t * (t + 1) / 2 + k * t for k in range(g.ttt_steps))
    return t * per_token + 3 * 2 * c.num_attention_heads * (c.head_dim + v_dim) * visible


def kv_cache_values_per_token(c: DrafterConfig) -> int:
    """What vLLM caches per token for this drafter's layer: K and V per KV head, or MLA's latent + rope key."""
    if c.mla is None:
        return 2 * c.num_key_value_heads * c.head_dim
    return c.mla.kv_lora_rank + c.mla.qk_rope_head_dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="kimi-k2.5")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile happens here)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak of the device for MFU (H200 measured)")
    p.add_argument("--no-compile", action="store_true", help="eager variants only")
    p.add_argument("--out", type=Path, help="JSON result file")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g, mla = GEOMETRIES[args.geometry]
    data = random_data(g, device)
    configs = drafter_configs(g, mla)
    modes = [False] + ([True] if device.type == "cuda" and not args.no_compile else [])
    variants: dict[str, Any] = {}
    for compiled in modes:  # every eager variant first: a run cut short still compares the two drafters
        for name, config in configs.items():
            variant = f"{name}_{'compiled' if compiled else 'eager'}"
            result = run_variant(variant, lambda c=config, cc=compiled: ours(g, data, device, cc, c), args, g, device)
            if "step_ms" in result:  # train_bench's MFU is the MHA count; each drafter gets its own
                result["mfu"] = round(model_flops(g, config) / (result["step_ms"] / 1e3) / (args.peak_tflops * 1e12), 4)
            variants[variant] = result
            release(device)
            if args.out:  # after every variant: a run cut short keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(record(args, g, device, configs, variants), indent=2) + "\n")
    write_record(record(args, g, device, configs, variants), args.out)


def record(args: argparse.Namespace, g: Geometry, device: torch.device, configs: dict[str, DrafterConfig],
           variants: dict[str, Any]) -> dict[str, Any]:
    summary = {}
    for name, config in configs.items():
        ran = [v for v in variants if v.startswith(name) and "tokens_per_s" in variants[v]]
        best = max(ran, key=lambda v: variants[v]["tokens_per_s"], default=None)
        summary[name] = {
            "variant": best,
            "tokens_per_s": variants[best]["tokens_per_s"] if best else None,
            "mfu": variants[best]["mfu"] if best else None,
            "peak_memory_gb": variants[best]["peak_memory_gb"] if best else None,
            "layer_attention_params": attention_params(config),
            "model_gflops_per_step": round(model_flops(g, config) / 1e9, 1),
            "served_kv_cache_values_per_token": kv_cache_values_per_token(config),
            "config": asdict(config),
        }
    return {
        "summary": summary,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": machine_info() | {"torch": torch.__version__, "device": str(device)},
        "geometry": asdict(g),
        "setup": "train stage's step: fp32 master weights, AdamW, grad clip 0.5; bf16 autocast on CUDA, fp32 on CPU",
        "variants": variants,
    }


if __name__ == "__main__":
    main()
