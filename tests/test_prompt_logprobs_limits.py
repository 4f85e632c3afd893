"""vLLM's prompt_logprobs beside pagewalk's other logprobs: the rank of tied and masked prompt tokens, the
prompt token's entry first, and the admission limits that count the prompt's records and name the field
that asks for them (a review of 6ed2b9d)."""

from __future__ import annotations

import pytest
import torch

from server.api.admission import RequestLimits
from server.api.app import create_app
from server.engine import prompt_logprobs as plp_mod
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64, max_num_batched_tokens=64)
OFFSET = 3  # ByteTokenizer.OFFSET: id of byte b is OFFSET + b


@pytest.fixture(scope="module")
def engine():
    with started_engine(**CFG) as eng:
        yield eng


class _FakeModel:
    """A 'model' whose logits are given: row t is logits[t] (predicts prompt token t + 1)."""

    device = torch.device("cpu")

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, ids, positions):
        return torch.arange(len(ids), dtype=torch.float32)[:, None]  # (T, 1): the row index

    def compute_logits(self, hidden):
        return self.logits[hidden[:, 0].long()]


# ---- 1. rank of a tied / masked prompt token: vLLM's count(x >= chosen) ----

def test_rank_of_a_tied_prompt_token_counts_the_ties_as_vllm():
    """vLLM (v1/sample/ops/logprobs.py batched_count_greater_than) ranks a token by (logprobs >= its
    logprob).sum(): a token tied with others gets the last place of its tie (1 + the count of strictly
    greater ones gave the first place)."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])  # row 0 predicts prompt token 1
    out = plp_mod.prompt_logprobs(_FakeModel(logits), [0, 2], 0)
    _, rank, _ = out[1]
    assert rank == 4  # tokens 0, 1, 2, 3 are >= token 2's logprob


def test_rank_of_a_masked_prompt_token_is_the_vocabulary_size(engine):
    """The tiny preset masks non-printable ids (-inf). A prompt of ids holding one: its logprob reads
    -9999.0 and its rank is the vocabulary size (every id is >= -inf), as vLLM's (1 + the number of
    unmasked ids, 99 of 259, was reported)."""
    app = create_app(engine)
    masked = OFFSET + 1  # byte 0x01: masked by restrict_to_printable
    ids = [OFFSET + ord("a"), masked, OFFSET + ord("b")]
    out = post(app, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}).json()
    entry = out["choices"][0]["prompt_logprobs"][1][str(masked)]
    assert entry["logprob"] == -9999.0
    assert entry["rank"] == engine.tokenizer.vocab_size, entry


# ---- 2. the prompt token's entry comes first, as vLLM's dict has it ---------------------------------------

def test_prompt_token_is_the_first_key_of_its_entry(engine):
    """vLLM's _make_logprob_dict zips [prompt token] + top-k: the prompt token is the dict's first key (a
    top-k duplicate overwrites its value in place). Written last, a client reading the first key of each
    position (vLLM's order) read the best token instead."""
    app = create_app(engine)
    out = post(app, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1, "prompt_logprobs": 3,
                                        "return_token_ids": True}).json()
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"]
    firsts = [next(iter(entry)) for entry in choice["prompt_logprobs"][1:]]
    assert firsts == [str(t) for t in ids[1:]]


# ---- 3. admission: echo logprobs and prompt_logprobs are two sets of records -------------------------------

def test_logprob_entry_limit_counts_echo_and_prompt_logprobs_both(engine):
    """With echo + logprobs k1 + prompt_logprobs k2 the response carries each prompt token's echo record
    (1 + k1) AND its prompt_logprobs record (1 + k2) per choice; counting one set of max(k1, k2) admitted
    a response of about twice max_logprob_entries."""
    body = {"prompt": "Once upon a time", "max_tokens": 1, "echo": True, "logprobs": 5, "prompt_logprobs": 5}
    app = create_app(engine, limits=RequestLimits(max_logprob_entries=150))
    r = post(app, "/v1/completions", body)
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        served = sum(len(t) for t in choice["logprobs"]["top_logprobs"] if t) \
            + sum(len(e) for e in choice["prompt_logprobs"] if e)
        pytest.fail(f"admitted under max_logprob_entries=150, and its response holds {served} records")
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt_logprobs", "logprobs")


def test_logprob_entry_limit_names_prompt_logprobs(engine):
    """A request whose only logprob records are prompt_logprobs' is refused naming prompt_logprobs (it named
    `logprobs`, a field the request did not send)."""
    app = create_app(engine, limits=RequestLimits(max_logprob_entries=100))
    r = post(app, "/v1/completions", {"prompt": "Once upon a time, far away", "max_tokens": 1,
                                      "prompt_logprobs": 20})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs", err


def test_chat_default_max_tokens_leaves_room_for_prompt_logprobs(engine):
    """chat's default max_tokens leaves room in max_logprob_entries for the prompt_logprobs records (it filled
    it with the completion's alone, and the request that set no max_tokens was refused)."""
    app = create_app(engine, limits=RequestLimits(max_logprob_entries=60))
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                           "top_logprobs": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text


# ---- 4. the prompt-length limit of prompt logprobs names the field the request used -----------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 1, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 1,
                              "prompt_logprobs": 1}),
])
def test_prompt_too_long_for_prompt_logprobs_names_prompt_logprobs(engine, path, body):
    """A prompt past max_num_batched_tokens with prompt logprobs is refused naming prompt_logprobs (it named
    'echo', also in chat, which has no echo field)."""
    r = post(create_app(engine), path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs", err
    assert "echo" not in err["message"], err
