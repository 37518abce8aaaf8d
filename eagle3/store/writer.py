"""Writing samples into a store: compression in threads, shards rotated by size, crash-safe resume.

A shard and then its index part appear under their final names only once complete and fsync'd
(eagle3/atomic.py); opening a writer removes what a crashed run of the same rank left and
continues its shard numbering, so a rerun stores exactly the samples not yet stored.
"""

from __future__ import annotations

import dataclasses
import errno
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle3.atomic import AtomicFile, atomic_write_bytes, parquet_bytes
from eagle3.errors import PipelineError
from eagle3.store.codec import (
    DEFAULT_DTYPE_NAMES,
    DEFAULT_LEVEL,
    ArraySpec,
    EncodedSample,
    array_spec,
    compressor,
    encode_sample,
)
from eagle3.store.layout import INDEX_SCHEMA, StoreTotals, file_seq, index_part_name, rank_tag, shard_name


class StoreWriteError(PipelineError, OSError):
    """A shard or index file could not be written; no partial file is left behind."""


def _write_error(exc: OSError, directory: Path, needed: int) -> StoreWriteError:
    try:
        free = f"{shutil.disk_usage(directory).free} bytes free there"
    except OSError:
        free = "free space unknown"
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return StoreWriteError(
        exc.errno,
        f"cannot write hidden-state store {directory}: {reason}; the shard being written needs "
        f"{needed} bytes ({free}). Samples of that shard were not stored and no partial file "
        "was kept; rerun to resume.",
    )


@dataclass
class WriteStats(StoreTotals):
    """What one writer stored, with wall time and the array schema it saw."""

    seconds: float = 0.0
    schema: dict[str, ArraySpec] = field(default_factory=dict)

    @property
    def raw_mb_per_s(self) -> float:
        return self.raw_bytes / 1e6 / self.seconds if self.seconds else float("nan")


@dataclass
class _OpenShard:
    path: Path
    index_path: Path
    file: AtomicFile
    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def create(cls, path: Path, index_path: Path) -> _OpenShard:
        return cls(path, index_path, AtomicFile(path))

    @property
    def size(self) -> int:
        return self.file.size

    def append(self, enc: EncodedSample, sample_id: str, tokens: int, loss_tokens: int) -> None:
        offset = self.size
        for part in enc.parts:
            self.file.write(part)
        self.rows.append({"sample_id": sample_id, "shard": self.path.name, "offset": offset, "length": enc.length,
                          "checksum": enc.checksum, "num_tokens": tokens, "num_loss_tokens": loss_tokens,
                          "raw_bytes": enc.raw_bytes})

    def commit(self) -> None:
        """Makes the shard durable under its final name, then its index part."""
        self.file.commit()
        atomic_write_bytes(self.index_path, parquet_bytes(pa.Table.from_pylist(self.rows, INDEX_SCHEMA)))

    def discard(self) -> None:
        self.file.discard()
        # a failed commit may have got as far as renaming the shard or even its index part
        for path in (self.path, self.index_path):
            path.unlink(missing_ok=True)


def _prepare_rank_dir(root: Path, rank: int) -> int:
    """Removes this rank's leftovers of a crashed run; returns the next shard number."""
    tag = rank_tag(rank)
    for tmp in root.glob(f"*-{tag}-*.tmp"):
        tmp.unlink()
    shards = {file_seq(p) for p in root.glob(f"shard-{tag}-*.bin")}
    indexed = {file_seq(p) for p in root.glob(f"index-{tag}-*.parquet")}
    for seq in shards - indexed:
        # crashed between shard rename and index write: its samples count as not stored
        (root / shard_name(rank, seq)).unlink()
    return max(shards | indexed, default=-1) + 1


