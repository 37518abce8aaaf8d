"""Hidden-state store: lossless roundtrip, corruption detection, crash resume, full disk, epochs."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from eagle3 import atomic
from eagle3.store import codec, layout
from eagle3.store.layout import completed_sample_ids, merge_index, rank_todo, write_manifest
from eagle3.store.reader import (
    Fp8States,
    HiddenStateStream,
    HiddenStore,
    StatePlanes,
    StoreCorruptError,
    epoch_rows,
    join_planes,
    to_torch,
)
from eagle3.store.writer import ShardWriter, StoreWriteError

HT = 4  # target hidden size of the toy samples


def toy_sample(i: int, tokens: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    t = tokens or int(rng.integers(3, 9))
    return {
        "input_ids": rng.integers(0, 50_000, t).astype(np.int32),
        "loss_mask": (rng.random(t) < 0.6).astype(np.uint8),
        "aux": rng.integers(0, 1 << 16, (t, 3 * HT)).astype(np.uint16),
        "last": rng.integers(0, 1 << 16, (t, HT)).astype(np.uint16),
    }


def ids(n: int) -> list[str]:
    return [f"s{i:03d}" for i in range(n)]


def write(root: Path, sample_ids: list[str], *, rank: int = 0, **kwargs: object) -> None:
    with ShardWriter(root, rank=rank, shard_samples=2, **kwargs) as writer:
        for sid in sample_ids:
            writer.put(sid, toy_sample(int(sid[1:])))


def finish(root: Path) -> layout.StoreTotals:
    totals = merge_index(root)
    spec = codec.ArraySpec
    write_manifest(
        root,
        model_hash="test",
        aux_layer_ids=[2, 15, 27],
        layer_id_convention="vllm: id X = output of decoder layer X-1 (HF hidden_states[X])",
        last_state="pre_norm",
        arrays={
            "input_ids": spec("int32", ()),
            "loss_mask": spec("uint8", ()),
            "aux": spec("bfloat16", (3 * HT,)),
            "last": spec("bfloat16", (HT,)),
        },
        level=codec.DEFAULT_LEVEL,
        totals=totals,
    )
    return totals


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


def no_temp_files(root: Path) -> bool:
    return not list(root.glob("*.tmp"))


def test_roundtrip_is_bitwise_for_every_bf16_pattern(tmp_path: Path) -> None:
    patterns = np.random.default_rng(0).permutation(1 << 16).astype(np.uint16)  # NaNs, infs, -0
    t = 128
    sample = {
        "input_ids": np.arange(t, dtype=np.int32),
        "loss_mask": (np.arange(t) % 2).astype(np.uint8),
        "aux": patterns[: t * 3 * t].reshape(t, 3 * t),
        "last": patterns[t * 3 * t :].reshape(t, t),
        "extra_f32": np.random.default_rng(1).standard_normal((t, 3)).astype(np.float32),
        "extra_i64": np.arange(t, dtype=np.int64) * -7,
    }
    with ShardWriter(tmp_path, level=3, shard_samples=2) as writer:
        for i in range(3):
            writer.put(f"p{i}", sample)
        writer.put("short", {key: value[:50] for key, value in sample.items()})
    stats = writer.close()
    totals = merge_index(tmp_path)
    assert (stats.samples, stats.tokens, stats.shards) == (4, 3 * t + 50, 2)
    assert (totals.raw_bytes, totals.stored_bytes) == (stats.raw_bytes, stats.stored_bytes)
    write_manifest(
        tmp_path, model_hash="m", aux_layer_ids=[1, 2, 3], layer_id_convention="c",
        last_state="post_norm", arrays=stats.schema, level=3, totals=totals,
    )
    store = HiddenStore(tmp_path)
    assert sorted(s.sample_id for s in store) == ["p0", "p1", "p2", "short"]
    got = store.get("p1")
    assert_same(got.arrays, sample)
    assert got.dtypes["aux"] == "bfloat16" and got.dtypes["extra_f32"] == "float32"

    tensors = to_torch(got)
    assert tensors["aux"].dtype == tensors["last"].dtype == torch.bfloat16
    flat = torch.cat([tensors["aux"].flatten(), tensors["last"].flatten()])
    bits = np.concatenate([sample["aux"].ravel(), sample["last"].ravel()])
    assert torch.equal(flat.view(torch.int16), torch.from_numpy(bits.view(np.int16)))
    where = {int(v): i for i, v in enumerate(bits)}
    assert torch.isnan(flat[where[0x7FC0]]) and torch.isnan(flat[where[0xFFFF]])
    assert flat[where[0x7F80]] == float("inf") and flat[where[0xFF80]] == float("-inf")
    assert flat[where[0x8000]] == 0 and torch.signbit(flat[where[0x8000]])

    # The trainer's path: planes kept at read, joined by torch (on its GPU): the same bits.
    split = to_torch(store.read_row(store.sample_ids.index("p1"), as_stored=True))
    for name in ("aux", "last"):
        assert isinstance(split[name], StatePlanes)
        joined = join_planes(split[name].top, split[name].low)
        assert torch.equal(joined.view(torch.int16), tensors[name].view(torch.int16)), name
    assert torch.equal(split["extra_f32"], torch.from_numpy(sample["extra_f32"]))


def index_row(root: Path, sample_id: str) -> dict[str, object]:
    rows = pq.read_table(root / layout.INDEX_NAME).to_pylist()
    return next(row for row in rows if row["sample_id"] == sample_id)


def test_corrupted_byte_is_detected(tmp_path: Path) -> None:
    write(tmp_path, ids(4))
    finish(tmp_path)
    row = index_row(tmp_path, "s003")
    shard = tmp_path / row["shard"]
    data = bytearray(shard.read_bytes())
    data[row["offset"] + row["length"] // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match=rf"checksum.*{shard.name}.*'s003'"):
        HiddenStore(tmp_path).get("s003")
    assert_same(HiddenStore(tmp_path).get("s002").arrays, toy_sample(2))  # its shard neighbour


def test_truncated_shard_is_detected(tmp_path: Path) -> None:
    write(tmp_path, ids(4))
    finish(tmp_path)
    row = index_row(tmp_path, "s001")
    shard = tmp_path / row["shard"]
    os.truncate(shard, row["offset"] + 5)
    store = HiddenStore(tmp_path)
    with pytest.raises(StoreCorruptError, match=rf"{shard.name} is truncated: sample 's001'"):
        store.get("s001")
    with pytest.raises(StoreCorruptError, match="s001"):
        list(HiddenStore(tmp_path))


def test_resume_after_crash_stores_exactly_the_missing_samples(tmp_path: Path) -> None:
    everything = ids(10)
    write(tmp_path, everything[:6])  # shards 0..2
    # the crash: shard 2 renamed but its index part never written, shard 3 half written
    (tmp_path / layout.index_part_name(0, 2)).unlink()
    (tmp_path / (layout.shard_name(0, 3) + ".tmp")).write_bytes(b"half a shard")
    (tmp_path / (layout.index_part_name(0, 3) + ".tmp")).write_bytes(b"x")

    done = completed_sample_ids(tmp_path)
    assert done == set(everything[:4])
    todo = rank_todo(everything, done, rank=0, world_size=1)
    assert todo == everything[4:]
    write(tmp_path, todo)

    assert no_temp_files(tmp_path)
    assert not (tmp_path / layout.shard_name(0, 2)).exists()  # numbering went on after it
    assert (tmp_path / layout.shard_name(0, 5)).exists()
    totals = finish(tmp_path)
    store = HiddenStore(tmp_path)
    assert totals.samples == 10 and sorted(store.sample_ids) == everything
    for sample in store:
        assert_same(sample.arrays, toy_sample(int(sample.sample_id[1:])))


def fill_disk_after(budget: int):
    """An atomic._write that writes what fits into `budget` bytes, then fails like a full disk."""
    written = 0

    def write_bytes(f, data) -> None:
        nonlocal written
        room = budget - written
        if len(data) > room:
            f.write(bytes(memoryview(data)[: max(room, 0)]))
            written = budget
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write(data)
        written += len(data)

    return write_bytes


def fail_index_part(number: int):
    """An atomic._write that fails the `number`-th index part write with ENOSPC."""
    count = 0

    def write_bytes(f, data) -> None:
        nonlocal count
        if ".parquet." in f.name and f.name.endswith(".tmp"):
            count += 1
            if count == number:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write(data)

    return write_bytes


@pytest.mark.parametrize("failure", ["in_shard", "in_index_part"])
def test_full_disk_leaves_no_partial_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    everything = ids(10)
    dry = tmp_path / "dry"
    write(dry, everything)
    first_two = sum(
        (dry / name(0, seq)).stat().st_size
        for seq in (0, 1)
        for name in (layout.shard_name, layout.index_part_name)
    )
    root = tmp_path / "store"
    if failure == "in_shard":
        third_half = (dry / layout.shard_name(0, 2)).stat().st_size // 2
        monkeypatch.setattr(atomic, "_write", fill_disk_after(first_two + third_half))
    else:
        monkeypatch.setattr(atomic, "_write", fail_index_part(3))

    with pytest.raises(StoreWriteError) as info:
        write(root, everything)
    assert info.value.errno == errno.ENOSPC
    assert str(root) in str(info.value) and "disk full" in str(info.value)
    assert "bytes" in str(info.value)

    assert no_temp_files(root)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        name(0, seq) for seq in (0, 1) for name in (layout.shard_name, layout.index_part_name)
    )
    assert completed_sample_ids(root) == set(everything[:4])

    monkeypatch.undo()
    write(root, rank_todo(everything, completed_sample_ids(root), 0, 1))
    finish(root)
    store = HiddenStore(root)
    assert sorted(store.sample_ids) == everything
    for sample in store:
        assert_same(sample.arrays, toy_sample(int(sample.sample_id[1:])))


def test_writer_rejects_contract_violations(tmp_path: Path) -> None:
    with ShardWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="bfloat16"):
            writer.put("a", {**toy_sample(0), "aux": np.zeros((5, 3 * HT), np.float32)})
        writer.put("a", toy_sample(0))
        with pytest.raises(ValueError, match="already put"):
            writer.put("a", toy_sample(0))
        with pytest.raises(ValueError, match="schema"):
            writer.put("b", {**toy_sample(1, 4), "last": np.zeros((4, HT + 1), np.uint16)})


@pytest.fixture(scope="module")
def two_rank_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_ranks")
    everything = ids(21)
    for rank in (0, 1):
        write(root, rank_todo(everything, set(), rank, 2), rank=rank)
    finish(root)
    return root


def epoch_ids(root: Path, *, seed: int, epoch: int, rank: int, world_size: int, workers: int):
    stream = HiddenStateStream(root, seed=seed, rank=rank, world_size=world_size)
    stream.set_epoch(epoch)
    items = list(DataLoader(stream, batch_size=None, num_workers=workers))
    assert all(item["aux"].dtype == torch.bfloat16 for item in items)
    return [item["sample_id"] for item in items]


def test_epoch_visits_every_sample_once_across_ranks_and_workers(two_rank_store: Path) -> None:
    everything = ids(21)
    by_rank = [
        epoch_ids(two_rank_store, seed=7, epoch=0, rank=r, world_size=2, workers=2) for r in (0, 1)
    ]
    assert sorted(by_rank[0] + by_rank[1]) == everything
    assert (len(by_rank[0]), len(by_rank[1])) == (11, 10)

    same = epoch_ids(two_rank_store, seed=7, epoch=0, rank=0, world_size=2, workers=0)
    assert same == by_rank[0]  # order depends on (seed, epoch) only, not on the worker count
    next_epoch = epoch_ids(two_rank_store, seed=7, epoch=1, rank=0, world_size=1, workers=2)
    assert sorted(next_epoch) == everything
    first_epoch = epoch_ids(two_rank_store, seed=7, epoch=0, rank=0, world_size=1, workers=2)
    assert next_epoch != first_epoch


def test_even_split_gives_every_rank_the_same_count() -> None:
    shares = [epoch_rows(21, seed=1, epoch=3, rank=r, world_size=4, even=True) for r in range(4)]
    assert {len(s) for s in shares} == {5}
    assert len(np.unique(np.concatenate(shares))) == 20


def test_unknown_codec_is_named() -> None:
    header = json.dumps({"id": "s0", "arrays": [{"name": "aux", "dtype": "bfloat16", "shape": [1, 2],
                                                 "codec": "lz4", "size": 0}]}).encode()
    with pytest.raises(ValueError, match="array 'aux': unknown codec 'lz4'"):
        codec.decode_sample(struct.pack("<I", len(header)) + header)


def test_fp8_store_reads_back_bf16_within_float8_rounding(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    t, groups = 64, 3
    aux = torch.from_numpy(rng.standard_normal((t, groups, HT * 8)).astype(np.float32))
    aux *= torch.tensor([0.05, 1.0, 30.0])[:, None]  # layers of different magnitude, one scale each
    aux[:, 2, 0] = 3000.0  # an outlier channel
    aux[5] = 0.0  # an all-zero token (scale 1, decodes to zeros)
    words = aux.reshape(t, -1).to(torch.bfloat16).view(torch.uint16).numpy()
    sample = {"input_ids": np.arange(t, dtype=np.int32), "loss_mask": np.ones(t, np.uint8), "aux": words,
              "last": words[:, : HT * 8].copy()}
    for name, groups_of in (("lossless", None), ("fp8", {"aux": HT * 8, "last": HT * 8})):
        with ShardWriter(tmp_path / name, fp8_groups=groups_of) as writer:
            writer.put("s0", sample)
        stats = writer.close()
        write_manifest(tmp_path / name, model_hash="m", aux_layer_ids=[1, 2, 3], layer_id_convention="c",
                       last_state="pre_norm", arrays=stats.schema, level=1, totals=merge_index(tmp_path / name),
                       store_dtype="fp8_e4m3" if groups_of else "bf16")
    lossless, fp8 = HiddenStore(tmp_path / "lossless"), HiddenStore(tmp_path / "fp8")
    assert fp8.manifest["codec"]["floats"] == codec.FP8_CODEC and fp8.manifest["codec"]["store_dtype"] == "fp8_e4m3"
    values, scales = words.size + sample["last"].size, t * (groups + 1)
    # at most a byte per value and 4 per scale (zstd shrinks float8 codes a little on real states: 0.86);
    # the lossless planes keep a raw mantissa byte per value plus the coded top byte
    assert fp8.manifest["stored_bytes"] < values + 4 * scales + 600 < lossless.manifest["stored_bytes"] - values // 4

    got = fp8.get("s0")
    assert got.dtypes["aux"] == "bfloat16" and got.arrays["aux"].dtype == np.uint16
    assert np.array_equal(got.arrays["input_ids"], sample["input_ids"])
    want = torch.from_numpy(words).view(torch.bfloat16).float().reshape(t, groups, -1)
    back = torch.from_numpy(got.arrays["aux"]).view(torch.bfloat16).float().reshape(t, groups, -1)
    scale = want.abs().amax(-1, keepdim=True) / codec.FP8_MAX
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; below 2^-6 (subnormals) a fixed step
    # of 2^-10, all times the group's scale; bf16's rounding of the result adds 1/256
    bound = want.abs() * (1 / 16 + 1 / 256) + scale * 2.0**-10
    assert ((back - want).abs() <= bound).all()
    assert (back[5] == 0).all() and torch.equal(back[:, 2, 0], want[:, 2, 0])  # a group's largest is exact
    assert ((back - want).norm() / want.norm()) < 0.03
    # the trainer's path: codes and scales as stored, decoded where it computes, to the same bits
    split = to_torch(fp8.read_row(0, as_stored=True))
    assert isinstance(split["aux"], Fp8States) and split["aux"].codes.dtype == torch.uint8
    assert split["aux"].scales.shape == (t, groups)
    assert torch.equal(split["aux"].decode().view(torch.int16), torch.from_numpy(got.arrays["aux"].view(np.int16)))

    bad = dict(sample, aux=words.copy())
    bad["aux"][3, 7] = 0x7F80  # +inf
    with pytest.raises(ValueError, match="sample 's1': array 'aux' holds inf or NaN.*store_dtype: bf16"):
        with ShardWriter(tmp_path / "bad", fp8_groups={"aux": HT * 8}) as writer:
            writer.put("s1", bad)


def test_fp8_decode_equals_the_float8_cast_times_the_scale_for_every_code() -> None:
    codes = np.tile(np.arange(256, dtype=np.uint8), (3, 2))  # 3 tokens x 512 channels, two groups of 256
    codes[codes == 0x7F] = codes[codes == 0xFF] = 0  # e4m3fn's NaN codes, which to_fp8 never writes
    scales = np.array([[1.0, 0.5], [2.0**-9, 3.0], [448.0, 1e-3]], np.float32)
    cast = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().reshape(3, 2, 256)
    want = (cast * torch.from_numpy(scales)[..., None]).to(torch.bfloat16).view(torch.uint16).numpy().reshape(3, 512)
    assert np.array_equal(codec.from_fp8(scales, codes, (3, 512)), want)
    # the trainer's decode (torch, on its device) is bitwise the host's table decode
    device_side = Fp8States(torch.from_numpy(codes), torch.from_numpy(scales)).decode()
    assert np.array_equal(device_side.view(torch.uint16).numpy(), want)
