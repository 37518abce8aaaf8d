"""Acceptance offline: chain speculative decoding with our decoder (eagle3/evaluation/speculative.py),
the target through transformers, with the aux layer ids and vocabulary map the drafter was TRAINED
with (the hidden store's manifest and artifacts/vocab), not those its export names.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from eagle3.evaluation.acceptance import pooled
from eagle3.evaluation.params import EvalPaths, EvaluateParams
from eagle3.evaluation.questions import conversation
from eagle3.evaluation.speculative import DecodeStats, SpecDecoder
from eagle3.model.checkpoint import load_drafter
from eagle3.progress import Progress
from eagle3.target.capture import Capture
from eagle3.target.chat import render
from eagle3.target.compute import target_dtype
from eagle3.target.record import hub_kwargs


class Answer(NamedTuple):
    tokens: list[int]  # the greedy answer, through its first end-of-turn token
    aux: Tensor | None  # the target's aux states at prompt + answer positions (all but the last), if captured


def greedy_answers(target: Any, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad_id: int,
                   batch_size: int, progress: Progress, capture: Capture | None = None) -> list[Answer]:
    """The target's greedy answers, `batch_size` prompts per generate call (left-padded), each cut
    after its first end-of-turn token. Batching shares each step's weight reads: decode is bound by them.
    With `capture` (hooks on the target), each answer also keeps the aux states its generation computed,
    so replaying the speculative rounds needs no second target forward over prompt + answer."""
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), pad_id)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        forwards: list[Tensor] = []  # aux of each forward generate makes: the prompts, then one token per step
        hook = (target.get_decoder().register_forward_hook(lambda *_: forwards.append(capture.take()[0]))
                if capture else None)
        try:
            with torch.no_grad():
                out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                                      pad_token_id=pad_id)
        finally:
            if hook:
                hook.remove()
        for row, (prompt, generated) in enumerate(zip(chunk, out[:, longest:].tolist())):
            ends = [i for i, t in enumerate(generated) if t in eos]
            tokens = generated[: ends[0] + 1] if ends else generated
            # answer token i is the input of step i + 1; the last one is never fed back
            aux = (torch.cat([forwards[0][row, longest - len(prompt):],
                              *(step[row] for step in forwards[1 : len(tokens)])]) if capture else None)
            answers.append(Answer(tokens, aux))
        progress.update(len(chunk))
    return answers


def replay_counts(decoder: SpecDecoder, prompt: list[int], reply: list[int], aux: Tensor,
                  head_tokens: int | None) -> tuple[DecodeStats, DecodeStats | None]:
    """One greedy answer's counts at T=0 from the aux states over prompt + answer, and (head_tokens)
    those over its first head_tokens tokens, from the same states."""
    head = (decoder.replay(prompt, reply, stop=min(head_tokens, len(reply)), aux=aux) if head_tokens else None)
    return decoder.replay(prompt, reply, stop=len(reply), aux=aux), head


def replay_along(decoder: SpecDecoder, answers: list[list[tuple[list[int], list[int]]]], progress: Progress,
                 head_tokens: int | None = None) -> tuple[list[DecodeStats], list[DecodeStats]]:
    """Each item's counts at T=0 along ANOTHER decoder's greedy answers (per item, per turn: prompt ids,
    answer ids), the engine's: what our decoder accepts on the very text the engine drafted on, from one
    target forward per answer; and (head_tokens) over each answer's first head_tokens tokens. Two greedy
    decoders' own answers part after some hundred tokens on kernel numerics alone, which moves acceptance
    more than a faulty export would on a few questions."""
    k = decoder.k
    per_item = [DecodeStats(accepted_per_pos=[0] * k) for _ in answers]
    heads = [DecodeStats(accepted_per_pos=[0] * k) for _ in answers]
    for stats, head, turns in zip(per_item, heads, answers):
        for prompt, reply in turns:
            whole, first = replay_counts(decoder, prompt, reply, decoder.aux_states(prompt + reply), head_tokens)
            stats.add(whole)
            if first:
                head.add(first)
            progress.update(1, extra=f"acceptance length {pooled(per_item).acceptance_length():.3f}")
    return per_item, heads


def draft_vocab_coverage(answers: list[list[int]], t2d: np.ndarray) -> float:
    """Share of the answers' tokens inside the draft vocabulary. A token outside it is never
    drafted, so this bounds how often a draft can be accepted; the vocab stage's coverage is that of
    the training answers, and a narrower prompt set than the evaluation's shows here first."""
    tokens = np.fromiter((t for answer in answers for t in answer), dtype=np.int64)
    return float(t2d[tokens].mean()) if tokens.size else 0.0


