"""train.source online and hybrid: a capture process beside the trainer computes the states.

The tiny target and store of tests/test_train.py. Its store's states come from one forward per
sample, so a capture process that also runs one sample per forward (capture_max_tokens=1) computes
them bitwise: then online and hybrid runs must train the store-trained weights bitwise, through a
kill -9 of the capture process or of the trainer. Nothing trained twice or skipped, or they differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from eagle3.store.layout import completed_sample_ids, merge_index, sample_arrays, write_manifest
from eagle3.store.reader import HiddenStore
from eagle3.store.writer import ShardWriter
from eagle3.training import online
from eagle3.training.loop import train
from eagle3.training.params import Paths, TrainError
from tests import test_train as tiny
from tests.test_train import AUX_IDS, killed_in_checkpoint, paths_for, small_params, weights

# the tiny target, its store and the store-trained reference run, shared with tests/test_train.py
workspace, trained, one_thread = tiny.workspace, tiny.trained, tiny.one_thread
ONLINE = dict(capture_max_tokens=1, prefetch_batches=2)


@pytest.fixture(autouse=True)
def one_capture_thread(monkeypatch):
    # The capture process computes as the fixture's store did: one intra-op thread.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def token_store(workspace) -> Path:
    """The store as extract leaves it for an online run: token ids and loss masks, no states."""
    full = HiddenStore(workspace / "artifacts" / "hidden")
    root = workspace / "artifacts" / "tokens"
    with ShardWriter(root, shard_samples=8) as writer:
        for sample in full:
            writer.put(sample.sample_id, {k: sample.arrays[k] for k in ("input_ids", "loss_mask")})
    write_manifest(root, model_hash=full.manifest["model_hash"], aux_layer_ids=AUX_IDS, layer_id_convention="vLLM",
                   last_state="pre_norm", arrays=sample_arrays(len(AUX_IDS), 64, states=False), level=1,
                   totals=merge_index(root), extra={"states": False})
    return root


def online_paths(workspace: Path, token_store: Path, out: Path) -> Paths:
    return dataclasses.replace(paths_for(workspace, out), hidden=token_store, hybrid=out / "run" / "hybrid-store")


def assert_bitwise(got: Path, expected: Path) -> None:
    reference = weights(expected)
    trained_now = weights(got)
    assert trained_now.keys() == reference.keys()
    assert all(torch.equal(trained_now[name], reference[name]) for name in reference), "weights differ"


def test_online_without_stored_states_trains_the_store_trained_weights(trained, workspace, token_store, tmp_path,
                                                                       monkeypatch):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = online_paths(workspace, token_store, tmp_path)
    record = train(small_params(source="online", **ONLINE), paths)
    assert_bitwise(paths.out, reference.out)
    states = record["states"]
    assert states["source"] == "online" and 0 <= states["stall_share"] <= 1
    assert states["captured_batches"] > 0 and states["capture_tokens_per_s"] > 0 and states["capture_restarts"] == 0
    assert 0 < states["prefetch_peak_mb"] and states["capture_peak_rss_mb"] > 0
    assert not list((tmp_path / "run" / "prefetch" / "rank0").glob("*.safetensors"))  # the buffer is drained


def test_store_source_refuses_a_token_store_naming_the_fix(workspace, token_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainError, match="token ids only .* train.source: store rerun extract"):
        train(small_params(), online_paths(workspace, token_store, tmp_path))


def test_capture_process_killed_with_kill_9_is_restarted_at_the_same_batch(trained, workspace, token_store,
                                                                           tmp_path, monkeypatch, capsys):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    real_account, kills = online.CaptureProcess.account, []

    def account_and_kill(self, waited, batch, meta):
        real_account(self, waited, batch, meta)
        if self.figures.batches in (3, 11):  # a capture process dies twice, mid-epoch and in a later one
            kills.append(self.process.pid)
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    monkeypatch.setattr(online.CaptureProcess, "account", account_and_kill)
    paths = online_paths(workspace, token_store, tmp_path)
    record = train(small_params(source="online", **ONLINE), paths)
    assert len(kills) == 2 and record["states"]["capture_restarts"] == 2
    assert_bitwise(paths.out, reference.out)
    assert capsys.readouterr().err.count("capture process exited with code -9; restarting it at batch") == 2


def test_trainer_killed_with_kill_9_resumes_and_asks_again_for_its_batch(trained, workspace, token_store, tmp_path,
                                                                         monkeypatch):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = online_paths(workspace, token_store, tmp_path)
    params = small_params(source="online", **ONLINE)
    killed_in_checkpoint(paths, params, 2)  # in its step-6 checkpoint
    record = train(params, paths)
    assert record["resumed_from_step"] == 3
    assert_bitwise(paths.out, reference.out)


def test_hybrid_interrupted_in_its_first_epoch_resumes_and_later_epochs_read_the_store(
        trained, workspace, token_store, tmp_path, monkeypatch):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = online_paths(workspace, token_store, tmp_path)
    params = small_params(source="hybrid", checkpoint_every=1, **ONLINE)
    killed_in_checkpoint(paths, params, 3)  # at step 3 of the first epoch's 4
    # its orphaned capture process commits what it stored once it sees the trainer gone
    deadline = time.monotonic() + 60
    while not completed_sample_ids(paths.hybrid) and time.monotonic() < deadline:
        time.sleep(0.1)
    kept = merge_index(paths.hybrid).samples
    assert 0 < kept < 24  # what the first epoch had stored survives the trainer
    record = train(params, paths)
    assert record["resumed_from_step"] == 2
    steps_per_epoch = record["steps"] // params.epochs
    # online: only the first epoch's last steps (2 batches each) and nothing after it
    assert record["states"]["captured_batches"] == 2 * (steps_per_epoch - 2)
    store = HiddenStore(paths.hybrid)
    assert len(store) == 24 and json.loads((paths.hybrid / "manifest.json").read_text())["states"]
    assert_bitwise(paths.out, reference.out)


def test_a_capture_that_cannot_start_stops_the_run_with_the_end_of_its_output(workspace, token_store, tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(online, "capture_device", lambda *args: "no-such-device")
    with pytest.raises(TrainError, match=r"died 3 times in a row .* the end of its output") as err:
        train(small_params(source="online", **ONLINE), online_paths(workspace, token_store, tmp_path))
    assert "no-such-device" in str(err.value).split("the end of its output")[1]  # the capture's own traceback


def test_capture_gpus_puts_each_ranks_capture_on_the_first_gpus_and_sharing_keeps_its_own():
    assert online.capture_device("cpu", 3, 2) == "cpu"
    assert [online.capture_device("cuda", rank, 0) for rank in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    # capture_gpus 2 on 8 GPUs: the 6 training ranks (GPUs 2-7, init_distributed's offset) capture on GPUs 0 and 1
    assert [online.capture_device("cuda", rank, 2) for rank in range(6)] == ["cuda:0", "cuda:1"] * 3


def test_the_engine_captures_jobs_carry_extract_engine_timeout_s(tmp_path):
    # A 1T target's 18K-token prefill on a loaded server outlasts the job's 600 s default.
    params = small_params(source="online", capture_engine="vllm", prefetch_dir=str(tmp_path / "prefetch"))
    server = online.CaptureServer(tmp_path / "server", started=False, timeout_s=3600.0)
    capture = online.start_capture(params, tmp_path / "hidden", tmp_path / "target", AUX_IDS, tmp_path, "cpu", 0, 0,
                                   server)
    assert capture.template.engine_timeout_s == 3600.0
    assert capture.template.engine_state_dir == str(tmp_path / "server")


def test_hybrid_store_compresses_with_half_the_hosts_cores_shared_by_its_ranks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert online.store_compress_threads() == 8  # one H200 box: the trainer and capture keep the other 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert online.store_compress_threads() == 2  # never fewer than the writer's default
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert online.store_compress_threads() == 8


def test_source_and_capture_params_are_checked_by_name():
    from eagle3.training.params import check_params

    with pytest.raises(TrainError, match="train.source='disk' is not one of"):
        check_params(small_params(source="disk"), 1)
    with pytest.raises(TrainError, match="train.prefetch_batches=0 must be >= 1"):
        check_params(small_params(prefetch_batches=0), 1)
    with pytest.raises(TrainError, match="train.capture_gpus=-1 must be >= 0"):
        check_params(small_params(capture_gpus=-1), 1)
