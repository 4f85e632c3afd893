"""tools/core_host_bench runs: its two cases on a small scale (the numbers themselves are for docs)."""

from tools.core_host_bench import decode_step_ms, prefix_hit_ms


def test_decode_steps_are_timed_on_a_full_batch():
    best, medians = decode_step_ms(batch=4, steps=3, repeats=2)
    assert len(medians) == 2 and best == min(medians) > 0


def test_the_prefix_hit_step_reports_its_phases():
    ms, phases = prefix_hit_ms(rounds=1)
    assert ms > 0
    assert {"schedule", "allocate", "execute", "execute: pack", "execute: send", "post"} <= set(phases)
    assert phases["allocate"] <= phases["schedule"] and phases["execute: pack"] <= phases["execute"]
