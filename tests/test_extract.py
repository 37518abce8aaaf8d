"""The extract stage on the embedded SmolLM2 target (CPU): what it captures, batching, resume."""
from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3.extraction import hf as extract
from eagle3.extraction.hf import run_extraction
from eagle3.extraction.params import ExtractError, ExtractParams
from eagle3.store.layout import completed_sample_ids
from eagle3.store.reader import HiddenStore, to_torch
from eagle3.target.chat import render
from tests.conftest import shipped

TEXTS = ["What is the capital of France?", "Write two lines about the sea.", "Count to five.",
         "Name a fruit that is red and round, and explain in a few words why people like it.", "Hi"]


@pytest.fixture(scope="module")
def responses(tmp_path_factory, tokenizer):
    """Responses as the generate stage writes them, with completions of varied length."""
    rows = []
    for i, text in enumerate(TEXTS):
        messages = [{"role": "user", "content": text}]
        completion = tokenizer.encode(" ".join(["Sure, here is an answer."] * (i + 1)), add_special_tokens=False)
        rows.append({"id": f"p{i}:0", "messages": json.dumps(messages),
                     "prompt_token_ids": render(tokenizer, messages, generation_prompt=True),
                     "completion_token_ids": completion + [tokenizer.convert_tokens_to_ids("<|im_end|>")]})
    path = tmp_path_factory.mktemp("responses") / "responses.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run(embedded_target, tokenizer, responses, tmp_path, answered=None, **overrides):
    params = shipped("extract", ExtractParams, **{"compress_threads": 1, **overrides})
    summary = run_extraction(params, embedded_target[1], tokenizer, responses=responses, out=tmp_path / "hidden",
                             work_root=tmp_path / "work", answered=answered)
    return summary, HiddenStore(tmp_path / "hidden")


def answered_file(tokenizer, path, conversations):
    """Conversations kept with their dataset answers, as the prompts stage writes them."""
    from eagle3.data.prompts import ANSWERED_SCHEMA

    rows = [{"id": f"a{i}", "messages": json.dumps(c), "token_ids": render(tokenizer, c, generation_prompt=False),
             "num_prompt_tokens": 0, "source": "test", "origin": f"row {i}"} for i, c in enumerate(conversations)]
    pq.write_table(pa.Table.from_pylist(rows, schema=ANSWERED_SCHEMA), path)
    return path


def test_captures_the_aux_layers_and_the_pre_norm_last_state(embedded_target, tokenizer, responses, tmp_path):
    from transformers import AutoModelForCausalLM

    summary, store = run(embedded_target, tokenizer, responses, tmp_path)
    assert store.manifest["aux_layer_ids"] == [2, 15, 27] and store.manifest["last_state"] == "pre_norm"
    assert summary["samples"] == len(TEXTS) and summary["new_tokens"] == summary["tokens"]
    model = AutoModelForCausalLM.from_pretrained(embedded_target[0]).eval()
    sample = to_torch(store.get("p3:0"))
    ids = torch.from_numpy(sample["input_ids"].numpy().astype(np.int64))[None]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    expected_aux = torch.cat([hidden[i][0] for i in (2, 15, 27)], dim=-1)  # HF hidden_states[X] = vLLM id X
    torch.testing.assert_close(sample["aux"].float(), expected_aux, atol=0.02, rtol=0.02)
    # HF's last entry is after the final norm; ours is before it, and the norm maps one to the other.
    torch.testing.assert_close(model.model.norm(sample["last"].float()), hidden[-1][0], atol=0.02, rtol=0.02)
    mask = sample["loss_mask"].numpy()
    row = pq.read_table(responses).to_pylist()[3]
    assert mask.sum() == len(row["completion_token_ids"]) and mask[: len(row["prompt_token_ids"])].sum() == 0


def test_batched_capture_equals_one_at_a_time(embedded_target, tokenizer, responses, tmp_path):
    _, batched = run(embedded_target, tokenizer, responses, tmp_path / "batched", max_tokens_per_batch=16384)
    _, single = run(embedded_target, tokenizer, responses, tmp_path / "single", max_tokens_per_batch=1)
    assert sorted(batched.sample_ids) == sorted(single.sample_ids)
    for sample_id in single.sample_ids:
        a, b = to_torch(batched.get(sample_id)), to_torch(single.get(sample_id))
        assert torch.equal(a["input_ids"], b["input_ids"])
        for name in ("aux", "last"):  # padding must not leak into real positions
            torch.testing.assert_close(a[name].float(), b[name].float(), atol=0.05, rtol=0.02)


