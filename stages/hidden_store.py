"""Hidden-state shard store: codec, writer, resume, index merge and manifest.

A store directory holds
  shard-r{rank}-{seq}.bin          many sample blobs back to back
  index-r{rank}-{seq}.parquet      one row per sample of that shard, written only after the shard
  index.parquet                    all index parts, sorted by sample id (merge_index)
  manifest.json                    what the states are and how they are coded (write_manifest)

Every file appears under its final name only once it is complete and fsync'd (temp name + rename),
so after a crash the index parts name exactly the samples that are safely stored.

A sample blob is: u32 little-endian header length, a JSON header naming each array's dtype, shape,
codec and stored size, then the arrays' stored bytes in header order. The index keeps each blob's
offset, length and CRC-32; the reader checks the CRC before decoding.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zstandard

from stages.atomic import fsync_path, parquet_bytes

FORMAT = "eagle3-hidden-store/1"
PLANES_CODEC = "top-byte-channel-major+zstd/low-bytes-raw"
PLAIN_CODEC = "zstd"
CHECKSUM = "crc32"
INDEX_NAME = "index.parquet"
MANIFEST_NAME = "manifest.json"
LAST_STATES = ("pre_norm", "post_norm")
DEFAULT_LEVEL = 1
# The top-byte plane is compressed with the level's settings but long, rarely-found matches:
# on real SmolLM2 states (benchmarks/storage_cpu.py) its bytes are worth entropy coding, not LZ
# matching; these settings store it ~5% smaller than plain level 1 and compress ~2x faster
# (min_match 7 against 6: the same size in 0.69 of the time).
_TOP_PLANE_OVERRIDES = {"min_match": 7, "hash_log": 7, "chain_log": 6, "window_log": 17}
# numpy has no bfloat16: callers hand such arrays over as uint16 views and name the real dtype here.
DEFAULT_DTYPE_NAMES: Mapping[str, str] = {"aux": "bfloat16", "last": "bfloat16"}
_STORAGE_DTYPES = {"bfloat16": np.dtype("<u2")}
_HEADER_LEN = struct.Struct("<I")

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


class StoreWriteError(OSError):
    """A shard or index file could not be written; no partial file is left behind."""


# ----------------------------------------------------------------------------------------- codec


@dataclass(frozen=True)
class ArraySpec:
    """Per-sample array description: dtype name and shape without the leading token axis."""

    dtype: str
    per_token_shape: tuple[int, ...]


@dataclass
class EncodedSample:
    parts: list[bytes | memoryview]  # written back to back; kept apart to avoid one more copy of the payload
    length: int
    checksum: int
    raw_bytes: int


@dataclass
class Planes:
    """A float array as stored, not yet joined (to_planes): `top` [channels, tokens] channel-major,
    `low` [tokens, channels, itemsize - 1]. The trainer joins bf16 planes on its GPU, where the
    transpose back to token-major is nearly free; on a CPU it is most of the decode time."""

    top: np.ndarray
    low: np.ndarray
    dtype: np.dtype  # the storage dtype (uint16 for bfloat16)
    shape: tuple[int, ...]

    def join(self) -> np.ndarray:
        return from_planes(self.top, self.low, self.dtype, self.shape)


@dataclass
class Sample:
    """A decoded sample; bfloat16 arrays are uint16 views, `dtypes` names their real dtype. Float
    arrays are Planes when the reader asked to keep them split."""

    sample_id: str
    arrays: dict[str, np.ndarray | Planes]
    dtypes: dict[str, str]


def storage_dtype(dtype_name: str) -> np.dtype:
    """The little-endian numpy dtype an array of this logical dtype is stored as."""
    return _STORAGE_DTYPES.get(dtype_name) or np.dtype(dtype_name).newbyteorder("<")


def uses_planes(dtype_name: str) -> bool:
    """Floats are split into byte planes: the sign + exponent byte is compressible, the rest is not."""
    return dtype_name in _STORAGE_DTYPES or np.dtype(dtype_name).kind == "f"


def compressor(level: int) -> zstandard.ZstdCompressor:
    """The store's compressor (not thread-safe: one per thread)."""
    params = zstandard.ZstdCompressionParameters.from_level(level, **_TOP_PLANE_OVERRIDES)
    return zstandard.ZstdCompressor(compression_params=params)


