"""The store's sample codec: a sample's arrays as one checksummed blob, bf16 states as byte planes.

A blob is: u32 little-endian header length, a JSON header naming each array's dtype, shape, codec
and stored size, then the arrays' stored bytes in header order. Float arrays are split into byte
planes: the top byte (sign + high exponent bits) channel-major and zstd-coded, the lower bytes
(mantissa noise no coder shrinks) stored raw. The index keeps each blob's CRC-32; the reader
checks it before decoding.

Lossy (extract.store_dtype: fp8_e4m3): a bf16 state array is stored as float8 e4m3 with one fp32
scale per token and group of channels (a group is one layer's state: aux concatenates layers whose
magnitudes differ tenfold), then zstd-coded token-major; it decodes back to bf16, so readers see
the same dtype either way.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

FORMAT = "eagle3-hidden-store/1"
PLANES_CODEC = "top-byte-channel-major+zstd/low-bytes-raw"
PLAIN_CODEC = "zstd"
FP8_CODEC = "fp8_e4m3-per-token-group-scale+zstd"
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
# extract.store_dtype -> the codec of the stored states
STATE_CODECS = {"bf16": PLANES_CODEC, "fp8_e4m3": FP8_CODEC}
CHECKSUM = "crc32"
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
class Fp8Codes:
    """A lossy state array as stored, not yet decoded (from_fp8): `scales` [tokens, groups] fp32,
    `codes` [tokens, channels] float8 e4m3 bytes. The trainer decodes them on its GPU: on the host
    the decode and the split into planes held one H200's reader to 1.33x its trainer's need."""

    scales: np.ndarray
    codes: np.ndarray
    shape: tuple[int, ...]

    def join(self) -> np.ndarray:
        return from_fp8(self.scales, self.codes, self.shape)


@dataclass
class Sample:
    """A decoded sample; bfloat16 arrays are uint16 views, `dtypes` names their real dtype. State
    arrays stay as stored (Planes, Fp8Codes) when the reader asked for them so."""

    sample_id: str
    arrays: dict[str, np.ndarray | Planes | Fp8Codes]
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
    k = dtype.itemsize
    word = np.dtype(f"<u{k}")
    # torch's 2-D transpose copy works in cache-sized tiles: ~3x faster than numpy's here
    out = torch.from_numpy(top).t().contiguous().numpy().astype(word)
    out <<= 8 * (k - 1)
    for i in range(k - 1):
        out |= low[..., i].astype(word) << (8 * i)
    return out.view(dtype).reshape(shape)


def to_fp8(data: np.ndarray, group: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(scales [tokens, groups] fp32, float8 e4m3 bytes [tokens, channels]) of bf16 words [tokens,
    channels]: each token's group of `group` channels scaled so its largest magnitude is FP8_MAX."""
    tokens, channels = data.shape[0], int(np.prod(data.shape[1:]))
    if channels % group:
        raise ValueError(f"array {name!r}: {channels} channels do not split into groups of {group}")
    x = torch.from_numpy(data.reshape(tokens, channels // group, group)).view(torch.bfloat16).float()
    if not torch.isfinite(x).all():
        raise ValueError(f"array {name!r} holds inf or NaN, which float8 e4m3 cannot store "
                         "(extract.store_dtype: bf16 keeps them)")
    amax = x.abs().amax(-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    codes = (x / scales).to(torch.float8_e4m3fn).view(torch.uint8).reshape(tokens, channels)
    return scales.reshape(tokens, -1).numpy(), codes.numpy()


# Every float8 e4m3 byte's value as float32: a table lookup decodes 2.5x faster than torch's float8 cast
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def from_fp8(scales: np.ndarray, codes: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of to_fp8, up to float8's rounding: bf16 words (uint16) of `shape` (code value x scale
    in float32, rounded once to bf16)."""
    tokens, groups = scales.shape
    x = _FP8_VALUES[codes].reshape(tokens, groups, -1)
    x *= scales[..., None]
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.uint16).numpy().reshape(shape)


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
    fp8_groups: Mapping[str, int] | None = None,
) -> EncodedSample:
    """Compresses one sample into a checksummed blob; `dtypes` maps every array to its dtype name.
    `fp8_groups`: bf16 arrays stored lossily as float8 e4m3, with the channels per scale of each."""
    entries: list[dict[str, Any]] = []
    payloads: list[bytes | memoryview] = []
    raw_bytes = 0
    for name, arr in arrays.items():
        dtype = dtypes[name]
        data = np.ascontiguousarray(arr, dtype=storage_dtype(dtype))
        entry = {"name": name, "dtype": dtype, "shape": list(data.shape)}
        group = (fp8_groups or {}).get(name)
        if group and dtype == "bfloat16" and data.size:
            scales, codes = to_fp8(data, group, name)
            stored = cctx.compress(codes)
            entry.update(codec=FP8_CODEC, group=group, scales_size=scales.nbytes, size=scales.nbytes + len(stored))
            payloads += [scales.tobytes(), stored]
        elif uses_planes(dtype) and data.size:
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


def decode_sample(blob: bytes | memoryview | np.ndarray, as_stored: bool = False) -> Sample:
    """Inverse of encode_sample (the caller has verified the checksum); with as_stored, float
    arrays stay as stored (Planes, Fp8Codes) for the caller to join where it computes."""
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
            arrays[name] = planes if as_stored else planes.join()
        elif entry["codec"] == FP8_CODEC:
            tokens, groups = shape[0], count // shape[0] // entry["group"]
            if entry["scales_size"] != tokens * groups * 4:
                raise ValueError(f"array {name!r} has {entry['scales_size']} scale bytes, shape {shape} and "
                                 f"group {entry['group']} say {tokens * groups * 4}")
            scales = np.frombuffer(stored[: entry["scales_size"]], "<f4").reshape(tokens, groups)
            lossy = Fp8Codes(scales, _decompress(dctx, stored[entry["scales_size"] :], count, name), shape)
            arrays[name] = lossy if as_stored else lossy.join()
        elif entry["codec"] == PLAIN_CODEC:
            raw = _decompress(dctx, stored, dtype.itemsize * count, name) if count else np.empty(0, np.uint8)
            arrays[name] = raw.view(dtype).reshape(shape)
        else:
            raise ValueError(f"array {name!r}: unknown codec {entry['codec']!r} (this reader knows "
                             f"{PLANES_CODEC!r}, {FP8_CODEC!r} and {PLAIN_CODEC!r})")
        dtypes[name] = entry["dtype"]
    if pos != len(view):
        raise ValueError(f"blob has {len(view) - pos} bytes after its last array")
    return Sample(header["id"], arrays, dtypes)
