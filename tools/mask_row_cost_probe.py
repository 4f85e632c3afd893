"""What a step's masks cost over a 128K-token vocabulary: `python -m tools.mask_row_cost_probe`.

The bench preset's byte vocabulary (259 ids) makes a mask row cheap (~3 us); a real checkpoint's tokenizer has
32K-152K tokens, and llguidance walks a token trie that large. No tokenizer.json travels to the GPU host, so
this builds a synthetic one: the 256 bytes and 127,744 random byte strings of 2-11 bytes (letters mostly,
digits, punctuation, half of them after a space), whose trie has the breadth of a BPE vocabulary's. Over it,
64 and 256 matchers of a JSON schema and of the regex [a-z ]+, each advanced along its own random allowed
path (every row in another state), time their masks: on one thread (server/engine/grammar.py's path for
cheap rows) and on llguidance's executor with 2 and 4 threads. Prints median ms over --steps steps, and the
one-thread ms a row (what Grammars.row_ms measures; PARALLEL_MASKS_MS weighs it)."""

from __future__ import annotations

import argparse
import random

import llguidance
import torch

from tools.grammar_mask_probe import median_ms

TOKENS = 128_000
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


class SyntheticVocabulary:
    """llguidance.TokenizerWrapper's view of the synthetic vocabulary (EOS last, empty)."""

    def __init__(self, rng: random.Random) -> None:
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        other = letters + "0123456789 ,.:;\"'{}[]()_-\n"
        tokens, seen = [bytes([b]) for b in range(256)], set()
        seen.update(tokens)
        while len(tokens) < TOKENS:
            n = rng.choice([2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 10])
            text = (" " if rng.random() < 0.5 else "") + "".join(
                rng.choice(letters if rng.random() < 0.8 else other) for _ in range(n))
            if text.encode() not in seen:
                seen.add(text.encode())
                tokens.append(text.encode())
        self.tokens = [*tokens, b""]
        self.eos_token_id = len(tokens)
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def advanced(vocab: llguidance.LLTokenizer, grammar: str, rows: int, rng: random.Random) -> list:
    """`rows` matchers of `grammar`, each advanced 0-20 tokens along random allowed tokens (not EOS)."""
    matchers = []
    for _ in range(rows):
        m = llguidance.LLMatcher(vocab, grammar, log_level=0)
        for _ in range(rng.randrange(21)):
            mask = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.uint8)  # bit t: token t
            ids = ((mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:TOKENS].nonzero()
            if not len(ids) or m.is_stopped():
                break
            m.consume_token(int(ids[rng.randrange(min(200, len(ids)))]))
        matchers.append(m)
    return matchers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = llguidance.LLTokenizer(llguidance.TokenizerWrapper(SyntheticVocabulary(rng)))
    words = (vocab.vocab_size + 31) // 32
    executors = {n: llguidance.LLExecutor(n) for n in (2, 4)}
    print(f"{'grammar':>8} {'rows':>5} {'1 thread':>9} {'2 thr.':>9} {'4 thr.':>9} {'ms a row':>9}")
    grammars = {"json": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA,
                                                                    defaults={"whitespace_flexible": False}),
                "regex": llguidance.LLMatcher.grammar_from_regex("[a-z ]+")}
    for name, grammar in grammars.items():
        for rows in (64, 256):
            times = row_times(advanced(vocab, grammar, rows, rng), words, executors, args.steps)
            cells = " ".join(f"{t:>9.3f}" for t in times)
            print(f"{name:>8} {rows:>5} {cells} {times[0] / rows:>9.4f}")


def row_times(matchers: list, words: int, executors: dict, steps: int) -> list[float]:
    """-> median ms of the rows' masks on this thread, then on each executor."""
    rows = len(matchers)
    bits = torch.full((rows, words), -1, dtype=torch.int32)
    pairs = [(m, g) for g, m in enumerate(matchers)]

    def serial():
        for m, g in pairs:
            m.unsafe_compute_mask_ptr(bits[g].data_ptr(), words * 4)

    return [median_ms(serial, steps)] + [
        median_ms(lambda e=e: e.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), words * 4, rows), steps)
        for e in executors.values()]

if __name__ == "__main__":
    main()
