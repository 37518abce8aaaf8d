"""What a training run reads: the target's record and frozen tensors, the store, the vocabulary map,
and the drafter it starts from (new, or a served one to fine-tune); and the run's fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers import PretrainedConfig

from eagle3.model.checkpoint import load_drafter, vocab_map_defects
from eagle3.model.drafter import Drafter, DrafterConfig
from eagle3.store.layout import INDEX_NAME, LAST_STATES, MANIFEST_NAME
from eagle3.store.reader import HiddenStore
from eagle3.target.record import load_record
from eagle3.training.params import OPERATIONAL, Paths, TrainError, TrainParams
from eagle3.training.teacher import Teacher, load_teacher, target_config


@dataclass
class Inputs:
    record: dict[str, Any]
    store: HiddenStore
    drafter: Drafter
    d2t: Tensor
    t2d: Tensor
    teacher: Teacher
    fingerprint: str


def check_store(manifest: dict[str, Any], record: dict[str, Any], config: PretrainedConfig,
                source: str = "store") -> tuple[list[int], bool]:
    """(aux layer ids, whether `last` is pre-norm) of a store made from this target. Online and
    hybrid runs read only its token ids (a token store, or a full one whose states they ignore)."""
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
    if source == "store" and not manifest.get("states", True):
        raise TrainError("artifacts/hidden holds token ids only (extracted for train.source: online or hybrid); "
                         "with train.source: store rerun extract (dvc repro does, the param is its dependency)")
    needed = (("input_ids", []), ("loss_mask", []), ("aux", [len(aux_ids) * ht]), ("last", [ht]))
    for name, shape in needed if source == "store" else needed[:2]:
        got = arrays.get(name, {}).get("per_token_shape")
        if got != shape:
            raise TrainError(
                f"store array {name!r}: per-token shape {got}, expected {shape} "
                f"({len(aux_ids)} aux layers x target hidden size {ht})"
            )
    for name in ("aux", "last") if source == "store" else ():
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
        kind = "llama" if model.config.mla is None else "deepseek_mla"
        if kind != params.drafter:
            raise TrainError(f"train.drafter={params.drafter!r}, but init_from {params.init_from} is a {kind} drafter")
        for name in ("hidden_size", "intermediate_size"):
            wanted = getattr(params, name)
            if wanted is not None and wanted != getattr(model.config, name):
                raise TrainError(
                    f"train.{name}={wanted}, but init_from {params.init_from} has {name} "
                    f"{getattr(model.config, name)}"
                )
        # Evaluation and export read artifacts/vocab as the map the drafter was trained with: another one there
        # would be caught only at the end of evaluate, after the whole training run.
        vocab_d2t, vocab_t2d = vocab_map(vocab_dir)
        if not (torch.equal(vocab_d2t, loaded.d2t.to(vocab_d2t.dtype))
                and torch.equal(vocab_t2d, loaded.t2d.to(vocab_t2d.dtype))):
            raise TrainError(f"train.init_from={params.init_from} brings its own vocabulary map (its lm_head rows "
                             f"belong to it), but {vocab_dir} holds another: set vocab.from_drafter: "
                             f"{params.init_from} and rerun the vocab stage")
        return model, loaded.d2t, loaded.t2d
    d2t, t2d = vocab_map(vocab_dir)
    defects = vocab_map_defects(d2t, t2d, len(d2t), config.vocab_size)
    if defects:
        raise TrainError(f"{vocab_dir}: " + "; ".join(defects))
    drafter_config = DrafterConfig.from_target(
        config,
        draft_vocab_size=len(d2t),
        aux_layer_ids=aux_ids,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        drafter=params.drafter,
    )
    torch.manual_seed(params.seed)
    return Drafter(drafter_config), d2t, t2d


def vocab_map(vocab_dir: Path) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) as the vocab stage wrote them."""
    return (torch.from_numpy(np.load(vocab_dir / "d2t.npy", allow_pickle=False)),
            torch.from_numpy(np.load(vocab_dir / "t2d.npy", allow_pickle=False)))


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
    aux_ids, pre_norm = check_store(store.manifest, record, config, params.source)
    try:
        drafter, d2t, t2d = build_drafter(params, config, aux_ids, paths.vocab)
    except ValueError as err:  # CheckpointError, DrafterConfig's checks: all name what is wrong
        raise TrainError(str(err)) from err
    teacher = load_teacher(record, config, d2t, pre_norm, t2d if params.out_of_vocab_weight != 1 else None)
    if params.head_init == "target" and not params.init_from:
        init_head_from_target(drafter, teacher)
    return Inputs(record, store, drafter, d2t, t2d, teacher, fingerprint(params, record, store, drafter, d2t, t2d))
