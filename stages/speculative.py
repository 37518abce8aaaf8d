"""Offline chain speculative decoding with the target through transformers.

Each round the drafter proposes k tokens from the target's aux states (the TTT unroll at the
last position is exactly what an engine's proposer computes), and the target verifies them in
one forward over [last token, drafts]. At temperature 0 a draft is accepted while it equals the
target's argmax, so the output equals plain greedy decoding. At temperature T > 0 draft d ~ q is
accepted with probability min(1, p(d)/q(d)) and a rejection resamples from max(0, p - q), which
leaves the output distributed exactly as the target's samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from stages.checkpoint import LoadedDrafter
from stages.drafter import TTTCache
from stages.extract import Capture


@dataclass
class DecodeStats:
    rounds: int = 0  # target verification forwards
    accepted_per_pos: list[int] = field(default_factory=list)  # how often draft position i was accepted
    generated: int = 0

    def acceptance_length(self) -> float:
        """Tokens produced per verification forward: 1 + accepted drafts per round."""
        return 1 + sum(self.accepted_per_pos) / self.rounds if self.rounds else 0.0

    def add(self, other: DecodeStats) -> None:
        self.rounds += other.rounds
        self.generated += other.generated
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos or [0] * len(other.accepted_per_pos),
                                                       other.accepted_per_pos)]


class SpecDecoder:
    def __init__(self, target, drafter: LoadedDrafter, aux_ids: list[int], k: int, temperature: float,
                 generator: torch.Generator | None = None):
        self.target, self.drafter, self.k, self.temperature = target, drafter, k, temperature
        self.capture = Capture(target, aux_ids)
        self.embedding = target.get_input_embeddings().weight
        self.draft_to_target = torch.arange(drafter.d2t.numel()) + drafter.d2t
        self.generator = generator

    def target_forward(self, ids: list[int], cache) -> tuple[Tensor, Tensor]:
        """(logits [n, V] in fp32, aux states [n, n_aux*Ht]) of the new positions."""
        out = self.target(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        aux = torch.cat([self.capture.outputs[n] for n in self.capture.names[:-1]], dim=-1)[0]
        self.capture.outputs.clear()
        return out.logits[0].float(), aux

    def probs(self, logits: Tensor) -> Tensor:
        if self.temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(logits / self.temperature, dim=-1)

    def sample(self, probs: Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def draft(self, aux: Tensor, next_tokens: list[int]) -> tuple[list[int], list[Tensor]]:
        """k drafted target ids and, per draft, q over the target vocabulary (zero outside the draft vocab)."""
        model = self.drafter.model
        positions = torch.arange(aux.shape[0])
        embeds = model.embed(torch.tensor([next_tokens]), self.embedding)
        hidden, cache = model.fuse(aux[None]), TTTCache()
        drafts, qs = [], []
        for step in range(self.k):
            hidden = model.step(embeds, hidden, positions + step, cache)
            q_draft = self.probs(model.logits(hidden[0, -1]).float())
            q = torch.zeros(self.embedding.shape[0]).index_copy_(0, self.draft_to_target, q_draft)
            token = int(self.draft_to_target[self.sample(q_draft)])
            drafts.append(token)
            qs.append(q)
            # Only the last position's later steps matter: earlier positions see step 0 alone.
            embeds = embeds.clone()
            embeds[0, -1] = model.embed(torch.tensor([token]), self.embedding)
        return drafts, qs

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], DecodeStats]:
        from transformers import DynamicCache

        stats = DecodeStats(accepted_per_pos=[0] * self.k)
        cache = DynamicCache()
        logits, aux = self.target_forward(prompt_ids, cache)
        sequence = list(prompt_ids)  # tokens whose target states are known
        token = self.sample(self.probs(logits[-1]))
        out = [token]
        while len(out) < max_new_tokens and out[-1] not in eos_ids:
            drafts, qs = self.draft(aux, sequence[1:] + [token])
            logits, new_aux = self.target_forward([token] + drafts, cache)
            accepted = 0
            for i, (d, q) in enumerate(zip(drafts, qs)):
                p = self.probs(logits[i])
                if self.temperature == 0:
                    ok = p[d] == 1
                else:
                    ok = torch.rand((), generator=self.generator) < torch.clamp(p[d] / q[d], max=1.0)
                if not ok:
                    residual = torch.clamp(p - q, min=0) if self.temperature else p
                    bonus = self.sample(residual / residual.sum())
                    break
                accepted += 1
                stats.accepted_per_pos[i] += 1
            else:
                bonus = self.sample(self.probs(logits[self.k]))
            stats.rounds += 1
            sequence += [token] + drafts[:accepted]
            aux = torch.cat([aux, new_aux[: accepted + 1]])
            cache.crop(len(sequence) - cache.get_seq_length())  # drop the rejected drafts' keys
            out += drafts[:accepted] + [bonus]
            token = bonus
        for i, t in enumerate(out):  # stop at the first end-of-turn token, as the engine does
            if t in eos_ids:
                out = out[: i + 1]
                break
        out = out[:max_new_tokens]
        stats.generated = len(out)
        return out, stats
