"""Responses on disk: atomic parquet parts while a run goes, the DVC output assembled at the end.

Whole prompts are buffered and written every `part_size` prompts as one atomic part under
run/generate/<fingerprint>/parts/, so a crash loses only the buffer and a rerun skips every
stored prompt: nothing is redone or duplicated.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.atomic import atomic_dir, atomic_write_bytes, parquet_bytes

RESPONSE_SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt_id", pa.string()), ("turn", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()), ("content", pa.string()), ("reasoning", pa.string()),
    ("template_match", pa.bool_()), ("usage", pa.string()), ("sampling", pa.string()), ("messages", pa.string()),
])


class PartWriter:
    """Whole prompts buffered, then written as one atomic parquet part: a crash loses only the buffer."""

    def __init__(self, parts_dir: Path, part_size: int):
        self.parts_dir, self.part_size = parts_dir, part_size
        parts_dir.mkdir(parents=True, exist_ok=True)
        self.next_index = 1 + max((int(p.stem.split("-")[1]) for p in parts_dir.glob("part-*.parquet")), default=-1)
        self.rows: list[dict[str, Any]] = []
        self.prompts = 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows
        self.prompts += 1
        if self.prompts >= self.part_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        atomic_write_bytes(self.parts_dir / f"part-{self.next_index:06d}.parquet",
                           parquet_bytes(pa.Table.from_pylist(self.rows, schema=RESPONSE_SCHEMA)))
        self.next_index += 1
        self.rows, self.prompts = [], 0


def read_parts(parts_dir: Path) -> pa.Table:
    parts = sorted(parts_dir.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else RESPONSE_SCHEMA.empty_table()


def assemble(work: Path, prompts: list[dict[str, Any]], out: Path) -> pa.Table:
    """The DVC output: this prompt set's responses in prompt order, whatever order they finished in."""
    import pyarrow.compute as pc

    table = read_parts(work / "parts")
    order = pc.index_in(table["prompt_id"], value_set=pa.array([p["id"] for p in prompts]))
    table = table.append_column("order", order).filter(pc.is_valid(order))
    table = table.sort_by([("order", "ascending"), ("turn", "ascending")]).drop_columns(["order"])
    with atomic_dir(out) as tmp:
        pq.write_table(table, tmp / "responses.parquet")
        (tmp / "errors.jsonl").write_bytes((work / "errors.jsonl").read_bytes())
    return table


def response_stats(table: pa.Table) -> dict[str, Any]:
    lengths = [len(ids) for ids in table["completion_token_ids"].to_pylist()]
    return {"responses": table.num_rows, "generated_tokens": sum(lengths),
            "prompt_tokens": sum(len(ids) for ids in table["prompt_token_ids"].to_pylist()),
            "mean_completion_tokens": round(sum(lengths) / len(lengths), 1) if lengths else 0,
            "max_completion_tokens": max(lengths, default=0),
            "finish_reasons": dict(Counter(table["finish_reason"].to_pylist())),
            "template_mismatches": table.num_rows - sum(table["template_match"].to_pylist())}
