"""Drafter training throughput at Llama-3.1-8B geometry: our train step against SpecForge's.

A full step: all K TTT steps forward, soft cross-entropy against the target's distribution,
backward, gradient clipping, AdamW step; fp32 master weights, bf16 autocast on a GPU (fp32 on
CPU). The offline path on random data: batch 1 x 2048 tokens, target distribution from a frozen
target lm_head over a stored last state, token embeddings from a frozen [128256, 4096] table;
H = Ht = 4096, intermediate 14336, 32 query / 8 KV heads, draft vocab 32000, K = 7.

Variants: ours eager and (on a GPU) ours with the drafter torch.compile'd; with --specforge, SpecForge
with each attention backend; the top-level figures are each implementation's fastest variant.
Reported per variant: tokens/s (median step time over --seconds of timed steps, after --warmup
steps that include torch.compile's), peak memory of the timed steps (max_memory_allocated) and
MFU. MFU counts the same model FLOPs for every implementation, per token:
  fc, forward + backward, once:                        6 * 3*Ht*H
  per TTT step, layer + draft lm_head fwd + bwd:       6 * (layer matmul params + H*Vd)
  the target head forward, once (every step reads the same positions' distributions): 2 * Ht*Vd
plus attention: 4 * (heads*head_dim) FLOPs per visible key per query forward, x3 with backward;
at TTT step k query t sees t+1 causal keys and k diagonal ones.

  python benchmarks/train_bench.py --out benchmarks/results/train-h200.json --specforge ~/SpecForge
  python benchmarks/train_bench.py --geometry tiny --seconds 2                  (CPU smoke run)
  python benchmarks/train_bench.py --geometry kimi-k2.5 --no-compile             (does it fit one GPU?)

Under torchrun (`torchrun --nproc_per_node N benchmarks/train_bench.py`) only ours runs, as the
train stage runs on N GPUs: its train_step on a DDP-wrapped (--fsdp: sharded) DraftLoss, one random
2048-token batch per rank (each rank its own) and batches_per_step = N, so one optimizer step
takes N x 2048 tokens; compiled on a GPU unless --no-compile. Rank 0 writes one record: per-rank
and aggregate tokens/s, and the time of one all-reduce of the drafter's gradients.
benchmarks/scaling.py runs it at 1 and N GPUs.

--specforge DIR imports SpecForge from DIR and times OnlineEagle3Model around
LlamaForCausalLMEagle3 with the "sdpa" and "flex_attention" backends, loss = sum 0.8^k * step
loss (its own trainer's weighting), same data, optimizer and precision. SpecForge's offline
teacher is full-vocabulary logits of its TargetHead (lm_head only: it stores post-norm states).
Any SpecForge failure is recorded in the JSON instead of stopping the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere
from benchmarks.ranks import HostSnapshot, all_agree, finish, gather, host_usage, process_cores, under_torchrun  # noqa: E402
from eagle3.metrics import machine_info  # noqa: E402
from eagle3.model.drafter import Drafter, DrafterConfig, RMSNorm  # noqa: E402
from eagle3.params import load_section  # noqa: E402
from eagle3.store.reader import StatePlanes  # noqa: E402
from eagle3.training.data import Batch, collate  # noqa: E402
from eagle3.training.loop import Dist, Run, distribute, init_distributed, make_optimizer, train_step, uses_bf16_autocast
from eagle3.training.objective import DraftLoss
from eagle3.training.params import Paths, TrainParams, check_params
from eagle3.training.teacher import Teacher  # noqa: E402

DECAY = 0.8
AUX_IDS = (2, 16, 29)


@dataclass(frozen=True)
class Geometry:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    draft_vocab: int = 32000
    seq: int = 2048
    ttt_steps: int = 7

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def llama_config(self, **extra: Any) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=32,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            **extra,
        )


TINY = Geometry(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, draft_vocab=128, seq=128)
# Kimi-K2.5's drafter (profiles/targets/kimi-k2.5.yaml): ~1B trainable parameters, the size where one
# asks whether the drafter and its AdamW state still fit one GPU without FSDP.
KIMI = Geometry(hidden=7168, intermediate=18432, heads=64, kv_heads=64, vocab=163840)
GEOMETRIES = {"llama-3.1-8b": Geometry(), "kimi-k2.5": KIMI, "tiny": TINY}


def model_flops(g: Geometry) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    t, h, q, kv = g.seq, g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * g.intermediate
    per_token = 6 * 3 * h * h + g.ttt_steps * 6 * (layer + h * g.draft_vocab) + 2 * h * g.draft_vocab
    visible = sum(t * (t + 1) / 2 + k * t for k in range(g.ttt_steps))
    return t * per_token + 3 * 4 * q * visible


@dataclass
class Data:
    """One random sample on the device, and the frozen target parts."""

    ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, 3*Ht] bf16
    last: torch.Tensor  # [T, Ht] bf16
    embed: torch.Tensor  # [V, Ht] bf16
    lm_head: torch.Tensor  # [V, Ht] bf16
    d2t: torch.Tensor  # [Vd] int64
    t2d: torch.Tensor  # [V] bool


def random_data(g: Geometry, device: torch.device) -> Data:
    gen = torch.Generator(device="cpu").manual_seed(0)
    draft_ids = torch.randperm(g.vocab, generator=gen)[: g.draft_vocab].sort().values
    t2d = torch.zeros(g.vocab, dtype=torch.bool)
    t2d[draft_ids] = True

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    return Data(
        ids=torch.randint(0, g.vocab, (g.seq,), generator=gen).to(device),
        aux=rand(g.seq, 3 * g.hidden),
        last=rand(g.seq, g.hidden),
        embed=rand(g.vocab, g.hidden, scale=0.02),
        lm_head=rand(g.vocab, g.hidden, scale=0.02),
        d2t=(draft_ids - torch.arange(g.draft_vocab)).to(device),
        t2d=t2d.to(device),
    )


def own_sample(data: Data, g: Geometry, rank: int) -> Data:
    """`data` with this rank's own random sample; the frozen target parts stay the same on every rank."""
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    device = data.ids.device
    return dataclasses.replace(
        data,
        ids=torch.randint(0, g.vocab, (g.seq,), generator=gen).to(device),
        aux=torch.randn(g.seq, 3 * g.hidden, generator=gen).to(device, torch.bfloat16),
        last=torch.randn(g.seq, g.hidden, generator=gen).to(device, torch.bfloat16),
    )


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def adamw_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class OurParts:
    loss: DraftLoss
    batch: Batch


