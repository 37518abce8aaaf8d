"""Stage `train`: an EAGLE-3 drafter from the hidden-state store (design.md, "Drafter").

    python -m stages.train                         # one process: CPU, or one GPU
    torchrun --nproc_per_node 8 -m stages.train    # DDP (FSDP with train.fsdp), one GPU per process (gloo on CPU)

Reads artifacts/hidden (tokens, loss mask, the target's aux and last states), artifacts/vocab
(d2t/t2d; a drafter given as init_from brings its own and keeps it, because its lm_head rows
belong to it) and artifacts/target (the record; of the target's weights only embed_tokens, the
final norm and lm_head are read). Writes artifacts/drafter (servable; validated before the stage
succeeds), metrics/train.json, metrics/train_curve.csv and metrics/train_heldout_curve.csv.
run/train/ holds the resumable state (stages/train_state.py); a rerun resumes from it when the
params and inputs are the same.

Objective, per anchor t and TTT step k (alignment: stages/train_data.py): soft cross-entropy
between the drafter's distribution and the target's at position t+1+k (final norm applied when
the store holds pre-norm states, lm_head rows of the draft vocabulary, softmax over those),
averaged per step over the global batch with row weights 1 (predicted token generated) or
prompt_loss_weight (any other valid row), summed over steps with weights step_decay^k.

Several processes: each rank runs its share of a step's batches (stages/train_data.py), and the
loss is scaled by the world size, so the gradient average over ranks is the sum one process would
accumulate. DDP keeps all weights, gradients and AdamW state on every rank; FSDP (train.fsdp)
keeps 1/world of them (Kimi-K2.5 geometry: 1.14B trainable parameters, 18 GB of fp32 weights,
gradients and AdamW state). Checkpoints hold whole tensors either way, so a run resumes with
another world size, or switches between DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import PretrainedConfig

from kernels.soft_ce import ttt_soft_cross_entropy
from stages.atomic import atomic_write_text
from stages.checkpoint import WEIGHT_DTYPES, CheckpointError, load_drafter, save_drafter, validate, vocab_map_defects
from stages.drafter import Drafter, DrafterConfig
from stages.hidden_reader import HiddenStore
from stages.hidden_store import INDEX_NAME, LAST_STATES, MANIFEST_NAME
from stages.metrics import METRICS_DIR, write_metrics
from stages.params import load_section
from stages.progress import Progress, format_duration
from stages.server import require_accelerators_free
from stages.target import TargetError, load_record
from stages.train_data import Batch, batch_loader, epoch_steps, is_heldout, pack
from stages.train_state import (
    GATHER,
    RunState,
    load_checkpoint,
    newest_checkpoint,
    remove_partial,
    save_checkpoint,
    saved_fingerprint,
)
from stages.train_teacher import Teacher, TeacherError, load_teacher, target_config

# Params that change how a run is watched or saved, not the weights it produces: changing them
# does not stop a resume.
HEAD_INITS = ("target", "random")
OPERATIONAL = ("log_every", "checkpoint_every", "eval_every", "num_workers", "compile", "save_dtype", "fsdp")


class TrainError(ValueError):
    pass


@dataclass
class TrainParams:
    init_from: str | None = None  # servable drafter directory to fine-tune (its d2t/t2d are kept)
    hidden_size: int | None = None  # drafter width; None: the target's (then it shares its embeddings)
    intermediate_size: int | None = None  # None: the target's
    # "target": a new drafter's lm_head and final norm start as the target's (its lm_head rows of the
    # draft vocabulary), so the drafter only has to learn which state to hand them; "random": nn.Linear init.
    head_init: str = "target"
    ttt_steps: int = 7
    step_decay: float = 0.8  # TTT step k weighs step_decay**k
    prompt_loss_weight: float = 0.0  # weight of rows whose predicted token is not generated
    epochs: int = 10
    max_seq_len: int = 2048  # longer samples are cut
    max_tokens_per_batch: int = 8192  # padded tokens of one forward (rows x longest)
    batches_per_step: int = 1  # batches per optimizer step over all ranks; a multiple of the world size
    length_group: int = 64  # shuffled samples sorted by length together before batching
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0  # on matrices only
    dropout: float = 0.0  # on the drafter layer's attention and MLP outputs while training
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 0.5  # max global grad norm
    eval_fraction: float = 0.05  # held-out share of samples, picked by a hash of the sample id
    eval_every: int = 0  # steps between held-out evaluations; 0: only at the end
    log_every: int = 10
    checkpoint_every: int = 200
    seed: int = 0
    num_workers: int = 2  # store-reading threads per rank
    compile: bool = False  # torch.compile the drafter
    cpu_bf16: bool = False  # bf16 autocast on CPU too (GPUs always use it): 1.3x with AVX512-BF16, slower without
    fsdp: bool = False  # several processes: shard weights, gradients and AdamW state instead of replicating them
    ce_chunk_size: int = 1024
    save_dtype: str = "float32"  # float32 | bfloat16 | float16 | target (the target's dtype)


@dataclass(frozen=True)
class Paths:
    hidden: Path = Path("artifacts/hidden")
    vocab: Path = Path("artifacts/vocab")
    target: Path = Path("artifacts/target")
    out: Path = Path("artifacts/drafter")
    run: Path = Path("run/train")
    curve: Path = METRICS_DIR / "train_curve.csv"
    heldout_curve: Path = METRICS_DIR / "train_heldout_curve.csv"


def check_params(params: TrainParams, world: int) -> None:
    problems = []
    if params.ttt_steps < 1:
        problems.append(f"ttt_steps={params.ttt_steps} must be >= 1")
    if params.max_seq_len < 2:
        problems.append(f"max_seq_len={params.max_seq_len} must be >= 2 (one anchor needs two tokens)")
    if params.max_seq_len > params.max_tokens_per_batch:
        problems.append(
            f"max_seq_len={params.max_seq_len} exceeds max_tokens_per_batch={params.max_tokens_per_batch}: "
            "a long sample would fit no batch"
        )
    if params.batches_per_step < 1 or params.batches_per_step % world:
        problems.append(
            f"batches_per_step={params.batches_per_step} is not a positive multiple of the world size {world} "
            "(every rank takes an equal share of a step's batches)"
        )
    if not 0 <= params.eval_fraction < 1:
        problems.append(f"eval_fraction={params.eval_fraction} must be in [0, 1)")
    if not 0 <= params.dropout < 1:
        problems.append(f"dropout={params.dropout} must be in [0, 1)")
    if params.step_decay <= 0 or params.prompt_loss_weight < 0:
        problems.append("step_decay must be > 0 and prompt_loss_weight >= 0")
    for name in ("epochs", "log_every", "checkpoint_every", "length_group", "ce_chunk_size"):
        if getattr(params, name) < 1:
            problems.append(f"{name}={getattr(params, name)} must be >= 1")
    if params.head_init not in HEAD_INITS:
        problems.append(f"head_init={params.head_init!r} is not one of {list(HEAD_INITS)}")
    if params.save_dtype not in (*WEIGHT_DTYPES, "target"):
        problems.append(f"save_dtype={params.save_dtype!r} is not one of {[*WEIGHT_DTYPES, 'target']}")
    if problems:
        raise TrainError("; ".join(f"train.{p}" for p in problems))


# ------------------------------------------------------------------------------------------ inputs


@dataclass
class Inputs:
    record: dict[str, Any]
    store: HiddenStore
    drafter: Drafter
    d2t: Tensor
    t2d: Tensor
    teacher: Teacher
    fingerprint: str


def check_store(manifest: dict[str, Any], record: dict[str, Any], config: PretrainedConfig) -> tuple[list[int], bool]:
    """(aux layer ids, whether `last` is pre-norm) of a store made from this target."""
    if manifest.get("model_hash") != record["weights_hash"]:
        raise TrainError(
            f"the hidden-state store was extracted from {manifest.get('model_hash')}, the target is "
            f"{record['weights_hash']}; rerun extract"
        )
    if manifest.get("last_state") not in LAST_STATES:
        raise TrainError(f"store manifest: last_state {manifest.get('last_state')!r} is not one of {LAST_STATES}")
    aux_ids = list(manifest["aux_layer_ids"])
    ht = config.hidden_size
    arrays = manifest["arrays"]
    for name, shape in (("input_ids", []), ("loss_mask", []), ("aux", [len(aux_ids) * ht]), ("last", [ht])):
        got = arrays.get(name, {}).get("per_token_shape")
        if got != shape:
            raise TrainError(
                f"store array {name!r}: per-token shape {got}, expected {shape} "
                f"({len(aux_ids)} aux layers x target hidden size {ht})"
            )
    for name in ("aux", "last"):
        if arrays[name].get("dtype") != "bfloat16":
            raise TrainError(f"store array {name!r} is {arrays[name].get('dtype')}; the trainer reads bfloat16 "
                             "states (what extract writes)")
    return aux_ids, manifest["last_state"] == "pre_norm"


def build_drafter(
    params: TrainParams, config: PretrainedConfig, aux_ids: list[int], vocab_dir: Path
) -> tuple[Drafter, Tensor, Tensor]:
    """(drafter, d2t, t2d): fine-tuned from init_from with its own vocab map, or new."""
    if params.init_from:
        loaded = load_drafter(
            params.init_from,
            target_hidden_size=config.hidden_size,
            target_vocab_size=config.vocab_size,
            aux_layer_ids=aux_ids,
        )
        model = loaded.model
        for name in ("hidden_size", "intermediate_size"):
            wanted = getattr(params, name)
            if wanted is not None and wanted != getattr(model.config, name):
                raise TrainError(
                    f"train.{name}={wanted}, but init_from {params.init_from} has {name} "
                    f"{getattr(model.config, name)}"
                )
        return model, loaded.d2t, loaded.t2d
    d2t = torch.from_numpy(np.load(vocab_dir / "d2t.npy", allow_pickle=False))
    t2d = torch.from_numpy(np.load(vocab_dir / "t2d.npy", allow_pickle=False))
    defects = vocab_map_defects(d2t, t2d, len(d2t), config.vocab_size)
    if defects:
        raise TrainError(f"{vocab_dir}: " + "; ".join(defects))
    drafter_config = DrafterConfig.from_target(
        config,
        draft_vocab_size=len(d2t),
        aux_layer_ids=aux_ids,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
    )
    torch.manual_seed(params.seed)
    return Drafter(drafter_config), d2t, t2d


def init_head_from_target(drafter: Drafter, teacher: Teacher) -> None:
    if drafter.config.hidden_size != drafter.config.target_hidden_size:
        raise TrainError(f"train.head_init=target needs the target's width {drafter.config.target_hidden_size}, "
                         f"the drafter has hidden_size {drafter.config.hidden_size}; use head_init: random")
    with torch.no_grad():
        drafter.lm_head.weight.copy_(teacher.head)
        if teacher.norm is not None:
            drafter.norm.weight.copy_(teacher.norm.weight)


def fingerprint(params: TrainParams, record: dict[str, Any], store: HiddenStore, drafter: Drafter, d2t: Tensor,
                t2d: Tensor) -> str:
    """What the trained weights depend on: params, target, store (its index checksums every
    sample), initial weights (seed or init_from) and vocab map."""
    digest = hashlib.sha256()
    knobs = {k: v for k, v in dataclasses.asdict(params).items() if k not in OPERATIONAL}
    digest.update(json.dumps([knobs, record["weights_hash"], store.manifest], sort_keys=True).encode())
    digest.update((store.root / INDEX_NAME).read_bytes())
    for name, tensor in sorted(drafter.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    digest.update(d2t.numpy().tobytes() + t2d.numpy().tobytes())
    return digest.hexdigest()


def load_inputs(params: TrainParams, paths: Paths) -> Inputs:
    record = load_record(paths.target)
    config = target_config(paths.target)
    if not (paths.hidden / MANIFEST_NAME).is_file():
        raise TrainError(f"{paths.hidden}: no hidden-state store; run the extract stage first")
    store = HiddenStore(paths.hidden)
    aux_ids, pre_norm = check_store(store.manifest, record, config)
    try:
        drafter, d2t, t2d = build_drafter(params, config, aux_ids, paths.vocab)
    except ValueError as err:  # CheckpointError, DrafterConfig's checks: all name what is wrong
        raise TrainError(str(err)) from err
    teacher = load_teacher(record, config, d2t, pre_norm)
    if params.head_init == "target" and not params.init_from:
        init_head_from_target(drafter, teacher)
    return Inputs(record, store, drafter, d2t, t2d, teacher, fingerprint(params, record, store, drafter, d2t, t2d))


# -------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    epochs: list[list[list[list[int]]]]  # epoch -> step -> batch -> index rows
    heldout: list[list[int]]  # held-out batches
    lengths: np.ndarray  # tokens of each index row after the cut to max_seq_len
    train_samples: int
    heldout_samples: int

    @property
    def total_steps(self) -> int:
        return sum(len(steps) for steps in self.epochs)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of global step `step`; (epochs, 0) once all are done."""
        for epoch, steps in enumerate(self.epochs):
            if step < len(steps):
                return epoch, step
            step -= len(steps)
        return len(self.epochs), 0

    def tokens(self, batches: Sequence[Sequence[int]]) -> int:
        return int(sum(self.lengths[row] for batch in batches for row in batch))

    def padding_fraction(self) -> float:
        """Share of the training batches' padded tokens (rows x longest) that are padding."""
        batches = [batch for steps in self.epochs for step in steps for batch in step]
        padded = sum(len(batch) * int(self.lengths[batch].max()) for batch in batches)
        return 1 - self.tokens(batches) / padded


