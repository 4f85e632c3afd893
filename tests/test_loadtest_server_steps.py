"""loadtest/server_steps.py: the server's engine steps from Prometheus text, and the report's fields."""

import pytest

from loadtest.server_steps import parse_steps, step_fields

PAGEWALK = """# HELP pagewalk_iteration_tokens_total Tokens (prompt and decode) of each engine step
# TYPE pagewalk_iteration_tokens_total histogram
pagewalk_iteration_tokens_total_bucket{le="1.0",model_name="tiny"} 2.0
pagewalk_iteration_tokens_total_bucket{le="+Inf",model_name="tiny"} 30.0
pagewalk_iteration_tokens_total_count{model_name="tiny"} 30.0
pagewalk_iteration_tokens_total_sum{model_name="tiny"} 1200.0
pagewalk_iteration_tokens_total_created{model_name="tiny"} 1.79e+09
# TYPE pagewalk_engine_steps counter
pagewalk_engine_steps_total{kind="prompt",model_name="tiny"} 4.0
pagewalk_engine_steps_created{kind="prompt",model_name="tiny"} 1.79e+09
pagewalk_engine_steps_total{kind="decode",model_name="tiny"} 26.0
# TYPE pagewalk_request_handoff_seconds histogram
pagewalk_request_handoff_seconds_bucket{le="+Inf",model_name="tiny"} 8.0
pagewalk_request_handoff_seconds_count{model_name="tiny"} 8.0
pagewalk_request_handoff_seconds_sum{model_name="tiny"} 0.02
"""
VLLM = """vllm:iteration_tokens_total_count{engine="0",model_name="m"} 10.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 100.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 5.0
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 20.0
"""


def test_pagewalk_steps_read_the_histogram_and_the_prompt_kind():
    assert parse_steps(PAGEWALK) == {"steps": 30.0, "tokens": 1200.0, "prompt_steps": 4.0, "handoffs": 8.0,
                                     "handoff_s": 0.02}


def test_vllm_steps_sum_every_label_set_and_have_no_kinds():
    assert parse_steps(VLLM) == {"steps": 15.0, "tokens": 120.0}


@pytest.mark.parametrize("text", ["", 'pagewalk_engine_steps_total{kind="prompt"} 3.0\n',
                                  "vllm:iteration_tokens_total_count 3.0\n",
                                  "vllm:iteration_tokens_total_count x\nvllm:iteration_tokens_total_sum 1\n"])
def test_a_server_without_the_histogram_gives_none(text):
    assert parse_steps(text) is None


def test_fields_are_the_changes_between_two_readings():
    before = {"steps": 30.0, "tokens": 1200.0, "prompt_steps": 4.0, "handoffs": 8.0, "handoff_s": 0.02}
    after = {"steps": 130.0, "tokens": 9200.0, "prompt_steps": 14.0, "handoffs": 12.0, "handoff_s": 0.03}
    fields = step_fields(before, after)
    assert fields == {"server_steps": 100.0, "server_tokens_per_step": 80.0, "server_prompt_steps": 10.0,
                      "server_handoff_ms": pytest.approx(2.5)}  # 10 ms over 4 requests
    vllm = step_fields({"steps": 1.0, "tokens": 5.0}, {"steps": 3.0, "tokens": 9.0})
    assert vllm == {"server_steps": 2.0, "server_tokens_per_step": 2.0, "server_prompt_steps": None,
                    "server_handoff_ms": None}


def test_no_reading_or_no_step_gives_none_fields():
    empty = {"server_steps": None, "server_tokens_per_step": None, "server_prompt_steps": None,
             "server_handoff_ms": None}
    assert step_fields(None, {"steps": 1.0, "tokens": 1.0}) == empty
    assert step_fields({"steps": 1.0, "tokens": 1.0}, {"steps": 1.0, "tokens": 1.0}) == empty