def our_parts(g: Geometry, data: Data, device: torch.device, compiled: bool,
              config: DrafterConfig | None = None) -> OurParts:
    """The train stage's pieces: DraftLoss (TTT attention kernel, chunked soft-CE) and one batch.
    config: the drafter (default: the Llama drafter of this geometry)."""
    if config is None:
        config = DrafterConfig.from_target(g.llama_config(), draft_vocab_size=g.draft_vocab, aux_layer_ids=AUX_IDS)
    drafter = Drafter(config).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    norm = RMSNorm(g.hidden, 1e-5).requires_grad_(False)
    teacher = Teacher(data.embed, data.lm_head[torch.arange(g.draft_vocab, device=device) + data.d2t], norm)
    sample = {"input_ids": data.ids.cpu(), "loss_mask": torch.ones(g.seq, dtype=torch.uint8),
              "aux": StatePlanes.of(data.aux.cpu()), "last": StatePlanes.of(data.last.cpu())}
    stored = collate([sample], ttt_steps=g.ttt_steps, max_seq_len=g.seq, prompt_loss_weight=0.0)
    batch: Batch = stored.to(device, dtype)
    loss = DraftLoss(drafter, teacher.to(device, dtype), g.ttt_steps, chunk_size=1024)
    if compiled:
        drafter.compile()
    return OurParts(loss, batch)