def make_plan(params: TrainParams, store: HiddenStore) -> Plan:
    lengths = np.minimum(store.num_tokens, params.max_seq_len)
    heldout = np.array([is_heldout(s, params.eval_fraction) for s in store.sample_ids], dtype=bool)
    # One anchor needs two tokens; a sample without generated tokens teaches nothing at prompt weight 0.
    useful = (lengths >= 2) & ((store.num_loss_tokens > 0) | (params.prompt_loss_weight > 0))
    if idle := int(((lengths >= 2) & ~useful).sum()):
        print(f"train: {idle} samples without generated tokens (conversations with dataset answers) are skipped: "
              "train.prompt_loss_weight=0 weighs their every position 0", file=sys.stderr)
    train_rows = np.flatnonzero(useful & ~heldout)
    heldout_rows = sorted(np.flatnonzero(useful & heldout), key=lambda r: -lengths[r])
    epochs = [
        epoch_steps(
            train_rows,
            lengths,
            seed=params.seed,
            epoch=epoch,
            max_tokens=params.max_tokens_per_batch,
            length_group=params.length_group,
            batches_per_step=params.batches_per_step,
        )
        for epoch in range(params.epochs)
    ]
    if not all(epochs):
        raise TrainError(
            f"{len(train_rows)} training samples fill fewer than batches_per_step={params.batches_per_step} "
            "batches: not one optimizer step"
        )
    return Plan(epochs, pack(heldout_rows, lengths, params.max_tokens_per_batch), lengths, len(train_rows),
                len(heldout_rows))


