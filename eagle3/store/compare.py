"""Two stores of the same samples, position by position: do they hold the same states?

Used to check that a store built through the serving engine equals one built through HF (and that
a resumed store equals an uninterrupted one). Per sample: token ids and loss mask identical; for
each aux layer separately and for `last`, the cosine of every position's state and its relative
error ||a - b|| / ||b||. A layer-id shift or a post-norm last state shows as cosines far below 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3.store.reader import HiddenStore, to_torch


@dataclass
class Agreement:
    samples: int = 0
    tokens: int = 0
    ids_differ: list[str] = field(default_factory=list)  # token ids or loss mask differ
    missing: list[str] = field(default_factory=list)  # in one store only
    min_cosine: dict[str, float] = field(default_factory=dict)  # "aux<id>" / "last" -> worst position
    max_rel_error: dict[str, float] = field(default_factory=dict)
    worst: dict[str, str] = field(default_factory=dict)  # "aux<id>" / "last" -> "sample@position"
    below: dict[str, int] = field(default_factory=dict)  # positions whose cosine is under `threshold`
    threshold: float = 0.999

    def ok(self, min_cosine: float) -> bool:
        return (not self.ids_differ and not self.missing and self.samples > 0
                and all(c >= min_cosine for c in self.min_cosine.values()))

    def line(self) -> str:
        parts = [f"{name}: cos >= {self.min_cosine[name]:.7f} (at {self.worst[name]}), "
                 f"rel err <= {self.max_rel_error[name]:.4f}, {self.below[name]} under {self.threshold}"
                 for name in self.min_cosine]
        return (f"{self.samples} samples, {self.tokens} positions, ids differ in {len(self.ids_differ)}, "
                f"missing {len(self.missing)}; " + "; ".join(parts))


def compare_stores(a: HiddenStore, b: HiddenStore, threshold: float = 0.999) -> Agreement:
    """`b` is the reference (relative errors are against it). Both must name the same aux ids.
    `threshold`: positions under this cosine are counted (the worst one alone can be an outlier)."""
    aux_ids = a.manifest["aux_layer_ids"]
    if aux_ids != b.manifest["aux_layer_ids"]:
        raise ValueError(f"the stores name different aux ids: {aux_ids} and {b.manifest['aux_layer_ids']}")
    out = Agreement(threshold=threshold)
    ids_a, ids_b = set(a.sample_ids), set(b.sample_ids)
    out.missing = sorted(ids_a ^ ids_b)
    for sample_id in sorted(ids_a & ids_b):
        x, y = to_torch(a.get(sample_id)), to_torch(b.get(sample_id))
        out.samples += 1
        if not (torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])):
            out.ids_differ.append(sample_id)
            continue
        out.tokens += len(x["input_ids"])
        n = len(aux_ids)
        pairs = {f"aux{i}": (chunk_x, chunk_y) for i, chunk_x, chunk_y in
                 zip(aux_ids, x["aux"].float().chunk(n, -1), y["aux"].float().chunk(n, -1))}
        pairs["last"] = (x["last"].float(), y["last"].float())
        for name, (p, q) in pairs.items():
            cos = torch.nn.functional.cosine_similarity(p, q, dim=-1)
            rel = (p - q).norm(dim=-1) / q.norm(dim=-1).clamp_min(1e-12)
            worst = int(cos.argmin())
            if cos[worst].item() < out.min_cosine.get(name, 2.0):
                out.min_cosine[name], out.worst[name] = cos[worst].item(), f"{sample_id}@{worst}"
            out.max_rel_error[name] = max(out.max_rel_error.get(name, 0.0), rel.max().item())
            out.below[name] = out.below.get(name, 0) + int((cos < threshold).sum())
    return out
