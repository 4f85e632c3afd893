"""Per-request sampling parameters (what the API turns an OpenAI request into)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # biased tokens of a request; also its allowed ids, the stop ids min_tokens holds back
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound of one bias value
MAX_N = 64
MAX_BAD_WORDS = 128  # a request's bad_words (the API encodes each one with and without a leading space)
MAX_BAD_WORD_TOKENS = 64  # tokens of one encoded bad word: the sampler's table is (rows, words, this wide)
# tokens of a request's encoded bad words in all: each row the request takes packs them (4 ints a token), and
# 128 words of 64 tokens at n = 64 packed 4M ints, a 0.6 s stall of every stream (a review, on CI's CPU)
MAX_BAD_WORDS_TOKENS = 1024
MAX_INT64 = 2**63 - 1  # seeds and top_k cross the core's wire (msgpack) as int64, as vLLM bounds its seed
GREEDY_TEMPERATURE = 1e-5  # below it a choice takes the argmax: dividing logits by it would overflow
# a structured output's grammar text: its compile time grows with the schema (3,000 optional properties, ~120K
# characters: ~0.3 s; 10,000: 2.6 s; llguidance 1.9.1, one CPU core; server/api/structured_output.py), and
# LLParserLimits bound the grammar's size only once it is compiled
MAX_GRAMMAR_CHARS = 128 << 10
# a cache salt's characters: vLLM's API takes any non-empty string (the 128-character bound and the '@', '/'
# ban some write-ups quote are LMCache's keys', not vLLM's; a review: base64 salts held '/' half the time).
# This bound is pagewalk's own, against a body's worth of salt kept per sequence and hashed per prompt.
MAX_CACHE_SALT_CHARS = 4096


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (anything below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 (or -1) = disabled
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    seed: int | None = None  # per-request generator: reproducible whatever the batch neighbours
    stop: list[str] = field(default_factory=list)  # stop strings: never emitted, text cut before them
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # choices; prefilled once, then forked
    logprobs: int | None = None  # None: no logprobs; k: sampled token's + top-k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob + top-k
    skip_special_tokens: bool = True  # False: the text spells the special tokens sampled (the API reads it)
    detokenize: bool = True  # False: no text, the API runs no detokenizer (vLLM's; the API reads it)
    # logprob entries name their tokens "token_id:{id}", not their text (vLLM's; the API reads it)
    return_tokens_as_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are held back (and stop strings ignored) until this many
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the output
    allowed_token_ids: list[int] | None = None  # the only tokens sampled; None: all
    # token sequences a choice never completes (vLLM's bad_words, encoded by the API; server/engine/
    # bad_words.py): the last token of each is out of the draw where the choice's last tokens are the others
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # a structured output: an llguidance grammar (LLMatcher.grammar_from_*'s text; server/api/
    # structured_output.py builds it from response_format / structured_outputs); None: free text
    grammar: str | None = None
    # vLLM's cache_salt: the prompt's blocks are shared in the prefix cache only with requests of the same
    # salt (KVCacheManager.allocate); None: with the unsalted requests. The prompt's, not the sampler's: it
    # rides here as n does, since every Sequence carries its params to the scheduler's allocations
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))  # distinct, in order
        if self.top_k == -1:
            self.top_k = 0

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as the core's finish check reads them once per token: a list scan per token let
        one request's 300K ids slow every stream of the step (not a field: it does not cross the wire)."""
        return frozenset(self.stop_token_ids)

    @functools.cached_property
    def bad_word_entries(self):
        """bad_words_ids as the runner packs them (server/engine/bad_words.py word_entries), computed once:
        a request of n choices places n rows, and each resume places one again."""
        from server.engine.bad_words import word_entries  # numpy and torch: the core's side

        return word_entries(self.bad_words_ids)

    @functools.cached_property
    def bad_words_by_last(self) -> dict[int, list[list[int]]]:
        """bad_words_ids by their last token: the core's check of each sampled token, computed once."""
        words: dict[int, list[list[int]]] = {}
        for word in self.bad_words_ids:
            words.setdefault(word[-1], []).append(word)
        return words

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_bias(self) -> bool:
        """Whether the sampler changes this choice's logits: logit_bias, min_tokens' hold-back, or
        allowed_token_ids."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field and its value. The API validates every request and
        the core every request it is sent: a message is formatted only for a field that fails."""
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens must be an integer >= 1, got {}", self.max_tokens)
        _check(self.temperature >= 0.0, "temperature must be >= 0, got {}", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1], got {}", self.top_p)
        _check(isinstance(self.top_k, int) and 0 <= self.top_k <= MAX_INT64,
               "top_k must be an integer in [0, 2**63) (0 or -1 disables it), got {}", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1], got {}", self.min_p)
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n must be in [1, {}], got {}", MAX_N,
               self.n)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(k is None or (isinstance(k, int) and 0 <= k <= MAX_LOGPROBS),
                   "{} must be in [0, {}], got {}", name, MAX_LOGPROBS, k)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, "{} must be in [-2, 2], got {}", name, value)
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be > 0, got {}",
               self.repetition_penalty)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(self.detokenize or not self.stop, "stop strings are found in the text, which detokenize false "
               "leaves out (stop_token_ids need no text)")
        _check_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        _check_bias(self.logit_bias, vocab_size)
        _check_allowed(self.allowed_token_ids, vocab_size)
        _check_bad_words(self.bad_words_ids, vocab_size)
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens must be an integer in [0, max_tokens={}], got {}", self.max_tokens,
               self.min_tokens)
        _check(self.min_tokens == 0 or len(self.stop_token_ids) <= MAX_LOGIT_BIAS,
               "min_tokens holds back at most {} stop_token_ids, got {}", MAX_LOGIT_BIAS,
               len(self.stop_token_ids))
        _check(self.grammar is None or (isinstance(self.grammar, str) and 0 < len(self.grammar)
                                        <= MAX_GRAMMAR_CHARS),
               "a structured output's grammar must be a non-empty string of at most {} characters",
               MAX_GRAMMAR_CHARS)
        _check(self.grammar is None or self.allowed_token_ids is None,
               "allowed_token_ids cannot be combined with a structured output")
        _check(self.seed is None or (isinstance(self.seed, int) and -MAX_INT64 - 1 <= self.seed <= MAX_INT64),
               "seed must be an integer in [-2**63, 2**63), got {}", self.seed)
        if self.cache_salt is not None:
            check_cache_salt(self.cache_salt)


