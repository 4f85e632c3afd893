"""StopChecker: stop strings never emitted, held-back prefixes, stop token ids, EOS, max_tokens."""

from __future__ import annotations

from server.engine.sampling_params import SamplingParams
from server.engine.stop_checker import StopChecker
from server.model import IncrementalDetokenizer
from server.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def run(text: str, **params) -> tuple[list[str], str | None, str | int | None]:
    """Feed `text` byte by byte; return the emitted pieces and the finish."""
    checker = StopChecker(SamplingParams(**params), IncrementalDetokenizer(TOK), TOK.eos_token_ids)
    pieces = []
    for token in TOK.encode(text, add_bos=False):
        res = checker.append(token)
        pieces.append(res.text)
        if res.finish_reason:
            return pieces, res.finish_reason, res.stop_reason
    return pieces, None, None


def test_stop_string_cut_and_never_emitted():
    pieces, reason, stop = run("hello world. bye", stop=["world"], max_tokens=100)
    assert "".join(pieces) == "hello "
    assert (reason, stop) == ("stop", "world")


def test_possible_prefix_is_held_back_then_released():
    pieces, reason, _ = run("a wo wonder", stop=["world"], max_tokens=100)
    assert reason is None
    assert pieces[:4] == ["a", " ", "", ""]  # "wo" might start "world": held
    assert pieces[4] == "wo "  # the space proves it was not
    assert "".join(pieces) == "a wo wonder"
    pieces, reason, _ = run("a wo wor", stop=["world"], max_tokens=100)
    assert reason is None and "".join(pieces) == "a wo "  # "wor" still held


def test_earliest_of_several_stops_wins():
    pieces, reason, stop = run("xx ab cd", stop=["cd", "b c"], max_tokens=100)
    assert "".join(pieces) == "xx a" and stop == "b c"


def test_stop_token_id_and_eos():
    checker = StopChecker(SamplingParams(stop_token_ids=[TOK.encode("!", add_bos=False)[0]], max_tokens=9),
                          IncrementalDetokenizer(TOK), TOK.eos_token_ids)
    assert checker.append(TOK.encode("h", add_bos=False)[0]).text == "h"
    res = checker.append(TOK.encode("!", add_bos=False)[0])
    assert (res.text, res.finish_reason, res.stop_reason) == ("", "stop", TOK.encode("!", add_bos=False)[0])
    eos = StopChecker(SamplingParams(), IncrementalDetokenizer(TOK), TOK.eos_token_ids).append(TOK.EOS)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    ignored = StopChecker(SamplingParams(ignore_eos=True), IncrementalDetokenizer(TOK), TOK.eos_token_ids)
    assert ignored.append(TOK.EOS).finish_reason is None


def test_max_tokens_flushes_held_text():
    pieces, reason, stop = run("abcwo", stop=["world"], max_tokens=5)
    assert (reason, stop) == ("length", None)
    assert "".join(pieces) == "abcwo"


def test_multibyte_characters_never_split():
    pieces, _, _ = run("né€", max_tokens=100)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "né€"
