"""Read side of the hidden-state store: random access, iteration, and the training stream."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import zstandard
from torch.utils.data import IterableDataset, get_worker_info

from stages.hidden_store import FORMAT, INDEX_NAME, MANIFEST_NAME, Sample, decode_sample


class StoreCorruptError(RuntimeError):
    """A stored sample failed its length, checksum or format check."""


def to_torch(sample: Sample) -> dict[str, torch.Tensor]:
    """The sample's arrays as tensors, bfloat16 ones as torch.bfloat16 (no copy)."""
    out = {}
    for name, arr in sample.arrays.items():
        tensor = torch.from_numpy(arr)
        out[name] = tensor.view(torch.bfloat16) if sample.dtypes[name] == "bfloat16" else tensor
    return out


class HiddenStore:
    """A finished store directory (index.parquet + manifest.json): get by id, or iterate."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest: dict[str, Any] = json.loads((self.root / MANIFEST_NAME).read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.root} is not a {FORMAT} store: {self.manifest.get('format')}")
        index = pq.read_table(self.root / INDEX_NAME)
        self.sample_ids: list[str] = index.column("sample_id").to_pylist()
        self.num_tokens: np.ndarray = index.column("num_tokens").to_numpy()
        self.num_loss_tokens: np.ndarray = index.column("num_loss_tokens").to_numpy()
        self._shards: list[str] = index.column("shard").to_pylist()
        self._offsets: np.ndarray = index.column("offset").to_numpy()
        self._lengths: np.ndarray = index.column("length").to_numpy()
        self._checksums: np.ndarray = index.column("checksum").to_numpy()
        self._rows = {sample_id: row for row, sample_id in enumerate(self.sample_ids)}
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def get(self, sample_id: str) -> Sample:
        """The sample with this id, checksum-verified."""
        try:
            row = self._rows[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in {self.root}") from None
        return self.read_row(row)

    def __iter__(self) -> Iterator[Sample]:
        """All samples in file order, so each shard is read front to back."""
        order = sorted(range(len(self)), key=lambda r: (self._shards[r], self._offsets[r]))
        for row in order:
            yield self.read_row(row)

    def read_row(self, row: int) -> Sample:
        """The sample in row `row` of the index, checksum-verified."""
        sample_id, shard = self.sample_ids[row], self._shards[row]
        offset, length = int(self._offsets[row]), int(self._lengths[row])
        path = self.root / shard
        blob = os.pread(self._fd(shard), length, offset)
        if len(blob) != length:
            raise StoreCorruptError(
                f"shard {path} is truncated: sample {sample_id!r} needs bytes "
                f"{offset}..{offset + length}, the file has {os.path.getsize(path)}"
            )
        if zlib.crc32(blob) != int(self._checksums[row]):
            raise StoreCorruptError(
                f"checksum mismatch in shard {path} for sample {sample_id!r} "
                f"(bytes {offset}..{offset + length}): the shard is corrupted"
            )
        try:
            sample = decode_sample(blob)
        except (ValueError, zstandard.ZstdError) as exc:
            raise StoreCorruptError(f"shard {path}, sample {sample_id!r}: {exc}") from exc
        if sample.sample_id != sample_id:
            raise StoreCorruptError(
                f"index of {self.root} points sample {sample_id!r} at {path}:{offset}, "
                f"which holds {sample.sample_id!r}"
            )
        self._check_schema(sample, path)
        return sample

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, shard: str) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
        return self._fds[shard]

    def _check_schema(self, sample: Sample, path: Path) -> None:
        for name, spec in self.manifest["arrays"].items():
            arr = sample.arrays.get(name)
            got = None if arr is None else (sample.dtypes[name], list(arr.shape[1:]))
            if got != (spec["dtype"], spec["per_token_shape"]):
                raise StoreCorruptError(
                    f"shard {path}, sample {sample.sample_id!r}: array {name!r} is {got}, "
                    f"the manifest says {spec}"
                )

    def __getstate__(self) -> dict[str, Any]:
        # descriptors do not travel to DataLoader workers; each process opens its own
        return {**self.__dict__, "_fds": {}}


def epoch_rows(
    num_samples: int, *, seed: int, epoch: int, rank: int, world_size: int, even: bool
) -> np.ndarray:
    """Index rows one rank reads in one epoch: a (seed, epoch) permutation dealt round-robin.

    With `even`, the permutation's tail is cut so every rank gets the same count (DDP steps stay
    in lockstep); the cut samples differ from epoch to epoch.
    """
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    if even:
        order = order[: num_samples - num_samples % world_size]
    return order[rank::world_size]


class HiddenStateStream(IterableDataset):
    """Training stream over a store: shuffled per epoch, split across DDP ranks and workers.

    Decoding happens in DataLoader worker processes; worker w of a rank reads every
    num_workers-th sample of the rank's share, and the DataLoader's round-robin over workers
    restores the share's order. Call `set_epoch` before each epoch (without persistent workers,
    which would keep the old epoch). Yields dicts of tensors plus "sample_id".
    """

    def __init__(
        self,
        root: str | Path,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        even: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.store = HiddenStore(root)
        self.seed, self.rank, self.world_size, self.even = seed, rank, world_size, even
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rows(self) -> np.ndarray:
        """This rank's rows for the current epoch."""
        return epoch_rows(
            len(self.store),
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            even=self.even,
        )

    def __len__(self) -> int:
        return len(self.rows())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rows = self.rows()
        worker = get_worker_info()
        if worker is not None:
            rows = rows[worker.id :: worker.num_workers]
        for row in rows:
            sample = self.store.read_row(int(row))
            yield {"sample_id": sample.sample_id, **to_torch(sample)}
