"""The benchmark report renders from a stored result (the published H200 runs): markdown and table."""

import json
from pathlib import Path

import pytest

from kernels import benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
RESULTS = [BENCHMARKS / "kernel_h200.json", BENCHMARKS / "kernel_h200_ptxas12.8.json"]   # the current format


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_report_names_the_config_the_heuristic_ran(path):
    result = json.loads(path.read_text())
    md = benchmark.markdown(result)
    text = benchmark.table(result)
    for row in result["rows"]:
        cfg = row["heuristic"]["config"]
        label = f"{cfg['block_n']}/{cfg['num_warps']}w/{cfg['num_stages']}s"
        assert f"| {row['B']} | {row['L']} | {row['block_size']} | {label}" in md
        assert label in text
    assert f"{result['geomean_sdpa_over_ours']:.3f}" in md


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_published_markdown_is_rendered_from_its_json(path):
    md = path.with_suffix(".md").read_text()
    assert md == benchmark.markdown(json.loads(path.read_text()))
