from __future__ import annotations

from stages.evaluate import agreement_failure, conversation, parse_spec_metrics

PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 5.0
vllm:generation_tokens_total{engine="0",model_name="target"} 999.0
"""


def test_parse_spec_decode_counters():
    m = parse_spec_metrics(PAGE)
    assert (m["drafts"], m["draft_tokens"], m["accepted_tokens"]) == (100, 300, 60)
    assert [m[f"pos{i}"] for i in range(3)] == [40, 15, 5]


def test_agreement_check_prints_both_curves_when_they_differ():
    offline = {"acceptance_length": 1.6, "per_position": [0.4, 0.15, 0.05]}
    assert agreement_failure(offline, {"acceptance_length": 1.55, "per_position": [0.38, 0.12, 0.05]}, 0.1) is None
    failure = agreement_failure(offline, {"acceptance_length": 1.05, "per_position": [0.04, 0.01, 0.0]}, 0.1)
    assert "differ by 52.4%" in failure and "position 0: offline 0.400  vLLM 0.040" in failure


def test_second_turn_follows_the_models_own_answer():
    assert conversation(["q1", "q2"], ["a1"]) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
