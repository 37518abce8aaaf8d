"""The prompt set: training prompts the target answers, conversations kept with their dataset
answers, and the evaluation questions, sampled deterministically for a seed (the prompts stage).

Conversations with dataset answers (`dataset_answers` > 0, `answered.parquet`, rendered token ids):
the extract stage stores the target's states along them like a response's, every position as
context, and the trainer weighs them by `train.prompt_loss_weight` (the target's distribution is
the teacher there too). They cost no generation.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.atomic import atomic_dir, atomic_write_json
from eagle3.data.eval_sets import load_set, set_name
from eagle3.data.sources import DropLog, PromptsError, Row, RowError, iter_source, normalize_messages
from eagle3.target.chat import render
from eagle3.target.record import load_tokenizer

PROMPTS_DIR = Path("artifacts/prompts")
TARGET_DIR = Path("artifacts/target")
MULTI_TURN_POLICIES = ("first_user", "all_turns")


@dataclass
class PromptsParams:
    source: str  # embedded (ShareGPT package) | HF dataset id | local .jsonl/.parquet
    split: str  # HF dataset split
    eval_sets: list[str]  # held-out question sets: mtbench | humaneval | math500 | a local .jsonl/.parquet
    num_samples: int  # prompts the target answers
    seed: int
    max_prompt_tokens: int  # longer prompts are dropped (and counted)
    dedupe: bool
    multi_turn: str  # first_user | all_turns
    dataset_answers: int  # further conversations trained on with the dataset's own answer (no generation)
    dataset_answer_max_tokens: int  # each such conversation's rendered tokens are cut here


ANSWERED_SCHEMA = pa.schema([("id", pa.string()), ("messages", pa.string()), ("token_ids", pa.list_(pa.int32())),
                             ("num_prompt_tokens", pa.int64()), ("source", pa.string()), ("origin", pa.string())])


# Usable = (location, messages kept by the multi-turn policy, the whole conversation).
Usable = tuple[str, list[dict[str, str]], list[dict[str, str]]]


def apply_policy(messages: list[dict[str, str]], policy: str) -> list[dict[str, str]]:
    """first_user: system prompt + first user turn; all_turns: the whole conversation as context."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RowError("no_user_turn")
    kept = messages[: users[0] + 1] if policy == "first_user" else messages
    if any(not m["content"].strip() for m in kept if m["role"] == "user"):
        raise RowError("empty")
    return kept


def with_dataset_answer(conversation: list[dict[str, str]], kept: list[dict[str, str]]) -> list[dict[str, str]]:
    """The kept context through the dataset's answer to its last user turn."""
    last_user = max(i for i, m in enumerate(kept) if m["role"] == "user")
    answer = conversation[last_user + 1] if last_user + 1 < len(conversation) else None
    if answer is None or answer["role"] != "assistant" or not answer["content"].strip():
        raise RowError("no_dataset_answer")
    return conversation[: last_user + 2]