def gpu_params(**overrides: Any) -> TrainParams:
    """The llama-3.1-8b profile's training params (optimizer settings of a real GPU run), with overrides."""
    return dataclasses.replace(load_section("train", TrainParams, REPO / "profiles/llama-3.1-8b.yaml"), **overrides)


def ours(g: Geometry, data: Data, device: torch.device, compiled: bool,
         config: DrafterConfig | None = None) -> Callable[[], None]:
    """The train stage's step, one process: DraftLoss + AdamW."""
    parts = our_parts(g, data, device, compiled, config)
    weights = parts.batch.step_weights(g.ttt_steps)
    scale = torch.tensor([DECAY**k for k in range(g.ttt_steps)], device=device) / weights
    params = list(parts.loss.drafter.parameters())
    optimizer = make_optimizer(parts.loss.drafter, gpu_params(), device)

    def step() -> None:
        with autocast(device):
            objective, _, _ = parts.loss(parts.batch, scale)
        objective.backward()
        adamw_step(params, optimizer)

    return step


def ours_ranks(g: Geometry, data: Data, dist: Dist, compiled: bool, fsdp: bool) -> tuple[Callable[[], None], DraftLoss]:
    """The train stage's own train_step over this rank's batch, with the stage's global-batch rule
    (batches_per_step = world size: per-step means over all ranks' tokens, DDP or FSDP averaging gradients)."""
    parts = our_parts(g, data, dist.device, compiled)
    params = gpu_params(ttt_steps=g.ttt_steps, step_decay=DECAY, max_seq_len=g.seq, max_tokens_per_batch=g.seq,
                        batches_per_step=dist.world, compile=compiled, fsdp=fsdp)
    check_params(params, dist.world)
    model = distribute(parts.loss, fsdp, dist)
    optimizer = make_optimizer(parts.loss.drafter, params, dist.device)
    decay = torch.tensor([params.step_decay**k for k in range(params.ttt_steps)], device=dist.device)
    dtype = torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    # train_step reads params, dist, loss, model, optimizer and decay; inputs, plan and state belong to the
    # stage's data pipeline and checkpoints, which this benchmark replaces with one resident batch.
    unused: Any = None
    run = Run(params=params, paths=Paths(), dist=dist, inputs=unused, plan=unused, loss=parts.loss, model=model,
              optimizer=optimizer, state=unused, dtype=dtype,
              bf16_autocast=uses_bf16_autocast(params, dist.device), decay=decay, capture=None)
    return lambda: train_step(run, [parts.batch], params.lr), parts.loss


def allreduce_ms(numel: int, dist: Dist, repeats: int = 5) -> float | None:
    """Median time of one all-reduce of `numel` fp32 values (the drafter's gradients), after a warm-up."""
    if dist.world == 1:
        return None
    buffer = torch.ones(numel, device=dist.device)
    times = []
    for _ in range(repeats + 1):
        sync(dist.device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        sync(dist.device)
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times[1:]), 2)


def import_first(modules: list[str], name: str) -> Any:
    errors = []
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{module}: {e}")
    raise ImportError(f"{name} not found: {'; '.join(errors)}")


