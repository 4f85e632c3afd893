"""One choice on the API side: the core's token ids -> text deltas, stop strings, logprob token strings
(with detokenize false: the ids alone, no text).

The core ends a choice on EOS / a stop token id (finish "stop", that last id is counted but never
detokenized, unless include_stop_str_in_output), on max_tokens ("length"), or on an abort or error. A
structured output also ends with finish "stop" on its grammar's last token, whose text is output: a guided
choice's last id is dropped only where it is EOS or a stop token id. A stop string is found here, in the
text of the tokens after the first min_tokens (as vLLM's v1): the choice ends with finish "stop" and the
caller aborts it in the core; tokens the core sends after that are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from server.api.outputs import ChoiceDelta, TokenLogprob, reported_logprob, token_id_string
from server.api.stop_strings import StopStrings
from server.engine.outputs import SeqUpdate
from server.engine.sampling_params import SamplingParams
from server.model.detokenizer import detokenizer_for


class ChoiceStream:
    __slots__ = ("index", "detokenizer", "stops", "text_of", "want_logprobs", "finish_reason", "num_tokens",
                 "min_tokens", "stop_text_kept", "guided_eos")

    def __init__(self, index: int, params: SamplingParams, tokenizer, text_of: Callable[[int], str],
                 prompt_token_ids: list[int] = ()):
        self.index = index
        # the prompt's tail: the first word's space; params: whether special tokens are spelled. None: the
        # choice has no text (detokenize false), its deltas carry ids alone
        self.detokenizer = (detokenizer_for(tokenizer, prompt_token_ids, params.skip_special_tokens)
                            if params.detokenize else None)
        self.stops = (StopStrings(params.stop, params.include_stop_str_in_output, params.cache_salt)
                      if params.stop else None)
        self.min_tokens = params.min_tokens  # stop strings count in the tokens after this many
        self.stop_text_kept = params.include_stop_str_in_output  # a stop token's text too
        # a structured output's EOS ids: its "stop" may come on a content token (the grammar complete)
        self.guided_eos = frozenset(tokenizer.eos_token_ids) if params.grammar is not None else None
        # token id -> its logprob entries' string: its text alone, or its id (return_tokens_as_token_ids)
        self.text_of = token_id_string if params.return_tokens_as_token_ids else text_of
        self.want_logprobs = params.logprobs is not None
        self.finish_reason: str | None = None
        self.num_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, u: SeqUpdate) -> tuple[ChoiceDelta | None, bool]:
        """-> (the delta to stream, None once finished here; whether a stop string ended the choice while
        the core still runs it: the caller then aborts it there)."""
        if self.finish_reason is not None:
            return None, False
        if self.detokenizer is None:
            return self._without_text(u), False
        ids = u.new_token_ids
        reason, stop_reason = u.finish_reason, u.stop_token_id
        if reason is None and self.stops is None and not self.want_logprobs and len(ids) == 1:
            # one token, nothing held, nothing ending: most updates of most streams (the general path
            # below gives the same delta)
            self.num_tokens += 1
            return ChoiceDelta(self.index, self.detokenizer.push(ids[0]), ids, None, None,
                               stop_reason, u.prompt_logprobs), False
        # EOS or a stop token id: its text is not part of the output (but where stop text is kept)
        by_token = reason == "stop" and not self.stop_text_kept and (
            self.guided_eos is None or stop_reason is not None or not ids or ids[-1] in self.guided_eos)
        pieces = []
        taken = len(ids)
        hit = None
        for i, token in enumerate(ids):
            if by_token and i == len(ids) - 1:
                break
            text = self.detokenizer.push(token)
            if self.stops is not None:
                text, hit = self.stops.feed(text, self.num_tokens + i + 1 > self.min_tokens)
            pieces.append(text)
            if hit is not None:
                taken = i + 1
                break
        if hit is None and reason in ("stop", "length"):
            text, hit = self._finish_text()
            pieces.append(text)
        elif hit is None and reason is not None and self.stops is not None:  # abort / error: held text
            pieces.append(self.stops.release())
        if hit is not None:
            reason, stop_reason = "stop", hit
        self.finish_reason = reason
        self.num_tokens += taken
        ids = ids[:taken] if taken < len(ids) else ids
        return ChoiceDelta(self.index, "".join(pieces), ids, self._logprobs(u, taken), reason,
                           stop_reason, u.prompt_logprobs), hit is not None and u.finish_reason is None

    def _without_text(self, u: SeqUpdate) -> ChoiceDelta:
        """detokenize false: the update's ids as they come (an ending EOS or stop token id among them, as
        token_ids always carry it) and the core's finish; nothing is held, there are no stop strings."""
        self.finish_reason = u.finish_reason
        self.num_tokens += len(u.new_token_ids)
        return ChoiceDelta(self.index, "", u.new_token_ids, self._logprobs(u, len(u.new_token_ids)),
                           u.finish_reason, u.stop_token_id, u.prompt_logprobs)

    def _finish_text(self) -> tuple[str, str | None]:
        """The core ended the choice: the detokenizer's held bytes, then the held stop-string prefix
        (a stop string the final bytes complete still counts)."""
        tail = self.detokenizer.flush()
        if self.stops is None:
            return tail, None
        text, hit = self.stops.feed(tail)
        return (text, hit) if hit is not None else (text + self.stops.release(), None)

    def _logprobs(self, u: SeqUpdate, taken: int) -> list[TokenLogprob] | None:
        if not self.want_logprobs or u.logprobs is None:
            return None
        text_of = self.text_of
        return [TokenLogprob(token, text_of(token), reported_logprob(lp),
                             [(t, text_of(t), reported_logprob(tlp)) for t, tlp in top])
                for token, (lp, top) in zip(u.new_token_ids[:taken], u.logprobs[:taken], strict=True)]
