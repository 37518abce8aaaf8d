"""Every entry point answers --help, refuses unknown arguments before it touches anything, and reports
bad params as one line naming the file and the key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
STAGES = ("target", "prompts", "generate", "vocab", "extract", "train", "evaluate", "report")
TOOLS = ("server", "profile", "plan", "sweep", "remote", "summary", "validate", "export_sglang", "sglang_bench")


def run(module: str, *args: str, cwd: Path, params: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"EAGLE3_PARAMS": str(params)} if params else {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("module", [f"stages.{s}" for s in STAGES] + [f"tools.{t}" for t in TOOLS])
def test_help_describes_and_touches_nothing(module, tmp_path):
    result = run(module, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:") and len(result.stdout.splitlines()) > 3
    assert files(tmp_path) == set()


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_refuses_any_argument_before_it_starts(stage, tmp_path):
    (tmp_path / "metrics").mkdir()
    result = run(f"stages.{stage}", "--bogus-flag", cwd=tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --bogus-flag" in result.stderr
    assert files(tmp_path) == {tmp_path / "metrics"}  # no metrics rewritten, no run/ started


def shipped_without(tmp_path: Path, section: str, key: str) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    del params[section][key]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_a_key_deleted_from_params_is_one_clear_line(tmp_path):
    """train.epochs deleted: an error naming it, not a 10-epoch run from a forgotten code default."""
    params = shipped_without(tmp_path, "train", "epochs")
    result = run("stages.train", cwd=tmp_path, params=params)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"train: {params}: train.epochs: missing key (expected a value of type int: "
                                     "every key is required, there are no defaults; profiles/embedded.yaml has "
                                     "them all)")
    assert files(tmp_path) == {params}


def test_a_value_of_the_wrong_type_is_one_clear_line(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["vocab"]["draft_vocab_size"] = "big"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    result = run("stages.vocab", cwd=tmp_path, params=path)
    assert result.returncode == 1
    assert result.stderr.strip() == f"vocab: {path}: vocab.draft_vocab_size: 'big' is not of type int"