def to_planes(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(top byte plane channel-major, lower bytes) of a little-endian [tokens, ...] float array.

    The top byte (sign + high exponent bits) of a hidden state depends mostly on its channel, so
    channel-major order lets the entropy coder's per-block tables fit narrower distributions; the
    lower bytes are mantissa noise that no coder shrinks, so they are stored as they are.
    """
    k = data.dtype.itemsize
    as_bytes = data.reshape(len(data), -1).view(np.uint8).reshape(len(data), -1, k)
    return np.ascontiguousarray(as_bytes[..., k - 1].T), np.ascontiguousarray(as_bytes[..., : k - 1])


def from_planes(top: np.ndarray, low: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of to_planes: `top` the decoded [channels, tokens] plane (writable), `low` [tokens, channels, k-1]."""
    k, tokens = dtype.itemsize, shape[0]
    word = np.dtype(f"<u{k}")
    # torch's 2-D transpose copy works in cache-sized tiles: ~3x faster than numpy's here
    out = torch.from_numpy(top).t().contiguous().numpy().astype(word)
    out <<= 8 * (k - 1)
    for i in range(k - 1):
        out |= low[..., i].astype(word) << (8 * i)
    return out.view(dtype).reshape(shape)


def _decompress(dctx: zstandard.ZstdDecompressor, stored: memoryview, size: int, name: str) -> np.ndarray:
    """The `size` bytes a zstd frame holds, decoded straight into a writable array (torch wants one)."""
    out = np.empty(size, np.uint8)
    view, filled = memoryview(out), 0
    with dctx.stream_reader(stored) as reader:
        while filled < size and (got := reader.readinto(view[filled:])):
            filled += got
        if filled != size or reader.read(1):
            raise ValueError(f"array {name!r} decodes to more or fewer bytes than its shape's {size}")
    return out


def array_spec(name: str, arr: np.ndarray, dtype_names: Mapping[str, str]) -> ArraySpec:
    """Checks that `arr` can be stored as its declared dtype without a value cast."""
    dtype = dtype_names.get(name, arr.dtype.name)
    want = storage_dtype(dtype)
    if (arr.dtype.kind, arr.dtype.itemsize) != (want.kind, want.itemsize):
        raise TypeError(f"array {name!r}: {dtype} is passed as {want.name}, got {arr.dtype}")
    if arr.ndim == 0:
        raise ValueError(f"array {name!r} has no token axis")
    return ArraySpec(dtype, tuple(arr.shape[1:]))


def encode_sample(
    sample_id: str,
    arrays: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str],
    cctx: zstandard.ZstdCompressor,
) -> EncodedSample:
    """Compresses one sample into a checksummed blob; `dtypes` maps every array to its dtype name."""
    entries: list[dict[str, Any]] = []
    payloads: list[bytes | memoryview] = []
    raw_bytes = 0
    for name, arr in arrays.items():
        dtype = dtypes[name]
        data = np.ascontiguousarray(arr, dtype=storage_dtype(dtype))
        entry = {"name": name, "dtype": dtype, "shape": list(data.shape)}
        if uses_planes(dtype) and data.size:
            top, low = to_planes(data)
            stored_top = cctx.compress(top)
            entry.update(codec=PLANES_CODEC, top_size=len(stored_top), size=len(stored_top) + low.nbytes)
            payloads += [stored_top, low.reshape(-1).data]
        else:
            stored = cctx.compress(data)
            entry.update(codec=PLAIN_CODEC, size=len(stored))
            payloads.append(stored)
        entries.append(entry)
        raw_bytes += data.nbytes
    header = json.dumps({"id": sample_id, "arrays": entries}).encode()
    parts: list[bytes | memoryview] = [_HEADER_LEN.pack(len(header)), header, *payloads]
    checksum = 0
    for part in parts:
        checksum = zlib.crc32(part, checksum)
    return EncodedSample(parts, sum(len(p) for p in parts), checksum, raw_bytes)


