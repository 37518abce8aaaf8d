"""Shipped params profiles are complete and valid; switching shows the changes and never loses edits."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from eagle3.params import SECTIONS, ParamsError, check_params_file, read_params, section_class
from tools import profile

REPO = Path(__file__).resolve().parent.parent


def test_every_shipped_profile_is_complete_and_typed():
    assert {"embedded", "llama-3.1-8b", "kimi-k2.5"} <= set(profile.profile_paths(REPO / "profiles"))
    assert profile.check_all(REPO / "params.yaml", REPO / "profiles") == []


def test_real_profiles_answer_long_and_keep_an_agreement_check():
    for name in ("llama-3.1-8b", "kimi-k2.5"):
        evaluate = read_params(REPO / f"profiles/{name}.yaml")["evaluate"]
        assert evaluate["max_new_tokens"] >= 1024 and evaluate["long_max_new_tokens"] > evaluate["max_new_tokens"]
        assert evaluate["offline"] and evaluate["online"] and 0.0 in evaluate["temperatures"]
        assert any(t > 0 for t in evaluate["temperatures"]) and evaluate["offline_sampling_questions"] >= 1


def test_a_profile_without_an_agreement_check_is_refused(workspace):
    params_file, profiles_dir = workspace
    path = profiles_dir / "kimi-k2.5.yaml"
    path.write_text(path.read_text().replace("  offline: true ", "  offline: false "))
    (problem,) = profile.check_all(params_file, profiles_dir)
    assert str(path) in problem and "evaluate.offline: false" in problem and "agreement check" in problem


def test_a_profile_the_train_stage_would_refuse_is_refused_before_any_stage_runs(workspace):
    # The train stage checks its values only when it starts, after generation and extraction have run for hours.
    params_file, profiles_dir = workspace
    path = profiles_dir / "kimi-k2.5.yaml"
    path.write_text(path.read_text().replace("  max_tokens_per_batch: 18432 ", "  max_tokens_per_batch: 16384 "))
    (problem,) = profile.check_all(params_file, profiles_dir)
    assert str(path) in problem and "train.max_seq_len=18432 exceeds max_tokens_per_batch=16384" in problem
    before = params_file.read_bytes()
    with pytest.raises(ParamsError, match="max_tokens_per_batch=16384"):
        profile.use("kimi-k2.5", params_file=params_file, profiles_dir=profiles_dir)
    assert params_file.read_bytes() == before


def test_every_params_section_has_a_schema():
    for section in read_params(REPO / "params.yaml"):
        assert section in SECTIONS, (f"params.yaml section '{section}': add its dataclass to SECTIONS in "
                                     "eagle3/params.py")
        section_class(section)  # the module imports and names the class


def test_real_profiles_say_what_their_hardware_needs():
    llama = read_params(REPO / "profiles/llama-3.1-8b.yaml")
    assert llama["target"]["source"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert llama["serve"]["tensor_parallel_size"] == 1
    assert (llama["generate"]["max_tokens"], llama["vocab"]["draft_vocab_size"]) == (8192, 32000)
    assert (llama["train"]["ttt_steps"], llama["train"]["epochs"], llama["train"]["compile"]) == (7, 10, True)
    kimi = read_params(REPO / "profiles/kimi-k2.5.yaml")
    assert kimi["target"]["source"] == "moonshotai/Kimi-K2.5" and kimi["target"]["trust_remote_code"] is True
    assert kimi["serve"]["tensor_parallel_size"] == 8 and kimi["serve"]["reasoning_parser"] == "kimi_k2"
    assert kimi["extract"]["device_map"] == "auto"
    for params in (llama, kimi):  # nothing a request can produce is cut before training
        budget = params["prompts"]["max_prompt_tokens"] + params["generate"]["max_tokens"]
        assert params["serve"]["max_model_len"] >= budget
        assert params["extract"]["max_seq_len"] >= budget and params["train"]["max_seq_len"] >= budget


@pytest.fixture
def broken(tmp_path) -> tuple[Path, dict]:
    """A writable copy of a complete profile and its values."""
    path = tmp_path / "profile.yaml"
    shutil.copy(REPO / "profiles/llama-3.1-8b.yaml", path)
    return path, read_params(path)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["train"].update(epoch=3), r"profile\.yaml: train\.epoch: unknown key"),
    (lambda p: p["train"].pop("lr"), r"profile\.yaml: train\.lr: missing key"),
    (lambda p: p["serve"].pop("extra_args"),
     r"serve\.extra_args: missing key \(expected a value of type list\[str\]: every key is required"),
    (lambda p: p["train"].update(lr="1e-4"), r"train\.lr: '1e-4' is not of type float"),
    (lambda p: p["train"].update(compile="yes"), r"train\.compile: 'yes' is not of type bool"),
    (lambda p: p["prompts"].update(num_samples=True), r"prompts\.num_samples: True is not of type int"),
    (lambda p: p.update(trian={}), r"section\(s\) trian not in params\.yaml"),
    (lambda p: p.pop("vocab"), r"section\(s\) vocab missing"),
])
def test_errors_name_the_file_and_key(broken, edit, message):
    path, params = broken
    edit(params)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(ParamsError, match=message):
        check_params_file(path, set(read_params(REPO / "params.yaml")))


@pytest.fixture
def workspace(tmp_path) -> tuple[Path, Path]:
    """(params.yaml, profiles/) copies: params.yaml as the embedded profile."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for path in profile.profile_paths(REPO / "profiles").values():
        shutil.copy(path, profiles / path.name)
    params = tmp_path / "params.yaml"
    shutil.copy(profiles / "embedded.yaml", params)
    return params, profiles


def test_use_prints_the_changes_and_copies_the_profile(workspace, capsys):
    params, profiles = workspace
    profile.use("llama-3.1-8b", params_file=params, profiles_dir=profiles)
    out = capsys.readouterr().out
    assert "target.source: 'embedded' -> 'meta-llama/Llama-3.1-8B-Instruct'" in out
    assert "generate.max_tokens: 256 -> 8192" in out
    assert params.read_bytes() == (profiles / "llama-3.1-8b.yaml").read_bytes()  # comments travel too
    assert profile.active_profile(params, profiles) == "llama-3.1-8b"


def test_use_refuses_to_lose_edits_no_profile_holds(workspace):
    params, profiles = workspace
    edited = params.read_text().replace("  seed: 0\n", "  seed: 7\n", 1)
    params.write_text(edited)
    with pytest.raises(ParamsError, match="match no profile.*FORCE=1"):
        profile.use("kimi-k2.5", params_file=params, profiles_dir=profiles)
    assert params.read_text() == edited
    profile.use("kimi-k2.5", force=True, params_file=params, profiles_dir=profiles)
    assert profile.active_profile(params, profiles) == "kimi-k2.5"


def test_use_names_the_profiles_there_are(workspace):
    params, profiles = workspace
    have = r"\(have: embedded, embedded-large, kimi-k2\.5, llama-3\.1-8b\)"
    with pytest.raises(ParamsError, match=r"llama\.yaml: no such profile " + have):
        profile.use("llama", params_file=params, profiles_dir=profiles)
