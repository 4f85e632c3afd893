"""bad_words in the engine: whole engines (preemption and resume, forks, rows reused, async scheduling on and
off, eager and static-graph steps) token by token against a dense greedy reference that bans the words
itself; and the sampler's bad-words table (rows reused, the table growing while rows hold words, the recent
tokens a resumed row starts from)."""

from __future__ import annotations

import pytest
import torch

from server.engine.bad_words import HOLD_BACK, placed_rows, recent_entries, word_entries
from server.engine.engine import EngineConfig, build_core
from server.engine.sampler import BAD_WORDS, LOGPROBS, Sampler, row_fields, step_flags
from server.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS_TOKENS, SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.test_engine_out_rows import last_logits, run_engine

EOS = ByteTokenizer.EOS
CONFIG = dict(model="tiny", device="cpu", dtype="float32", block_size=4, num_blocks=12, max_num_seqs=6,
              max_num_batched_tokens=20, attention_backend="torch")


def banned(out: list[int], words: list[list[int]]) -> list[int]:
    """The tokens `words` ban after the sampled tokens `out`."""
    return [w[-1] for w in words if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]]


def dense_banned(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy through the contiguous forward with each banned token at -inf; ends as the core ends one."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = last_logits(model, ids)
            logits[banned(out, params.bad_words_ids)] = float("-inf")
            t = int(logits.argmax())
            ids.append(t)
            out.append(t)
            if t == EOS and not params.ignore_eos:
                break
    return out


def contains(out: list[int], word: list[int]) -> bool:
    return any(out[i:i + len(word)] == word for i in range(len(out) - len(word) + 1))


def requests(model):
    """Prompts whose plain greedy replies hold the words that then ban: a one-token word (its first token),
    two- and three-token words from inside the reply, a word longer than the reply, and none."""
    gen = torch.Generator().manual_seed(11)
    reqs = []
    for i, n_tok in enumerate([19, 7, 13, 4, 17, 10, 12, 6]):
        prompt = torch.randint(3, 250, (n_tok,), generator=gen).tolist()
        plain = dense_banned(model, prompt, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
        words = [[[plain[0]]], [plain[2:4]], [plain[3:6], [7, 8]], [plain + [5]], [],
                 [plain[1:3], plain[5:6]], [plain[4:6]], [plain[0:2]]][i]
        params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, n=2 if i in (1, 5) else 1,
                                bad_words_ids=words)
        reqs.append((f"r{i}", prompt, params, plain))
    return reqs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("static_graphs", [False, True])
def test_engine_tokens_equal_the_dense_banned_reference(static_graphs, async_scheduling):
    model = build_core(EngineConfig(**CONFIG))[0].runner.model  # the tiny preset's seeded weights
    reqs = requests(model)
    config = EngineConfig(**CONFIG, async_scheduling=async_scheduling)
    tokens, _, stats, core, _ = run_engine(config, [r[:3] for r in reqs], static_graphs)
    moved = 0
    for rid, prompt, params, plain in reqs:
        want = dense_banned(model, prompt, params)
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i, params.bad_words_ids)
        for word in params.bad_words_ids:
            assert not contains(want, word)
        moved += want != plain
    assert moved >= 5 and stats["preemptions"] > 0  # the bans changed replies; rows were resumed
    assert not core.requests and core.kv.num_free_blocks == core.kv.num_blocks - 1  # nothing leaked


def sampler_with(rows_words: dict[int, list[list[int]]], outputs: dict[int, list[int]] | None = None,
                 vocab: int = 40) -> Sampler:
    sampler = Sampler(max_rows=4, vocab_size=vocab, device=torch.device("cpu"), kernel=False)
    sampler.init_rows(torch.arange(4), torch.zeros(4, 6), torch.zeros(4, 4, dtype=torch.int64))
    for row, words in rows_words.items():
        init_row(sampler, row, words, (outputs or {}).get(row, []))
    return sampler