def test_resume_after_a_crash_stores_each_sample_once(embedded_target, tokenizer, responses, tmp_path, monkeypatch):
    forwarded = []
    real_forward = extract.forward_batch

    def crashing_forward(model, capture, batch, device):
        if len(forwarded) == 3:
            raise RuntimeError("simulated crash")
        forwarded.extend(s.id for s in batch)
        return real_forward(model, capture, batch, device)

    monkeypatch.setattr(extract, "forward_batch", crashing_forward)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(embedded_target, tokenizer, responses, tmp_path, max_tokens_per_batch=1, shard_mb=1e-6)
    stored_before = set(completed_sample_ids(next((tmp_path / "work").iterdir())))
    assert 0 < len(stored_before) < len(TEXTS)
    calls: list[str] = []
    monkeypatch.setattr(extract, "forward_batch",
                        lambda m, c, b, d: calls.extend(s.id for s in b) or real_forward(m, c, b, d))
    summary, store = run(embedded_target, tokenizer, responses, tmp_path, max_tokens_per_batch=1, shard_mb=1e-6)
    assert not set(calls) & stored_before  # finished work is not redone
    assert sorted(store.sample_ids) == sorted(f"p{i}:0" for i in range(len(TEXTS)))
    assert summary["samples"] == len(TEXTS)


def test_over_length_sequences_truncated_or_skipped(embedded_target, tokenizer, responses, tmp_path):
    summary, store = run(embedded_target, tokenizer, responses, tmp_path / "t", max_seq_len=40)
    assert summary["truncated"] == len(TEXTS) and store.num_tokens.max() == 40
    summary, store = run(embedded_target, tokenizer, responses, tmp_path / "s", max_seq_len=60, over_length="skip")
    longer = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) > 60
                 for r in pq.read_table(responses).to_pylist())
    assert 0 < longer < len(TEXTS) and summary["skipped"] == longer and summary["samples"] == len(TEXTS) - longer
    # Asked to store the samples and left with none: an error, not an empty store handed to training.
    with pytest.raises(ExtractError, match=r"no sample to store \(5 skipped as longer than extract.max_seq_len=40\)"):
        run(embedded_target, tokenizer, responses, tmp_path / "none", max_seq_len=40, over_length="skip")


def test_responses_from_another_tokenizer_are_refused(embedded_target, tokenizer, responses, tmp_path):
    rows = pq.read_table(responses).to_pylist()
    rows[2]["prompt_token_ids"] = [t + 1 for t in rows[2]["prompt_token_ids"]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "other.parquet")
    with pytest.raises(ExtractError, match="response p2:0 was not rendered with artifacts/target's tokenizer"):
        run(embedded_target, tokenizer, tmp_path / "other.parquet", tmp_path)


def test_aux_ids_out_of_range(embedded_target, tokenizer, responses, tmp_path):
    with pytest.raises(ExtractError, match=r"aux_layer_ids=\[2, 15, 31\]: expected increasing ids in 0..30"):
        run(embedded_target, tokenizer, responses, tmp_path, aux_layer_ids=[2, 15, 31])


def test_dataset_answers_are_stored_as_context(embedded_target, tokenizer, responses, tmp_path):
    conversations = [[{"role": "user", "content": t}, {"role": "assistant", "content": "A dataset answer."}]
                     for t in TEXTS[:2]]
    answered = answered_file(tokenizer, tmp_path / "answered.parquet", conversations)
    summary, store = run(embedded_target, tokenizer, responses, tmp_path, answered=answered)
    assert summary["samples"] == len(TEXTS) + 2 and summary["dataset_answer_samples"] == 2
    assert store.manifest["dataset_answer_samples"] == 2
    sample = to_torch(store.get("a1"))
    assert sample["input_ids"].tolist() == render(tokenizer, conversations[1], generation_prompt=False)
    assert sample["loss_mask"].sum() == 0  # nothing generated: every position is context
    # The responses' samples are the same as without dataset answers.
    _, alone = run(embedded_target, tokenizer, responses, tmp_path / "alone")
    assert torch.equal(to_torch(store.get("p3:0"))["loss_mask"], to_torch(alone.get("p3:0"))["loss_mask"])


def test_dataset_answers_from_another_tokenizer_or_missing_are_refused(embedded_target, tokenizer, responses,
                                                                        tmp_path):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    answered = answered_file(tokenizer, tmp_path / "answered.parquet", [conversation])
    table = pq.read_table(answered).to_pylist()
    table[0]["token_ids"] = [t + 1 for t in table[0]["token_ids"]]
    pq.write_table(pa.Table.from_pylist(table), answered)
    with pytest.raises(ExtractError, match="answered.parquet: conversation a0 was not rendered with"):
        run(embedded_target, tokenizer, responses, tmp_path, answered=answered)
    with pytest.raises(ExtractError, match="gone.parquet: not found; rerun the prompts stage"):
        run(embedded_target, tokenizer, responses, tmp_path, answered=tmp_path / "gone.parquet")


