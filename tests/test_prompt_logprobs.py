"""Prompt logprobs (`echo` + `logprobs` on /v1/completions): against transformers' logits on small byte-BPE
checkpoints, against the engine's own sampled-token logprobs on the tiny preset, and the OpenAI shapes."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from model_fixtures import hf_config, write_hf_checkpoint

from server.api.app import create_app
from server.engine.prompt_logprobs import ROWS_PER_CHUNK, prompt_logprobs
from server.engine.sampling_params import SamplingParams
from server.model import load_model
from tests.asgi_client import post as post_to
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(device="cpu", attention_backend="torch", num_blocks=64)


def post(app, body: dict) -> httpx.Response:
    return post_to(app, "/v1/completions", body)


@pytest.fixture(scope="module")
def tiny():
    with started_engine(model="tiny", **CFG) as engine:
        yield create_app(engine), engine


@pytest.mark.parametrize("arch,overrides", [("llama", {}),
                                            ("mistral", {"sliding_window": 5, "head_dim": 16})])
def test_prompt_logprobs_equal_transformers(tmp_path, arch, overrides):
    hf_model = write_hf_checkpoint(tmp_path, hf_config(arch, **overrides))
    model, tok = load_model(str(tmp_path), "cpu", torch.float32)
    ids = tok.encode("héllo 東京 🙂 and a longer prompt about paged attention")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)
    out = prompt_logprobs(model, ids, 3)
    assert out[0] is None and len(out) == len(ids)
    for t, (logprob, rank, top) in enumerate(out[1:], start=1):
        assert logprob == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        assert [i for i, _ in top] == ref[t - 1].topk(3).indices.tolist()
        assert rank == int((ref[t - 1] >= ref[t - 1, ids[t]]).sum())  # the prompt token's vocabulary rank


def test_long_prompts_are_chunked_the_same(monkeypatch):
    model, tok = load_model("tiny", "cpu")
    ids = tok.encode("chunks of the lm_head " * 3)
    whole = prompt_logprobs(model, ids, 2)
    monkeypatch.setattr("server.engine.prompt_logprobs.ROWS_PER_CHUNK", 5)
    assert ROWS_PER_CHUNK > len(ids)
    chunked = prompt_logprobs(model, ids, 2)
    assert [e[0] for e in chunked[1:]] == pytest.approx([e[0] for e in whole[1:]], abs=1e-5)


def test_echo_logprobs_match_the_engines_sampled_logprobs(tiny):
    app, engine = tiny
    first = post(app, {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 2,
                       "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]
    prompt_ids = first["prompt_token_ids"] + first["token_ids"]  # the greedy continuation, fed back
    echoed = post(app, {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "logprobs": 2,
                        "echo": True, "ignore_eos": True}).json()["choices"][0]
    lp = echoed["logprobs"]
    n = len(prompt_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][n - 6 : n] == pytest.approx(first["logprobs"]["token_logprobs"], abs=1e-4)
    prompt_part = zip(lp["top_logprobs"][1:n], lp["tokens"][1:n], lp["token_logprobs"][1:n], strict=True)
    for top, tok, x in prompt_part:
        assert top[tok] == x and 2 <= len(top) <= 3  # the prompt token besides the top 2
    assert echoed["text"].startswith(engine.tokenizer.decode(prompt_ids))


def test_echo_logprobs_n_prompts_and_stream(tiny):
    app, _ = tiny
    body = {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 2, "logprobs": 0, "echo": True, "temperature": 0.8,
            "seed": 1}
    choices = post(app, body).json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [3 + 2, 3 + 2, 4 + 2, 4 + 2]  # BOS + bytes
    assert choices[0]["logprobs"]["token_logprobs"][:3] == choices[1]["logprobs"]["token_logprobs"][:3]
    r = post(app, {**body, "stream": True})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    echoes = [e["choices"][0] for e in events if e["choices"][0]["text"] in ("ab", "xyz")]
    assert sorted(c["index"] for c in echoes) == [0, 1, 2, 3]
    assert all(c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) in (3, 4)
               for c in echoes)


@pytest.mark.parametrize("stream", [False, True])
def test_masked_ids_report_the_logprob_floor_not_null(tiny, stream):
    """The presets mask unprintable ids (-inf logits): an echoed prompt of them and top lists reaching
    them report -9999.0 (vLLM's floor), never null or -Infinity; only the first prompt token has none."""
    app, _ = tiny
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "echo": True, "logprobs": 5, "temperature": 0.0,
            "stream": stream}
    r = post(app, body)
    assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs")]
        token_lps = [x for lp in lps for x in lp["token_logprobs"]]
        tops = [t for lp in lps for t in lp["top_logprobs"]]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        token_lps, tops = lp["token_logprobs"], lp["top_logprobs"]
    assert token_lps[0] is None and tops[0] is None
    assert all(isinstance(x, float) and x >= -9999.0 for x in token_lps[1:])
    values = [v for t in tops[1:] for v in t.values()]
    assert all(isinstance(v, float) and v >= -9999.0 for v in values) and -9999.0 in values + token_lps[1:]


def test_prompt_logprobs_is_validated():
    SamplingParams(prompt_logprobs=20).validate(259)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21).validate(259)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tolerance", [("float32", 2e-3), ("bfloat16", 0.15)])
def test_echo_logprobs_on_cuda_match_the_engines_sampled_logprobs(dtype, tolerance):
    """The contiguous forward beside the paged, graph-captured decode of the engine core's process."""
    with started_engine(model="tiny", device="cuda", dtype=dtype, num_blocks=256, in_process=False) as engine:
        app = create_app(engine)
        first = post(app, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 1,
                           "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]
        prompt_ids = first["prompt_token_ids"] + first["token_ids"]
        echoed = post(app, {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                            "echo": True}).json()["choices"][0]["logprobs"]["token_logprobs"]
        n = len(prompt_ids)
        assert echoed[n - 8 : n] == pytest.approx(first["logprobs"]["token_logprobs"], abs=tolerance)


def test_vllm_prompt_logprobs_field(tiny):
    """vLLM's prompt_logprobs k: per choice (completions) or per response (chat), one entry per prompt token
    (None first), keyed by token id: the prompt token with its vocabulary rank, and the top k ranked 1..k;
    the same logprobs as an echo's, beside an echo asking for a different k."""
    app, engine = tiny
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    out = post(app, {**body, "prompt_logprobs": 3, "n": 2, "echo": True, "logprobs": 1}).json()
    ids = out["choices"][0]["prompt_token_ids"]
    for choice in out["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        echo = choice["logprobs"]
        for t in range(1, len(ids)):
            entry = plp[t]
            own = entry[str(ids[t])]
            assert own["logprob"] == pytest.approx(echo["token_logprobs"][t], abs=1e-5)
            assert own["decoded_token"] == echo["tokens"][t] and own["rank"] >= 1
            ranked = sorted(entry.values(), key=lambda e: e["rank"])  # the top 3, and the token if not in it
            assert [e["rank"] for e in ranked[:3]] == [1, 2, 3] and len(entry) in (3, 4)
            assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
            assert len(echo["top_logprobs"][t]) <= 2  # the echo keeps its own k (1) + the prompt token
    chat = post_to(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "prompt_logprobs": 0,
                                                  "return_token_ids": True}).json()
    plp, ids = chat["prompt_logprobs"], chat["prompt_token_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(list(entry) == [str(ids[t])] for t, entry in enumerate(plp[1:], start=1))  # k 0: its own
    assert "prompt_logprobs" not in post(app, body).json()["choices"][0]  # only when asked