def decode_sample(blob: bytes | memoryview | np.ndarray, keep_planes: bool = False) -> Sample:
    """Inverse of encode_sample (the caller has verified the checksum); with keep_planes, float
    arrays stay Planes for the caller to join."""
    view = memoryview(blob)
    (header_len,) = _HEADER_LEN.unpack_from(view, 0)
    pos = _HEADER_LEN.size + header_len
    if pos > len(view):
        raise ValueError(f"header length {header_len} exceeds the blob of {len(view)} bytes")
    header = json.loads(bytes(view[_HEADER_LEN.size : pos]))
    dctx = zstandard.ZstdDecompressor()
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for entry in header["arrays"]:
        name, shape = entry["name"], tuple(entry["shape"])
        dtype = storage_dtype(entry["dtype"])
        stored = view[pos : pos + entry["size"]]
        pos += entry["size"]
        count = int(np.prod(shape))
        if entry["codec"] == PLANES_CODEC:
            low = stored[entry["top_size"] :]
            if len(low) != count * (dtype.itemsize - 1):
                raise ValueError(f"array {name!r} has {len(low)} low-plane bytes, shape {shape} says "
                                 f"{count * (dtype.itemsize - 1)}")
            tokens = shape[0]
            top = _decompress(dctx, stored[: entry["top_size"]], count, name).reshape(-1, tokens)
            planes = Planes(top, np.frombuffer(low, np.uint8).reshape(tokens, -1, dtype.itemsize - 1), dtype, shape)
            arrays[name] = planes if keep_planes else planes.join()
        elif entry["codec"] == PLAIN_CODEC:
            raw = _decompress(dctx, stored, dtype.itemsize * count, name) if count else np.empty(0, np.uint8)
            arrays[name] = raw.view(dtype).reshape(shape)
        else:
            raise ValueError(f"array {name!r}: unknown codec {entry['codec']!r} (this reader knows "
                             f"{PLANES_CODEC!r} and {PLAIN_CODEC!r})")
        dtypes[name] = entry["dtype"]
    if pos != len(view):
        raise ValueError(f"blob has {len(view) - pos} bytes after its last array")
    return Sample(header["id"], arrays, dtypes)


# ------------------------------------------------------------------------------------- file names


def _rank_tag(rank: int) -> str:
    return f"r{rank:05d}"


def shard_name(rank: int, seq: int) -> str:
    return f"shard-{_rank_tag(rank)}-{seq:06d}.bin"


def index_part_name(rank: int, seq: int) -> str:
    return f"index-{_rank_tag(rank)}-{seq:06d}.parquet"


def _seq_of(path: Path) -> int:
    return int(path.name.split(".")[0].rsplit("-", 1)[1])


def _index_parts(root: Path) -> list[Path]:
    return sorted(root.glob("index-r*-*.parquet"))


# --------------------------------------------------------------------------------- durable writes


def _write_bytes(f: BinaryIO, data: bytes | memoryview) -> None:
    # the single place file contents are written (tests replace it to simulate a full disk)
    f.write(data)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `path` via a fsync'd temp file and a rename; on error no temp file remains."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            _write_bytes(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


# ----------------------------------------------------------------------------------------- writer


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
    tmp: Path
    file: BinaryIO
    rows: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0

    @classmethod
    def create(cls, path: Path, index_path: Path) -> _OpenShard:
        tmp = path.with_name(path.name + ".tmp")
        return cls(path, index_path, tmp, open(tmp, "wb"))

    def append(self, enc: EncodedSample, sample_id: str, tokens: int, loss_tokens: int) -> None:
        for part in enc.parts:
            _write_bytes(self.file, part)
        self.rows.append(
            {
                "sample_id": sample_id,
                "shard": self.path.name,
                "offset": self.size,
                "length": enc.length,
                "checksum": enc.checksum,
                "num_tokens": tokens,
                "num_loss_tokens": loss_tokens,
                "raw_bytes": enc.raw_bytes,
            }
        )
        self.size += enc.length

    def commit(self) -> None:
        """Makes the shard durable under its final name, then its index part."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)
        write_atomic(self.index_path, parquet_bytes(pa.Table.from_pylist(self.rows, INDEX_SCHEMA)))

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # closing flushes, which fails again on a full disk; the file goes anyway
        # a failed commit may have got as far as renaming the shard or even its index part
        for path in (self.tmp, self.path, self.index_path):
            path.unlink(missing_ok=True)


def _prepare_rank_dir(root: Path, rank: int) -> int:
    """Removes this rank's leftovers of a crashed run; returns the next shard number."""
    tag = _rank_tag(rank)
    for tmp in root.glob(f"*-{tag}-*.tmp"):
        tmp.unlink()
    shards = {_seq_of(p) for p in root.glob(f"shard-{tag}-*.bin")}
    indexed = {_seq_of(p) for p in root.glob(f"index-{tag}-*.parquet")}
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
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.level = level
        self.shard_bytes = shard_bytes
        self.shard_samples = shard_samples
        self._dtype_names = dict(dtype_names)
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
        return encode_sample(sample_id, arrays, dtypes, cctx)

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


# ------------------------------------------------------------------------- resume, merge, manifest


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
    write_atomic(root / INDEX_NAME, parquet_bytes(table.sort_by("sample_id")))
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
) -> dict[str, Any]:
    """Writes `manifest.json`: what the stored states are, how they are coded, how much there is.

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
            "floats": PLANES_CODEC,
            "others": PLAIN_CODEC,
            "zstd_level": level,
            "checksum": CHECKSUM,
        },
        **{f.name: getattr(totals, f.name) for f in dataclasses.fields(StoreTotals)},
        **(extra or {}),
    }
    write_atomic(Path(root) / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
