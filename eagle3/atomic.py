"""Atomic writes, the one helper every writer uses: a reader, or a crashed run, sees the old file or
directory or the new one, never a part of it. A file is written under a temporary name beside its
final one, fsync'd, renamed, and its directory fsync'd (a rename is durable only then).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(f: BinaryIO, data: bytes | memoryview) -> None:
    # the single place file contents are written (tests replace it to simulate a full disk)
    f.write(data)


class AtomicFile:
    """A file written piece by piece under a temporary name, and renamed to `path` by commit()."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide outputs from other users
        self.tmp, self.file, self.size = Path(tmp), open(tmp, "wb"), 0  # opened by name: errors name the file
        os.close(fd)

    def write(self, data: bytes | memoryview) -> None:
        _write(self.file, data)
        self.size += memoryview(data).nbytes

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # closing flushes, which fails again on a full disk; the file goes anyway
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()


def parquet_bytes(table: Any) -> bytes:
    """A pyarrow table as parquet file bytes, for an atomic write."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with AtomicFile(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp.chmod(0o755)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
