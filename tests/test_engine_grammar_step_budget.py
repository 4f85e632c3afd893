"""One guided request whose n choices' masks take 2 ms each (under COSTLY_ROW_MS) holds every step of every
stream for n x 2 ms: its rows count together, 80 ms at n = 40, and it fails as one 80 ms row would (a review
found it never struck: 314 ms a step at n = 64 rows of 4.9 ms).

Each row's mask is timed as 2 ms here (it also sleeps 2 ms), so that a loaded box's sleep overshoot past
5 ms cannot strike a row by chance."""

from __future__ import annotations

import dataclasses
import time

import pytest

from server.api.app import create_app
from server.engine import grammar as grammar_module
from server.engine.engine import build_core
from server.engine.sampling_params import SamplingParams
from tests.asgi_client import post
from tests.engine_helpers import started_engine
from tests.test_engine_grammar import config, regex_grammar, run

pytestmark = pytest.mark.timeout(300)


def test_a_request_of_many_cheap_choices_over_the_step_budget_fails(monkeypatch):
    real_mask_ms = grammar_module._mask_ms
    rows_per_step = []

    def two_ms(call):
        real_mask_ms(call)  # the row's real mask
        time.sleep(0.002)
        rows_per_step[-1] += 1
        return 2.0

    monkeypatch.setattr(grammar_module, "_mask_ms", two_ms)
    cfg = dataclasses.replace(config(async_scheduling=False, num_blocks=256, max_num_seqs=40),
                              max_num_batched_tokens=64)  # every choice decodes in every step
    core, _ = build_core(cfg)
    masks = core.grammars.masks

    def counted(matchers, costly=None, owners=None, lanes=None):
        rows_per_step.append(0)
        return masks(matchers, costly, owners, lanes)

    core.grammars.masks = counted
    params = SamplingParams(max_tokens=12, temperature=0.0, n=40, grammar=regex_grammar("[a-c]{12}"))
    _, ends = run(core, [("g", [1, 80, 81], params)])
    over = [2.0 * r for r in rows_per_step if 2.0 * r > grammar_module.MAX_TOKEN_MS]
    assert over, rows_per_step
    assert all(reason == "error" for reason, _ in ends.values()), (
        f"{len(over)} steps whose masks took {max(over):.0f} ms "
        f"(budget {grammar_module.MAX_TOKEN_MS:.0f} ms), "
        f"all from one request; finishes {sorted({r for r, _ in ends.values()})}")


def test_prompts_of_one_request_count_together_as_its_choices_do(monkeypatch):
    """/v1/completions sends each prompt as an engine request of its own ("{engine id}-{i}"), of one group:
    40 prompts x n = 1 in one request count as 40 choices do (a review found them 40 owners of 2 ms, never
    struck, holding every stream's step 80 ms)."""
    real_mask_ms, real_struck = grammar_module._mask_ms, grammar_module.struck_rows
    serial_ms = []  # each step's masks, ms

    def two_ms(call):
        real_mask_ms(call)
        time.sleep(0.002)
        return 2.0  # each row timed as 2 ms (under COSTLY_ROW_MS)

    def recording(times, *args):
        serial_ms.append(sum(ms for ms, _ in times))
        return real_struck(times, *args)

    monkeypatch.setattr(grammar_module, "_mask_ms", two_ms)
    monkeypatch.setattr(grammar_module, "struck_rows", recording)
    with started_engine(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                        num_blocks=512, max_num_seqs=80, max_num_batched_tokens=256) as eng:
        app = create_app(eng)
        base = {"max_tokens": 12, "temperature": 0, "structured_outputs": {"regex": "[a-c]{12}"}}
        by_n = post(app, "/v1/completions", {**base, "prompt": "a", "n": 40})
        serial_ms.clear()
        by_prompts = post(app, "/v1/completions", {**base, "prompt": ["a"] * 40})
    slow = [ms for ms in serial_ms if ms > grammar_module.MAX_TOKEN_MS]
    for r in (by_n, by_prompts):  # the request's own grammar failed it: a 400 clients do not retry
        assert r.status_code == 400 and "took 80 ms" in r.text, r.text[:300]
        assert r.json()["error"]["code"] == "structured_output_failed"
    assert len(slow) <= grammar_module.GRAMMAR_STRIKES + 1, serial_ms  # struck at its strikes, as n = 40 is