def prompt_id(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def held_out_texts(questions: list[dict[str, Any]]) -> set[str]:
    return {" ".join(turn.split()) for q in questions for turn in q["turns"]}


def usable_rows(rows: Iterator[Row], policy: str, dedupe: bool, log: DropLog, held_out: set[str]) -> list[Usable]:
    """Rows the policy can use, each once; a conversation with a turn that is an evaluation question
    (whitespace aside) is dropped as eval_overlap, so the drafter is never trained on what it is scored on."""
    usable, seen = [], set()
    for where, obj in rows:
        try:
            conversation = normalize_messages(obj)
            messages = apply_policy(conversation, policy)
        except RowError as err:
            log.drop(str(err).split(":")[0], f"{where}: {err}")
            continue
        if any(" ".join(m["content"].split()) in held_out for m in conversation if m["role"] == "user"):
            log.drop("eval_overlap", where)
            continue
        pid = prompt_id(messages)
        if dedupe and pid in seen:
            log.drop("duplicate", where)
            continue
        seen.add(pid)
        usable.append((where, messages, conversation))
    return usable


def count_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    context = messages if messages[-1]["role"] == "user" else messages[:-1]
    return len(render(tokenizer, context, generation_prompt=True))


def sample_train(params: PromptsParams, tokenizer: Any, log: DropLog, held_out: set[str]
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompts the target answers, conversations with the dataset's answers), deterministic for a seed:
    shuffle the usable rows; the first that fit the token budget are prompts, the next ones with an
    answer keep it. A row serves one role only."""
    usable = usable_rows(iter_source(params.source, params.split), params.multi_turn, params.dedupe, log, held_out)
    if not usable:
        raise PromptsError(f"prompts.source={params.source!r}: zero usable rows (dropped: {dict(log.counts)})")
    order = list(range(len(usable)))
    random.Random(params.seed).shuffle(order)
    kept, answered = [], []
    for index in order:
        if len(kept) == params.num_samples and len(answered) == params.dataset_answers:
            break
        where, messages, conversation = usable[index]
        num_tokens = count_prompt_tokens(tokenizer, messages)
        if num_tokens > params.max_prompt_tokens:
            log.drop("too_long", f"{where}: {num_tokens} tokens")
            continue
        if len(kept) < params.num_samples:
            kept.append({"id": prompt_id(messages), "messages": json.dumps(messages, ensure_ascii=False),
                         "num_prompt_tokens": num_tokens, "source": params.source, "origin": where})
            continue
        try:
            dialogue = with_dataset_answer(conversation, messages)
        except RowError as err:
            log.drop(str(err), where)
            continue
        token_ids = render(tokenizer, dialogue, generation_prompt=False)[: params.dataset_answer_max_tokens]
        answered.append({"id": prompt_id(dialogue), "messages": json.dumps(dialogue, ensure_ascii=False),
                         "token_ids": token_ids, "num_prompt_tokens": num_tokens, "source": params.source,
                         "origin": where})
    return kept, answered


def load_eval(params: PromptsParams, log: DropLog) -> list[dict[str, Any]]:
    """Every question of every set in prompts.eval_sets (the evaluate stage draws from them by category,
    so a change of how many it asks reruns evaluate only), all turns kept."""
    names = [set_name(spec) for spec in params.eval_sets]
    if not names or len(set(names)) != len(names):
        raise PromptsError(f"prompts.eval_sets={params.eval_sets}: expected one or more sets with distinct names")
    questions = []
    for spec in params.eval_sets:
        for q in load_set(spec, log):
            turns = [{"role": "user", "content": t} for t in q["turns"]]
            questions.append({"id": prompt_id(turns), **q, "messages": json.dumps(turns[:1], ensure_ascii=False)})
    return questions


def check_params(params: PromptsParams) -> None:
    if params.multi_turn not in MULTI_TURN_POLICIES:
        raise PromptsError(f"prompts.multi_turn={params.multi_turn!r}: expected one of "
                           f"{', '.join(MULTI_TURN_POLICIES)}")
    for name in ("num_samples", "max_prompt_tokens", "dataset_answer_max_tokens"):
        if getattr(params, name) <= 0:
            raise PromptsError(f"prompts.{name}={getattr(params, name)}: expected a positive number")
    if params.dataset_answers < 0:
        raise PromptsError(f"prompts.dataset_answers={params.dataset_answers}: expected 0 or more")


def build(params: PromptsParams, target_dir: Path = TARGET_DIR, out: Path = PROMPTS_DIR) -> dict[str, Any]:
    check_params(params)
    tokenizer = load_tokenizer(target_dir)
    log = DropLog()
    evaluation = load_eval(params, log)
    train, answered = sample_train(params, tokenizer, log, held_out_texts(evaluation))
    # Asked for N, got none: a stage that exits 0 here would hand an empty set to every later stage.
    if not train:
        raise PromptsError(f"prompts.num_samples={params.num_samples}: no usable prompt fits "
                           f"prompts.max_prompt_tokens={params.max_prompt_tokens} (dropped: {dict(log.counts)})")
    if params.dataset_answers and not answered:
        raise PromptsError(f"prompts.dataset_answers={params.dataset_answers}: no conversation with a usable dataset "
                           f"answer is left after the {len(train)} prompts (dropped: {dict(log.counts)})")
    stats = {"kept": len(train), "eval": len(evaluation), "requested": params.num_samples,
             "prompt_tokens": sum(r["num_prompt_tokens"] for r in train), "dataset_answers": len(answered),
             "dataset_answer_tokens": sum(len(r["token_ids"]) for r in answered), **log.as_dict()}
    with atomic_dir(out) as tmp:
        pq.write_table(pa.Table.from_pylist(train), tmp / "train.parquet")
        pq.write_table(pa.Table.from_pylist(answered, schema=ANSWERED_SCHEMA), tmp / "answered.parquet")
        pq.write_table(pa.Table.from_pylist(evaluation), tmp / "eval.parquet")
        atomic_write_json(tmp / "stats.json", stats)
    return stats
