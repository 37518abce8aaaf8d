"""`dvc repro` in a temporary copy of the repository: full run, no-op rerun, selective rerun, diffs."""
from __future__ import annotations

import json

from dvc_repo import REPO, init_copy, repo_env, sh, write_params


def test_dvc_repro_noop_and_selective_rerun(tmp_path):
    env = repo_env()
    work, params = init_copy(tmp_path / "repo", env)

    # The first two stages; later ones need a server and the accelerators and have their own tests.
    first = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage 'target'" in first and "Running stage 'prompts'" in first
    record = json.loads((work / "artifacts/target/target.json").read_text())
    # Conversion is deterministic: the same weights as the committed run of these params.
    assert record["weights_hash"] == json.loads((REPO / "metrics/target.json").read_text())["weights_hash"]
    assert json.loads((work / "metrics/prompts.json").read_text())["items"] == 20
    sh(["git", "add", "-A"], work, env)
    sh(["git", "commit", "-qm", "first run"], work, env)

    again = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage" not in again

    params["prompts"]["seed"] = 1
    write_params(work, params)
    selective = sh(["dvc", "repro", "prompts"], work, env)
    assert "Running stage 'prompts'" in selective and "Running stage 'target'" not in selective

    params_diff = sh(["dvc", "params", "diff"], work, env)
    assert "prompts.seed" in params_diff and "0" in params_diff and "1" in params_diff
    # Later stages' metrics do not exist here; DVC warns about them on stderr.
    metrics_diff = sh(["dvc", "metrics", "diff", "--json", "--targets", "metrics/prompts.json"], work, env,
                      stdout_only=True)
    assert "tokens" in json.loads(metrics_diff)["metrics/prompts.json"]  # another sample, other prompt tokens
