from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.data.prompts import PromptsParams, apply_policy, build, usable_rows, with_dataset_answer
from eagle3.data.sources import (
    SHAREGPT_FILE,
    SHAREGPT_PACKAGE,
    DropLog,
    PromptsError,
    RowError,
    iter_hf,
    iter_json_array_items,
    normalize_messages,
    package_file,
)
from eagle3.target.chat import render
from tests.conftest import shipped

MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def run(embedded_target, tmp_path, **overrides):
    params = shipped("prompts", PromptsParams, **{"num_samples": 30, "max_prompt_tokens": 1024, "dataset_answers": 0,
                                                  **overrides})
    out = tmp_path / "prompts"
    stats = build(params, target_dir=embedded_target[0], out=out)
    return stats, pq.read_table(out / "train.parquet").to_pylist(), pq.read_table(out / "eval.parquet").to_pylist()


def test_embedded_prompts_and_mtbench(embedded_target, tmp_path):
    stats, train, evaluation = run(embedded_target, tmp_path)
    assert stats["kept"] == len(train) == 30
    assert len({row["id"] for row in train}) == 30
    for row in train:
        messages = json.loads(row["messages"])
        assert messages[-1]["role"] == "user" and messages[-1]["content"].strip()
        assert 0 < row["num_prompt_tokens"] <= 1024
    by_set = {name: [q for q in evaluation if q["set"] == name] for name in ("mtbench", "humaneval", "math500")}
    assert [len(v) for v in by_set.values()] == [80, 164, 311] and stats["eval"] == len(evaluation) == 555
    assert all(len(q["turns"]) == 2 for q in by_set["mtbench"])  # MT-bench: both turns kept
    assert Counter(q["category"] for q in by_set["mtbench"]) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert by_set["humaneval"][0]["question_id"] == "HumanEval/0" and "def has_close_elements" in by_set[
        "humaneval"][0]["turns"][0] and by_set["humaneval"][0]["category"] == "code"
    assert {q["category"] for q in by_set["math500"]} == {"math"} and by_set["math500"][0]["turns"][0].strip()
    assert json.loads((tmp_path / "prompts" / "stats.json").read_text())["kept"] == 30


def test_dataset_answers_are_further_rows_with_their_own_answer(embedded_target, tmp_path, tokenizer):
    stats, train, _ = run(embedded_target, tmp_path, num_samples=10, dataset_answers=12, dataset_answer_max_tokens=200)
    answered = pq.read_table(tmp_path / "prompts" / "answered.parquet").to_pylist()
    assert stats["dataset_answers"] == len(answered) == 12
    assert stats["dataset_answer_tokens"] == sum(len(r["token_ids"]) for r in answered)
    firsts = {json.loads(r["messages"])[0]["content"] for r in train}
    for row in answered:
        conversation = json.loads(row["messages"])
        roles = [m["role"] for m in conversation]
        assert roles[-2:] == ["user", "assistant"] and "user" not in roles[:-2]  # first_user: the first exchange
        assert conversation[0]["content"] not in firsts  # a row is either answered by the target or not at all
        assert row["token_ids"] == render(tokenizer, conversation, generation_prompt=False)[:200]
        assert row["num_prompt_tokens"] == len(render(tokenizer, conversation[:-1], generation_prompt=True))
    # The same prompts are kept for the target whether or not dataset answers are asked for.
    assert [r["id"] for r in train] == [r["id"] for r in run(embedded_target, tmp_path / "none", num_samples=10)[1]]
    assert pq.read_table(tmp_path / "none" / "prompts" / "answered.parquet").num_rows == 0


def test_sampling_is_deterministic_for_a_seed(embedded_target, tmp_path):
    first = [r["id"] for r in run(embedded_target, tmp_path / "a", seed=7)[1]]
    again = [r["id"] for r in run(embedded_target, tmp_path / "b", seed=7)[1]]
    other = [r["id"] for r in run(embedded_target, tmp_path / "c", seed=8)[1]]
    assert first == again
    assert first != other


def test_truncated_json_array_keeps_whole_items_only():
    text = '[\n {"id": 1, "conversations": []},\n {"id": 2, "conversations": []},\n {"id": 3, "conv'
    assert [item["id"] for _, item in iter_json_array_items(text, "cut.json")] == [1, 2]