# -------------------------------------------------------------------------------------- objective


class DraftLoss(nn.Module):
    """The drafter and the frozen teacher; forward(batch) gives the losses of all TTT steps.

    One module, so that DDP and FSDP see every use of the drafter's parameters (lm_head's weight
    goes to the loss kernel directly) inside its forward.
    """

    def __init__(self, drafter: Drafter, teacher: Teacher, ttt_steps: int, chunk_size: int) -> None:
        super().__init__()
        self.drafter = drafter
        self.teacher = teacher  # a plain attribute: frozen, and no buffers for DDP to broadcast
        self.ttt_steps = ttt_steps
        self.chunk_size = chunk_size

    def forward(self, batch: Batch, step_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(sum_k step_scale[k] * loss_k, loss_k [K], hits_k [K]): loss_k and hits_k are sums over
        rows weighted by their loss weight; a hit is a draft argmax equal to the target's."""
        embeds = [self.drafter.embed(batch.step(k)[0], self.teacher.embed) for k in range(self.ttt_steps)]
        positions = torch.arange(batch.anchors, device=batch.aux.device)  # step k adds k itself
        hidden = self.drafter(batch.aux, embeds, positions)
        with torch.no_grad():
            target = self.teacher.states(batch.next_last)
        return ttt_soft_cross_entropy(hidden, self.drafter.lm_head.weight, target, self.teacher.head,
                                      batch.next_weight, step_scale, self.chunk_size)


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
        fused=device.type == "cuda",
    )


