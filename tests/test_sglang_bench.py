"""The SGLang benchmark's logic that runs without SGLang: what it refuses, the command it starts, the
acceptance arithmetic. Serving itself needs a GPU and sglang; this machine has neither."""
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.engine.server import ServeParams
from eagle3.evaluation.params import EvaluateParams
from eagle3.metrics import gpus
from eagle3.params import read_params
from tests.conftest import REPO, shipped
from tools import sglang_bench
from tools.sglang_bench import (
    BenchParams,
    acceptance,
    by_temperature,
    importable,
    main,
    missing_requirements,
    sglang_command,
)


def test_missing_gpu_and_sglang_are_both_named():
    missing = missing_requirements(False, [], "/env/bin/python")
    assert len(missing) == 2
    assert missing[0].startswith("no NVIDIA GPU") and "runs on CUDA" in missing[0]
    assert "sglang is not importable by /env/bin/python" in missing[1] and "SGLANG_PY=" in missing[1]
    assert missing_requirements(True, ["NVIDIA H200"], "python") == []


@pytest.mark.skipif(importable(sys.executable, "sglang") and bool(gpus()), reason="this machine could run SGLang")
def test_main_exits_2_saying_what_is_missing_here(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sglang-bench: cannot run on this machine:")
    assert ("no NVIDIA GPU" in err) == (not gpus())
    assert ("sglang is not importable" in err) == (not importable(sys.executable, "sglang"))


def test_command_drafts_a_chain_of_k_tokens_from_the_export():
    serve = shipped("serve", ServeParams, max_model_len=4096, tensor_parallel_size=2)
    record = {"model_path": "artifacts/target", "revision": None}
    params = BenchParams(shipped("evaluate", EvaluateParams, num_speculative_tokens=3), port=8021)
    cmd = sglang_command("/env/bin/python", serve, record, params, Path("artifacts/drafter-sglang"))
    assert cmd[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {
        "--model-path": "artifacts/target", "--served-model-name": "target", "--host": "127.0.0.1", "--port": "8021",
        "--dtype": "bfloat16", "--context-length": "4096", "--tp-size": "2", "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": str(Path("artifacts/drafter-sglang").resolve()),
        "--speculative-num-steps": "3", "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4"}
    baseline = sglang_command("/env/bin/python", serve, record, params, None)
    assert not any(arg.startswith("--speculative") for arg in baseline)


def test_acceptance_in_vllm_terms_and_per_position_from_the_histogram():
    # Request 1: prefill token + verifies accepting 3, 1, 0 drafts -> 1 + 4 + 2 + 1 = 8 tokens.
    # Request 2: prefill token + verifies accepting 2, 3 -> 1 + 3 + 4 = 8 tokens.
    metas = [{"completion_tokens": 8, "spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 1, 0, 1]},
             {"completion_tokens": 8, "spec_verify_ct": 2, "spec_correct_drafts_histogram": [0, 0, 1, 1]}]
    result = acceptance(metas, k=3)
    assert result["acceptance_length"] == pytest.approx(1 + 9 / 5)  # vLLM's 1 + accepted / drafts
    assert result["sglang_accept_length"] == pytest.approx(16 / 5)
    assert result["per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert result["histogram"] == pytest.approx([1 / 5, 1 / 5, 1 / 5, 2 / 5])
    older = acceptance([{"completion_tokens": 8, "spec_verify_ct": 3}], k=3)  # releases without the histogram
    assert older["acceptance_length"] == pytest.approx(7 / 3) and older["per_position"] is None


def test_no_verify_steps_means_the_drafter_did_not_run():
    with pytest.raises(RuntimeError, match="no verify steps"):
        acceptance([{"completion_tokens": 20}], k=3)


def test_acceptance_per_temperature_is_the_mean_over_sets_like_the_vllm_evaluation():
    # (tokens - requests) / verifies: MT-bench 4/3, HumanEval 2/2. The pooled 6/5 weighs the sets by size.
    metas = [{"completion_tokens": 5, "spec_verify_ct": 3, "set": "mtbench"},
             {"completion_tokens": 3, "spec_verify_ct": 2, "set": "humaneval"}]
    result = by_temperature({0.0: metas, 0.7: metas[:1]}, k=3)
    assert result["T=0.0"]["acceptance_length"] == pytest.approx((4 / 3 + 1) / 2, abs=1e-4)
    assert result["T=0.0"]["pooled"]["acceptance_length"] == pytest.approx(6 / 5)
    assert set(result["T=0.0"]["sets"]) == {"mtbench", "humaneval"}
    assert result["T=0.7"]["acceptance_length"] == pytest.approx(4 / 3, abs=1e-4)


def test_main_refuses_an_incomplete_evaluate_section_naming_the_key(tmp_path, monkeypatch, capsys):
    # Past the machine check (a GPU and sglang are assumed here), the params come first.
    params = read_params(REPO / "params.yaml")
    del params["evaluate"]["temperatures"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sglang_bench, "missing_requirements", lambda *args: [])
    assert main([]) == 1
    assert "evaluate.temperatures: missing key" in capsys.readouterr().err