def init_row(sampler: Sampler, row: int, words: list[list[int]], output_ids: list[int] = ()) -> None:
    """What the runner does when a sequence with these words (and these sampled tokens) takes `row`."""
    f, i = row_fields(SamplingParams(temperature=0.0), 0, 0)
    sampler.init_rows(torch.tensor([row]), torch.tensor([f]), torch.tensor([i]))
    slots, backs, tokens = word_entries(words)
    recent_backs, recent_tokens = recent_entries(words, list(output_ids))
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)  # as the step packer sends them

    sampler.bad_words.write(t([row] * len(tokens)), t(slots), t(backs), t(tokens),
                            t([row] * len(recent_tokens)), t(recent_backs), t(recent_tokens), len(words),
                            max(map(len, words)))


def step(sampler: Sampler, favourite: list[int], rows: list[int]) -> list[int]:
    """One greedy step whose rows' best token is `favourite` and second best token 1 (then 0)."""
    logits = torch.zeros(len(rows), 40)
    logits[:, 1] = 1.0
    logits[torch.arange(len(rows)), favourite] = 2.0
    return sampler(logits, torch.tensor(rows), BAD_WORDS).token_ids.tolist()


def test_a_word_bans_its_last_token_only_after_its_others():
    sampler = sampler_with({0: [[5, 6, 7]], 1: [[9]]})
    assert step(sampler, [5, 9], [0, 1]) == [5, 1]  # row 1's one-token word: banned at every step
    assert step(sampler, [6, 9], [0, 1]) == [6, 1]
    assert step(sampler, [7, 9], [0, 1]) == [1, 1]  # 5 6 -> 7 banned
    assert step(sampler, [7, 7], [0, 1]) == [7, 7]  # after 5 6 1: 7 is free again


def test_the_table_grows_while_rows_hold_words():
    """Row 0's two-token word, already half matched, keeps banning after a longer word widens the table."""
    sampler = sampler_with({0: [[5, 6]]})
    assert step(sampler, [5], [0]) == [5]
    init_row(sampler, 1, [[2, 3, 4, 8], [3], [11, 12]])  # a wider table: 3 words of up to 4 tokens
    assert sampler.bad_words.shape == (3, 4)
    assert step(sampler, [6, 2], [0, 1]) == [1, 2]
    assert step(sampler, [7, 3], [0, 1]) == [7, 1]


def test_a_reused_row_keeps_none_of_its_last_owners_words_or_tokens():
    sampler = sampler_with({0: [[5, 6]], 1: [[9]]})
    assert step(sampler, [5, 9], [0, 1]) == [5, 1]
    init_row(sampler, 0, [[30]])  # row 0's next owner: 5 is not its last token, 6 not banned
    f, i = row_fields(SamplingParams(temperature=0.0), 0, 0)
    sampler.init_rows(torch.tensor([1]), torch.tensor([f]), torch.tensor([i]))  # row 1's owner: no words
    assert step(sampler, [6, 9], [0, 1]) == [6, 9]


def test_a_resumed_row_starts_from_its_sampled_tokens():
    """After a preemption the row's recent tokens come from the host: the prompt's never count."""
    sampler = sampler_with({0: [[4, 5, 6]], 1: [[4, 5, 6]]}, outputs={0: [9, 4, 5], 1: [5]})
    assert step(sampler, [6, 6], [0, 1]) == [1, 6]


def test_a_resumed_row_with_fewer_sampled_tokens_than_its_word_keeps_them_all():
    """Resumed after 1 2 3 with the word 1 2 3 4 5 (4 recent tokens read): all three come back, so 4 then 5
    completes the word and 5 is banned (a negative slice start kept only the last one: a review)."""
    assert recent_entries([[1, 2, 3, 4, 5]], [1, 2, 3]) == ([2, 1, 0], [1, 2, 3])
    sampler = sampler_with({0: [[1, 2, 3, 4, 5]]}, outputs={0: [1, 2, 3]})
    assert step(sampler, [4], [0]) == [4]
    assert step(sampler, [5], [0]) == [1]