def step_row(loss: Tensor, hits: Tensor, weight: Tensor, decay: Tensor) -> dict[str, float]:
    """Per-step mean loss and top-1 agreement from weighted sums, plus the objective."""
    valid = weight > 0
    per_loss = torch.where(valid, loss / weight.clamp_min(1e-12), 0.0).tolist()
    per_top1 = torch.where(valid, hits / weight.clamp_min(1e-12), 0.0).tolist()
    row = {"loss": float((decay * torch.tensor(per_loss, device=decay.device)).sum())}
    row |= {f"loss_{k}": v for k, v in enumerate(per_loss)}
    row |= {f"top1_{k}": v for k, v in enumerate(per_top1)}
    return row


# -------------------------------------------------------------------------------------- the loop


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


def init_distributed() -> Dist:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), or one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
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
    decay: Tensor  # [K] step_decay**k

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dist.device.type == "cuda" or self.params.cpu_bf16:
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def batches(self, batches: list[list[int]]) -> Generator[Batch, None, None]:
        loader = batch_loader(
            self.inputs.store,
            batches,
            ttt_steps=self.params.ttt_steps,
            max_seq_len=self.params.max_seq_len,
            prompt_loss_weight=self.params.prompt_loss_weight,
            num_workers=self.params.num_workers,
            pin_memory=self.dist.device.type == "cuda",
        )
        with contextlib.closing(loader):  # closing this generator stops the loader's threads now
            for batch in loader:
                yield batch.to(self.dist.device, self.dtype)

    def epoch_batches(self, epoch: int, start: int) -> Generator[Batch, None, None]:
        """This rank's batches of `epoch` from step `start` on: its share of every step."""
        d = self.dist
        return self.batches([b for step in self.plan.epochs[epoch][start:] for b in step[d.rank :: d.world]])


