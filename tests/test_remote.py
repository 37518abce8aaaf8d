"""DVC remotes for real: an S3 endpoint on loopback (moto_server), push from one clone, pull into others.

Credentials are dummies and reach DVC through the environment only; the endpoint sits in
.dvc/config.local (never committed) or AWS_ENDPOINT_URL, as docs/runs.md "Artifacts on a remote" says.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from dvc_repo import REPO, copy_built, repo_env, sh, write_params

boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    """moto_server on 127.0.0.1 and a free port, started for this module and stopped after it."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert proc.poll() is None and time.monotonic() < deadline, f"moto_server did not start:\n{log.read_text()}"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def s3_env(s3_endpoint, tmp_path) -> dict[str, str]:
    """Dummy credentials in the environment; no real AWS config file can leak in."""
    return repo_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                    AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
                    AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"))


def make_bucket(endpoint: str, env: dict[str, str], name: str):
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
    client.create_bucket(Bucket=name)
    return client


def object_count(client, bucket: str) -> int:
    return sum(page.get("KeyCount", 0) for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket))


def git_clone(src: Path, dst: Path, env: dict[str, str]) -> Path:
    """A clean clone: committed files only (no DVC cache, no artifacts, no .dvc/config.local)."""
    sh(["git", "clone", "-q", str(src), str(dst)], dst.parent, env)
    sh(["dvc", "config", "--local", "core.site_cache_dir", str(dst.parent / f"{dst.name}-site-cache")], dst, env)
    return dst


def test_push_then_pull_into_clean_clones_reruns_nothing(built_repo, tmp_path, s3_endpoint, s3_env):
    env = s3_env
    make_bucket(s3_endpoint, env, "eagle3-remote")
    first = copy_built(built_repo, tmp_path / "first", env)
    # The URL is committed (clones find the remote); the endpoint stays in .dvc/config.local.
    sh(["dvc", "remote", "add", "-d", "s3", "s3://eagle3-remote/dvc"], first, env)
    sh(["dvc", "remote", "modify", "--local", "s3", "endpointurl", s3_endpoint], first, env)
    sh(["git", "add", ".dvc/config"], first, env)
    sh(["git", "commit", "-qm", "S3 remote"], first, env)
    committed = (first / ".dvc/config").read_text()
    assert "endpointurl" not in committed and "testing" not in committed

    # A second params set, run but never committed: only the run cache can lead another clone to its outputs.
    params = yaml.safe_load((first / "params.yaml").read_text())
    params["prompts"]["seed"] = 1
    write_params(first, params)
    sh(["dvc", "repro", "prompts"], first, env)
    sh(["git", "checkout", "params.yaml", "dvc.lock"], first, env)
    sh(["dvc", "checkout", "prompts"], first, env)

    # What `make push JOBS=4` runs.
    pushed = sh(["dvc", "push", "--run-cache", "-j", "4"], first, env)
    assert re.search(r"\d+ files? pushed", pushed), pushed
    runs = sh(["python", "-m", "tools.remote", "push-runs", "-j", "4"], first, env)
    assert re.search(r"outputs of \d+ recorded runs pushed \([1-9]\d* objects", runs), runs

    # Clone 2: dvc pull (prompts and what it depends on: the later stages were never built here), then repro
    # finds everything up to date.
    second = git_clone(first, tmp_path / "second", env)
    sh(["dvc", "remote", "modify", "--local", "s3", "endpointurl", s3_endpoint], second, env)
    sh(["dvc", "pull", "--run-cache", "-j", "4", "--with-deps", "prompts"], second, env)
    assert (second / "artifacts/prompts/train.parquet").read_bytes() == \
        (first / "artifacts/prompts/train.parquet").read_bytes()
    again = sh(["dvc", "repro", "prompts"], second, env)
    assert "Running stage" not in again, again

    # Clone 3, endpoint from the environment: `repro --pull` fetches what the remote holds, both the committed
    # run (target) and, through the run cache, the uncommitted seed=1 run of prompts. Nothing is recomputed.
    third = git_clone(first, tmp_path / "third", env)
    write_params(third, params)
    restored = sh(["dvc", "repro", "--pull", "prompts"], third, {**env, "AWS_ENDPOINT_URL": s3_endpoint})
    assert "Running stage" not in restored, restored
    assert "Stage 'prompts' is cached - skipping run" in restored, restored
    assert (third / "artifacts/target/target.json").is_file()
    assert sh(["dvc", "status", "prompts"], third, env).strip().endswith("Data and pipelines are up to date.")


