"""OpenAI request fields -> engine SamplingParams (validated against the vocabulary)."""

from __future__ import annotations

from server.api.errors import APIError
from server.api.protocol import _SamplingRequest
from server.api.structured_output import Grammar
from server.engine.sampling_params import SamplingParams, bad_token_ids

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(req: _SamplingRequest, max_tokens: int, logprobs: int | None, tokenizer,
                    defaults: dict | None = None, grammar: Grammar | None = None) -> SamplingParams:
    """Builds SamplingParams from the request; an invalid value becomes a 400 naming its field. `tokenizer`
    (server/model/tokenizer.py) encodes the bad words; `defaults`: the model's generation_config.json values
    for the fields a request leaves out (then OpenAI's); `grammar`: the request's structured output
    (structured_output.request_grammar): one whose literals take special tokens spells special tokens in
    the reply unless the request sets skip_special_tokens, so that a trigger written as its token stays in
    the text."""
    d = defaults or {}
    vocab_size = tokenizer.vocab_size
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(req.temperature, d.get("temperature", 1.0)),
        top_p=_or(req.top_p, d.get("top_p", 1.0)),
        top_k=_top_k(_or(req.top_k, d.get("top_k")), vocab_size),
        min_p=_or(req.min_p, d.get("min_p", 0.0)),
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        n=_or(req.n, 1),
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
        detokenize=req.detokenizes,
        return_tokens_as_token_ids=bool(req.return_tokens_as_token_ids),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
        logit_bias={int(token): value for token, value in (req.logit_bias or {}).items()},
        min_tokens=_or(req.min_tokens, 0),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
        bad_words_ids=bad_words_ids(tokenizer, req.bad_words or []),
        prompt_logprobs=req.prompt_logprobs,
        grammar=None if grammar is None else grammar.text,
        cache_salt=req.cache_salt,
    )
    if grammar is not None and grammar.special and req.skip_special_tokens is None:
        params.skip_special_tokens = False
    try:
        params.validate(vocab_size)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        raise APIError(400, message, field if field in type(req).model_fields else None) from None
    return params


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it starts the text and as it follows a space (vLLM's two spellings: a
    word's tokens differ with a leading space in BPE and SentencePiece vocabularies), distinct, in order."""
    seqs = {}
    for word in words:
        bare = word.lstrip() or word  # a word of whitespace alone is itself ("\n" bans a newline)
        for text in (bare, " " + bare):
            ids = tokenizer.encode(text, add_bos=False)
            if ids:
                seqs.setdefault(tuple(ids), None)
    return [list(ids) for ids in seqs]


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = bad_token_ids(token_ids, vocab_size)  # ints already (the request models are strict)
    if bad:
        raise APIError(400, f"token id {bad[0]} in '{param}' is outside the vocabulary [0, {vocab_size})",
                       param, "invalid_token_id")


def _top_k(top_k: int | None, vocab_size: int) -> int:
    """The request's top_k; one that keeps the whole vocabulary (>= its size) disables the cut: 0."""
    return 0 if top_k is None or top_k >= vocab_size else top_k


def _or(value, default):
    return default if value is None else value
