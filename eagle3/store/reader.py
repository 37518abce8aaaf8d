"""Read side of the hidden-state store: random access, iteration, and the training stream."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import zstandard
from torch.utils.data import IterableDataset, get_worker_info

from eagle3.store.codec import FORMAT, Fp8Codes, Planes, Sample, decode_sample
from eagle3.store.layout import INDEX_NAME, MANIFEST_NAME


class StoreCorruptError(RuntimeError):
    """A stored sample failed its length, checksum or format check."""


@dataclass
class StatePlanes:
    """bf16 states [..., tokens, channels] as the lossless store keeps them: `top` [..., channels,
    tokens] uint8 (sign and exponent bytes, channel-major), `low` [..., tokens, channels] uint8.

    This and Fp8States are the two forms a batch's states travel in from the store to the trainer's
    device, where decode() makes them bf16: on a GPU that is a few kernels; on the host it would
    cost the CPU what decoding costs the store's reader. collate fills a batch's rows through
    `batch` and `put_row`."""

    top: torch.Tensor
    low: torch.Tensor

    @classmethod
    def of(cls, states: torch.Tensor) -> StatePlanes:
        """The planes of bf16 states [tokens, channels], split where they are."""
        words = states.contiguous().view(torch.int16)
        top = ((words >> 8) & 0xFF).to(torch.uint8).t().contiguous()
        return cls(top, (words & 0xFF).to(torch.uint8))

    def batch(self, rows: int, columns: int, pin_memory: bool) -> StatePlanes:
        """Room for `rows` samples' states of `columns` tokens each, in this sample's form."""
        channels = self.top.shape[0]
        return StatePlanes(_empty(rows, channels, columns, pin_memory=pin_memory),
                           _empty(rows, columns, channels, pin_memory=pin_memory))

    def put_row(self, row: int, sample: StatePlanes, start: int, count: int) -> None:
        """Row `row` of this batch: the sample's tokens start..start+count, then zeros (bf16 0)."""
        self.top[row, :, :count] = sample.top[:, start : start + count]
        self.low[row, :count] = sample.low[start : start + count]
        self.top[row, :, count:].zero_()
        self.low[row, count:].zero_()

    def to(self, device: torch.device) -> StatePlanes:
        return StatePlanes(*(t.to(device, non_blocking=True) for t in (self.top, self.low)))

    def decode(self) -> torch.Tensor:
        return join_planes(self.top, self.low)


@dataclass
class Fp8States:
    """bf16 states as the lossy store (extract.store_dtype: fp8_e4m3) keeps them: `codes` [...,
    tokens, channels] float8 e4m3 bytes, `scales` [..., tokens, groups] fp32 (one per token and
    group of channels/groups channels). Half the bytes of StatePlanes on the way to the device."""

    codes: torch.Tensor
    scales: torch.Tensor

    def batch(self, rows: int, columns: int, pin_memory: bool) -> Fp8States:
        return Fp8States(_empty(rows, columns, self.codes.shape[-1], pin_memory=pin_memory),
                         _empty(rows, columns, self.scales.shape[-1], dtype=torch.float32, pin_memory=pin_memory))

    def put_row(self, row: int, sample: Fp8States, start: int, count: int) -> None:
        """As StatePlanes.put_row; the padding is code 0 with scale 0, which decodes to 0."""
        self.codes[row, :count] = sample.codes[start : start + count]
        self.scales[row, :count] = sample.scales[start : start + count]
        self.codes[row, count:].zero_()
        self.scales[row, count:].zero_()

    def to(self, device: torch.device) -> Fp8States:
        return Fp8States(*(t.to(device, non_blocking=True) for t in (self.codes, self.scales)))

    def decode(self) -> torch.Tensor:
        """bf16 [..., tokens, channels]: code value x scale in float32, rounded once to bf16 (bitwise
        the host's codec.from_fp8)."""
        values = self.codes.view(torch.float8_e4m3fn).float().unflatten(-1, (self.scales.shape[-1], -1))
        return (values * self.scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


StoredStates = StatePlanes | Fp8States


def _empty(*shape: int, dtype: torch.dtype = torch.uint8, pin_memory: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)


def join_planes(top: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """bf16 states [..., tokens, channels] from top [..., channels, tokens] and low [..., tokens,
    channels] (uint8), on whatever device they are; contiguous token-major (elementwise ops may
    otherwise keep the channel-major strides of `top`, which every consumer would then pay for)."""
    return ((top.transpose(-1, -2).to(torch.int16) << 8) | low.to(torch.int16)).view(torch.bfloat16).contiguous()


def to_torch(sample: Sample) -> dict[str, torch.Tensor | StoredStates]:
    """The sample's arrays as tensors, bfloat16 ones as torch.bfloat16 (no copy); bfloat16 arrays
    read as stored stay so (StatePlanes, Fp8States: decode() where they are used), other Planes are
    joined here."""
    out: dict[str, torch.Tensor | StoredStates] = {}
    for name, arr in sample.arrays.items():
        bf16 = sample.dtypes[name] == "bfloat16"
        if isinstance(arr, Planes) and bf16:
            out[name] = StatePlanes(torch.from_numpy(arr.top), torch.from_numpy(arr.low[..., 0]))
            continue
        if isinstance(arr, Fp8Codes):
            out[name] = Fp8States(torch.from_numpy(arr.codes).view(len(arr.scales), -1), torch.from_numpy(arr.scales))
            continue
        tensor = torch.from_numpy(arr.join() if isinstance(arr, Planes) else arr)
        out[name] = tensor.view(torch.bfloat16) if bf16 else tensor
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

    def read_row(self, row: int, as_stored: bool = False) -> Sample:
        """The sample in row `row` of the index, checksum-verified; with as_stored, state arrays as
        stored (codec.decode_sample)."""
        sample_id, shard = self.sample_ids[row], self._shards[row]
        offset, length = int(self._offsets[row]), int(self._lengths[row])
        path = self.root / shard
        blob = np.empty(length, np.uint8)  # writable: arrays decoded from it become tensors without a copy
        if os.preadv(self._fd(shard), [blob], offset) != length:
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
            sample = decode_sample(blob, as_stored)
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
        if shard not in self._fds:  # several reader threads may open it at once: one descriptor is kept
            fd = os.open(self.root / shard, os.O_RDONLY)
            if self._fds.setdefault(shard, fd) != fd:
                os.close(fd)
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
