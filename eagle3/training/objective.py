"""The training objective: the drafter unrolled over K TTT steps against the target's distribution.

Per anchor t and TTT step k (alignment: eagle3/training/data.py): soft cross-entropy between the
drafter's distribution and the target's at position t+1+k (final norm applied when the store holds
pre-norm states, lm_head rows of the draft vocabulary, softmax over those), averaged per step over
the global batch with row weights 1 (predicted token generated) or prompt_loss_weight (any other
valid row), times out_of_vocab_weight where the target's argmax is no draft token (Run.weigh_out_of_vocab),
summed over steps with weights step_decay^k.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eagle3.model.drafter import Drafter
from eagle3.training.data import Batch
from eagle3.training.teacher import Teacher
from kernels.soft_ce import ttt_soft_cross_entropy


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


def step_row(loss: Tensor, hits: Tensor, weight: Tensor, decay: Tensor) -> dict[str, float]:
    """Per-step mean loss and top-1 agreement from weighted sums, plus the objective."""
    valid = weight > 0
    per_loss = torch.where(valid, loss / weight.clamp_min(1e-12), 0.0).tolist()
    per_top1 = torch.where(valid, hits / weight.clamp_min(1e-12), 0.0).tolist()
    row = {"loss": float((decay * torch.tensor(per_loss, device=decay.device)).sum())}
    row |= {f"loss_{k}": v for k, v in enumerate(per_loss)}
    row |= {f"top1_{k}": v for k, v in enumerate(per_top1)}
    return row
