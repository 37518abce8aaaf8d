"""Push the outputs behind DVC's run cache, so `dvc repro --pull` elsewhere restores every pushed run.

`dvc push --run-cache` (DVC 3) uploads the run-cache entries but only the objects the workspace's
dvc.lock names; a stage's `cache: false` metrics are never among them. Another clone then finds the
entry, misses an output and recomputes the stage (every stage here has such metrics). DVC keeps
those outputs in the local cache when it records a run; this uploads every object that the local
run-cache entries name, with DVC's own transfer (parallel, skipping what the remote already has).

    python -m tools.remote push-runs [-r REMOTE] [-j JOBS]      (`make push` runs it after `dvc push`)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def run_cache_entries(cache_dir: Path) -> list[tuple[str, str]]:
    """(stage key, run value) of every entry: DVC stores them as runs/<key[:2]>/<key>/<value>."""
    return sorted((entry.parent.name, entry.name) for entry in cache_dir.glob("*/*/*") if entry.is_file())


def push_run_outputs(remote: str | None = None, jobs: int | None = None) -> tuple[int, int]:
    """Upload the outputs of every local run-cache entry; returns (entries, objects transferred)."""
    from dvc.repo import Repo

    with Repo() as repo:
        entries = run_cache_entries(Path(repo.stage_cache.cache_dir))
        transferred = 0
        for odb, objs in repo.stage_cache.get_used_objs(entries).items():
            result = repo.cloud.push(objs, jobs=jobs, remote=remote, odb=odb)
            if result.failed:
                raise RuntimeError(f"run-cache outputs: {len(result.failed)} objects failed to upload "
                                   f"(rerun to retry; objects already uploaded are skipped)")
            transferred += len(result.transferred)
    return len(entries), transferred


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.remote", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["push-runs"])
    parser.add_argument("-r", "--remote", default=None, help="DVC remote name (default: the default remote)")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel transfers (default: DVC's)")
    args = parser.parse_args(argv)
    if not Path(".dvc").is_dir():
        print(f"remote: {os.getcwd()} is not a DVC repository (run from the repository root)", file=sys.stderr)
        return 1
    entries, transferred = push_run_outputs(args.remote, args.jobs)
    print(f"remote: outputs of {entries} recorded runs pushed ({transferred} objects were missing on the remote)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