def test_a_request_packs_its_words_once_and_a_bounded_count_of_them():
    """Words past MAX_BAD_WORDS_TOKENS in all are refused: each row a request takes packs them (128 words of
    64 tokens at n = 64 packed 4M ints, a 0.6 s stall: a review); the entries are computed once a request."""
    words = [[3 + i] * 8 for i in range(MAX_BAD_WORDS_TOKENS // 8)]
    params = SamplingParams(bad_words_ids=words)
    params.validate(259)
    assert params.bad_word_entries is params.bad_word_entries
    sections, shape = placed_rows([(r, params, []) for r in range(64)])
    assert shape == (len(words), 8) and len(sections[0]) == 64 * MAX_BAD_WORDS_TOKENS
    with pytest.raises(ValueError, match="at most 1024 tokens in all"):
        SamplingParams(bad_words_ids=words + [[5]]).validate(259)


def test_a_row_whose_every_allowed_token_is_banned_draws_one():
    """Banned tokens are at HOLD_BACK, finite: a row left with nothing else (a grammar's mask at -inf) takes
    a banned token rather than token 0 of an all -inf row."""
    sampler = sampler_with({0: [[7], [8]]})
    logits = torch.full((1, 40), float("-inf"))
    logits[0, 7] = 0.5
    assert sampler(logits, torch.tensor([0]), BAD_WORDS).token_ids.tolist() == [7]
    logits[0, 20] = -50.0  # any other token wins over a banned one
    assert sampler(logits, torch.tensor([0]), BAD_WORDS).token_ids.tolist() == [20]
    assert sampler.bad_words.ban_(logits, torch.tensor([0]))[0, 7] == HOLD_BACK


def test_bad_words_are_validated_and_set_their_flag():
    assert step_flags(SamplingParams(bad_words_ids=[[3]])) & BAD_WORDS
    assert not step_flags(SamplingParams()) & BAD_WORDS
    for words, message in (([[]], "1 to"), ([[3] * (MAX_BAD_WORD_TOKENS + 1)], "1 to"),
                           ([[300]], "bad_words token ids"), ([[3]] * 257, "at most 256")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(bad_words_ids=words).validate(259)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_engine_with_graphs_equals_the_dense_banned_reference(async_scheduling):
    """The decode graphs' steps with bad-word rows take the sampler's path (no in-graph argmax): fp32 on the
    GPU, the argmax kernel over the banned logits; sampled rows with words (the sampling kernel) never
    complete one."""
    config = EngineConfig(**{**CONFIG, "device": "cuda", "attention_backend": "triton"},
                          async_scheduling=async_scheduling)
    model = build_core(config)[0].runner.model
    reqs = requests(model)
    sampled = [(f"s{i}", prompt, SamplingParams(max_tokens=9, temperature=1.0, seed=i, ignore_eos=True,
                                                bad_words_ids=[plain[0:1], plain[2:4]]))
               for i, (_, prompt, _, plain) in enumerate(reqs)]
    tokens, _, stats, core, _ = run_engine(config, [r[:3] for r in reqs] + sampled)
    assert core.runner.graphs is not None and core.runner.graphs.num_replays > 0 and stats["preemptions"] > 0
    for rid, prompt, params, _ in reqs:
        want = dense_banned(core.runner.model, prompt, params)
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i, params.bad_words_ids)
    for rid, _, params in sampled:
        assert not any(contains(tokens[(rid, 0)], w) for w in params.bad_words_ids)


def test_logprobs_stay_the_models_where_a_word_is_banned():
    """The ban works on a copy when the step reports logprobs: the banned best token keeps its logprob and
    rank; the step's own logits are banned in place otherwise."""
    sampler = sampler_with({0: [[9]]})
    logits = torch.zeros(1, 40)
    logits[0, 9], logits[0, 1] = 2.0, 1.0
    out = sampler(logits, torch.tensor([0]), BAD_WORDS | LOGPROBS, num_logprobs=2)
    assert out.token_ids.tolist() == [1] and out.top_ids[0].tolist() == [9, 1]
    assert out.top_logprobs[0, 0] == torch.log_softmax(logits[0], dim=0)[9]