def run_until(cmd: list[str], cwd: Path, env: dict[str, str], done: Callable[[], bool], timeout_s: float = 120) -> None:
    """Start cmd and SIGKILL its process group once done() holds: an interruption in the middle of a transfer."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert proc.poll() is None, f"{' '.join(cmd)} finished before it could be interrupted"
            assert time.monotonic() < deadline, f"{' '.join(cmd)}: no progress in {timeout_s} s"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def files_transferred(output: str) -> int:
    match = re.search(r"(\d+) files? (?:pushed|fetched)", output)
    return int(match.group(1)) if match else 0


def test_interrupted_push_and_pull_resume(tmp_path, s3_endpoint, s3_env):
    env = s3_env
    client = make_bucket(s3_endpoint, env, "eagle3-resume")
    work = tmp_path / "work"
    work.mkdir()
    sh(["git", "init", "-q"], work, env)
    sh(["dvc", "init", "-q"], work, env)
    sh(["dvc", "config", "--local", "core.site_cache_dir", str(tmp_path / "work-site-cache")], work, env)
    shards = work / "shards"  # stands in for artifacts/hidden: a directory of many shard files
    shards.mkdir()
    for i in range(300):
        (shards / f"shard-{i:05d}.bin").write_bytes(os.urandom(32 * 1024))
    sh(["dvc", "add", "-q", "shards"], work, env)
    sh(["dvc", "remote", "add", "-d", "s3", "s3://eagle3-resume/dvc"], work, env)
    sh(["git", "add", "-A"], work, env)
    sh(["git", "commit", "-qm", "shards"], work, env)
    local = {**env, "AWS_ENDPOINT_URL": s3_endpoint}
    total = 301  # 300 files + the directory's manifest (.dir), which DVC uploads last

    # One transfer at a time, killed once 30 objects are up.
    run_until(["dvc", "push", "-j", "1"], work, local, lambda: object_count(client, "eagle3-resume") >= 30)
    before = object_count(client, "eagle3-resume")
    assert 30 <= before < total
    resumed = sh(["dvc", "push", "-j", "8"], work, local)
    assert files_transferred(resumed) == total - before, resumed  # only what was missing
    assert object_count(client, "eagle3-resume") == total

    clone = git_clone(work, tmp_path / "clone", env)
    cached = clone / ".dvc/cache/files/md5"

    def fetched() -> int:  # complete objects only: their names are the rest of their md5
        return sum(1 for p in cached.rglob("*") if re.fullmatch(r"[0-9a-f]{30}(\.dir)?", p.name))

    run_until(["dvc", "pull", "-j", "1"], clone, local, lambda: fetched() >= 30)
    before = fetched()
    assert 30 <= before < total
    resumed = sh(["dvc", "pull", "-j", "8"], clone, local)
    assert files_transferred(resumed) == total - before, resumed
    for path in shards.iterdir():
        assert (clone / "shards" / path.name).read_bytes() == path.read_bytes()
    assert "up to date" in sh(["dvc", "status"], clone, local)


def test_make_passes_jobs_and_remote_to_dvc():
    dry = subprocess.run(["make", "-n", "push", "pull", "JOBS=16", "REMOTE=s3"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "dvc push --run-cache -j 16 -r s3" in dry and "dvc pull --run-cache -j 16 -r s3" in dry
    assert "-m tools.remote push-runs -j 16 -r s3" in dry
