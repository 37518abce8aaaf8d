"""Server lifecycle: stop exactly what we started, status from files, the accelerator guard."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from eagle3.atomic import atomic_write_json
from eagle3.engine import server, state
from eagle3.generation.status import progress_lines
from tests.conftest import shipped


def fake_state(state_dir, pid: int, gpu: bool, port: int = 1) -> None:
    record = state.ServerState(pid=pid, url=f"http://127.0.0.1:{port}", model="target", model_path="/m",
                               started_at=time.time(), gpu=gpu, log=str(state_dir / "server.log"))
    atomic_write_json(state_dir / "server.json", record.__dict__)


def test_stop_ends_the_whole_process_group(tmp_path):
    # A parent with a child, in its own session, as `start` launches vLLM (API server + engine workers).
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], start_new_session=True)
    time.sleep(0.5)
    children = [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(children) == 2
    fake_state(tmp_path, proc.pid, gpu=False)
    assert server.stop(tmp_path, timeout_s=10) is True
    proc.wait(timeout=10)
    assert not any(state.pid_alive(pid) for pid in children)
    assert state.ServerState.read(tmp_path) is None
    assert server.stop(tmp_path) is False  # nothing left to stop


def test_accelerator_guard_refuses_while_our_gpu_server_runs(tmp_path):
    fake_state(tmp_path, os.getpid(), gpu=True)
    with pytest.raises(state.ServerError, match=r"\(pid \d+, http://127.0.0.1:1\) holds the GPUs that extract needs; run "
                                                "`make stop` first"):
        state.require_accelerators_free("extract", tmp_path)
    fake_state(tmp_path, os.getpid(), gpu=False)  # CPU-only server: nothing to free
    state.require_accelerators_free("extract", tmp_path)


def test_status_of_a_running_server(vllm_server, tmp_path):
    atomic_write_json(tmp_path / "server.json", vllm_server.__dict__)
    line = state.status_lines(tmp_path)[0]
    assert line.startswith(f"server: up at {vllm_server.url}, model target") and f"pid {vllm_server.pid}" in line
    assert state.status_lines(tmp_path / "none") == ["server: not running"]


def test_generation_progress_read_from_its_files(tmp_path):
    assert progress_lines(tmp_path) == ["generate: no generation has run yet"]
    run = tmp_path / "abc123"
    run.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "progress.json").write_text(json.dumps({
        "pid": dead.pid, "total": 10, "done": 3, "errors": 1, "retries": 4, "skipped": 0, "generated_tokens": 700,
        "rate_per_s": 0.5, "eta_s": 14.0, "started_at": 0, "updated_at": 0}))
    line = progress_lines(tmp_path)[0]
    assert line.startswith("generate: interrupted: 3/10 prompts, 0.50 prompts/s") and "1 errors, 4 retries" in line


def _stage_holding_a_server(state_dir, port: int, www) -> None:
    """A stage as generate and evaluate run one: start the server, work, stop it in `finally`."""
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(www)]
    server.start(shipped("serve", server.ServeParams, port=port, startup_timeout_s=30), {"model_path": "/m"}, state_dir, command)
    try:
        time.sleep(120)  # killed before this ends
    finally:
        server.stop(state_dir)


def test_a_stage_ended_by_sigterm_stops_the_server_it_started(tmp_path):
    www = tmp_path / "www"
    (www / "v1").mkdir(parents=True)
    (www / "health").write_text("ok")
    (www / "v1" / "models").write_text(json.dumps({"data": [{"id": "target"}]}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    state_dir = tmp_path / "state"
    stage = multiprocessing.get_context("fork").Process(target=_stage_holding_a_server, args=(state_dir, port, www))
    stage.start()
    deadline = time.monotonic() + 30
    while state.running_server(state_dir) is None or server.port_free("127.0.0.1", port):
        assert time.monotonic() < deadline and stage.is_alive(), "the fake server never came up"
        time.sleep(0.2)
    pid = state.running_server(state_dir).pid
    os.kill(stage.pid, signal.SIGTERM)  # in start-up's health polling or in the work: both must stop it
    stage.join(60)
    assert stage.exitcode == 128 + signal.SIGTERM
    assert not state.pid_alive(pid) and server.port_free("127.0.0.1", port)
    assert state.running_server(state_dir) is None
