"""Resumable training state: one directory per checkpoint under run/train/, complete or absent.

A checkpoint `step-00001200/` is written to a temporary sibling and renamed when complete and
fsync'd; only then are older ones deleted, so a crash at any moment leaves at least one whole
checkpoint. No pickle anywhere: the drafter's weights, the flattened AdamW state (both whole,
keyed by parameter name, gathered from the ranks under FSDP) and the RNG states (uint8 tensors)
go to `tensors.safetensors`; step, data position, the optimizer's hyper-parameters, the curves
and the run's fingerprint go to `state.json`. The learning rate is a pure function of the step,
so the step is the whole scheduler state.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from eagle3.atomic import atomic_dir, fsync_path

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
PREFIX = "step-"
# Whole tensors in CPU memory, whatever the sharding; every rank loads whole tensors and keeps its part.
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTER = StateDictOptions(full_state_dict=True)


@dataclass
class RunState:
    fingerprint: str  # params and inputs the checkpoint belongs to
    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position: the epoch of the next step ...
    step_in_epoch: int = 0  # ... and how many of that epoch's steps are done
    tokens: int = 0  # real tokens trained on, all ranks
    samples: int = 0
    curve: list[dict[str, float]] = field(default_factory=list)  # train rows, every log_every steps
    heldout_curve: list[dict[str, float]] = field(default_factory=list)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"{PREFIX}{step:08d}"


def remove_partial(run_dir: Path) -> None:
    """Temporary directories of a checkpoint write that was killed (atomic_dir's naming)."""
    for tmp in run_dir.glob(f".{PREFIX}*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (normally the only one), if any."""
    return max(run_dir.glob(f"{PREFIX}*"), default=None)


def saved_fingerprint(path: Path) -> str:
    return json.loads((path / STATE_FILE).read_text())["fingerprint"]


def save_checkpoint(run_dir: Path, state: RunState, model: nn.Module, optimizer: torch.optim.Optimizer,
                    write: bool = True) -> Path | None:
    """Writes the checkpoint of `state.step` atomically, then deletes all others. Every rank calls
    it (a collective under FSDP: rank 0 gets the gathered tensors, the others empty dicts); only
    the one with `write` writes."""
    weights = get_model_state_dict(model, options=GATHER)
    opt = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not write:
        return None
    tensors = {f"model.{name}": t for name, t in weights.items()}
    for name, entries in opt["state"].items():
        for key, value in entries.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"optimizer state {name}.{key} is a {type(value).__name__}, not a tensor")
            tensors[f"optim.{name}.{key}"] = value
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():  # this rank's device only: touching others would create contexts there
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    meta = {**dataclasses.asdict(state), "optimizer_groups": opt["param_groups"]}

    path = checkpoint_dir(run_dir, state.step)
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / TENSORS_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        for name in (TENSORS_FILE, STATE_FILE):
            fsync_path(tmp / name)
    fsync_path(run_dir)
    for old in run_dir.glob(f"{PREFIX}*"):
        if old != path:
            shutil.rmtree(old)
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> RunState:
    """Restores weights, optimizer and RNG states in place; returns the saved RunState. Every rank
    reads the whole checkpoint and keeps its part (all of it under DDP, its shards under FSDP), so
    a run may resume with another world size or from DDP to FSDP."""
    meta = json.loads((path / STATE_FILE).read_text())
    with safe_open(path / TENSORS_FILE, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    set_model_state_dict(model, weights, options=SCATTER)
    state: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            name, entry = key.removeprefix("optim.").rsplit(".", 1)
            state.setdefault(name, {})[entry] = value
    groups = [{**group, "betas": tuple(group["betas"])} for group in meta.pop("optimizer_groups")]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=SCATTER)

    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available() and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return RunState(**meta)
