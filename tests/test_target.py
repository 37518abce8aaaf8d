from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.engine.server import ServeParams, server_command
from eagle3.target import build as target_build
from eagle3.target.build import TargetParams, build, source_kind, weight_files
from eagle3.target.record import TargetError, default_aux_layer_ids, hub_kwargs, load_tokenizer, sha256_files
from tests.conftest import shipped

REPO = Path(__file__).resolve().parent.parent


def test_embedded_target_record(embedded_target):
    folder, record = embedded_target
    assert record["architecture"] == "LlamaForCausalLM"
    assert (record["num_layers"], record["hidden_size"], record["vocab_size"]) == (30, 576, 49152)
    assert record["default_aux_layer_ids"] == [2, 15, 27]
    assert record["chat_template"] is True
    assert record["parameter_count"] == 134_515_008  # embeddings tied to lm_head, counted once
    assert record["weights_hash"] == "sha256:" + sha256_files(weight_files(folder))
    assert json.loads((folder / "target.json").read_text()) == record


def test_converted_model_loads_fast_and_answers(embedded_target, tokenizer):
    import time

    import torch
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(embedded_target[0])
    assert time.monotonic() - start < 10  # plain safetensors, no GGUF de-quantisation on every load
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2: the public drafters use exactly these


def test_source_kinds(tmp_path):
    assert source_kind("embedded") == "embedded"
    assert source_kind(str(tmp_path)) == "local"
    assert source_kind("meta-llama/Llama-3.1-8B-Instruct") == "hub"
    with pytest.raises(TargetError, match="unknown source"):
        source_kind("not a source!")


def linked_copy(src: Path, dst: Path) -> Path:
    """A local model dir without copying 540 MB: metadata copied, weights symlinked."""
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            (dst / path.name).symlink_to(path)
        elif path.name != "target.json":
            shutil.copyfile(path, dst / path.name)
    return dst


def test_local_directory_source_points_to_weights(embedded_target, tmp_path):
    folder, embedded_record = embedded_target
    local = linked_copy(folder, tmp_path / "model")
    record = build(shipped("target", TargetParams, dtype="float32", source=str(local)), out=tmp_path / "out")
    assert record["source_kind"] == "local"
    assert record["model_path"] == str(local.resolve())
    assert record["weights_hash"] == embedded_record["weights_hash"]
    assert not list((tmp_path / "out").glob("*.safetensors"))  # a pointer, never a copy of the weights


REMOTE_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class RepoTokenizer(PreTrainedTokenizerFast):  # a class transformers does not ship, as Kimi-K2.5's
    pass
"""


def test_a_hub_target_pins_its_commit_and_its_remote_code_reaches_every_load(embedded_target, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"

    def download(repo: str, revision: str, out: Path, trust_remote_code: bool) -> str:  # the hub, offline
        assert (repo, revision, trust_remote_code) == ("org/model", "main", True)
        linked_copy(embedded_target[0], out / "copy")
        for path in (out / "copy").iterdir():
            if path.suffix != ".safetensors":
                path.rename(out / path.name)
        shutil.rmtree(out / "copy")
        config = json.loads((out / "tokenizer_config.json").read_text())
        config |= {"tokenizer_class": "RepoTokenizer",
                   "auto_map": {"AutoTokenizer": [None, "tokenization_repo.RepoTokenizer"]}}
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        (out / "tokenization_repo.py").write_text(REMOTE_TOKENIZER)
        return commit

    monkeypatch.setattr(target_build, "download_hub_metadata", download)
    record = build(shipped("target", TargetParams, source="org/model", revision="main", trust_remote_code=True),
                   out=tmp_path / "out")
    # every later load reads the commit the weights hash names, not whatever "main" is by then
    assert record["weights_hash"] == f"hf:org/model@{commit}" and record["revision"] == commit
    assert hub_kwargs(record) == {"revision": commit, "trust_remote_code": True}
    assert type(load_tokenizer(tmp_path / "out")).__name__ == "RepoTokenizer"  # not a generic fallback
    cmd = server_command(shipped("serve", ServeParams), record, gpu=False)
    assert cmd[cmd.index("--revision") + 1] == commit and "--trust-remote-code" in cmd
    local = build(shipped("target", TargetParams, dtype="float32", source=str(linked_copy(embedded_target[0],
                                                                                          tmp_path / "model"))),
                  out=tmp_path / "local")
    assert hub_kwargs(local) == {"revision": None, "trust_remote_code": False}
    assert "--trust-remote-code" not in server_command(shipped("serve", ServeParams), local, gpu=False)


@pytest.mark.parametrize("defect, message", [
    ("no_config", "config.json missing"),
    ("no_tokenizer", "no tokenizer file"),
    ("no_weights", "no \\*.safetensors weights"),
    ("pickle_weights", "weights only as pickle"),
    ("no_chat_template", "no chat template"),
    ("unsupported_arch", "architecture GPT2LMHeadModel is not supported \\(supported: LlamaForCausalLM"),
])
def test_bad_local_directory(embedded_target, tmp_path, defect, message):
    local = linked_copy(embedded_target[0], tmp_path / "model")
    if defect == "no_config":
        (local / "config.json").unlink()
    elif defect == "no_tokenizer":
        (local / "tokenizer.json").unlink()
    elif defect in ("no_weights", "pickle_weights"):
        (local / "model.safetensors").unlink()
        if defect == "pickle_weights":
            (local / "pytorch_model.bin").write_bytes(b"not loaded")
    elif defect == "no_chat_template":
        (local / "chat_template.jinja").unlink()
        config = json.loads((local / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (local / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        config = json.loads((local / "config.json").read_text())
        config["architectures"] = ["GPT2LMHeadModel"]
        (local / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match=message):
        build(shipped("target", TargetParams, dtype="float32", source=str(local)), out=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # a failed build leaves no half-written output


def test_cli_error_is_one_line(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("target:\n  source: embedded\n  dtype: float8\n  revision: main\n  trust_remote_code: false\n")
    result = subprocess.run([sys.executable, "-m", "stages.target"], cwd=REPO, capture_output=True, text=True,
                            env={"EAGLE3_PARAMS": str(params), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert result.stderr.strip() == "target: target.dtype='float8': expected one of float32, bfloat16, float16"
