"""/tokenize, /detokenize, /version and /v1/models in vLLM's shapes; model ids (--served-model-name, the
path as given); chat without a chat template. Tiny preset and small byte-BPE checkpoints vs transformers."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from model_fixtures import CHAT_TEMPLATE, hf_config, write_hf_checkpoint

from server.api.app import create_app
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(device="cpu", attention_backend="torch", num_blocks=64)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 東京"}]


@pytest.fixture(scope="module")
def tiny():
    with started_engine(model="tiny", served_model_name=("my-model", "alias"), **CFG) as eng:
        yield create_app(eng), eng


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Llama checkpoint whose tokenizer_config.json has no chat template."""
    path = tmp_path_factory.mktemp("ckpt")
    write_hf_checkpoint(path, hf_config("llama"))
    cfg_file = path / "tokenizer_config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"chat_template"', '"unused_template"'))
    return path


def call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, json=body, timeout=60)
    return asyncio.run(go())


def test_tokenize_prompt_and_messages(tiny):
    app, engine = tiny
    body = call(app, "POST", "/tokenize", {"model": "my-model", "prompt": "héllo"}).json()
    ids = engine.tokenizer.encode("héllo")
    assert body == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    bare = call(app, "POST", "/tokenize", {"prompt": "héllo", "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:]
    chat = call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                       "return_token_ids": True}).json()
    tok = call(app, "POST", "/tokenize", {"messages": MESSAGES}).json()
    assert tok["tokens"] == chat["prompt_token_ids"] and tok["count"] == chat["usage"]["prompt_tokens"]
    no_gen = call(app, "POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert engine.tokenizer.decode(no_gen["tokens"]) == "system: be brief\nuser: héllo 東京\n"


def test_add_special_tokens_and_template_kwargs(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ flavour | default('plain') }}"
    with started_engine(model="tiny", chat_template=template, **CFG) as engine:
        app, tok = create_app(engine), engine.tokenizer
        r = call(app, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 1, "return_token_ids": True,
                                                  "add_special_tokens": False})
        assert r.json()["choices"][0]["prompt_token_ids"] == tok.encode("ab", add_bos=False), r.text
        body = {"messages": MESSAGES[1:], "max_tokens": 1, "return_token_ids": True,
                "chat_template_kwargs": {"flavour": "spicy"}}
        chat = call(app, "POST", "/v1/chat/completions", body).json()
        assert chat["prompt_token_ids"] == tok.encode("héllo 東京spicy")  # the preset's chat keeps BOS
        bare = call(app, "POST", "/v1/chat/completions", {**body, "add_special_tokens": False}).json()
        assert bare["prompt_token_ids"] == tok.encode("héllo 東京spicy", add_bos=False)
        ids = call(app, "POST", "/tokenize", {"messages": MESSAGES[1:]}).json()["tokens"]
        assert ids == tok.encode("héllo 東京plain")


def test_template_kwargs_of_any_name_and_type_are_the_requests_fault_not_the_servers():
    """A variable called `self` is accepted (it collided with the render methods' own parameter: a 500), and
    a value the template's expressions cannot use (a Hub template iterating `tools` given an int) is a 400
    naming the messages, as a template's own refusal is."""
    template = ("{% for t in tools or [] %}[{{ t.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    with started_engine(model="tiny", chat_template=template, **CFG) as engine:
        app, tok = create_app(engine), engine.tokenizer
        ok = call(app, "POST", "/tokenize", {"messages": MESSAGES[1:], "chat_template_kwargs":
                                             {"self": "me:", "tools": [{"name": "f"}]}})
        assert ok.status_code == 200 and ok.json()["tokens"] == tok.encode("[f]héllo 東京"), ok.text
        for path in ("/tokenize", "/v1/chat/completions"):
            bad = call(app, "POST", path, {"messages": MESSAGES[1:], "max_tokens": 1,
                                           "chat_template_kwargs": {"tools": 5}})
            assert bad.status_code == 400, bad.text
            err = bad.json()["error"]
            assert "TypeError" in err["message"] and err["type"] == "invalid_request_error"


def test_detokenize_round_trips(tiny):
    app, engine = tiny
    ids = engine.tokenizer.encode("a €5 🙂", add_bos=False)
    assert call(app, "POST", "/detokenize", {"tokens": ids}).json() == {"prompt": "a €5 🙂"}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    # vLLM's fields not served here: refused, never a count of another prompt (a review: ignored before)
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors(tiny, path, body, status, param):
    r = call(tiny[0], "POST", path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_models_version_and_model_ids(tiny):
    app, engine = tiny
    cards = call(app, "GET", "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["my-model", "alias"] and engine.model_name == "my-model"
    assert call(app, "GET", "/version").json()["version"].count(".") == 2
    for name in ("my-model", "alias", "tiny"):  # "tiny": the --model value as given
        r = call(app, "POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
    r = call(app, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and "'my-model'" in r.json()["error"]["message"]
    # OpenAI's "retrieve model" (the openai client's models.retrieve): each id a request may name, else 404
    for name in ("my-model", "alias", "tiny"):
        card = call(app, "GET", f"/v1/models/{name}").json()
        assert card == {**cards[0], "id": name}, card
    r = call(app, "GET", "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_checkpoint_path_is_a_model_id_and_tokens_match_hf(checkpoint):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    with started_engine(model=str(checkpoint), **CFG) as engine:
        app = create_app(engine)
        for text in ("héllo wörld", "東京 🙂", "<s> spelled"):
            body = call(app, "POST", "/tokenize", {"model": str(checkpoint), "prompt": text}).json()
            assert body["tokens"] == hf(text).input_ids
        ids = hf("héllo <s>").input_ids
        assert call(app, "POST", "/detokenize", {"tokens": ids}).json()["prompt"] == hf.decode(ids)
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
                           ("/tokenize", {"messages": MESSAGES})):
            r = call(app, "POST", path, body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "chat_template_missing" and "--chat-template" in err["message"]


def test_chat_template_flag_supplies_the_template(checkpoint):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    expected = hf.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    with started_engine(model=str(checkpoint), chat_template=CHAT_TEMPLATE, **CFG) as engine:
        app = create_app(engine)
        assert call(app, "POST", "/tokenize", {"messages": MESSAGES}).json()["tokens"] == expected
        r = call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                        "return_token_ids": True})
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == expected, r.text


def test_the_schema_names_the_responses(tiny):
    """The handlers answer with pydantic's JSON as a Response (no encoder pass in the event loop); the
    OpenAPI schema still names their response models."""
    spec = tiny[0].openapi()
    for path, model in (("/tokenize", "TokenizeResponse"), ("/detokenize", "DetokenizeResponse")):
        schema = spec["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}
