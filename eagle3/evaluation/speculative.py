"""Offline chain speculative decoding with the target through transformers.

Each round the drafter proposes k tokens from the target's aux states (the TTT unroll at the
last position is exactly what an engine's proposer computes), and the target verifies them in
one forward over [last token, drafts]. Drafts are the drafter's argmax at every temperature, as
vLLM's EAGLE-3 proposer drafts (greedily, with no draft probabilities): q is one-hot. At temperature 0
a draft is accepted while it equals the target's argmax, so the output equals plain greedy decoding.
At T > 0 draft d is accepted with probability min(1, p(d)/q(d)) = p(d) and a rejection resamples
from max(0, p - q), p without d: the output is distributed exactly as the target's samples, and the
acceptance is the one the engine should measure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eagle3.model.checkpoint import LoadedDrafter
from eagle3.model.drafter import TTTCache
from eagle3.target.capture import Capture


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
        self.device = self.embedding.device  # where the target reads its input ids (its first GPU, or the CPU)
        drafter.model.to(self.device, self.embedding.dtype)  # the engine runs the drafter in the target's dtype too
        self.draft_to_target = (torch.arange(drafter.d2t.numel()) + drafter.d2t).to(self.device)
        self.generator = generator  # on self.device when sampling (T > 0)

    def ids(self, ids: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(ids, device=self.device)

    def target_forward(self, ids: list[int], cache) -> tuple[Tensor, Tensor]:
        """(logits [n, V] in fp32, aux states [n, n_aux*Ht]) of the new positions, on self.device
        (under device_map the logits come from the last GPU)."""
        out = self.target(input_ids=self.ids([ids]), past_key_values=cache, use_cache=True)
        return out.logits[0].float().to(self.device), self.capture.take()[0][0]

    def probs(self, logits: Tensor) -> Tensor:
        if self.temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(logits / self.temperature, dim=-1)

    def sample(self, probs: Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def draft(self, aux: Tensor, next_tokens: list[int], prefix: tuple[Tensor, Tensor] | None
              ) -> tuple[list[int], list[Tensor], tuple[Tensor, Tensor]]:
        """k drafted target ids (the drafter's argmax), per draft q over the target vocabulary (one-hot),
        and the step-0 keys/values of every position so far.

        Step 0 runs only on the positions `prefix` does not cover yet (their next token is known now);
        steps 1..k-1 only at the last position: exactly the keys the TTT mask gives each query.
        """
        model = self.drafter.model
        done, total = (0 if prefix is None else prefix[0].shape[2]), aux.shape[0]
        cache = TTTCache(prefix=prefix)
        embeds = model.embed(self.ids([next_tokens[done:]]), self.embedding)
        positions = torch.arange(done, total, device=self.device)
        hidden = model.step(embeds, model.fuse(aux[None, done:]), positions, cache)[:, -1:]
        keys, values = cache.keys[0], cache.values[0]
        if prefix is not None:
            keys, values = torch.cat([prefix[0], keys], dim=2), torch.cat([prefix[1], values], dim=2)
        last = TTTCache([keys[:, :, -1:]], [values[:, :, -1:]], (keys[:, :, :-1], values[:, :, :-1]))
        drafts: list[int] = []
        qs: list[Tensor] = []
        for step in range(self.k):
            if step:
                embeds = model.embed(self.ids([[drafts[-1]]]), self.embedding)
                hidden = model.step(embeds, hidden, self.ids([total - 1 + step]), last)
            draft = self.draft_to_target[model.logits(hidden[0, -1]).argmax()]
            qs.append(torch.zeros(self.embedding.shape[0], device=self.device).index_fill_(0, draft, 1.0))
            drafts.append(int(draft))
        return drafts, qs, (keys, values)

    def draft_matches(self, tokens: list[int], aux: Tensor) -> Tensor:
        """[len(tokens) - 1, k] bool: whether draft step j from anchor t (the position whose aux states
        start the round, token t+1 just verified) equals tokens[t+2+j]; False past the end.

        At T=0 a round's drafts count only up to the first one that differs from the verified tokens,
        and up to there they ARE those tokens. So every round's drafts are the drafter unrolled k steps
        over the whole sequence with the sequence's own tokens as inputs: the training unroll, one call.
        """
        model, k, anchors = self.drafter.model, self.k, len(tokens) - 1
        inputs = self.ids(tokens + [0] * k)  # past the end: any id, those drafts match nothing
        expected = self.ids(tokens + [-1] * (k + 1))
        embeds = [model.embed(inputs[None, 1 + j : 1 + j + anchors], self.embedding) for j in range(k)]
        heads = model(aux[None, :anchors].to(self.device), embeds, torch.arange(anchors, device=self.device))
        drafts = torch.stack([self.draft_to_target[model.lm_head(h[0]).argmax(-1)] for h in heads], dim=1)
        return drafts == expected.unfold(0, k, 1)[2 : 2 + anchors]

    @torch.no_grad()
    def aux_states(self, tokens: list[int]) -> Tensor:
        """The target's aux states over `tokens`, from one forward of its decoder (no logits)."""
        self.target.get_decoder()(input_ids=self.ids([tokens]), use_cache=False)
        return self.capture.take()[0][0]

    @torch.no_grad()
    def replay(self, prompt_ids: list[int], continuation: list[int], stop: int,
               aux: Tensor | None = None) -> DecodeStats:
        """Temperature 0 only: the rounds `generate(prompt_ids, stop, ...)` runs, from ONE target forward
        and one drafter call.

        At T=0 the verified output is the target's greedy continuation whatever the drafts are,
        and causal attention gives every position the same aux states in one pass over prompt +
        continuation as in the incremental verifications; the drafts that count are computed in one
        unroll (draft_matches). Tokens past `stop` (if given) stand for the target's argmax there.
        `aux`: the target's aux states over prompt + continuation if already known (at least all
        but the continuation's last position), else one forward computes them.
        """
        if self.temperature != 0:
            raise ValueError("replay is exact only at temperature 0; use generate")
        tokens = list(prompt_ids) + list(continuation)
        if aux is None:
            aux = self.aux_states(tokens)
        matches = self.draft_matches(tokens, aux).tolist()
        stats = DecodeStats(accepted_per_pos=[0] * self.k)
        n, i = len(prompt_ids), 0  # continuation[i] is the token the next round starts from
        while i + 1 < stop:
            accepted = 0
            while accepted < self.k and matches[n + i - 1][accepted]:
                stats.accepted_per_pos[accepted] += 1
                accepted += 1
            stats.rounds += 1
            i += accepted + 1
        stats.generated = min(stop, len(continuation))
        return stats

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], DecodeStats]:
        from transformers import DynamicCache

        stats = DecodeStats(accepted_per_pos=[0] * self.k)
        cache = DynamicCache()
        logits, aux = self.target_forward(prompt_ids, cache)
        sequence = list(prompt_ids)  # tokens whose target states are known
        token = self.sample(self.probs(logits[-1]))
        out = [token]
        prefix = None  # the drafter's step-0 keys/values of the positions drafted from so far
        while len(out) < max_new_tokens and out[-1] not in eos_ids:
            drafts, qs, prefix = self.draft(aux, sequence[1:] + [token], prefix)
            logits, new_aux = self.target_forward([token] + drafts, cache)
            accepted = 0
            for i, (d, q) in enumerate(zip(drafts, qs)):
                p = self.probs(logits[i])
                if self.temperature == 0:
                    ok = p[d] == 1
                else:
                    u = torch.rand((), generator=self.generator, device=self.device)
                    ok = u < torch.clamp(p[d] / q[d], max=1.0)
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
