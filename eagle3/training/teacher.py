"""The frozen parts of the target the drafter learns from: embeddings, final norm, lm_head rows.

Only these three tensors are read from the target's safetensors (a local folder, or the files of
the hub commit the target stage pinned that hold them), sharded or not, tied or not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig

from eagle3.model.drafter import RMSNorm
from eagle3.target.record import text_config

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Parts of multimodal checkpoints that also have embeddings and norms; `.layers.` excludes
# DeepSeek-style MTP layers, which carry their own embed_tokens.
NOT_TEXT_MODEL = ("vision", "visual", "mm_projector", ".layers.")
# Language models whose text config names a type transformers registers under another name, as its own
# multimodal wrappers map them (Kimi-K2.5's text_config says kimi_k2: a DeepSeek-V3).
TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


class TeacherError(ValueError):
    pass


@dataclass
class Teacher:
    """The frozen parts of the target the objective needs."""

    embed: Tensor  # [V, Ht] input embeddings
    head: Tensor  # [Vd, Ht] the target's lm_head rows of the draft vocabulary, in draft id order
    norm: RMSNorm | None  # the final norm; None when the stored last states are already normed
    full_head: Tensor | None = None  # [V, Ht] the whole lm_head, where in_draft_vocab is asked
    drafted: Tensor | None = None  # [V] bool: which target ids are draft tokens

    def to(self, device: torch.device, dtype: torch.dtype) -> Teacher:
        norm = None if self.norm is None else self.norm.to(device, dtype)
        embed = self.embed.to(device, dtype)
        full_head = self.full_head
        if full_head is not None:  # a tied head is the embedding: one copy on the device
            full_head = embed if full_head is self.embed else full_head.to(device, dtype)
        drafted = None if self.drafted is None else self.drafted.to(device)
        return Teacher(embed, self.head.to(device, dtype), norm, full_head, drafted)

    def states(self, last: Tensor) -> Tensor:
        """The states the target's lm_head reads, from stored last states."""
        return last if self.norm is None else self.norm(last)

    @torch.no_grad()
    def in_draft_vocab(self, last: Tensor, chunk_size: int) -> Tensor:
        """[...] bool for last states [..., Ht]: is the target's argmax over its whole vocabulary
        a draft token? Logits are made chunk_size rows at a time ([chunk, V] at most)."""
        if self.full_head is None or self.drafted is None:
            raise TeacherError("in_draft_vocab needs the whole lm_head: load_teacher(..., t2d=...)")
        states = self.states(last).flatten(0, -2)
        top = torch.cat([(part @ self.full_head.T).argmax(-1) for part in states.split(chunk_size)])
        return self.drafted[top].view(last.shape[:-1])


def target_config(target_dir: Path) -> PretrainedConfig:
    """The language model's config from the target stage's config.json (text part of multimodal ones)."""
    raw = json.loads((target_dir / "config.json").read_text())
    fields = dict(text_config(raw))
    fields.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    model_type = fields.pop("model_type", None)
    model_type = TEXT_MODEL_TYPES.get(model_type, model_type)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError:  # a type transformers does not know (remote code): its plain fields still serve
        return PretrainedConfig(**fields)


def weight_file(record: dict[str, Any], filename: str) -> Path:
    """A file of the target's weights: in its local folder, or fetched from the hub commit the
    target stage pinned (only the files holding the tensors asked for are downloaded)."""
    folder = Path(record["model_path"])
    if folder.is_dir():
        return folder / filename
    from huggingface_hub import hf_hub_download

    commit = record["weights_hash"].rsplit("@", 1)[-1]
    return Path(hf_hub_download(record["model_path"], filename, revision=commit))


def tensor_files(record: dict[str, Any]) -> dict[str, str]:
    """Tensor name -> safetensors file name, for every tensor of the target."""
    folder = Path(record["model_path"])
    if folder.is_dir():
        if (folder / SAFETENSORS_INDEX).is_file():
            return _weight_map(record)
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    else:
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return _weight_map(record)
        except EntryNotFoundError:
            files = ["model.safetensors"]
    names: dict[str, str] = {}
    for name in files:
        with safe_open(weight_file(record, name), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), name))
    return names


def _weight_map(record: dict[str, Any]) -> dict[str, str]:
    return json.loads(weight_file(record, SAFETENSORS_INDEX).read_text())["weight_map"]


def teacher_tensor_names(names: Sequence[str]) -> tuple[str, str, str | None]:
    """(embed_tokens, final norm, lm_head or None when tied) of the language model."""
    text = [n for n in names if not any(part in f".{n}" for part in NOT_TEXT_MODEL)]
    embeds = [n for n in text if n.endswith("embed_tokens.weight")]
    if len(embeds) != 1:
        raise TeacherError(f"target weights: expected one embed_tokens.weight, found {embeds or 'none'}")
    norm = embeds[0].removesuffix("embed_tokens.weight") + "norm.weight"  # the final norm beside it
    if norm not in text:
        raise TeacherError(f"target weights: no final norm {norm!r} beside {embeds[0]!r}")
    heads = [n for n in text if n.endswith("lm_head.weight")]
    if len(heads) > 1:
        raise TeacherError(f"target weights: several lm_head weights {heads}")
    return embeds[0], norm, heads[0] if heads else None


def load_teacher(record: dict[str, Any], config: PretrainedConfig, d2t: Tensor, pre_norm: bool,
                 t2d: Tensor | None = None) -> Teacher:
    """t2d (the vocab map's [V] bool, which target ids are draft tokens): keep the whole lm_head too,
    for Teacher.in_draft_vocab, not only the draft rows."""
    files = tensor_files(record)
    embed_name, norm_name, head_name = teacher_tensor_names(list(files))
    if head_name is None and not config.tie_word_embeddings:
        raise TeacherError("target weights have no lm_head.weight and tie_word_embeddings is false")
    wanted = {embed_name, norm_name, head_name or embed_name}
    tensors: dict[str, Tensor] = {}
    for filename in sorted({files[n] for n in wanted}):
        with safe_open(weight_file(record, filename), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in wanted if files[n] == filename})
    embed, head = tensors[embed_name], tensors[head_name or embed_name]
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in ((embed_name, embed), (head_name or embed_name, head)):
        if tuple(tensor.shape) != expected:
            raise TeacherError(f"target {name} has shape {tuple(tensor.shape)}, config says {expected}")
    norm = None
    if pre_norm:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps).requires_grad_(False)
        norm.weight.copy_(tensors[norm_name])
    rows = head[torch.arange(len(d2t)) + d2t]
    return Teacher(embed, rows, norm) if t2d is None else Teacher(embed, rows, norm, head, t2d.bool())