def test_shipped_sharegpt_is_cut_off_and_recovered():
    path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    items = list(iter_json_array_items(path.read_text(encoding="utf-8"), path.name))
    assert len(items) > 17_000
    assert all("conversations" in item for _, item in items)


BAD_ROWS = [
    '{"messages": [{"role": "user", "content": "Explain rainbows."}]}',             # line 1 good
    '{"messages": [{"role": "user", "content": "Explain rainbows."}',               # line 2 bad JSON
    '{"text": "no messages here"}',                                                 # line 3 malformed
    '{"conversations": [{"from": "robot", "value": "hi"}]}',                        # line 4 unknown role
    '{"messages": [{"role": "assistant", "content": "only me"}]}',                  # line 5 no user turn
    '{"messages": [{"role": "user", "content": "   "}]}',                           # line 6 empty
    '{"messages": [{"role": "user", "content": "Explain rainbows."}]}',             # line 7 duplicate
    '{"conversations": [{"from": "human", "value": "Write a haiku."}, {"from": "gpt", "value": "..."}]}',
    '["a list, not an object"]',                                                    # line 9 malformed
]


def test_malformed_rows_are_counted_with_line_numbers(embedded_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(BAD_ROWS) + "\n")
    stats, train, _ = run(embedded_target, tmp_path, source=str(bad), num_samples=10)
    assert sorted(json.loads(r["messages"])[-1]["content"] for r in train) == ["Explain rainbows.", "Write a haiku."]
    assert stats["dropped"] == {"malformed": 4, "no_user_turn": 1, "empty": 1, "duplicate": 1}
    examples = " | ".join(stats["examples"]["malformed"])
    for line in (2, 3, 4, 9):
        assert f"bad.jsonl line {line}" in examples
    assert "invalid JSON" in examples and "unknown role 'robot'" in examples


def test_zero_usable_rows_is_an_error(embedded_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(BAD_ROWS[1:6]) + "\n")
    with pytest.raises(PromptsError, match="zero usable rows"):
        run(embedded_target, tmp_path, source=str(bad))


def test_a_blank_line_is_counted_with_its_line_number(embedded_target, tmp_path):
    source = tmp_path / "blank.jsonl"
    source.write_text(BAD_ROWS[0] + "\n\n" + BAD_ROWS[7] + "\n")
    stats, train, _ = run(embedded_target, tmp_path, source=str(source), num_samples=10)
    assert len(train) == 2 and stats["dropped"] == {"blank_line": 1}
    assert stats["examples"]["blank_line"] == [f"{source} line 2: blank_line"]


def test_dataset_answers_asked_for_and_none_usable_is_an_error(embedded_target, tmp_path):
    """Every row serves as a prompt or has no answer: an empty answered.parquet would pass silently."""
    source = tmp_path / "questions.jsonl"
    source.write_text("\n".join(f'{{"messages": [{{"role": "user", "content": "Question {i}?"}}]}}' for i in range(8)))
    with pytest.raises(PromptsError, match=r"prompts.dataset_answers=5: no conversation with a usable dataset answer "
                                           r"is left after the 3 prompts \(dropped: \{'no_dataset_answer': 5\}\)"):
        run(embedded_target, tmp_path, source=str(source), num_samples=3, dataset_answers=5)
    assert not (tmp_path / "prompts").exists()  # nothing written


def test_too_long_prompts_are_dropped_and_counted(embedded_target, tmp_path):
    stats, train, _ = run(embedded_target, tmp_path, num_samples=10, max_prompt_tokens=60)
    assert stats["dropped"]["too_long"] > 0
    assert all(row["num_prompt_tokens"] <= 60 for row in train)


def test_parquet_source_and_multi_turn_policy(embedded_target, tmp_path):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."}]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": conversation}]), path)
    _, first, _ = run(embedded_target, tmp_path / "first", source=str(path), num_samples=1)
    _, every, _ = run(embedded_target, tmp_path / "all", source=str(path), num_samples=1, multi_turn="all_turns")
    assert json.loads(first[0]["messages"]) == conversation[:2]
    assert json.loads(every[0]["messages"]) == conversation


