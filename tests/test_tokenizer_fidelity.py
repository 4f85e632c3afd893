"""Tokenizer and chat-template fidelity against HF transformers: special tokens where tokenizer.json's
post-processor puts them, chat prompts as apply_chat_template builds them, the HF template extensions,
templates compiled at start-up, and no silent fallback template."""

from __future__ import annotations

import json

import pytest
from model_fixtures import CHAT_TEMPLATE, byte_bpe_tokenizer

from server.model.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from server.model.loader import load_tokenizer
from server.model.tokenizer import HFTokenizer, NoChatTemplateError

transformers = pytest.importorskip("transformers")

TEXTS = ["hello", "héllo wörld — naïve café", "東京 🙂", "<s> spelled", " leading space"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "東京?"}]
# every extension HF templates use: loop controls, generation blocks, tojson kwargs, strftime_now
RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"
    "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True, indent=1) }}"
    "{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(path, bos_post_processor: bool, template: str | None = CHAT_TEMPLATE) -> None:
    path.mkdir(parents=True, exist_ok=True)
    byte_bpe_tokenizer(bos_post_processor=bos_post_processor).save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("bos_post_processor", [True, False], ids=["llama-style", "gpt2-style"])
def test_special_tokens_follow_the_post_processor_like_hf(tmp_path, bos_post_processor):
    write_tokenizer(tmp_path, bos_post_processor)
    ours, hf = HFTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.bos_token_id == 1  # declared either way; only the post-processor decides whether it is added
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids
        assert ours.encode(text, add_bos=False) == hf(text, add_special_tokens=False).input_ids
    assert (ours.encode("hi")[0] == 1) == bos_post_processor


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["simple", "extensions"])
@pytest.mark.parametrize("bos_post_processor", [True, False], ids=["llama-style", "gpt2-style"])
def test_chat_prompt_ids_equal_apply_chat_template(tmp_path, template, bos_post_processor):
    write_tokenizer(tmp_path, bos_post_processor, template)
    ours, hf = HFTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for gen in (True, False):
        text = hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True, return_dict=True)
        assert ours.apply_chat_template(MESSAGES, gen) == text
        assert ours.chat_token_ids(MESSAGES, gen) == ids["input_ids"]
    assert ours.chat_token_ids(MESSAGES).count(1) == 1  # the template's BOS, never doubled


def test_template_extensions_render():
    out = ChatTemplate(RICH_TEMPLATE, "test").render(MESSAGES, True, bos_token="<s>", eos_token="</s>")
    # the system message continued past, the fourth message broken off before
    assert out == '<s><|user|>hi</s><|assistant|>ok</s>{\n "a": "é",\n "b": 1\n}4<|assistant|>'


def test_raise_exception_is_a_template_error_not_a_crash():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}", "t")
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render(MESSAGES)
    with pytest.raises(ChatTemplateError):  # an undefined call inside the template
        ChatTemplate("{{ messages.nope() }}", "t").render(MESSAGES)
    # a template that walks a client's tool schema recursively, given one nested deeper than Python's stack
    walk = ("{% macro show(s) %}{% if s.properties is defined %}{% for k, v in s.properties.items() %}{{ k }}"
            "{{ show(v) }}{% endfor %}{% endif %}{% endmacro %}{% for t in tools %}{{ show(t) }}{% endfor %}")
    deep: dict = {}
    for _ in range(1000):
        deep = {"properties": {"a": deep}}
    with pytest.raises(ChatTemplateError, match="RecursionError"):
        ChatTemplate(walk, "t").render(MESSAGES, tools=[deep])


def test_templates_compile_at_start_up(tmp_path):
    write_tokenizer(tmp_path, True, "{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="tokenizer_config.json does not compile"):
        HFTokenizer.from_dir(tmp_path)


def test_no_template_means_no_chat(tmp_path):
    write_tokenizer(tmp_path, True, template=None)
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplateError, match="--chat-template"):
        tok.chat_token_ids(MESSAGES)
    with pytest.raises(ValueError, match="chat template"):  # transformers refuses too
        transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(MESSAGES)


def test_chat_template_flag_file_or_inline(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages | length }}")
    assert load_chat_template(str(tmp_path / "t.jinja")).render(MESSAGES) == "4"
    assert load_chat_template("{{ messages[0].role }}").render(MESSAGES) == "system"
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template does not compile"):
        load_chat_template("{% if %}")


def test_load_tokenizer_overrides(tmp_path):
    write_tokenizer(tmp_path / "tok", True, template=None)
    tok = load_tokenizer("tiny", chat_template="{{ messages[0].content }}")
    assert tok.chat_token_ids(MESSAGES) == tok.encode("be brief")  # the byte tokenizer keeps its BOS
    preset = load_tokenizer("tiny")
    assert preset.apply_chat_template(MESSAGES[:2]) == "system: be brief\nuser: hi\nassistant:"
    with pytest.raises(ValueError, match="ids up to 299 but the model only 259"):
        load_tokenizer("tiny", tokenizer=str(tmp_path / "tok"))
    with pytest.raises(FileNotFoundError, match="does not download from the Hugging Face Hub"):
        load_tokenizer("meta-llama/Llama-3.1-8B")
