"""tools/sampler_bench.py on CPU: the dry run writes a report whose every path drew valid tokens, and without
a GPU the real run refuses loudly instead of timing nothing."""

from __future__ import annotations

import json
import os

import pytest

from tools import sampler_bench


def test_without_cuda_the_bench_exits_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler_bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        sampler_bench.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs the interpreter")
def test_dry_run_writes_every_path_and_config(tmp_path, capsys):
    sampler_bench.main(["--dry-run", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    seen = {(r["S"], r["config"], r["path"]) for r in report["results"]}
    sampled = [(c, p) for c in sampler_bench.CONFIGS for p in ("sorted", "kernel")]
    assert seen == {(S, c, p) for S in (1, 4) for c, p in [("greedy", "greedy"), *sampled]}
    assert all(r["bad_tokens"] == 0 and r["host_ms"] > 0 for r in report["results"])
    assert "kernel/greedy" in capsys.readouterr().out.splitlines()[-5]  # the table is printed last
