"""Acceptance offline: chain speculative decoding with our decoder (eagle3/evaluation/speculative.py),
the target through transformers, with the aux layer ids and vocabulary map the drafter was TRAINED
with (the hidden store's manifest and artifacts/vocab), not those its export names.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from eagle3.evaluation.acceptance import histogram
from eagle3.evaluation.params import EvalPaths, EvaluateParams
from eagle3.evaluation.questions import conversation
from eagle3.evaluation.speculative import DecodeStats, SpecDecoder
from eagle3.model.checkpoint import load_drafter
from eagle3.progress import Progress
from eagle3.target.capture import Capture
from eagle3.target.chat import render


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
    placement = {"device_map": "auto"} if torch.cuda.is_available() else {"attn_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=getattr(torch, record["dtype"]),
                                                **placement).eval()


def offline_eval(params: EvaluateParams, record: dict, tokenizer: Any, items: list[dict],
                 paths: EvalPaths = EvalPaths()) -> dict[str, Any]:
    """Chain speculative decoding with our decoder. At T=0 the target's greedy answers are generated
    in batches and the rounds replayed along them (SpecDecoder.replay: the same counts as decoding
    one round at a time, tested); at T>0 every answer is decoded with rejection sampling."""
    target = load_target(record)
    drafter = load_drafter(paths.drafter)
    drafter.d2t = torch.from_numpy(np.load(paths.vocab / "d2t.npy"))  # the map it was trained with
    aux_ids = json.loads(paths.manifest.read_text())["aux_layer_ids"]
    decoder = SpecDecoder(target, drafter, aux_ids, params.num_speculative_tokens, params.temperature,
                          torch.Generator(target.device).manual_seed(params.seed))
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total, per_category = DecodeStats(), defaultdict(DecodeStats)
    answers: list[list[str]] = [[] for _ in items]
    replies: list[list[int]] = []
    for turn in range(max(len(item["turns"]) for item in items)):
        todo = [i for i, item in enumerate(items) if len(item["turns"]) > turn]
        prompts = [render(tokenizer, conversation(items[i]["turns"], answers[i]), True) for i in todo]
        greedy: list[Answer | None] = [None] * len(todo)
        if params.temperature == 0:
            greedy = greedy_answers(target, prompts, params.max_new_tokens, eos, pad_id, params.offline_batch_size,
                                    Progress(f"evaluate offline turn {turn + 1}: greedy answers", len(todo), "answers"),
                                    decoder.capture)
        progress = Progress(f"evaluate offline turn {turn + 1}: speculative rounds", len(todo), "answers")
        for i, prompt, answer in zip(todo, prompts, greedy):
            if answer is None:
                reply, stats = decoder.generate(prompt, params.max_new_tokens, eos)
            else:
                reply = answer.tokens
                stats = decoder.replay(prompt, reply, stop=len(reply), aux=answer.aux)
            answers[i].append(tokenizer.decode(reply, skip_special_tokens=True))
            replies.append(reply)
            total.add(stats)
            per_category[items[i]["category"]].add(stats)
            progress.update(1, extra=f"acceptance length {total.acceptance_length():.3f}")
    return {"acceptance_length": total.acceptance_length(),
            "per_position": [a / total.rounds for a in total.accepted_per_pos],
            "histogram": histogram(total.accepted_per_pos, total.rounds),
            "rounds": total.rounds, "generated": total.generated,
            "draft_vocab_coverage": draft_vocab_coverage(replies, np.load(paths.vocab / "t2d.npy")),
            "per_category": {c: round(s.acceptance_length(), 4) for c, s in sorted(per_category.items())}}