def load_target(record: dict) -> Any:
    """The target through transformers, on the GPUs if there are any (vLLM starts only after the
    offline evaluation), spread over all of them if it needs more than one; else on the CPU."""
    from transformers import AutoModelForCausalLM

    # On CPU, eager attention: SDPA's CPU kernel is slow for one query under the left-padding mask of
    # batched decoding (1.5x the greedy answers' time here). Eager materialises [B, heads, T, T]
    # scores only while prefilling the prompts; GPUs keep SDPA, where long second turns would make that large.
    # On a CPU without instructions for the target's dtype, float32 (eagle3/target/compute.py).
    gpu = torch.cuda.is_available()
    placement = {"device_map": "auto"} if gpu else {"attn_implementation": "eager"}
    dtype = target_dtype(record, torch.device("cuda" if gpu else "cpu"))
    return AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=dtype, **hub_kwargs(record),
                                                **placement).eval()


class OfflineEvaluator:
    """Our chain speculative decoder with the target through transformers, loaded once for every
    temperature and answer length the stage asks for."""

    def __init__(self, params: EvaluateParams, record: dict, tokenizer: Any, paths: EvalPaths = EvalPaths()):
        self.params, self.tokenizer, self.paths = params, tokenizer, paths
        self.target = load_target(record)
        drafter = load_drafter(paths.drafter)
        # the map it was trained with
        drafter.d2t = torch.from_numpy(np.load(paths.vocab / "d2t.npy", allow_pickle=False))
        aux_ids = json.loads(paths.manifest.read_text())["aux_layer_ids"]
        self.decoder = SpecDecoder(self.target, drafter, aux_ids, params.num_speculative_tokens, 0.0)
        self.eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.replies: list[list[int]] = []  # every answer's tokens, for the draft vocabulary's coverage

    def run(self, items: list[dict], temperature: float, max_new_tokens: int, head_tokens: int | None = None
            ) -> tuple[list[DecodeStats], list[DecodeStats]]:
        """Each item's counts over all its turns, and (with head_tokens, T=0) over each answer's first
        head_tokens tokens. At T=0 the target's greedy answers are generated in batches and the rounds
        replayed along them (SpecDecoder.replay: the same counts as decoding round by round, tested);
        at T>0 every answer is decoded round by round with rejection sampling, seeded."""
        decoder, k = self.decoder, self.params.num_speculative_tokens
        decoder.temperature = temperature
        decoder.generator = torch.Generator(decoder.device).manual_seed(self.params.seed)
        per_item = [DecodeStats(accepted_per_pos=[0] * k) for _ in items]
        heads = [DecodeStats(accepted_per_pos=[0] * k) for _ in items]
        answers: list[list[str]] = [[] for _ in items]
        label = f"evaluate offline T={temperature:g}, {max_new_tokens} tokens"
        for turn in range(max(len(item["turns"]) for item in items)):
            todo = [i for i, item in enumerate(items) if len(item["turns"]) > turn]
            prompts = [render(self.tokenizer, conversation(items[i]["turns"], answers[i]), True) for i in todo]
            greedy: list[Answer | None] = [None] * len(todo)
            if temperature == 0:
                greedy = greedy_answers(self.target, prompts, max_new_tokens, self.eos, self.pad_id,
                                        self.params.offline_batch_size,
                                        Progress(f"{label}, turn {turn + 1}: greedy answers", len(todo), "answers"),
                                        decoder.capture)
            progress = Progress(f"{label}, turn {turn + 1}: speculative rounds", len(todo), "answers")
            for i, prompt, answer in zip(todo, prompts, greedy):
                if answer is None:
                    reply, stats = decoder.generate(prompt, max_new_tokens, self.eos)
                else:
                    reply = answer.tokens
                    stats, first = replay_counts(decoder, prompt, reply, answer.aux, head_tokens)
                    if first:
                        heads[i].add(first)
                answers[i].append(self.tokenizer.decode(reply, skip_special_tokens=True))
                self.replies.append(reply)
                per_item[i].add(stats)
                progress.update(1, extra=f"acceptance length {pooled(per_item).acceptance_length():.3f}")
        return per_item, heads

    def replay_answers(self, answers: list[list[tuple[list[int], list[int]]]], label: str,
                       head_tokens: int | None = None) -> tuple[list[DecodeStats], list[DecodeStats]]:
        """`run`'s counts at T=0 along the engine's answers (`replay_along`)."""
        self.decoder.temperature = 0.0
        self.replies += [reply for turns in answers for _, reply in turns]
        return replay_along(self.decoder, answers, Progress(f"evaluate offline along {label}",
                                                            sum(map(len, answers)), "answers"), head_tokens)

    def draft_vocab_coverage(self) -> float:
        return draft_vocab_coverage(self.replies, np.load(self.paths.vocab / "t2d.npy", allow_pickle=False))
