"""ChoiceStream (API side): stop strings never emitted, held-back prefixes across token boundaries and
multibyte characters, the core's finishes (stop token ids, EOS, max_tokens), tokens after a stop dropped."""

from __future__ import annotations

import pytest
from engine_helpers import stream_choice
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.choice_stream import ChoiceStream
from server.api.stop_strings import StopStrings
from server.engine.outputs import SeqUpdate
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def run(text: str, per_update: int = 1, **params) -> tuple[list[str], str | None, str | int | None]:
    deltas = stream_choice(TOK, ids(text), SamplingParams(**params), per_update, frozenset(TOK.eos_token_ids))
    last = deltas[-1]
    return [d.text for d in deltas], last.finish_reason, last.stop_reason


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


@pytest.mark.parametrize("per_update", [1, 2, 3, 7])
def test_stop_string_spanning_updates_and_multibyte_characters(per_update):
    # "€" is 3 bytes (3 token ids here), "é" 2: the stop string spans several ids and several updates
    pieces, reason, stop = run("né€ x é€!", per_update, stop=["é€!"], max_tokens=100)
    assert "".join(pieces) == "né€ x " and (reason, stop) == ("stop", "é€!")
    assert all("\ufffd" not in p for p in pieces)
    pieces, reason, stop = run("ab€cd", per_update, stop=["€"], max_tokens=100)
    assert "".join(pieces) == "ab" and stop == "€"


def test_tokens_after_a_stop_string_are_dropped():
    choice = ChoiceStream(0, SamplingParams(stop=["cd"], max_tokens=100), TOK, lambda t: TOK.decode([t]))
    delta, abort = choice.apply(SeqUpdate("r", 0, ids("abcdef")))
    assert (delta.text, delta.finish_reason, delta.stop_reason, abort) == ("ab", "stop", "cd", True)
    assert delta.token_ids == ids("abcd")  # the ids up to the one completing the stop string
    assert choice.apply(SeqUpdate("r", 0, ids("g"))) == (None, False)
    assert choice.apply(SeqUpdate("r", 0, [], None, "abort")) == (None, False)


def test_stop_token_id_and_eos_are_counted_not_detokenized():
    bang = ids("!")[0]
    pieces, reason, stop = run("h!", stop_token_ids=[bang], max_tokens=9)
    assert (pieces, reason, stop) == (["h", ""], "stop", bang)
    deltas = stream_choice(TOK, ids("a") + [TOK.EOS], SamplingParams(), 1, frozenset(TOK.eos_token_ids))
    assert deltas[-1].token_ids == [TOK.EOS] and deltas[-1].text == ""
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)


def test_without_detokenize_no_detokenizer_runs_and_the_ids_alone_go(monkeypatch):
    """detokenize false: no detokenizer is built or fed, no token text is read (return_tokens_as_token_ids
    spells the logprob entries), the deltas carry the ids, an ending EOS among them, and no text."""
    def no_text(*args):
        raise AssertionError("detokenized")

    monkeypatch.setattr("server.api.choice_stream.detokenizer_for", no_text)
    params = SamplingParams(detokenize=False, return_tokens_as_token_ids=True, logprobs=1, max_tokens=9)
    choice = ChoiceStream(0, params, TOK, no_text)
    a, b = ids("ab")
    delta, abort = choice.apply(SeqUpdate("r", 0, [a, b], [(-0.5, [(a, -0.5)]), (-1.5, [(a, -0.25)])]))
    assert (delta.text, delta.token_ids, delta.finish_reason, abort) == ("", [a, b], None, False)
    assert [(lp.token, lp.top) for lp in delta.logprobs] == [
        (f"token_id:{a}", [(a, f"token_id:{a}", -0.5)]), (f"token_id:{b}", [(a, f"token_id:{a}", -0.25)])]
    delta, _ = choice.apply(SeqUpdate("r", 0, [TOK.EOS], [(-0.1, [])], "stop"))
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("", [TOK.EOS], "stop")
    assert choice.num_tokens == 3 and choice.apply(SeqUpdate("r", 0, [a])) == (None, False)


def test_stop_strings_need_the_text():
    with pytest.raises(ValueError, match="^stop strings .* detokenize false"):
        SamplingParams(stop=["x"], detokenize=False).validate(TOK.vocab_size)
    SamplingParams(stop_token_ids=[5], detokenize=False).validate(TOK.vocab_size)


def test_max_tokens_flushes_held_text():
    pieces, reason, stop = run("abcwo", stop=["world"], max_tokens=5)
    assert (reason, stop) == ("length", None)
    assert "".join(pieces) == "abcwo"


def test_abort_releases_the_held_prefix():
    choice = ChoiceStream(0, SamplingParams(stop=["world"]), TOK, lambda t: TOK.decode([t]))
    assert choice.apply(SeqUpdate("r", 0, ids("a wo")))[0].text == "a "
    delta, abort = choice.apply(SeqUpdate("r", 0, [], None, "abort"))
    assert (delta.text, delta.finish_reason, abort) == ("wo", "abort", False)


def test_multibyte_characters_never_split():
    pieces, _, _ = run("né€", max_tokens=100)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "né€"


def test_stop_matching_scans_only_the_held_tail():
    s = StopStrings(["abcd", "xy"])
    assert s.feed("zzab") == ("zz", None) and s.held == "ab"
    assert s.feed("c" * 1) == ("", None) and s.held == "abc"
    assert s.feed("q" + "z" * 1000) == ("abcq" + "z" * 1000, None) and s.held == ""



def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The reference: the first character at which a stop string ends cuts the text before the longest
    one ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end - len(stop)], stop
    return text, None


def matched(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    matcher, out = StopStrings(stops), []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit is not None:
            return "".join(out), hit
    return "".join(out) + matcher.release(), None


def test_the_first_stop_to_end_wins_however_the_text_is_split():
    """["b a", " "] over "b a": " " ends first (generation stops there), whether the text comes whole, as
    "b" + " a" (which returned "" and "b a": a later-ending stop starting earlier won inside one delta) or
    as "b" + " " + "a"."""
    for pieces in (["b a"], ["b", " a"], ["b", " ", "a"]):
        assert matched(pieces, ["b a", " "]) == ("b", " ")
    assert matched(["xab", "c"], ["abc", "b"]) == ("xa", "b")
    assert matched(["xabc"], ["abc", "bc"]) == ("x", "abc")  # both end at "c": the earlier start


@settings(max_examples=300, deadline=None)
@given(st.text("ab ", max_size=14), st.lists(st.text("ab ", min_size=1, max_size=4), min_size=1, max_size=4),
       st.lists(st.integers(0, 14), max_size=5))
def test_any_split_gives_the_reference_cut(text, stops, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    assert matched(pieces, stops) == first_stop(text, stops)
