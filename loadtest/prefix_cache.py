"""The server's prefix-cache counters around a measured run, from its Prometheus /metrics (best effort).

A run whose prompts the server already holds in its prefix cache (an earlier run with the same seed: the
same seed gives the same first N prompts) skips most of its prefill and measures something else than a run
of fresh prompts. The report therefore carries the share of the run's prompt tokens the server found
cached, where the server exports prompt-token lookup and hit counters: pagewalk's
`pagewalk_prefix_cache_{queries,hits}_total` and vLLM's `vllm:prefix_cache_{queries,hits}_total` (every
label set summed). Servers without them give None and nothing is reported.
"""

from __future__ import annotations

import re

_SERIES = re.compile(r"^(?:pagewalk_|vllm:)prefix_cache_(queries|hits)(?:_total)?(?:\{[^}]*\})?\s+(\S+)\s*$",
                     re.M)
WARN_HIT_RATE = 0.10  # above this share of cached prompt tokens the report warns


def parse_counters(text: str) -> dict[str, float] | None:
    """{"queries": prompt tokens looked up, "hits": of them found cached} from Prometheus text; None when
    the text has neither series."""
    sums: dict[str, float] = {}
    for kind, value in _SERIES.findall(text):
        try:
            sums[kind] = sums.get(kind, 0.0) + float(value)
        except ValueError:
            continue
    return sums if "queries" in sums and "hits" in sums else None


def hit_rate(before: dict | None, after: dict | None) -> float | None:
    """Hits / queries between two readings; None without both or without lookups in between."""
    if not before or not after:
        return None
    queries = after["queries"] - before["queries"]
    return (after["hits"] - before["hits"]) / queries if queries > 0 else None


def cache_warning(report: dict) -> str | None:
    rate = report.get("server_prefix_cache_hit_rate")
    if rate is None or rate <= WARN_HIT_RATE:
        return None
    return (f"the server found {rate:.0%} of this run's prompt tokens in its prefix cache (prompts it had "
            f"seen): prefill was mostly skipped; another --seed gives fresh prompts")