def check_cache_salt(salt: object) -> None:
    """ValueError naming cache_salt unless `salt` is a string of 1 to MAX_CACHE_SALT_CHARS characters (the
    API's check and the core's)."""
    _check(isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS,
           "cache_salt must be a string of 1 to {} characters", MAX_CACHE_SALT_CHARS)


def bad_token_ids(ids: list, vocab_size: int, integer: type = int) -> list:
    """The ids that are no `integer` in [0, vocab_size), [] for a valid list. The common case first: plain
    ints, checked by one type collection and min / max (a type test per id against numbers.Integral ran
    ~20x slower, 0.85 ms for a 512-token prompt on this project's CI CPU; the types collected by
    set(map(type, ...)) take 11.9 us for 512 ids against 27.6 for a generator of `type(t) is int`)."""
    if not ids or (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return []
    return [t for t in ids if not (isinstance(t, integer) and 0 <= t < vocab_size)]


def _check_ids(ids: list[int], vocab_size: int, name: str) -> None:
    bad = bad_token_ids(ids, vocab_size)  # (bools are ints, as before)
    if bad:
        raise ValueError(f"{name} must be in [0, {vocab_size}), got {bad[0]}")


def _check_bias(bias: dict[int, float], vocab_size: int) -> None:
    _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias holds at most {} tokens, got {}", MAX_LOGIT_BIAS,
           len(bias))
    if not bias:
        return
    _check_ids(list(bias), vocab_size, "logit_bias token ids")
    for value in bias.values():
        _check(-LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE,
               "logit_bias values must be in [-{0:g}, {0:g}], got {1}", LOGIT_BIAS_RANGE, value)


def _check_allowed(allowed: list[int] | None, vocab_size: int) -> None:
    if allowed is None:
        return
    _check(0 < len(allowed) <= MAX_LOGIT_BIAS,
           "allowed_token_ids must hold 1 to {} token ids, got {}", MAX_LOGIT_BIAS, len(allowed))
    _check_ids(allowed, vocab_size, "allowed_token_ids")


def _check_bad_words(words: list[list[int]], vocab_size: int) -> None:
    _check(len(words) <= 2 * MAX_BAD_WORDS, "bad_words holds at most {} token sequences, got {}",
           2 * MAX_BAD_WORDS, len(words))
    for word in words:
        _check(isinstance(word, list) and 0 < len(word) <= MAX_BAD_WORD_TOKENS,
               "bad_words must each encode to 1 to {} tokens, got {}", MAX_BAD_WORD_TOKENS,
               len(word) if isinstance(word, list) else word)
        _check_ids(word, vocab_size, "bad_words token ids")
    total = sum(map(len, words))
    _check(total <= MAX_BAD_WORDS_TOKENS, "bad_words encode to at most {} tokens in all, got {}",
           MAX_BAD_WORDS_TOKENS, total)


def _check(ok: bool, message: str, *values: object) -> None:
    if not ok:
        raise ValueError(message.format(*values))
