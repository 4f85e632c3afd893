"""loadtest/prefix_cache.py: the server's prefix-cache counters from Prometheus text, and the warning."""

import pytest

from loadtest.prefix_cache import WARN_HIT_RATE, cache_warning, hit_rate, parse_counters

PAGEWALK = """# HELP pagewalk_prefix_cache_queries Prompt tokens looked up in the prefix cache
# TYPE pagewalk_prefix_cache_queries counter
pagewalk_prefix_cache_queries_total{model_name="tiny"} 200.0
pagewalk_prefix_cache_queries_created{model_name="tiny"} 1.7961501172178543e+09
pagewalk_prefix_cache_hits_total{model_name="tiny"} 96.0
pagewalk_prefix_cache_hits_created{model_name="tiny"} 1.7961501172178683e+09
pagewalk_prompt_tokens_total{model_name="tiny"} 300.0
"""
VLLM = """vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 50.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_pagewalk_counters_leave_out_the_created_timestamps():
    assert parse_counters(PAGEWALK) == {"queries": 200.0, "hits": 96.0}


def test_vllm_counters_sum_every_label_set():
    assert parse_counters(VLLM) == {"queries": 1500.0, "hits": 300.0}


@pytest.mark.parametrize("text", ["", "pagewalk_prompt_tokens_total 3.0\n",
                                  'pagewalk_prefix_cache_queries_total{model_name="x"} 5.0\n'])
def test_a_server_without_both_series_gives_none(text):
    assert parse_counters(text) is None


def test_hit_rate_is_the_share_of_the_lookups_in_between():
    assert hit_rate({"queries": 100.0, "hits": 10.0}, {"queries": 300.0, "hits": 160.0}) == 0.75
    assert hit_rate({"queries": 100.0, "hits": 10.0}, {"queries": 100.0, "hits": 10.0}) is None
    assert hit_rate(None, {"queries": 1.0, "hits": 1.0}) is None


def test_the_report_warns_only_above_the_threshold():
    assert cache_warning({"server_prefix_cache_hit_rate": None}) is None
    assert cache_warning({"server_prefix_cache_hit_rate": WARN_HIT_RATE}) is None
    assert "97%" in cache_warning({"server_prefix_cache_hit_rate": 0.97})
