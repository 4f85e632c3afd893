"""Host cost of a step's structured-output masks on this machine: `python -m tools.grammar_mask_probe`.

The bench preset's vocabulary (the byte tokenizer padded to 128256 ids), the regex [a-z]{128}: per step
the pinned bitmask's allocation, Grammars.masks, llguidance's masks with 1 / 2 / 4 executor threads, and the
matchers' consume_token, at 1 / 64 / 256 rows (median ms over --steps steps); on CUDA the mask applied to the
logits, by torch ops and by kernels/token_mask.py."""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import llguidance
import llguidance.torch
import torch

from kernels.token_mask import mask_tokens_
from server.engine.grammar import Grammars
from server.engine.sampler import mask_tokens
from server.model.tokenizer import ByteTokenizer

VOCAB = 128256
THREADS = (1, 2, 4)


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    pin = torch.cuda.is_available()
    grammars = Grammars(ByteTokenizer(VOCAB), VOCAB, {ByteTokenizer.EOS})
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{128}")
    t0 = time.perf_counter()
    matchers = [grammars.compile(grammar).result() for _ in range(256)]
    print(f"compile 256 (the vocabulary first): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    print(f"{'rows':>5} {'alloc pinned':>12} {'alloc':>8} {'masks':>8} " +
          " ".join(f"{'threads ' + str(n):>10}" for n in THREADS) + f" {'consume':>8}")
    for rows in (1, 64, 256):
        print(f"{rows:>5} " + " ".join(f"{t:>8.3f}" for t in probe_rows(grammars, matchers[:rows], pin,
                                                                           args.steps)))
    if torch.cuda.is_available():
        for rows in (1, 64, 256):
            print(f"the mask on the device, {rows} rows: torch {device_mask_ms(rows, mask_tokens):.3f} ms, "
                  f"kernel {device_mask_ms(rows, mask_tokens_):.3f} ms")


def device_mask_ms(rows: int, fn) -> float:
    """Device ms of `fn` (the sampler's torch mask_tokens, or kernels/token_mask.py) over (rows, VOCAB) fp32
    logits, every row guided (CUDA events)."""
    logits = torch.randn(rows, VOCAB, device="cuda")
    bits = torch.randint(-2**31, 2**31 - 1, (rows, (VOCAB + 31) // 32), dtype=torch.int32, device="cuda")
    samples = torch.arange(rows, device="cuda")
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(logits, samples, bits)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe_rows(grammars: Grammars, matchers: list, pin: bool, steps: int) -> list[float]:
    """-> median ms of: the pinned and the pageable bitmask's allocation, Grammars.masks, the masks with
    1 / 2 / 4 executor threads, and consuming a token (rolled back) in every matcher."""
    shape = (len(matchers), (VOCAB + 31) // 32)
    out = [median_ms(lambda: torch.full(shape, -1, dtype=torch.int32, pin_memory=pin), steps),
           median_ms(lambda: torch.full(shape, -1, dtype=torch.int32), steps),
           median_ms(lambda: grammars.masks(matchers), steps)]
    rows = [(m, g) for g, m in enumerate(matchers)]
    own = (grammars._vocabulary().vocab_size + 31) // 32  # llguidance's words: the tokenizer's own ids
    bits = torch.full((len(matchers), own), -1, dtype=torch.int32)
    for executor in map(llguidance.LLExecutor, THREADS):
        fill = functools.partial(llguidance.torch.fill_next_token_bitmask_par, executor, rows, bits)
        out.append(median_ms(fill, steps))
    a = ByteTokenizer.OFFSET + ord("a")

    def consume():
        for m in matchers:
            m.consume_token(a)
            m.rollback(1)

    out.append(median_ms(consume, steps))
    return out

if __name__ == "__main__":
    main()