def setup(params: TrainParams, paths: Paths, dist: Dist) -> Run:
    check_params(params, dist.world)
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
    decay = torch.tensor([params.step_decay**k for k in range(params.ttt_steps)], device=dist.device)
    return Run(params, paths, dist, inputs, plan, loss, model, optimizer, state, dtype, decay)


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
    for batch in run.batches(run.plan.heldout[run.dist.rank :: run.dist.world]):
        with run.autocast():
            _, losses, hits = run.loss(batch, zero)
        sums += torch.stack([losses, hits, batch.step_weights(k)])
    run.loss.train()
    run.dist.all_reduce(sums)
    return {"step": run.state.step, **step_row(*sums, run.decay)}


def loop(run: Run) -> tuple[int, int, float]:
    """Trains from the state's position to the end; returns (tokens, samples, seconds) of this call."""
    params, dist, plan, state = run.params, run.dist, run.plan, run.state
    k = params.ttt_steps
    window = torch.zeros(3, k, device=dist.device)  # local loss sums, local hits, global weights
    progress = Progress("train", plan.total_steps, unit="steps", done=state.step) if dist.main else None
    extra = ""
    tokens = samples = 0
    started = time.monotonic()
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
                   "lr": lr, "grad_norm": float(grad_norm), "tokens": state.tokens, **step_row(*window, run.decay)}
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
    return tokens, samples, time.monotonic() - started


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


def train(params: TrainParams, paths: Paths = Paths()) -> dict[str, Any] | None:
    """Trains (or resumes) and writes the outputs; rank 0 returns the metrics record, others None."""
    dist = init_distributed()
    try:
        # DDP and everything else of the run is freed when train_on returns, before the process
        # group goes: a DDP reducer destroyed after its group could hang the process at exit.
        return train_on(dist, params, paths)
    finally:
        if dist.world > 1:
            torch.distributed.destroy_process_group()


def train_on(dist: Dist, params: TrainParams, paths: Paths) -> dict[str, Any] | None:
    started = time.monotonic()
    run = setup(params, paths, dist)
    resumed_from = run.state.step
    tokens, samples, loop_s = loop(run)
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
        record = report(run, heldout, dtype, resumed_from, tokens, samples, loop_s, time.monotonic() - started)
    dist.barrier()  # all ranks leave together
    return record


def report(run: Run, heldout: dict[str, float] | None, dtype: torch.dtype, resumed_from: int, tokens: int,
           samples: int, loop_s: float, wall: float) -> dict[str, Any]:
    params, plan, state = run.params, run.plan, run.state
    k = params.ttt_steps
    drafter = run.loss.drafter
    final = {"train": per_step(state.curve[-1], k), "heldout": per_step(heldout, k)}
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
        world_size=run.dist.world,
        device=str(run.dist.device.type),
        drafter_parameters=sum(p.numel() for p in drafter.parameters()),
        draft_vocab_size=drafter.config.draft_vocab_size,
        aux_layer_ids=list(drafter.config.aux_layer_ids),
        saved_dtype=str(dtype).removeprefix("torch."),
        final=final,
    )
    heldout_top1 = final["heldout"]["top1"] if final["heldout"] else "n/a"
    print(
        f"train: {plan.total_steps} steps ({params.epochs} epochs, {plan.train_samples} samples, "
        f"{plan.heldout_samples} held out), {tokens} tokens this run at {record['train_tokens_per_s']} tok/s"
        f"{f' (resumed at step {resumed_from})' if resumed_from else ''}; final top-1 per step train "
        f"{final['train']['top1']}, held-out {heldout_top1}; {format_duration(wall)} -> {run.paths.out}"
    )
    return record


def main() -> None:
    require_accelerators_free("train")
    params = load_section("train", TrainParams)
    try:
        train(params)
    except (TrainError, CheckpointError, TargetError, TeacherError) as err:
        sys.exit(f"train: {err}")


if __name__ == "__main__":
    main()
