"""Temporary copies of this repository (own git, DVC, cache and site cache) for end-to-end DVC tests."""
from __future__ import annotations

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


def repo_env(**extra: str) -> dict[str, str]:
    """The test's venv first on PATH (dvc runs `python -m stages.*`), no analytics, a git identity."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
            **extra}


def sh(cmd: list[str], cwd: Path, env: dict, stdout_only: bool = False) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout if stdout_only else result.stdout + result.stderr


def init_copy(dst: Path, env: dict, num_samples: int = 20) -> tuple[Path, dict]:
    """A fresh git + DVC repository with this project's files and a small prompts sample; returns (dir, params)."""
    work = copy_repo(dst)
    sh(["git", "init", "-q"], work, env)
    sh(["dvc", "init", "-q"], work, env)
    # DVC keeps per-repo state (locks, indexes) in a site cache; one per copy keeps copies independent.
    sh(["dvc", "config", "--local", "core.site_cache_dir", str(dst.parent / f"{dst.name}-site-cache")], work, env)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["prompts"]["num_samples"] = num_samples
    params["prompts"]["dataset_answers"] = num_samples // 2
    write_params(work, params)
    return work, params


def write_params(work: Path, params: dict) -> None:
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def copy_built(built: Path, dst: Path, env: dict) -> Path:
    """A private copy of a built repository: its DVC cache hard-linked (content-addressed, never written in
    place), everything else copied, DVC's scratch state left behind, a site cache of its own."""
    cache = built / ".dvc" / "cache"

    def link_or_copy(src: str, target: str) -> None:
        if Path(src).is_relative_to(cache):
            os.link(src, target)
        else:
            shutil.copy2(src, target)

    shutil.copytree(built, dst, symlinks=True, copy_function=link_or_copy,
                    ignore=lambda folder, names: ["tmp"] if Path(folder) == built / ".dvc" else [])
    sh(["dvc", "config", "--local", "core.site_cache_dir", str(dst.parent / f"{dst.name}-site-cache")], dst, env)
    return dst