def specforge(g: Geometry, data: Data, device: torch.device, backend: str) -> Callable[[], None]:
    """SpecForge's OnlineEagle3Model over LlamaForCausalLMEagle3, fed as its offline trainer does:
    input ids and target shifted left by one (TargetHead.preprocess), loss mask [B, T, 1]."""
    # Its trainer module moved from specforge.core.eagle3 to specforge.algorithms.eagle3.model in 2026.
    model_cls = import_first(["specforge.algorithms.eagle3.model", "specforge.core.eagle3"], "OnlineEagle3Model")
    draft_cls = import_first(["specforge.modeling.draft.llama3_eagle"], "LlamaForCausalLMEagle3")
    config = g.llama_config(draft_vocab_size=g.draft_vocab, hidden_act="silu", pretraining_tp=1,
                            tie_word_embeddings=False)
    config.num_hidden_layers = 1
    draft = draft_cls(config, attention_backend=backend).to(device)
    with torch.no_grad():
        draft.t2d.copy_(data.t2d)
        draft.d2t.copy_(data.d2t)
        draft.embed_tokens.weight.copy_(data.embed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as ours: bf16 states under autocast
    draft.embed_tokens.to(dtype).requires_grad_(False)  # frozen, as its trainer has it
    model = model_cls(draft_model=draft, length=g.ttt_steps, attention_backend=backend).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    shifted_ids = torch.cat([data.ids[1:], data.ids.new_zeros(1)])[None]
    shifted_last = torch.cat([data.last[1:], data.last.new_zeros(1, g.hidden)])[None].to(dtype)
    lm_head = data.lm_head.to(dtype)
    hidden_states = data.aux[None].to(dtype)
    attention_mask = torch.ones(1, g.seq, dtype=torch.bool, device=device)
    loss_mask = torch.ones(1, g.seq, 1, device=device)

    def step() -> None:
        with autocast(device):
            with torch.no_grad():
                target = F.linear(shifted_last, lm_head)  # [1, T, V]: its TargetHead
            out = model(input_ids=shifted_ids, attention_mask=attention_mask, target=target, loss_mask=loss_mask,
                        hidden_states=hidden_states)
            loss = sum(DECAY**k * p for k, p in enumerate(out[0]))
        loss.backward()
        adamw_step(params, optimizer)

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step: Callable[[], None], g: Geometry, device: torch.device, warmup: int, seconds: float,
            peak_flops: float, agree: Callable[[bool], bool] = lambda more: more) -> dict[str, Any]:
    """`agree` turns this process's "time another step?" into the answer all processes share (DDP ranks
    that stopped at different steps would wait for each other's gradients forever)."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    start = time.perf_counter()
    while agree(len(times) < 3 or time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {
        "tokens_per_s": round(g.seq / median, 1),
        "step_ms": round(1e3 * median, 2),
        "timed_steps": len(times),
        "mfu": round(model_flops(g) / median / peak_flops, 4),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
    }


def profile_table(step: Callable[[], None], device: torch.device, steps: int = 3, rows: int = 30) -> str:
    """torch.profiler's kernel table over `steps` steps (after one untimed step), by device time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90)


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variant(name: str, build: Callable[[], Callable[[], None]], args: argparse.Namespace, g: Geometry,
                device: torch.device) -> dict[str, Any]:
    print(f"[train_bench] {name} ...", file=sys.stderr, flush=True)
    try:
        result = measure(build(), g, device, args.warmup, args.seconds, args.peak_tflops * 1e12)
    except Exception as e:  # a reference that fails must not cost us our own figures
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    release(device)
    print(f"[train_bench] {name}: {json.dumps({k: v for k, v in result.items() if k != 'traceback'})}",
          file=sys.stderr, flush=True)
    return result


def fastest(variants: dict[str, dict[str, Any]], prefix: str) -> str | None:
    """The fastest variant of one implementation that ran."""
    ran = [name for name, result in variants.items() if name.startswith(prefix) and "tokens_per_s" in result]
    return max(ran, key=lambda name: variants[name]["tokens_per_s"], default=None)