def test_token_store_for_online_training_holds_the_full_stores_tokens_and_no_states(embedded_target, tokenizer,
                                                                                    responses, tmp_path):
    from eagle3.extraction.store import plan_work, write_token_store

    _, full = run(embedded_target, tokenizer, responses, tmp_path / "full")
    params = shipped("extract", ExtractParams, compress_threads=1)
    work = plan_work(params, embedded_target[1], tokenizer, responses, None, tmp_path / "work",
                     extra_key={"states": False})
    summary = write_token_store(work, tmp_path / "tokens", embedded_target[1], params)
    tokens = HiddenStore(tmp_path / "tokens")
    assert tokens.manifest["states"] is False and set(tokens.manifest["arrays"]) == {"input_ids", "loss_mask"}
    assert tokens.manifest["aux_layer_ids"] == full.manifest["aux_layer_ids"]
    assert tokens.sample_ids == full.sample_ids and (tokens.num_tokens == full.num_tokens).all()
    for row in range(len(tokens)):
        got, want = tokens.read_row(row).arrays, full.read_row(row).arrays
        assert all(np.array_equal(got[k], want[k]) for k in ("input_ids", "loss_mask"))
    assert summary["bytes_per_token"] < 8 < full.manifest["stored_bytes"] / full.manifest["tokens"]


def test_a_resume_under_another_engine_length_limit_starts_a_new_work_dir(embedded_target, tokenizer, responses,
                                                                          tmp_path):
    # serve.max_model_len changed between a crash and the rerun: the finished samples were cut at the old limit
    from eagle3.extraction.store import plan_work

    params = shipped("extract", ExtractParams)
    dirs = {limit: plan_work(params, embedded_target[1], tokenizer, responses, None, tmp_path, max_len=limit).dir
            for limit in (None, params.max_seq_len, 1023, 511)}
    assert dirs[None] == dirs[params.max_seq_len]  # a limit above extract.max_seq_len cuts nothing
    assert len({dirs[None], dirs[1023], dirs[511]}) == 3


def test_fp8_store_dtype_stores_fewer_bytes_and_reads_back_close(embedded_target, tokenizer, responses, tmp_path):
    full_summary, full = run(embedded_target, tokenizer, responses, tmp_path / "full")
    summary, fp8 = run(embedded_target, tokenizer, responses, tmp_path / "fp8", store_dtype="fp8_e4m3")
    assert fp8.manifest["codec"]["store_dtype"] == "fp8_e4m3" and summary["store_dtype"] == "fp8_e4m3"
    assert fp8.manifest["arrays"] == full.manifest["arrays"]  # read back as bf16, the same schema
    assert summary["bytes_per_token"] < 0.7 * full_summary["bytes_per_token"]
    for row in range(len(fp8)):
        got, want = to_torch(fp8.read_row(row)), to_torch(full.read_row(row))
        assert torch.equal(got["input_ids"], want["input_ids"])
        for name in ("aux", "last"):
            a, b = got[name].float(), want[name].float()
            assert ((a - b).norm() / b.norm()) < 0.03, name  # float8 e4m3's rounding: ~2% of the state's norm


def test_unknown_store_dtype_is_refused(embedded_target, tokenizer, responses, tmp_path):
    with pytest.raises(ExtractError, match="extract.store_dtype='int4': expected one of bf16, fp8_e4m3"):
        run(embedded_target, tokenizer, responses, tmp_path, store_dtype="int4")


def test_a_cpu_without_bf16_instructions_computes_in_float32_into_a_store_of_its_own(
        embedded_target, tokenizer, responses, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from eagle3.target import compute

    bf16_target = (embedded_target[0], {**embedded_target[1], "dtype": "bfloat16"})  # the target stage's default
    monkeypatch.setattr(compute, "cpu_computes", lambda dtype: True)
    native, _ = run(bf16_target, tokenizer, responses, tmp_path)
    monkeypatch.setattr(compute, "cpu_computes", lambda dtype: dtype == torch.float32)
    emulated, store = run(bf16_target, tokenizer, responses, tmp_path)
    assert (native["compute_dtype"], emulated["compute_dtype"]) == ("bfloat16", "float32")
    # a work directory of its own: a crashed bf16-computed run never resumes into a float32-computed one
    work_dirs = re.findall(r"already stored in (\S+);", capsys.readouterr().err)
    assert len(work_dirs) == 2 and work_dirs[0] != work_dirs[1]
    assert store.manifest["arrays"]["aux"]["dtype"] == "bfloat16"  # stored as bf16 all the same
    model = AutoModelForCausalLM.from_pretrained(embedded_target[0], dtype=torch.float32).eval()
    sample = to_torch(store.get("p3:0"))
    with torch.no_grad():
        hidden = model(torch.from_numpy(sample["input_ids"].numpy().astype(np.int64))[None],
                       output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i][0] for i in (2, 15, 27)], dim=-1)
    # float32 states rounded once to bf16 (2^-8 relative), not bf16 arithmetic's drift through 27 layers
    torch.testing.assert_close(sample["aux"].float(), expected, atol=1e-3, rtol=2**-8)
