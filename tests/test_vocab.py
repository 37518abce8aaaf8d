from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save_file

from eagle3.vocab import VocabParams, build, top_n_map


def write_responses(path, completions, prompt=(0, 0, 0)):
    pq.write_table(pa.Table.from_pylist([{"completion_token_ids": c, "prompt_token_ids": list(prompt)}
                                         for c in completions]), path)
    return path


def test_top_n_by_frequency_ties_by_id_unseen_fill():
    counts = np.array([0, 5, 1, 5, 0, 9, 0, 0])
    d2t, t2d = top_n_map(counts, 4)
    draft_to_target = np.arange(4) + d2t
    assert draft_to_target.tolist() == [1, 2, 3, 5]  # ascending target ids, as engines index them
    assert t2d.tolist() == [False, True, True, True, False, True, False, False]
    d2t, _ = top_n_map(counts, 6)  # only 4 tokens seen: the lowest unseen ids fill up
    assert (np.arange(6) + d2t).tolist() == [0, 1, 2, 3, 4, 5]
    assert d2t.dtype == np.int64


def test_counts_only_generated_tokens_and_reports_coverage(tmp_path):
    responses = write_responses(tmp_path / "r.parquet", [[5, 5, 5, 7], [7, 9, 5]])  # prompt ids (0) never count
    stats = build(VocabParams(draft_vocab_size=2, from_drafter=None), vocab_size=16, responses=responses, out=tmp_path / "vocab",
                  answered=None)
    d2t, t2d = np.load(tmp_path / "vocab/d2t.npy"), np.load(tmp_path / "vocab/t2d.npy")
    assert (np.arange(2) + d2t).tolist() == [5, 7] and t2d.sum() == 2 and t2d.size == 16
    assert stats["coverage"] == pytest.approx(6 / 7)
    assert stats["generated_tokens"] == 7 and stats["distinct_generated"] == 3
    assert json.loads((tmp_path / "vocab/stats.json").read_text()) == stats


def test_ties_and_unused_ids_go_to_the_rest_of_the_training_text(tmp_path):
    counts = np.array([0, 5, 1, 1, 0, 9, 0, 0])
    context = np.array([0, 0, 1, 4, 0, 0, 2, 0])
    assert (np.arange(3) + top_n_map(counts, 3, context)[0]).tolist() == [1, 3, 5]  # 3 beats 2 on context
    assert (np.arange(6) + top_n_map(counts, 6, context)[0]).tolist() == [0, 1, 2, 3, 5, 6]  # 6, then lowest id

    # the same through the stage: prompt tokens and dataset answer tokens add up (11: 3, 13: 1 + 2, 12: 1)
    responses = write_responses(tmp_path / "r.parquet", [[5, 5, 7]], prompt=(12, 13))
    answered = tmp_path / "answered.parquet"
    pq.write_table(pa.Table.from_pylist([{"token_ids": [11, 11, 11, 13, 13]}]), answered)
    stats = build(VocabParams(draft_vocab_size=4, from_drafter=None), vocab_size=16, responses=responses, out=tmp_path / "vocab",
                  answered=answered)
    assert (np.arange(4) + np.load(tmp_path / "vocab/d2t.npy")).tolist() == [5, 7, 11, 13]
    assert stats["filled_from_context"] == 2 and stats["coverage"] == 1.0


def test_existing_drafter_map_is_kept(tmp_path):
    d2t = np.array([1, 1, 3], dtype=np.int64)  # draft -> target 1, 2, 5
    t2d = np.zeros(16, dtype=bool)
    t2d[[1, 2, 5]] = True
    (tmp_path / "drafter").mkdir()
    save_file({"d2t": d2t, "t2d": t2d, "lm_head.weight": np.zeros((3, 4), np.float32)},
              str(tmp_path / "drafter/model.safetensors"))
    responses = write_responses(tmp_path / "r.parquet", [[5, 9, 9]], prompt=(1, 2))
    stats = build(VocabParams(draft_vocab_size=3, from_drafter=str(tmp_path / "drafter")), vocab_size=16,
                  responses=responses, out=tmp_path / "vocab", answered=None)
    assert np.load(tmp_path / "vocab/d2t.npy").tolist() == [1, 1, 3]
    assert stats["coverage"] == pytest.approx(1 / 3)
    assert stats["filled_from_context"] == 0  # ids 1 and 2 are the drafter's, not filled from the prompts


def test_bad_input(tmp_path):
    responses = write_responses(tmp_path / "r.parquet", [[3, 99]])
    with pytest.raises(ValueError, match="completion_token_ids has token id 99 outside the target vocabulary"):
        build(VocabParams(draft_vocab_size=4, from_drafter=None), vocab_size=16, responses=responses, out=tmp_path / "v",
              answered=None)
    with pytest.raises(ValueError, match="draft_vocab_size=32: expected 1..16"):
        build(VocabParams(draft_vocab_size=32, from_drafter=None), vocab_size=16, responses=responses, out=tmp_path / "v")