def main_ranks(args: argparse.Namespace) -> None:
    """Ours under DDP on every rank of a torchrun job; rank 0 writes the record."""
    dist = init_distributed()
    g = GEOMETRIES[args.geometry]
    data = own_sample(random_data(g, dist.device), g, dist.rank)
    compiled = dist.device.type == "cuda" and not args.no_compile
    step, loss = ours_ranks(g, data, dist, compiled, args.fsdp)
    before = HostSnapshot.take()
    result = measure(step, g, dist.device, args.warmup, args.seconds, args.peak_tflops * 1e12,
                     lambda more: all_agree(more, dist.device))
    after = HostSnapshot.take()
    result |= {"rank": dist.rank, "process_cores": process_cores(before, after)}
    gradients = sum(p.numel() for p in loss.drafter.parameters())
    reduce_ms = allreduce_ms(gradients, dist)
    per_rank = gather(result)
    del step, loss  # DDP's reducer goes before its process group (see eagle3.training.loop.train)
    gc.collect()
    if dist.main:
        record = {
            "benchmark": "train",
            "world_size": dist.world,
            "variant": "ours_compiled" if compiled else "ours_eager",
            "parallel": "fsdp" if args.fsdp else "ddp",
            # DDP keeps ranks in step: each rank's median step covers the whole global batch
            "aggregate_tokens_per_s": round(sum(r["tokens_per_s"] for r in per_rank), 1),
            "global_batch_tokens": dist.world * g.seq,
            "gradient_values": gradients,
            "gradient_allreduce_ms": reduce_ms,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": machine_info() | {"torch": torch.__version__, "device": str(dist.device)},
            "geometry": asdict(g),
            "seconds": args.seconds,
            **host_usage(before, after),
            "per_rank": per_rank,
        }
        write_record(record, args.out)
    finish()


def write_record(record: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(record, indent=2) + "\n"
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama-3.1-8b",
                   help="drafter geometry; tiny for a CPU smoke run")
    p.add_argument("--seconds", type=float, default=30.0, help="timed seconds per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile happens here)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak of the device for MFU (H200 measured)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd variant of ours")
    p.add_argument("--specforge", type=Path, help="a SpecForge checkout to compare against")
    p.add_argument("--profile", type=Path, help="also write torch.profiler's kernel table of ours (compiled "
                   "on a GPU) over 3 steps to this file")
    p.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP instead of DDP (train.fsdp)")
    p.add_argument("--out", type=Path, help="JSON result file")
    args = p.parse_args()
    if under_torchrun():
        return main_ranks(args)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = GEOMETRIES[args.geometry]
    data = random_data(g, device)
    use_compile = device.type == "cuda" and not args.no_compile
    variants = {"ours_eager": run_variant("ours eager", lambda: ours(g, data, device, False), args, g, device)}
    if use_compile:
        variants["ours_compiled"] = run_variant("ours compiled", lambda: ours(g, data, device, True), args, g, device)
    if args.specforge:
        sys.path.insert(0, str(args.specforge.resolve()))
        for backend in ("sdpa", "flex_attention"):
            variants[f"specforge_{backend}"] = run_variant(
                f"specforge {backend}", lambda b=backend: specforge(g, data, device, b), args, g, device
            )
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(profile_table(ours(g, data, device, use_compile), device) + "\n")
        release(device)
    mine = fastest(variants, "ours")
    reference = fastest(variants, "specforge")
    record = {
        "ours_tokens_per_s": variants[mine]["tokens_per_s"] if mine else None,
        "ours_variant": mine,
        "reference_tokens_per_s": variants[reference]["tokens_per_s"] if reference else None,
        "reference": reference,
        "mfu": variants[mine]["mfu"] if mine else None,
        "peak_memory_gb": variants[mine]["peak_memory_gb"] if mine else None,
        "reference_peak_memory_gb": variants[reference]["peak_memory_gb"] if reference else None,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": machine_info() | {"torch": torch.__version__, "device": str(device)},
        "geometry": asdict(g),
        "model_gflops_per_step": round(model_flops(g) / 1e9, 1),
        "setup": "fp32 master weights, AdamW, grad clip 0.5; bf16 autocast on CUDA, fp32 on CPU",
        "variants": variants,
    }
    write_record(record, args.out)


if __name__ == "__main__":
    main()
