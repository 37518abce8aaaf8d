"""The inference server's lifecycle: start vLLM for the target, wait until it answers, stop exactly it.

State lives under run/server/ (eagle3/engine/state.py: pidfile, log, state JSON) so `make status` and
the stages that need the accelerators free can see what this project started. Servers bind to
127.0.0.1 unless `serve.host` says otherwise.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3.atomic import atomic_write_json
from eagle3.engine.state import STATE_DIR, ServerError, ServerState, pid_alive, running_server
from eagle3.metrics import gpus
from eagle3.target.compute import cpu_note, served_dtype

LOG_TAIL_LINES = 40


@dataclass
class ServeParams:
    host: str
    port: int
    served_model_name: str
    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool  # MoE: experts over all tensor x data parallel ranks
    max_model_len: int
    gpu_memory_utilization: float
    reasoning_parser: str | None  # e.g. kimi_k2, deepseek_r1, qwen3
    cpu_kvcache_space_gb: int  # VLLM_CPU_KVCACHE_SPACE, CPU machines only
    # VLLM_CPU_OMP_THREADS_BIND, CPU machines only. "all": every core computes; "auto" is vLLM's default,
    # which keeps one core for the API server: half the machine on 2 cores (generation measured
    # 107 against 71 tok/s there). Or an explicit core list such as "0-7".
    cpu_omp_threads_bind: str
    enforce_eager: bool  # skips graph capture/compilation: start-up in about a minute on CPU
    startup_timeout_s: float
    extra_args: list[str]


def base_url(params: ServeParams) -> str:
    return f"http://{params.host}:{params.port}"


def server_command(params: ServeParams, record: dict[str, Any], gpu: bool) -> list[str]:
    # The module entry point, not the `vllm` script: that script fails for the vllm-cpu distribution.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", record["model_path"], "--served-model-name", params.served_model_name,
           "--host", params.host, "--port", str(params.port), "--dtype", served_dtype(record, gpu),
           "--max-model-len", str(params.max_model_len),
           "--tensor-parallel-size", str(params.tensor_parallel_size),
           "--data-parallel-size", str(params.data_parallel_size)]
    if params.enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    if record.get("revision"):
        cmd += ["--revision", record["revision"]]
    if record.get("trust_remote_code"):  # target.trust_remote_code: the repo's own model and tokenizer code
        cmd.append("--trust-remote-code")
    if gpu:
        cmd += ["--gpu-memory-utilization", str(params.gpu_memory_utilization)]
    if params.enforce_eager:
        cmd.append("--enforce-eager")
    if params.reasoning_parser:
        cmd += ["--reasoning-parser", params.reasoning_parser]
    return cmd + list(params.extra_args)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, timeout_s: float, alive: Any = lambda: True) -> dict[str, Any]:
    """Poll /health then /v1/models until both answer; returns the first served model's entry."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"server at {url} exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                models = httpx.get(f"{url}/v1/models", timeout=5)
                if models.status_code == 200 and models.json().get("data"):
                    return models.json()["data"][0]
                last_error = f"/v1/models answered {models.status_code}"
        except httpx.HTTPError as err:
            last_error = f"{type(err).__name__}: {err}"
        time.sleep(1.0)
    raise ServerError(f"server at {url} not healthy after {timeout_s:.0f}s ({last_error})")


def start(params: ServeParams, record: dict[str, Any], state_dir: Path = STATE_DIR,
          command: list[str] | None = None, capture: dict | None = None, env: dict[str, str] | None = None
          ) -> ServerState:
    """Start vLLM (or `command`: another engine serving /health and /v1/models); return once it answers.
    `capture` is recorded in the state for the callers that must know what the server captures;
    `env` is set for the server over this process's environment (CUDA_VISIBLE_DEVICES)."""
    running = running_server(state_dir)
    if running:
        print(f"serve: already running (pid {running.pid}, {running.url})", file=sys.stderr)
        return running
    if not port_free(params.host, params.port):
        raise ServerError(f"port {params.host}:{params.port} is taken by a process this project did not start; "
                          "set serve.port or stop that process")
    gpu = bool(gpus())
    env = {**os.environ, **(env or {})}
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(params.cpu_kvcache_space_gb))
        bind = f"0-{os.cpu_count() - 1}" if params.cpu_omp_threads_bind == "all" else params.cpu_omp_threads_bind
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        if params.tensor_parallel_size * params.data_parallel_size == 1:
            # The model runs inside the engine-core process instead of a worker process of its own: one
            # interpreter less to import vLLM into, start-up 22 s against 32 s here at the same tok/s.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if command is None:
        command = server_command(params, record, gpu)
        if served_dtype(record, gpu) != record["dtype"]:
            print(f"serve: {cpu_note(record['dtype'])}", file=sys.stderr)
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir / "server.log"
    unwind_on_sigterm()
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        # Own session and process group: `stop` can end the server and every worker it spawned.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    state = ServerState(pid=proc.pid, url=base_url(params), model=params.served_model_name,
                        model_path=record["model_path"], started_at=time.time(), gpu=gpu, log=str(log_path),
                        capture=capture)
    (state_dir / "server.pid").write_text(f"{proc.pid}\n")
    atomic_write_json(state_dir / "server.json", state.__dict__)
    print(f"serve: started pid {proc.pid} ({' '.join(command[2:6])} ...), log {log_path}", file=sys.stderr)
    try:
        wait_healthy(state.url, params.startup_timeout_s, alive=lambda: proc.poll() is None)
    except ServerError as err:
        stop(state_dir)
        raise ServerError(f"{err}\n--- last lines of {log_path} ---\n{log_tail(log_path)}") from None
    except BaseException:  # SIGTERM's SystemExit or Ctrl-C during start-up: no caller's `finally` yet
        stop(state_dir)
        raise
    print(f"serve: {state.url} is up after {time.time() - state.started_at:.0f}s", file=sys.stderr)
    return state


def unwind_on_sigterm() -> None:
    """SIGTERM (dvc, make or a job scheduler ending the stage) raises SystemExit, as Ctrl-C raises
    KeyboardInterrupt, so the stage's `finally` stops the server it started: in its own session,
    the server would otherwise outlive the stage and hold the port and the accelerators."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def stop(state_dir: Path = STATE_DIR, timeout_s: float = 60) -> bool:
    """Stop the server this project started (its whole process group); False if none was running."""
    state = ServerState.read(state_dir)
    if state is None:
        return False
    was_alive = pid_alive(state.pid)
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(state.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and pid_alive(state.pid):
            time.sleep(0.5)
        if not pid_alive(state.pid):
            break
    host, port = state.url.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while not port_free(host, int(port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name in ("server.json", "server.pid"):
        (state_dir / name).unlink(missing_ok=True)
    return was_alive
