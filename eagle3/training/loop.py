"""The training loop: one process, or torchrun's ranks under DDP or FSDP, with resumable checkpoints.

Several processes: each rank runs its share of a step's batches (eagle3/training/data.py), and the
loss is scaled by the world size, so the gradient average over ranks is the sum one process would
accumulate. DDP keeps all weights, gradients and AdamW state on every rank; FSDP (train.fsdp)
keeps 1/world of them (Kimi-K2.5 geometry: 1.14B trainable parameters, 18 GB of fp32 weights,
gradients and AdamW state). Checkpoints (eagle3/training/state.py) hold whole tensors either way,
so a run resumes with another world size, or switches between DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from eagle3.atomic import atomic_write_text
from eagle3.malloc import keep_freed_memory
from eagle3.metrics import write_metrics
from eagle3.model.checkpoint import WEIGHT_DTYPES, save_drafter, validate
from eagle3.model.drafter import Drafter
from eagle3.progress import Progress, format_duration
from eagle3.store.reader import HiddenStore
from eagle3.target.compute import cpu_computes, cpu_note
from eagle3.training.data import Batch, Plan, StoredBatch, make_plan
from eagle3.training.inputs import Inputs, load_inputs
from eagle3.training.objective import DraftLoss, step_row
from eagle3.training.online import (
    CaptureProcess,
    EngineCapture,
    connect_capture_server,
    fill_hybrid_store,
    start_capture,
    store_batches,
)
from eagle3.training.params import Paths, TrainError, TrainParams, check_params
from eagle3.training.state import (
    GATHER,
    RunState,
    load_checkpoint,
    newest_checkpoint,
    remove_partial,
    save_checkpoint,
    saved_fingerprint,
)


def lr_at(step: int, total: int, params: TrainParams) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < params.warmup_steps:
        return params.lr * (step + 1) / params.warmup_steps
    progress = min((step - params.warmup_steps) / max(total - 1 - params.warmup_steps, 1), 1.0)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return params.lr * (params.min_lr_ratio + (1 - params.min_lr_ratio) * cosine)


def make_optimizer(drafter: Drafter, params: TrainParams, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in drafter.parameters() if p.ndim >= 2]
    gains = [p for p in drafter.parameters() if p.ndim < 2]  # norms: decaying them shrinks the signal
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": params.weight_decay}, {"params": gains, "weight_decay": 0.0}],
        lr=params.lr,
        betas=(params.beta1, params.beta2),
        eps=params.adam_eps,
        fused=True,  # one kernel over all tensors, on CPUs too: 1.9 ms a step here against 11.5
    )


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: Tensor) -> Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def init_distributed(gpu_offset: int = 0) -> Dist:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), or one process; on a GPU box the
    ranks take the GPUs from `gpu_offset` on (the ones before capture the states)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", gpu_offset + local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world, device)


@dataclass
class Run:
    """Everything the loop touches."""

    params: TrainParams
    paths: Paths
    dist: Dist
    inputs: Inputs
    plan: Plan
    loss: DraftLoss
    model: nn.Module  # `loss`: DDP-wrapped, or itself sharded by FSDP, when there are several processes
    optimizer: torch.optim.AdamW
    state: RunState
    dtype: torch.dtype  # of the states fed in: bf16 on GPU, fp32 on CPU (where cpu_bf16 autocasts the matmuls)
    bf16_autocast: bool  # GPUs; CPUs with bf16 instructions when train.cpu_bf16 asks (eagle3/target/compute.py)
    decay: Tensor  # [K] step_decay**k
    capture: CaptureProcess | None  # train.source online / hybrid
    hybrid_store: HiddenStore | None = None  # hybrid, once the first epoch has filled it
    wait_s: float = 0.0  # the loop waiting for states, whatever their source
    # train.out_of_vocab_weight < 1: index row -> [tokens - 1] bool, is the target's argmax at
    # positions 1.. a draft token (Batch.next_* column order)
    in_vocab: dict[int, Tensor] = field(default_factory=dict)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16_autocast:
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def states(self, batches: list[list[int]], epoch: int) -> Generator[StoredBatch, None, None]:
        pin = self.dist.device.type == "cuda"
        if self.params.source == "store":
            return store_batches(self.inputs.store, batches, self.params, pin)
        if self.params.source == "hybrid" and epoch > 0:
            return store_batches(self.filled_hybrid_store(), batches, self.params, pin)
        return self.capture.run(batches, store_dir=self.paths.hybrid if self.params.source == "hybrid" else None)

    def batches(self, batches: list[list[int]], epoch: int, training: bool = True) -> Generator[Batch, None, None]:
        """The batches on the device; training ones weighed by train.out_of_vocab_weight (held-out
        figures stay on every position, as acceptance counts them)."""
        waited = time.monotonic()  # from here: a hybrid run's filling of its store is waiting too
        loader = self.states(batches, epoch)
        weigh = training and self.params.out_of_vocab_weight != 1
        with contextlib.closing(loader):  # closing this generator stops the loader's threads now
            for stored, rows in zip(loader, batches):  # the loader first: it runs to its end
                self.wait_s += time.monotonic() - waited
                batch = stored.to(self.dist.device, self.dtype)
                yield self.weigh_out_of_vocab(batch, rows) if weigh else batch
                waited = time.monotonic()

    def weigh_out_of_vocab(self, batch: Batch, rows: list[int]) -> Batch:
        """train.out_of_vocab_weight times the weight of the positions where the target's argmax
        over its whole vocabulary is no draft token. A sample's positions are found in its first
        batch (one [chunk, V] matmul per chunk of rows) and kept for the later epochs."""
        new = [i for i, row in enumerate(rows) if row not in self.in_vocab]
        if new:
            with self.autocast():
                found = self.loss.teacher.in_draft_vocab(batch.next_last[new], self.params.ce_chunk_size).cpu()
            for i, flags in zip(new, found):
                self.in_vocab[rows[i]] = flags[: int(self.plan.lengths[rows[i]]) - 1].clone()
        keep = torch.ones(batch.next_weight.shape, dtype=torch.bool)  # past a sample the weight is 0 already
        for i, row in enumerate(rows):
            keep[i, : len(self.in_vocab[row])] = self.in_vocab[row]
        keep = keep.to(batch.next_weight.device)
        batch.next_weight = torch.where(keep, batch.next_weight, batch.next_weight * self.params.out_of_vocab_weight)
        return batch

    def out_of_vocab_share(self) -> float | None:
        """Share of the positions weighed so far (this rank's) whose target argmax is no draft token."""
        if not self.in_vocab:
            return None
        total = sum(len(flags) for flags in self.in_vocab.values())
        return 1 - sum(int(flags.sum()) for flags in self.in_vocab.values()) / max(total, 1)

    def epoch_batches(self, epoch: int, start: int) -> Generator[Batch, None, None]:
        """This rank's batches of `epoch` from step `start` on: its share of every step."""
        d = self.dist
        return self.batches([b for step in self.plan.epochs[epoch][start:] for b in step[d.rank :: d.world]], epoch)

    def filled_hybrid_store(self) -> HiddenStore:
        """The store the first epoch filled: the samples it did not capture (held out, or lost with a
        shard a crash left uncommitted) are captured now, without training on them."""
        if self.hybrid_store is None:
            if self.capture.current:
                self.capture.wait_done(self.capture.current)  # the first epoch's last shard is committed
            self.dist.barrier()
            if self.dist.main:
                fill_hybrid_store(self.capture, self.paths.hybrid, self.inputs.store, self.inputs.record)
            self.dist.barrier()
            self.hybrid_store = HiddenStore(self.paths.hybrid)
            if self.hybrid_store.sample_ids != self.inputs.store.sample_ids:
                raise TrainError(f"{self.paths.hybrid} does not hold the samples of {self.inputs.store.root}")
        return self.hybrid_store


def setup(params: TrainParams, paths: Paths, dist: Dist, engine: EngineCapture | None = None) -> Run:
    check_params(params, dist.world)
    if dist.device.type == "cpu":
        keep_freed_memory()
    inputs = load_inputs(params, paths)
    plan = make_plan(params, inputs.store)
    drafter = inputs.drafter.to(dist.device)
    drafter.midlayer.dropout.p = params.dropout
    if params.compile:
        drafter.compile()
    dtype = torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    loss = DraftLoss(drafter, inputs.teacher.to(dist.device, dtype), params.ttt_steps, params.ce_chunk_size)
    model = distribute(loss, params.fsdp, dist)
    optimizer = make_optimizer(drafter, params, dist.device)  # after FSDP has replaced the parameters by shards
    paths.run.mkdir(parents=True, exist_ok=True)
    if dist.main:
        remove_partial(paths.run)
    dist.barrier()
    state = RunState(inputs.fingerprint)
    checkpoint = newest_checkpoint(paths.run)
    if checkpoint and saved_fingerprint(checkpoint) == inputs.fingerprint:
        state = load_checkpoint(checkpoint, loss, optimizer)
    elif checkpoint and dist.main:
        print(f"[train] starting afresh: {checkpoint} was made with other params or inputs", file=sys.stderr)
    if state.step == 0 and dist.main and paths.hybrid.exists():
        shutil.rmtree(paths.hybrid)  # states of another run's samples or target; a resume keeps them
    dist.barrier()
    decay = torch.tensor([params.step_decay**k for k in range(params.ttt_steps)], device=dist.device)
    bf16_autocast = uses_bf16_autocast(params, dist.device)
    if params.cpu_bf16 and not bf16_autocast and dist.main:
        print(f"[train] train.cpu_bf16: {cpu_note(torch.bfloat16)}", file=sys.stderr)
    capture = None
    if params.source != "store":
        aux_ids = list(drafter.config.aux_layer_ids)
        capture_server = None
        if params.capture_engine == "vllm":
            if engine is None:
                raise TrainError("train.capture_engine: vllm needs the serve section (the capture server's params)")
            capture_server = connect_capture_server(engine, inputs.record, aux_ids, paths.server, params.capture_gpus,
                                                    dist.main, dist.barrier)
        capture = start_capture(params, paths.hidden, paths.target, aux_ids, paths.run, dist.device.type, dist.rank,
                                int(os.environ.get("LOCAL_RANK", "0")), capture_server)
    return Run(params, paths, dist, inputs, plan, loss, model, optimizer, state, dtype, bf16_autocast, decay, capture)


def uses_bf16_autocast(params: TrainParams, device: torch.device) -> bool:
    """GPUs always; a CPU when train.cpu_bf16 asks and it has bf16 instructions (else 4x slower)."""
    return device.type == "cuda" or (params.cpu_bf16 and cpu_computes(torch.bfloat16))


def distribute(loss: DraftLoss, fsdp: bool, dist: Dist) -> nn.Module:
    """The module the training step calls: `loss` itself in one process; else DDP-wrapped, or
    sharded in place by FSDP. One FSDP unit: the drafter is a single decoder layer, gathered whole
    for the step; what sharding saves is the gradients and the AdamW state (12 of its 16 bytes per
    weight)."""
    if dist.world == 1:
        return loss
    if fsdp:
        return fully_shard(loss)
    return DistributedDataParallel(loss, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = sync


def train_step(run: Run, batches: list[Batch], lr: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One optimizer step over this rank's batches: (loss sums, hits, global weights, grad norm)."""
    k = run.params.ttt_steps
    weights = run.dist.all_reduce(sum(b.step_weights(k) for b in batches))
    # Per-step means over the global batch; times the world size because DDP and FSDP average over ranks.
    scale = run.decay * run.dist.world * torch.where(weights > 0, 1 / weights, 0.0)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    losses = torch.zeros(k, device=run.dist.device)
    hits = torch.zeros(k, device=run.dist.device)
    for i, batch in enumerate(batches):
        set_gradient_sync(run.model, i == len(batches) - 1)  # exchanged once, after the last batch
        with run.autocast():
            objective, batch_losses, batch_hits = run.model(batch, scale)
        objective.backward()
        losses += batch_losses
        hits += batch_hits
    grad_norm = nn.utils.clip_grad_norm_(run.loss.drafter.parameters(), run.params.grad_clip)
    if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards
        grad_norm = grad_norm.full_tensor()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return losses, hits, weights, grad_norm


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float] | None:
    """Per-step loss and top-1 on the held-out samples; None when there are none."""
    if not run.plan.heldout:
        return None
    k = run.params.ttt_steps
    sums = torch.zeros(3, k, device=run.dist.device)
    zero = torch.zeros(k, device=run.dist.device)
    run.loss.eval()  # no dropout
    epoch = run.plan.position(run.state.step)[0]
    for batch in run.batches(run.plan.heldout[run.dist.rank :: run.dist.world], epoch, training=False):
        with run.autocast():
            _, losses, hits = run.loss(batch, zero)
        sums += torch.stack([losses, hits, batch.step_weights(k)])
    run.loss.train()
    run.dist.all_reduce(sums)
    return {"step": run.state.step, **step_row(*sums, run.decay)}


def loop(run: Run) -> tuple[int, int, float]:
    """Trains from the state's position to the end; returns (tokens, samples, seconds, seconds waiting
    for states) of this call."""
    params, dist, plan, state = run.params, run.dist, run.plan, run.state
    k = params.ttt_steps
    window = torch.zeros(3, k, device=dist.device)  # local loss sums, local hits, global weights
    progress = Progress("train", plan.total_steps, unit="steps", done=state.step) if dist.main else None
    extra = ""
    tokens = samples = 0
    started, waited = time.monotonic(), run.wait_s
    batches: Generator[Batch, None, None] | None = None
    for step in range(state.step, plan.total_steps):
        epoch, in_epoch = plan.position(step)
        if batches is None or in_epoch == 0:
            if batches is not None:
                batches.close()  # stops its loader's threads now, not whenever it is collected
            batches = run.epoch_batches(epoch, in_epoch)
        step_batches = plan.epochs[epoch][in_epoch]
        lr = lr_at(step, plan.total_steps, params)
        local = [next(batches) for _ in range(len(step_batches) // dist.world)]
        losses, hits, weights, grad_norm = train_step(run, local, lr)
        window += torch.stack([losses, hits, weights])
        step_tokens, step_samples = plan.tokens(step_batches), sum(len(b) for b in step_batches)
        tokens, samples = tokens + step_tokens, samples + step_samples
        state.step = step + 1
        state.epoch, state.step_in_epoch = plan.position(state.step)
        state.tokens, state.samples = state.tokens + step_tokens, state.samples + step_samples
        last = state.step == plan.total_steps
        if state.step % params.log_every == 0 or last:
            dist.all_reduce(window[:2])
            row = {"step": state.step, "epoch": round(epoch + (in_epoch + 1) / len(plan.epochs[epoch]), 4),
                   "lr": lr, "grad_norm": float(grad_norm), "tokens": state.tokens, **step_row(*window, run.decay),
                   # seconds into this process's loop (0 again where a run resumed), and of them waiting for states
                   "loop_s": round(time.monotonic() - started, 3), "wait_s": round(run.wait_s - waited, 3)}
            if not math.isfinite(row["loss"]):
                raise TrainError(f"loss is {row['loss']} at step {state.step}")
            state.curve.append(row)
            window.zero_()
            elapsed = time.monotonic() - started
            top1 = "/".join(f"{row[f'top1_{i}']:.2f}" for i in range(k))
            extra = f"loss {row['loss']:.3f} top1 {top1} {tokens / max(elapsed, 1e-9):.0f} tok/s lr {lr:.2e}"
        if params.eval_every and state.step % params.eval_every == 0 and not last:
            heldout = evaluate(run)
            if heldout is not None:
                state.heldout_curve.append(heldout)
        if state.step % params.checkpoint_every == 0 or last:
            save_checkpoint(run.paths.run, state, run.loss, run.optimizer, write=dist.main)
            dist.barrier()
        if progress:
            progress.update(1, extra)
    if batches is not None:
        batches.close()
    return tokens, samples, time.monotonic() - started, run.wait_s - waited


def write_curve(path: Path, rows: list[dict[str, float]]) -> None:
    out = io.StringIO()
    columns = list(rows[0]) if rows else ["step"]
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows([{c: round(v, 6) if isinstance(v, float) else v for c, v in row.items()} for row in rows])
    atomic_write_text(path, out.getvalue())


def save_output(run: Run) -> torch.dtype:
    """The servable checkpoint, validated; raises TrainError naming every defect. Every rank
    calls it (FSDP gathers the weights); rank 0 writes."""
    record, inputs = run.inputs.record, run.inputs
    name = record.get("dtype", "float32") if run.params.save_dtype == "target" else run.params.save_dtype
    dtype = WEIGHT_DTYPES[name]
    weights = get_model_state_dict(run.loss.drafter, options=GATHER)
    if not run.dist.main:
        return dtype
    save_drafter(run.paths.out, run.loss.drafter, inputs.d2t, inputs.t2d, dtype, weights=weights)
    config = run.loss.drafter.config
    defects = validate(run.paths.out, record["num_layers"], config.target_hidden_size, config.vocab_size)
    if defects:
        raise TrainError(f"{run.paths.out} failed validation: " + "; ".join(defects))
    return dtype


def per_step(row: dict[str, float] | None, k: int) -> dict[str, list[float]] | None:
    if row is None:
        return None
    return {name: [round(row[f"{name}_{i}"], 4) for i in range(k)] for name in ("loss", "top1")}


def train(params: TrainParams, paths: Paths = Paths(), engine: EngineCapture | None = None) -> dict[str, Any] | None:
    """Trains (or resumes) and writes the outputs; rank 0 returns the metrics record, others None.
    `engine`: the capture server's params, for train.capture_engine: vllm."""
    dist = init_distributed(params.capture_gpus if params.source != "store" else 0)
    try:
        # DDP and everything else of the run is freed when train_on returns, before the process
        # group goes: a DDP reducer destroyed after its group could hang the process at exit.
        return train_on(dist, params, paths, engine)
    finally:
        if dist.world > 1:
            torch.distributed.destroy_process_group()


def train_on(dist: Dist, params: TrainParams, paths: Paths, engine: EngineCapture | None) -> dict[str, Any] | None:
    started = time.monotonic()
    run = setup(params, paths, dist, engine)
    try:
        return finish_run(run, started)
    finally:
        if run.capture:
            run.capture.stop()


def finish_run(run: Run, started: float) -> dict[str, Any] | None:
    dist, paths = run.dist, run.paths
    resumed_from = run.state.step
    tokens, samples, loop_s, wait_s = loop(run)
    heldout = run.state.heldout_curve[-1] if run.state.heldout_curve else None
    if heldout is None or heldout["step"] != run.state.step:
        heldout = evaluate(run)
        if heldout is not None:
            run.state.heldout_curve.append(heldout)
    record = None
    dtype = save_output(run)
    if dist.main:
        write_curve(paths.curve, run.state.curve)
        write_curve(paths.heldout_curve, run.state.heldout_curve)
        record = report(run, heldout, dtype, resumed_from, tokens, samples, loop_s, wait_s, time.monotonic() - started)
    dist.barrier()  # all ranks leave together
    return record


def report(run: Run, heldout: dict[str, float] | None, dtype: torch.dtype, resumed_from: int, tokens: int,
           samples: int, loop_s: float, wait_s: float, wall: float) -> dict[str, Any]:
    params, plan, state = run.params, run.plan, run.state
    k = params.ttt_steps
    drafter = run.loss.drafter
    final = {"train": per_step(state.curve[-1], k), "heldout": per_step(heldout, k)}
    states = {"source": params.source, "stall_share": round(wait_s / loop_s, 4) if loop_s > 0 else None,
              "trainer_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if run.capture:
        f = run.capture.figures
        steady = loop_s - f.startup_s
        states |= {"capture_engine": params.capture_engine, "capture_startup_s": round(f.startup_s, 2),
                   "stall_share_after_startup": round((wait_s - f.startup_s) / steady, 4) if steady > 0 else None,
                   "capture_tokens_per_s": round(f.captured_tokens / f.capture_s, 1) if f.capture_s else None,
                   "capture_restarts": f.restarts, "captured_batches": f.batches,
                   "prefetch_peak_mb": round(f.prefetch_peak_bytes / 1e6, 1),
                   "capture_peak_rss_mb": round(f.capture_peak_rss_mb, 1)}
    record = write_metrics(
        "train",
        wall,
        items=samples,
        tokens=tokens,
        steps=plan.total_steps,
        resumed_from_step=resumed_from,
        epochs=params.epochs,
        train_samples=plan.train_samples,
        heldout_samples=plan.heldout_samples,
        train_tokens_per_s=round(tokens / loop_s, 1) if loop_s > 0 else None,
        total_tokens=state.tokens,
        total_samples=state.samples,
        padding_fraction=round(plan.padding_fraction(), 4),
        out_of_vocab_weight=params.out_of_vocab_weight,
        # of the training positions this rank weighed: their target argmax is no draft token
        out_of_vocab_share=None if (share := run.out_of_vocab_share()) is None else round(share, 4),
        world_size=run.dist.world,
        device=str(run.dist.device.type),
        drafter_parameters=sum(p.numel() for p in drafter.parameters()),
        draft_vocab_size=drafter.config.draft_vocab_size,
        aux_layer_ids=list(drafter.config.aux_layer_ids),
        saved_dtype=str(dtype).removeprefix("torch."),
        compute="bf16 autocast" if run.bf16_autocast else "float32",
        states=states,
        final=final,
    )
    heldout_top1 = final["heldout"]["top1"] if final["heldout"] else "n/a"
    print(
        f"train: {plan.total_steps} steps ({params.epochs} epochs, {plan.train_samples} samples, "
        f"{plan.heldout_samples} held out), {tokens} tokens this run at {record['train_tokens_per_s']} tok/s, "
        f"states from {params.source} (waited {states['stall_share']:.1%} of the loop)"
        f"{f' (resumed at step {resumed_from})' if resumed_from else ''}; final top-1 per step train "
        f"{final['train']['top1']}, held-out {heldout_top1}; {format_duration(wall)} -> {run.paths.out}"
    )
    return record