def test_dataset_answer_follows_the_multi_turn_policy():
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    for policy, expected in (("first_user", conversation[:2]), ("all_turns", conversation)):
        assert with_dataset_answer(conversation, apply_policy(conversation, policy)) == expected
    for unanswered in (conversation[:3], conversation[:3] + [{"role": "assistant", "content": " "}]):
        with pytest.raises(RowError, match="no_dataset_answer"):
            with_dataset_answer(unanswered, apply_policy(unanswered, "all_turns"))


def test_hf_datasets_path_on_shipped_data(tmp_path):
    """The code path real runs take (`datasets.load_dataset`), fed a local file of the shipped ShareGPT."""
    path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    items = [item for _, (_, item) in zip(range(50), iter_json_array_items(path.read_text(encoding="utf-8"), "x"))]
    local = tmp_path / "sharegpt.jsonl"
    # Arrow needs one schema per column: keep the fields every ShareGPT item has.
    local.write_text("\n".join(json.dumps({"id": item["id"], "conversations": [
        {"from": t["from"], "value": t["value"]} for t in item["conversations"]]}) for item in items) + "\n")
    rows = list(iter_hf("json", "train", data_files=str(local)))
    assert len(rows) == 50 and rows[3][0] == "json[train] row 3"
    log = DropLog()
    usable = usable_rows(iter(rows), "first_user", True, log, held_out=set())
    assert len(usable) + sum(log.counts.values()) == 50
    assert usable and usable[0][1][-1]["role"] == "user"


def test_unknown_source_and_bad_policy(embedded_target, tmp_path):
    with pytest.raises(PromptsError, match="unknown source"):
        run(embedded_target, tmp_path, source="nonsense")
    with pytest.raises(PromptsError, match="multi_turn='last'"):
        run(embedded_target, tmp_path, multi_turn="last")
    with pytest.raises(PromptsError, match="dataset_answers=-1: expected 0 or more"):
        run(embedded_target, tmp_path, dataset_answers=-1)


def test_normalize_sharegpt_roles():
    assert normalize_messages({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                                 {"from": "gpt", "value": "a"}]}) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def test_evaluation_questions_are_held_out_of_training_by_id_and_text(embedded_target, tmp_path):
    """A ShareGPT conversation that asks an evaluation question (whitespace aside) is dropped as
    eval_overlap; no training prompt or dataset-answered conversation shares an eval id or turn."""
    from eagle3.data.eval_sets import mtbench_rows

    first = next(obj for _, obj in mtbench_rows())["turns"][0]
    source = tmp_path / "source.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Tell me about topic {i}."},
                               {"from": "gpt", "value": f"Topic {i} is interesting."}]} for i in range(12)]
    rows.insert(3, {"conversations": [{"from": "human", "value": "  " + first.replace(" ", "  ") + "\n"},
                                      {"from": "gpt", "value": "A travel blog post."}]})
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stats, train, evaluation = run(embedded_target, tmp_path, source=str(source), num_samples=6, dataset_answers=6)
    answered = pq.read_table(tmp_path / "prompts" / "answered.parquet").to_pylist()
    assert stats["dropped"]["eval_overlap"] == 1
    eval_ids = {q["id"] for q in evaluation}
    eval_texts = {" ".join(t.split()) for q in evaluation for t in q["turns"]}
    for row in train + answered:
        assert row["id"] not in eval_ids
        turns = [m["content"] for m in json.loads(row["messages"])]
        assert not {" ".join(t.split()) for t in turns} & eval_texts, row


def test_a_local_eval_set_is_read_like_the_shipped_ones(tmp_path):
    from eagle3.data.eval_sets import load_set

    path = tmp_path / "support.jsonl"
    path.write_text('{"turns": ["How do I reset my password?"], "category": "account"}\n'
                    '{"prompt": "Where is my order?"}\n\n{"turns": []}\n')
    log = DropLog()
    rows = load_set(str(path), log)
    assert [(r["set"], r["category"], r["turns"]) for r in rows] == [
        ("support", "account", ["How do I reset my password?"]), ("support", "support", ["Where is my order?"])]
    assert log.counts == {"eval_blank_line": 1, "eval_malformed": 1}
    assert f"{path} line 4" in log.examples["eval_malformed"][0]
    with pytest.raises(PromptsError, match=r"prompts.eval_sets: 'gsm8k' is neither a shipped set \(mtbench, "):
        load_set("gsm8k", log)
