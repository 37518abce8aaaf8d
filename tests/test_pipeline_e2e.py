"""`dvc repro` in a temporary copy of the repository: full run, no-op rerun, selective rerun, diffs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SKIP = {".git", ".venv", "artifacts", "metrics", ".pytest_cache", "__pycache__", "run", ".dvc"}


def copy_repo(dst: Path) -> Path:
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        if name.split("/")[0] in SKIP or not (REPO / name).is_file():
            continue
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dst / name)
    return dst


def sh(cmd: list[str], cwd: Path, env: dict, stdout_only: bool = False) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout if stdout_only else result.stdout + result.stderr


def test_dvc_repro_noop_and_selective_rerun(tmp_path, embedded_target):
    work = copy_repo(tmp_path / "repo")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    sh(["git", "init", "-q"], work, env)
    sh(["dvc", "init", "-q"], work, env)
    sh(["dvc", "config", "--local", "core.site_cache_dir", str(tmp_path / "site-cache")], work, env)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["prompts"]["num_samples"] = 20
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    # The first two stages; later ones need a server and the accelerators and have their own tests.
    first = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage 'target'" in first and "Running stage 'prompts'" in first
    record = json.loads((work / "artifacts/target/target.json").read_text())
    assert record["weights_hash"] == embedded_target[1]["weights_hash"]  # conversion is deterministic
    assert json.loads((work / "metrics/prompts.json").read_text())["items"] == 20
    sh(["git", "add", "-A"], work, env)
    sh(["git", "commit", "-qm", "first run"], work, env)

    again = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage" not in again

    params["prompts"]["seed"] = 1
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    selective = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage 'prompts'" in selective and "Running stage 'target'" not in selective

    params_diff = sh(["dvc", "params", "diff"], work, env)
    assert "prompts.seed" in params_diff and "0" in params_diff and "1" in params_diff
    # Later stages' metrics do not exist here; DVC warns about them on stderr.
    metrics_diff = sh(["dvc", "metrics", "diff", "--json", "--targets", "metrics/prompts.json"], work, env,
                      stdout_only=True)
    assert "tokens" in json.loads(metrics_diff)["metrics/prompts.json"]  # another sample, other prompt tokens
