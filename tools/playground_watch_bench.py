"""What watching the KV block map costs, one GPU call (not a test): `python -m tools.playground_watch_bench
--out DIR`.

`pagewalk serve --model bench` on CUDA (serving_bench's settings, so the KV cache is a GPU's: hundreds of
thousands of blocks) under the project's loadtest at concurrency 64, twice: nobody watching, then one client
reading /debug/kvcache/stream the whole time (what the playground page does). Also times GET /debug/kvcache
under load and idle. Prints a table last; writes playground_watch.json under --out. Needs the FastAPI stack,
pyzmq and msgspec importable (the wheels tools/serving_gpu_run.sh installs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from tools.serving_bench import URL, loadtest, start_server, stop_server

CONCURRENCY, NUM_REQUESTS = 64, 256


class Watcher(threading.Thread):
    """Reads the map stream like the page does; records each map's arrival time and size."""

    def __init__(self):
        super().__init__(daemon=True)
        self.maps: list[tuple[float, int]] = []
        self.last: dict | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        timeout = httpx.Timeout(10.0, read=5.0)  # an idle stream sends nothing: the read timeout ends it
        try:
            with httpx.stream("GET", f"{URL}/debug/kvcache/stream", timeout=timeout) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.maps.append((time.monotonic(), len(line) - 6))
                        self.last = json.loads(line[6:])
                    if self.stopping.is_set():
                        return
        except httpx.ReadTimeout:
            pass

    def summary(self) -> dict:
        gaps = [b[0] - a[0] for a, b in zip(self.maps, self.maps[1:], strict=False)]
        sizes = [n for _, n in self.maps]
        return {"maps": len(self.maps), "median_gap_s": statistics.median(gaps) if gaps else None,
                "mean_bytes": statistics.mean(sizes) if sizes else None,
                "max_bytes": max(sizes, default=None), "num_blocks": (self.last or {}).get("num_blocks")}


def timed_get() -> dict:
    start = time.perf_counter()
    r = httpx.get(f"{URL}/debug/kvcache", timeout=60)
    r.raise_for_status()
    snap = r.json()
    return {"seconds": time.perf_counter() - start, "bytes": len(r.content), "num_blocks": snap["num_blocks"],
            "used_blocks": snap["used_blocks"], "seqs": len(snap["seqs"])}


def under_load(out: Path, name: str) -> tuple[dict | None, dict]:
    """The loadtest, with a GET /debug/kvcache timed halfway through."""
    probe: dict = {}

    def probe_later() -> None:
        time.sleep(5)
        probe.update(timed_get())

    t = threading.Thread(target=probe_later, daemon=True)
    t.start()
    rep = loadtest(out, name, CONCURRENCY, NUM_REQUESTS, [])
    t.join(timeout=60)
    return rep, probe


def figures(rep: dict | None) -> dict:
    rep = rep or {}
    return {"output_tok_s": rep.get("output_throughput"),
            "tpot_p50_ms": (rep.get("tpot_ms") or {}).get("p50"),
            "ttft_p50_ms": (rep.get("ttft_ms") or {}).get("p50")}


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> str:
    idle, probe, s = res["idle_get"], res["unwatched"]["get_under_load"], res["watched"]["stream"]
    lines = [f"KV cache of {idle['num_blocks']} blocks. GET /debug/kvcache: idle "
             f"{_f(idle['seconds'] * 1e3, '.1f')} ms, {idle['bytes']} B; "
             f"under load {_f(probe.get('seconds', 0) * 1e3, '.1f')} ms, "
             f"{probe.get('bytes')} B ({probe.get('seqs')} seqs)",
             f"stream while watched: {s['maps']} maps, median gap {_f(s['median_gap_s'], '.2f')} s, "
             f"mean {_f(s['mean_bytes'], ',.0f')} B", "",
             f"| concurrency {res['concurrency']} | out tok/s | TPOT p50 ms | TTFT p50 ms |",
             "|---|---|---|---|"]
    for name in ("unwatched", "watched"):
        f = res[name]
        lines.append(f"| {name} | {_f(f['output_tok_s'], ',.0f')} | {_f(f['tpot_p50_ms'], '.2f')} | "
                     f"{_f(f['ttft_p50_ms'], '.1f')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc = start_server(args.out, [])
    try:
        idle = timed_get()
        loadtest(args.out, "warmup", CONCURRENCY, CONCURRENCY, [])
        alone, probe_alone = under_load(args.out, "unwatched")
        watcher = Watcher()
        watcher.start()
        watched, probe_watched = under_load(args.out, "watched")
        watcher.stopping.set()
        watcher.join(timeout=30)
    finally:
        code = stop_server(proc)
    res = {"idle_get": idle, "unwatched": {**figures(alone), "get_under_load": probe_alone},
           "watched": {**figures(watched), "get_under_load": probe_watched, "stream": watcher.summary()},
           "server_exit_code": code, "concurrency": CONCURRENCY, "num_requests": NUM_REQUESTS}
    (args.out / "playground_watch.json").write_text(json.dumps(res, indent=1))
    print(table(res))

if __name__ == "__main__":
    main()
