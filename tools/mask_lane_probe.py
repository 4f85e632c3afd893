"""Whether copies of one compiled grammar compute their masks in parallel: `python -m tools.mask_lane_probe`.

The core hands every request of a grammar a copy of one kept compile (server/engine/grammar.py), and copies
share the compile's lexer. Over the synthetic 128K-token vocabulary of tools/mask_row_cost_probe (a real
tokenizer's breadth), ROWS matchers of a JSON schema (or the regex [a-z ]+) are copies of LANES compiles: 1
(the core's case), the thread count (each a block of rows, or every LANES-th row) or one a row; every case
walks the same random paths. Each step computes their masks, then every row takes a random allowed token (a
matcher keeps its mask until its next token: a step without one reads it back in microseconds), on
llguidance's executor (--threads) and on this thread (each row timed, as grammar.py's core's thread). Prints
the median ms a step of each and its ratio to the executor on one lane; JSON with --out. (A pool of Python
threads, one job a lane, took about as long as this thread over these ~8 us rows: their hand-offs and
per-row Python work cost what they save; grammar.py runs only costly steps on them.)"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import llguidance
import numpy as np
import torch

from server.engine.grammar import _mask_ms
from tools.mask_row_cost_probe import SCHEMA, TOKENS, SyntheticVocabulary


def step_ms(compute, matchers: list, lanes: list[int], words: int, steps: int, rng: random.Random
            ) -> float:
    """Median ms of compute(matchers, lanes, bits)'s masks over `steps` steps, each row advanced by an allowed
    token between them (the first two steps not counted)."""
    bits = torch.empty((len(matchers), words), dtype=torch.int32)
    took = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        compute(matchers, lanes, bits)
        took.append((time.perf_counter() - start) * 1e3)
        allowed = bits.numpy().view(np.uint32)
        for g, m in enumerate(matchers):
            if m.is_stopped():
                continue
            nonzero = np.nonzero(allowed[g])[0]
            word = int(nonzero[rng.randrange(min(len(nonzero), 50))])
            value = int(allowed[g, word])
            token = 32 * word + (value & -value).bit_length() - 1
            if token < TOKENS:  # not EOS
                m.consume_token(token)
    return statistics.median(took[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--grammar", choices=["json", "regex"], default="json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = llguidance.LLTokenizer(llguidance.TokenizerWrapper(SyntheticVocabulary(rng)))
    words = (vocab.vocab_size + 31) // 32
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
               if args.grammar == "json" else llguidance.LLMatcher.grammar_from_regex("[a-z ]+"))
    executor = llguidance.LLExecutor(args.threads)

    def on_executor(matchers, lanes, bits):
        executor.unsafe_compute_mask_ptr([(m, g) for g, m in enumerate(matchers)], bits.data_ptr(),
                                         words * 4, len(matchers))

    def on_this_thread(matchers, lanes, bits):  # grammar.py's core's thread: each row timed, in turn
        for g, m in enumerate(matchers):
            _mask_ms((m, bits.data_ptr() + g * words * 4, words * 4))

    runners = {"executor": on_executor, "this thread": on_this_thread}
    results = []
    for rows in args.rows:
        # one lane again last: a drift shows as a gap
        for lanes, order in ((1, "-"), (args.threads, "blocks"), (args.threads, "interleaved"), (rows, "-"),
                             (1, "-")):
            compiles = [llguidance.LLMatcher(vocab, grammar, log_level=0) for _ in range(lanes)]
            lane = [g % lanes if order == "interleaved" else g * lanes // rows for g in range(rows)]
            for runner, compute in runners.items():
                matchers = [compiles[lane[g]].deep_copy() for g in range(rows)]
                ms = step_ms(compute, matchers, lane, words, args.steps, random.Random(rows))  # same paths
                results.append({"rows": rows, "lanes": lanes, "order": order, "runner": runner, "ms": ms})
                print(f"rows {rows:>4} lanes {lanes:>4} {order:>11} {runner:>12}: {ms:.3f} ms a step",
                      flush=True)
    print(f"\n{args.grammar}, {TOKENS}-token synthetic vocabulary, executor of {args.threads} threads, "
          f"median of {args.steps} steps")
    print("| rows | lanes | rows of a lane | runner | ms a step | vs the executor on one lane (first run) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        first = next(x["ms"] for x in results if x["rows"] == r["rows"] and x["lanes"] == 1)
        print(f"| {r['rows']} | {r['lanes']} | {r['order']} | {r['runner']} | {r['ms']:.3f} | "
              f"{r['ms'] / first:.2f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": args.threads, "grammar": args.grammar, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
