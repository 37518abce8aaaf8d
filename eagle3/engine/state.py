"""What this project's servers are: their state files under run/, and whether one holds the GPUs.

A server started by eagle3/engine/server.py leaves run/<name>/server.json (pid, url, model, log) and
a pidfile; `make status` and the stages that need the accelerators free read them here. Reading
state never starts or stops anything.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from eagle3.errors import PipelineError

STATE_DIR = Path("run/server")


class ServerError(PipelineError, RuntimeError):
    pass


@dataclass
class ServerState:
    pid: int
    url: str
    model: str
    model_path: str
    started_at: float
    gpu: bool
    log: str
    # What the server captures for the extract stage (eagle3/extraction/engine.py: layer ids, spool
    # directory), None for a plain server; state files written before this field read as None.
    capture: dict | None = None

    @classmethod
    def read(cls, state_dir: Path = STATE_DIR) -> ServerState | None:
        path = state_dir / "server.json"
        return cls(**json.loads(path.read_text())) if path.is_file() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def running_server(state_dir: Path = STATE_DIR) -> ServerState | None:
    state = ServerState.read(state_dir)
    return state if state and pid_alive(state.pid) else None


def require_accelerators_free(stage: str, state_dir: Path = STATE_DIR) -> None:
    """Extraction, training and offline evaluation need the GPUs the server would hold."""
    state = running_server(state_dir)
    if state and state.gpu:
        raise ServerError(f"the inference server this project started (pid {state.pid}, {state.url}) holds the "
                          f"GPUs that {stage} needs; run `make stop` first")


def status_lines(state_dir: Path = STATE_DIR) -> list[str]:
    state = running_server(state_dir)
    if not state:
        return ["server: not running"]
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.started_at))
    try:
        healthy = httpx.get(f"{state.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        healthy = False
    return [f"server: {'up' if healthy else 'starting or unresponsive'} at {state.url}, model {state.model} "
            f"({state.model_path}), pid {state.pid}, since {since}, log {state.log}"]
