"""A store directory's files: their names, resume, the merged index and the manifest.

  shard-r{rank}-{seq}.bin          many sample blobs back to back (eagle3/store/codec.py)
  index-r{rank}-{seq}.parquet      one row per sample of that shard, written only after the shard
  index.parquet                    all index parts, sorted by sample id (merge_index)
  manifest.json                    what the states are and how they are coded (write_manifest)

Every file appears under its final name only once it is complete and fsync'd (eagle3/atomic.py),
so after a crash the index parts name exactly the samples that are safely stored.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.atomic import atomic_write_bytes, parquet_bytes
from eagle3.store.codec import CHECKSUM, FORMAT, PLAIN_CODEC, STATE_CODECS, ArraySpec

INDEX_NAME = "index.parquet"
MANIFEST_NAME = "manifest.json"
LAST_STATES = ("pre_norm", "post_norm")

INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("shard", pa.string()),
        ("offset", pa.int64()),
        ("length", pa.int64()),
        ("checksum", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_loss_tokens", pa.int64()),
        ("raw_bytes", pa.int64()),
    ]
)


def rank_tag(rank: int) -> str:
    return f"r{rank:05d}"


def shard_name(rank: int, seq: int) -> str:
    return f"shard-{rank_tag(rank)}-{seq:06d}.bin"


def index_part_name(rank: int, seq: int) -> str:
    return f"index-{rank_tag(rank)}-{seq:06d}.parquet"


def file_seq(path: Path) -> int:
    return int(path.name.split(".")[0].rsplit("-", 1)[1])


def _index_parts(root: Path) -> list[Path]:
    return sorted(root.glob("index-r*-*.parquet"))


@dataclass
class StoreTotals:
    """Sizes of a set of stored samples."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    shards: int = 0

    @property
    def stored_over_raw(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else float("nan")


def completed_sample_ids(root: str | Path) -> set[str]:
    """Ids of all samples completely stored in `root` by any rank (empty for a new store)."""
    root = Path(root)
    ids: set[str] = set()
    for part in _index_parts(root):
        ids.update(pq.read_table(part, columns=["sample_id"]).column(0).to_pylist())
    return ids


def rank_todo(sample_ids: Sequence[str], done: set[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of the samples not yet stored.

    Shares are dealt by position in the full list, not in the list of missing samples: ranks that
    read `done` at different moments (while others already write) still get disjoint shares.
    """
    return [s for i, s in enumerate(sample_ids) if i % world_size == rank and s not in done]


def merge_index(root: str | Path) -> StoreTotals:
    """Writes `index.parquet` from all ranks' index parts; run once every writer has closed.

    Also removes what crashed runs of any rank left behind (temp files, shards without index).
    """
    root = Path(root)
    parts = _index_parts(root)
    table = pa.concat_tables([pq.read_table(p, schema=INDEX_SCHEMA) for p in parts]) if parts else (
        INDEX_SCHEMA.empty_table()
    )
    dups = [s for s, n in Counter(table.column("sample_id").to_pylist()).items() if n > 1]
    if dups:
        raise ValueError(f"{len(dups)} samples are stored twice in {root}, e.g. {dups[:5]}")
    shards = set(table.column("shard").to_pylist())
    missing = sorted(s for s in shards if not (root / s).is_file())
    if missing:
        raise FileNotFoundError(f"index parts in {root} name missing shards: {missing[:5]}")
    for path in root.glob("*.tmp"):
        path.unlink()
    for path in root.glob("shard-r*-*.bin"):
        if path.name not in shards:
            path.unlink()
    atomic_write_bytes(root / INDEX_NAME, parquet_bytes(table.sort_by("sample_id")))
    return StoreTotals(
        samples=table.num_rows,
        tokens=_column_sum(table, "num_tokens"),
        loss_tokens=_column_sum(table, "num_loss_tokens"),
        raw_bytes=_column_sum(table, "raw_bytes"),
        stored_bytes=_column_sum(table, "length"),
        shards=len(shards),
    )


def _column_sum(table: pa.Table, name: str) -> int:
    return int(np.sum(table.column(name).to_numpy(), dtype=np.int64))


def sample_arrays(num_aux: int, hidden: int, states: bool = True) -> dict[str, ArraySpec]:
    """What a sample holds: its token ids and loss mask, and (`states`) the aux and last states."""
    arrays = {"input_ids": ArraySpec("int32", ()), "loss_mask": ArraySpec("uint8", ())}
    if states:
        arrays |= {"aux": ArraySpec("bfloat16", (num_aux * hidden,)), "last": ArraySpec("bfloat16", (hidden,))}
    return arrays


def write_manifest(
    root: str | Path,
    *,
    model_hash: str,
    aux_layer_ids: Sequence[int],
    layer_id_convention: str,
    last_state: str,
    arrays: Mapping[str, ArraySpec],
    level: int,
    totals: StoreTotals,
    extra: Mapping[str, Any] | None = None,
    store_dtype: str = "bf16",
) -> dict[str, Any]:
    """Writes `manifest.json`: what the stored states are, how they are coded, how much there is.
    `store_dtype` (STATE_CODECS): how the float states were stored; they read back as bf16 either way.

    `last_state` is "pre_norm" (engine-style capture) or "post_norm" (HF's last hidden_states);
    the trainer applies the final norm only to the former.
    """
    if last_state not in LAST_STATES:
        raise ValueError(f"last_state must be one of {LAST_STATES}, got {last_state!r}")
    manifest = {
        "format": FORMAT,
        "model_hash": model_hash,
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "layer_id_convention": layer_id_convention,
        "last_state": last_state,
        "arrays": {
            name: {"dtype": spec.dtype, "per_token_shape": list(spec.per_token_shape)}
            for name, spec in arrays.items()
        },
        "codec": {
            "floats": STATE_CODECS[store_dtype],
            "store_dtype": store_dtype,
            "others": PLAIN_CODEC,
            "zstd_level": level,
            "checksum": CHECKSUM,
        },
        **{f.name: getattr(totals, f.name) for f in dataclasses.fields(StoreTotals)},
        **(extra or {}),
    }
    atomic_write_bytes(Path(root) / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