class ShardWriter:
    """Writes samples into shards; compression runs in threads while the caller keeps working.

    `put` returns once the sample is queued and blocks while `max_pending` samples are in flight,
    so memory stays bounded. Errors of the background work surface in the next `put` or in
    `close`. Several ranks may write into one directory: each uses its own file names. Opening a
    writer removes leftovers of an earlier crashed run of the same rank and continues its shard
    numbering; to resume, put only the samples `rank_todo` leaves.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        level: int = DEFAULT_LEVEL,
        shard_bytes: int = 512 << 20,
        shard_samples: int | None = None,
        threads: int = 2,
        max_pending: int | None = None,
        dtype_names: Mapping[str, str] = DEFAULT_DTYPE_NAMES,
        fp8_groups: Mapping[str, int] | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.level = level
        self.shard_bytes = shard_bytes
        self.shard_samples = shard_samples
        self._dtype_names = dict(dtype_names)
        self._fp8_groups = dict(fp8_groups or {})
        self._next_seq = _prepare_rank_dir(self.root, rank)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hidden-compress")
        self._queue: queue.Queue[tuple[str, Future[EncodedSample], int, int] | None] = queue.Queue(
            max_pending or 2 * threads
        )
        self._stats = WriteStats()
        self._seen: set[str] = set()
        self._shard: _OpenShard | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._started = time.perf_counter()
        self._finished: float | None = None
        self._thread = threading.Thread(target=self._drain, name="hidden-store-writer", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> WriteStats:
        """Snapshot of what has been appended so far (durable once `close` returns)."""
        end = self._finished or time.perf_counter()
        return dataclasses.replace(self._stats, seconds=end - self._started)

    def put(self, sample_id: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Queues one sample; the arrays must not be modified afterwards."""
        if self._closed:
            raise RuntimeError("put() on a closed ShardWriter")
        self._raise_if_failed()
        if sample_id in self._seen:
            raise ValueError(f"sample {sample_id!r} was already put")
        tokens, loss_tokens = self._check(arrays)
        self._seen.add(sample_id)
        future = self._pool.submit(self._encode, sample_id, dict(arrays))
        self._queue.put((sample_id, future, tokens, loss_tokens))

    def close(self) -> WriteStats:
        """Finishes the open shard and returns the totals; raises the first background error."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            self._pool.shutdown()
            self._finished = time.perf_counter()
        self._raise_if_failed()
        return self.stats

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            self.close()
        except StoreWriteError as err:
            if err is not exc:
                raise

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _check(self, arrays: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """Validates the sample against the data contract and the first sample's schema."""
        for key in ("input_ids", "loss_mask"):
            if key not in arrays or arrays[key].ndim != 1:
                raise ValueError(f"sample needs a 1-D {key!r} array")
        num_tokens = len(arrays["input_ids"])
        schema = {name: array_spec(name, a, self._dtype_names) for name, a in arrays.items()}
        for name, arr in arrays.items():
            if arr.shape[0] != num_tokens:
                raise ValueError(f"array {name!r} has {arr.shape[0]} rows, input_ids has {num_tokens}")
        if not self._stats.schema:
            self._stats.schema = schema
        elif schema != self._stats.schema:
            raise ValueError(f"sample schema {schema} differs from the first one {self._stats.schema}")
        return num_tokens, int(np.count_nonzero(arrays["loss_mask"]))

    def _encode(self, sample_id: str, arrays: dict[str, np.ndarray]) -> EncodedSample:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:  # compressor objects are not thread-safe: one per thread
            cctx = self._local.cctx = compressor(self.level)
        dtypes = {name: spec.dtype for name, spec in self._stats.schema.items()}
        try:
            return encode_sample(sample_id, arrays, dtypes, cctx, self._fp8_groups)
        except ValueError as exc:  # a value the codec cannot store (fp8: inf or NaN)
            raise ValueError(f"{self.root}: sample {sample_id!r}: {exc}") from exc

    def _drain(self) -> None:
        """Writer thread: appends encoded samples in put order, rotating shards."""
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep consuming so a blocked put() wakes up and sees the error
            try:
                self._append(*item)
            except BaseException as exc:
                self._fail(exc)
        if self._error is None:
            try:
                self._commit()
            except BaseException as exc:
                self._fail(exc)

    def _append(self, sample_id: str, future: Future[EncodedSample], tokens: int, loss: int) -> None:
        enc = future.result()
        needed = enc.length
        try:
            if self._shard is None:
                self._shard = _OpenShard.create(
                    self.root / shard_name(self.rank, self._next_seq),
                    self.root / index_part_name(self.rank, self._next_seq),
                )
            needed += self._shard.size
            self._shard.append(enc, sample_id, tokens, loss)
        except OSError as exc:
            raise _write_error(exc, self.root, needed) from exc
        s = self._stats
        s.samples, s.tokens, s.loss_tokens = s.samples + 1, s.tokens + tokens, s.loss_tokens + loss
        s.raw_bytes += enc.raw_bytes
        s.stored_bytes += enc.length
        rows = len(self._shard.rows)
        if self._shard.size >= self.shard_bytes or rows == self.shard_samples:
            self._commit()

    def _commit(self) -> None:
        if self._shard is None:
            return
        try:
            self._shard.commit()
        except OSError as exc:
            raise _write_error(exc, self.root, self._shard.size) from exc
        self._shard = None
        self._next_seq += 1
        self._stats.shards += 1

    def _fail(self, exc: BaseException) -> None:
        if self._shard is not None:
            self._shard.discard()
            self._shard = None
        self._error = exc
