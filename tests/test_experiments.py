"""`dvc exp run -S` on the pipeline: the workspace stays as it was; params and metrics diffs show the change."""
from __future__ import annotations

import csv
import io
import json

from dvc_repo import copy_built, repo_env, sh


def test_exp_run_temp_leaves_workspace_and_diffs_show_param_and_metric(built_repo, tmp_path):
    env = repo_env()
    work = copy_built(built_repo, tmp_path / "repo", env)
    params_before = (work / "params.yaml").read_bytes()
    prompts_before = (work / "artifacts/prompts/train.parquet").read_bytes()

    ran = sh(["dvc", "exp", "run", "--temp", "prompts", "-S", "prompts.seed=1", "-n", "seed1"], work, env)
    assert "Running stage 'prompts'" in ran and "Running stage 'target'" not in ran, ran
    # --temp ran it in a scratch copy: params, outputs and git status here are untouched.
    assert (work / "params.yaml").read_bytes() == params_before
    assert (work / "artifacts/prompts/train.parquet").read_bytes() == prompts_before
    assert sh(["git", "status", "--porcelain"], work, env, stdout_only=True) == ""

    params_diff = json.loads(sh(["dvc", "params", "diff", "HEAD", "seed1", "--json"], work, env, stdout_only=True))
    assert list(params_diff) == ["params.yaml"] and list(params_diff["params.yaml"]) == ["prompts.seed"]
    assert (params_diff["params.yaml"]["prompts.seed"]["old"], params_diff["params.yaml"]["prompts.seed"]["new"]) == (0, 1)
    metrics_diff = json.loads(sh(["dvc", "metrics", "diff", "HEAD", "seed1", "--json", "--targets",
                                  "metrics/prompts.json"], work, env, stdout_only=True))
    tokens = metrics_diff["metrics/prompts.json"]["tokens"]
    assert tokens["old"] != tokens["new"]  # another sample of prompts, another token count
    assert "metrics/target.json" not in metrics_diff  # the target did not change

    table = sh(["dvc", "exp", "show", "--csv", "--only-changed"], work, env, stdout_only=True)
    rows = {row["Experiment"] or row["rev"]: row for row in csv.DictReader(io.StringIO(table))}
    assert rows["seed1"]["prompts.seed"] == "1"
