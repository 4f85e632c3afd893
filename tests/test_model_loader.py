"""load_model: presets (seeded weights, shapes) and checkpoint loading (sharding, dtype, errors)."""

from __future__ import annotations

import json

import pytest
import torch
from model_fixtures import hf_config, write_hf_checkpoint
from runner_chunks import Chunk, run_chunks
from safetensors.torch import load_file, save_file

from server.engine.runner import ModelRunner
from server.model import PRESETS, ModelConfig, load_model
from server.model.llama import LlamaForCausalLM
from server.model.tokenizer import ByteTokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(path, hf_config("llama"))
    return path


def copy_checkpoint(src, dst):
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu")


def test_tiny_preset_is_seeded_and_shaped_as_documented(tiny):
    model, tok = tiny
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (4, 256, 8, 2)
    assert cfg.head_dim == 32 and cfg.max_position_embeddings == 2048 and model.dtype == torch.float32
    assert cfg.vocab_size == tok.vocab_size == 259 and isinstance(tok, ByteTokenizer)
    again, _ = load_model("tiny", "cpu")
    first = state(model)
    assert all(torch.equal(first[k], v) for k, v in state(again).items())
    gen = torch.Generator().manual_seed(cfg.seed)
    embed = torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, cfg.init_std, generator=gen)
    assert torch.equal(model.model.embed_tokens.weight, embed)  # the first parameter drawn


def test_tiny_greedy_text_is_printable_and_not_a_single_repeated_byte(tiny):
    model, tok = tiny
    runner = ModelRunner(model, block_size=16, num_blocks=8, attention_backend="torch")
    table = [1, 2, 3, 4]
    seq = tok.encode("Once upon a time")
    start = 0
    for _ in range(32):
        slots = [table[t // 16] * 16 + t % 16 for t in range(start, len(seq))]
        chunk = Chunk(seq[start:], start, table, slots)
        start = len(seq)
        seq.append(int(run_chunks(runner, [chunk])[0].argmax()))
    text = tok.decode(seq[-32:])
    assert all(c.isprintable() or c == "\n" for c in text)
    assert len(set(seq[-32:])) > 8


def test_tiny_masked_ids_have_zero_probability_at_any_temperature(tiny):
    model, _ = tiny
    keep = torch.zeros(259, dtype=torch.bool)
    keep[[1, 2, 3 + ord("\n")]] = True
    keep[3 + 32 : 3 + 127] = True
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 10
    logits = model.compute_logits(hidden)  # (64, V)
    assert torch.isneginf(logits[:, ~keep]).all() and torch.isfinite(logits[:, keep]).all()
    probs = torch.softmax(logits / 5.0, dim=-1)  # hot sampling cannot reach a lone UTF-8 byte (U+FFFD)
    assert (probs[:, ~keep] == 0).all()


def test_bench_preset_matches_llama_3_2_1b_shape():
    cfg = PRESETS["bench"]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400  # Llama-3.2-1B
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"


def test_sharded_checkpoint_loads_like_unsharded(tmp_path, llama_dir):
    write_hf_checkpoint(tmp_path, hf_config("llama"), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, _ = load_model(str(tmp_path), "cpu", torch.float32)
    whole, _ = load_model(str(llama_dir), "cpu", torch.float32)
    a, b = state(sharded), state(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_single_file_beside_an_index_is_refused(tmp_path):
    """save_pretrained unsharded, then sharded into the same folder, leaves model.safetensors beside the
    index: transformers loads the one, the index named the other (served 1.6x off transformers: a review)."""
    write_hf_checkpoint(tmp_path, hf_config("llama"))
    write_hf_checkpoint(tmp_path, hf_config("llama"), max_shard_size="40KB")
    assert all((tmp_path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    with pytest.raises(ValueError, match="model.safetensors beside an index of other shards"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_an_index_of_the_single_file_itself_loads(tmp_path, llama_dir):
    """Some exporters write an index whose weight_map names model.safetensors alone: no conflict."""
    write_hf_checkpoint(tmp_path, hf_config("llama"))
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    assert state(model).keys() == state(load_model(str(llama_dir), "cpu", torch.float32)[0]).keys()


def test_fused_parameters_stack_q_k_v_and_gate_up(llama_dir):
    model, _ = load_model(str(llama_dir), "cpu", torch.float32)
    ckpt = load_file(str(llama_dir / "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([ckpt[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([ckpt["model.layers.0.mlp.gate_proj.weight"],
                                           ckpt["model.layers.0.mlp.up_proj.weight"]]))  # fmt: skip


def test_bfloat16_load_keeps_rope_frequencies_fp32(llama_dir):
    model, _ = load_model(str(llama_dir), "cpu", "bf16")
    assert model.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary.inv_freq.dtype == torch.float32


def test_generation_config_eos_ids(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "ck")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    _, tok = load_model(str(path), "cpu")
    assert tok.eos_token_ids == {2, 5}


def test_unknown_model_and_missing_files(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_model(str(tmp_path / "nope"), "cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), "cpu")
    path = copy_checkpoint(llama_dir, tmp_path / "no_weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(str(path), "cpu")
    index = {"weight_map": {"a": "shard-1.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard-1.safetensors"):
        load_model(str(path), "cpu")


def test_unsupported_architecture(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(str(path), "cpu")


def test_shape_mismatch_names_the_tensor(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "bad_shape")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight'.*shape"):
        load_model(str(path), "cpu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8])
def test_a_quantized_tensor_under_a_plain_name_is_refused(tmp_path, llama_dir, dtype):
    """No quantization_config in config.json, but int8 / fp8 tensors: a cast would serve garbage."""
    path = copy_checkpoint(llama_dir, tmp_path / "quantized")
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    tensors[key] = torch.randn(tensors[key].shape).clamp(-1, 1).mul(100).to(dtype)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' in model\.safetensors "
                                         r"is torch\.(int8|float8_e4m3fn|uint8).*quantized"):
        load_model(str(path), "cpu")


def test_missing_tensor_is_named(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "missing")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. model\.layers\.1\.self_attn\.v_proj\."):
        load_model(str(path), "cpu")


def test_config_from_hf_spellings():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rope_theta": 1e6,
            "sliding_window": 4, "use_sliding_window": False, "eos_token_id": [3, 4]}  # fmt: skip
    cfg = ModelConfig.from_hf(base, "q")
    assert cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None and cfg.head_dim == 4
    assert cfg.rope_theta == 1e6 and cfg.eos_token_ids == (3, 4)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "q")


QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 4}


@pytest.mark.parametrize("extra,window", [
    ({"use_sliding_window": False}, None),
    ({"use_sliding_window": True, "max_window_layers": 0}, 4),  # every layer slides
    ({"use_sliding_window": True, "max_window_layers": 28}, None),  # none of the 2 layers does (HF's rule)
    ({"layer_types": ["sliding_attention", "sliding_attention"], "use_sliding_window": True}, 4),
    ({"layer_types": ["full_attention", "full_attention"], "use_sliding_window": True}, None),
    ({"use_sliding_window": True}, None),  # HF's default max_window_layers (28) above both layers
])
def test_the_sliding_window_follows_which_layers_slide(extra, window):
    assert ModelConfig.from_hf({**QWEN2, **extra}, "q").sliding_window == window


def test_transformers_default_max_window_layers_is_refused_where_it_splits_the_layers():
    cfg = {**QWEN2, "num_hidden_layers": 36, "use_sliding_window": True}  # layers 28-35 slide in HF
    with pytest.raises(ValueError, match="sliding window to 8 of 36 layers"):
        ModelConfig.from_hf(cfg, "q")


def test_positions_default_as_transformers_configs_do():
    import transformers

    base = {k: v for k, v in QWEN2.items() if k != "sliding_window"}
    for arch, cls in (("LlamaForCausalLM", transformers.LlamaConfig),
                      ("MistralForCausalLM", transformers.MistralConfig),
                      ("Qwen2ForCausalLM", transformers.Qwen2Config)):
        got = ModelConfig.from_hf({**base, "architectures": [arch]}, "x").max_position_embeddings
        assert got == cls().max_position_embeddings, arch


def test_llama_attends_fully_whatever_sliding_window_says():
    """transformers' Llama never reads sliding_window: a window here gave other logits from token 5 on."""
    llama = {**QWEN2, "architectures": ["LlamaForCausalLM"], "sliding_window": 4}
    assert ModelConfig.from_hf(llama, "l").sliding_window is None
    assert ModelConfig.from_hf({**llama, "architectures": ["MistralForCausalLM"]}, "m").sliding_window == 4


@pytest.mark.parametrize("extra", [{"use_sliding_window": True, "max_window_layers": 1},
                                   {"layer_types": ["full_attention", "sliding_attention"],
                                    "use_sliding_window": True}])
def test_windows_on_some_layers_only_are_refused(extra):
    """One window for every layer is what the decoder serves: a mixed checkpoint was served with the
    window on every layer (wrong tokens from the first on)."""
    with pytest.raises(ValueError, match="sliding window to 1 of 2 layers"):
        ModelConfig.from_hf({**QWEN2, **extra}, "q")


@pytest.mark.parametrize("cfg,message", [
    ({k: v for k, v in QWEN2.items() if k != "intermediate_size"}, "lacks the field 'intermediate_size'"),
    ([1, 2], "must hold a JSON object"),
    ({**QWEN2, "rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ({**QWEN2, "rope_parameters": {"rope_type": "llama3"}}, "lacks the field 'factor'"),
    ({**QWEN2, "sliding_window": 0, "layer_types": ["sliding_attention"] * 2, "use_sliding_window": True},
     "sliding_window must"),
    ({**QWEN2, "layer_types": ["sliding_attention"] * 2}, "use_sliding_window is false"),
    ({**QWEN2, "rms_norm_eps": "1e-6"}, "rms_norm_eps must be a number"),
    ({**QWEN2, "rms_norm_eps": -1.0}, "rms_norm_eps must be a number"),
    ({**QWEN2, "max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
    ({**QWEN2, "vocab_size": 2.5}, "vocab_size must be an integer >= 1"),
    ({**QWEN2, "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1"),
    ({**QWEN2, "rope_theta": 0}, "rope_theta must be > 0"),
    ({**QWEN2, "rope_theta": -5.0}, "rope_theta must be > 0"),
    ({**QWEN2, "rope_scaling": {"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
     "factor must be > 0"),
    ({**QWEN2, "layer_types": ["sliding_attention"]}, "layer_types names 1 layers"),
    ({**QWEN2, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({**QWEN2, "quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantized checkpoint \(gptq\)"),
])
def test_a_config_it_cannot_use_is_one_value_error(cfg, message):
    """Each of these started a server that failed every request, or printed a traceback at start-up."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg, "q")


@pytest.mark.parametrize("write,message", [
    (lambda p: (p / "tokenizer.json").write_text("{}"), "tokenizer.json does not load"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"eos_token": 5}'), "wrong shape"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"chat_template": [{"template": "x"}]}'),
     "wrong shape"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"bos_token": '),
     "tokenizer_config.json is not valid"),
    (lambda p: (p / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "a"}, {"name": "rag", "template": "b"}]}'),
     "none 'default'"),
])
def test_a_tokenizer_it_cannot_use_is_one_value_error(tmp_path, write, message):
    from server.model.tokenizer import HFTokenizer

    write_hf_checkpoint(tmp_path, hf_config("llama"))
    write(tmp_path)
    with pytest.raises(ValueError, match=message):
        HFTokenizer.from_dir(tmp_path)


def test_special_tokens_map_supplies_what_tokenizer_config_lacks(tmp_path):
    """transformers reads special_tokens_map.json under tokenizer_config.json: BOS, EOS (a stop id) and the
    template-only tokens (sep_token) come from it."""
    from server.model.tokenizer import HFTokenizer

    write_hf_checkpoint(tmp_path, hf_config("llama"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ sep_token }}{{ eos_token }}"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "sep_token": "<pad>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi<pad></s>"


@pytest.mark.parametrize("config, expected", [
    ({"eos_token": "</s>"}, ("<pad>", {0})),  # legacy: the map's token over the config's
    ({"eos_token": None}, ("<pad>", {0})),  # legacy: the map's token where the config has null
    ({"eos_token": "</s>", "added_tokens_decoder": {}}, ("</s>", {2})),  # newer: the config's own
])
def test_special_tokens_map_over_a_legacy_tokenizer_config(tmp_path, config, expected):
    """transformers lets special_tokens_map.json override a tokenizer_config.json saved before 4.34 (no
    added_tokens_decoder), and reads no map beside a newer one; the config won both ways here (a review)."""
    from server.model.tokenizer import HFTokenizer

    write_hf_checkpoint(tmp_path, hf_config("llama"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": "{{ messages[0]['content'] }}{{ eos_token }}"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    eos, ids = expected
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == f"hi{eos}"
    assert tok.eos_token_ids == ids


def test_a_tool_use_template_file_beside_a_tokenizer_config_template(tmp_path):
    """additional_chat_templates/tool_use.jinja renders requests with tools whichever file holds the main
    template (it was read only beside chat_template.jinja: a review)."""
    from server.model.tokenizer import HFTokenizer

    write_hf_checkpoint(tmp_path, hf_config("llama"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "DEFAULT"}))
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | length }}")
    tok = HFTokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, True, {"tools": [{"type": "function"}]}) == "TOOLS 1"
    assert tok.apply_chat_template(messages, True) == "DEFAULT"


def test_tools_and_documents_are_none_in_the_template():
    from server.model.chat_template import ChatTemplate

    text = "{% if tools is not none %}T{% endif %}{% if documents is none %}D{% endif %}"
    template = ChatTemplate(text, "t")
    assert template.render([{"role": "user", "content": "x"}]) == "D"
    assert template.render([{"role": "user", "content": "x"}], variables={"tools": []}) == "TD"


def tied_checkpoint(src, dst, head: str) -> dict:
    """A copy of src with tie_word_embeddings and a chosen lm_head.weight: "same", "other" or "only" (the
    head stored, the embedding not)."""
    copy_checkpoint(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = load_file(dst / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = {"same": embed.clone(), "other": torch.randn_like(embed)}.get(head, embed)
    if head == "only":
        del tensors["model.embed_tokens.weight"]
    save_file(tensors, dst / "model.safetensors")
    return tensors


def test_a_tied_checkpoint_serves_its_stored_head_or_refuses_a_different_one(tmp_path, llama_dir):
    tensors = tied_checkpoint(llama_dir, tmp_path / "same", "same")
    model, _ = load_model(str(tmp_path / "same"))
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    tensors = tied_checkpoint(llama_dir, tmp_path / "only", "only")
    model, _ = load_model(str(tmp_path / "only"))  # the head is the embedding
    assert torch.equal(model.model.embed_tokens.weight, tensors["lm_head.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tied_checkpoint(llama_dir, tmp_path / "other", "other")
    with pytest.raises(ValueError, match="lm_head.weight differs from its model.embed_tokens.weight"):
        load_model(str(tmp_path / "other"))


def test_a_tied_checkpoints_quantized_head_is_refused(tmp_path, llama_dir):
    """The head that stands in for a missing embedding is read through the same check."""
    tensors = tied_checkpoint(llama_dir, tmp_path / "only", "only")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].clamp(-1, 1).mul(100).to(torch.int8)
    save_file(tensors, tmp_path / "only" / "model.safetensors")
    with pytest.raises(ValueError,
                       match=r"'lm_head\.weight' in model\.safetensors is torch\.int8.*quantized"):
        load_model(str(tmp_path / "only"))


@pytest.mark.parametrize("write,message", [
    (lambda p: (p / "generation_config.json").write_text("[2]"), "must hold a JSON object"),
    (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": "2"}'), "eos_token_id must be"),
    (lambda p: (p / "config.json").write_text('{"vocab_size": '), "config.json is not valid JSON"),
    (lambda p: (p / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"),
     "not a readable safetensors file"),
])
def test_a_broken_checkpoint_file_is_named(tmp_path, llama_dir, write, message):
    copy_checkpoint(llama_dir, tmp_path)
    write(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path))


def test_generation_config_sampling_values_are_the_defaults_a_request_omits(tmp_path, llama_dir):
    """As vLLM's --generation-config auto: a checkpoint's temperature / top_p / ... replace OpenAI's
    defaults for the fields a request leaves out; the request's own values win."""
    from server.api.protocol import CompletionRequest
    from server.api.sampling import sampling_params
    from server.model.loader import sampling_defaults
    from server.model.tokenizer import ByteTokenizer

    copy_checkpoint(llama_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    defaults = sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9}
    omitted = sampling_params(CompletionRequest(prompt="x"), 4, None, ByteTokenizer(320), defaults)
    assert (omitted.temperature, omitted.top_p, omitted.min_p) == (0.6, 0.9, 0.0)
    given = sampling_params(CompletionRequest(prompt="x", temperature=0.0, top_p=1.0), 4, None,
                            ByteTokenizer(320), defaults)
    assert (given.temperature, given.top_p) == (0.0, 1.0)
    assert sampling_defaults("tiny") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        sampling_defaults(str(tmp_path))


@pytest.mark.parametrize("values,message", [({"temperature": -1.0}, "temperature must be >= 0"),
                                            ({"top_p": 5.0}, "top_p must be in"),
                                            ({"top_k": 0.5}, "top_k must be an integer"),
                                            ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0")])
def test_an_out_of_range_sampling_default_is_refused_at_start_up(tmp_path, llama_dir, values, message):
    """A default out of a request's own range would refuse every request that leaves its field out, with a
    400 that blames the client (a review): the engine refuses it, the file named."""
    from server.api.async_engine import checked_sampling_defaults

    copy_checkpoint(llama_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    with pytest.raises(ValueError, match=f"generation_config.json: {message}"):
        checked_sampling_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": -1}))
    assert checked_sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_k": -1}


def test_the_tokenizer_is_held_to_the_embedding_by_its_largest_id(tmp_path, llama_dir):
    """A tokenizer.json may leave ids unused: its id range is its largest id + 1, not its count (a review:
    300 entries, one of them id 400, passed the check against 320 rows, then a prompt holding that token
    was a 500 in the core). Within the rows, the API takes every id up to the largest."""
    from server.model.loader import load_tokenizer

    copy_checkpoint(llama_dir, tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    word = next(t for t, i in spec["model"]["vocab"].items() if i == 290)
    for new_id, fits in ((400, False), (310, True)):
        spec["model"]["vocab"][word] = new_id
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
        if not fits:
            with pytest.raises(ValueError, match="has ids up to 400 but the model only 320 embedding rows"):
                load_tokenizer(str(tmp_path))
            continue
        tok = load_tokenizer(str(tmp_path))
        assert tok.vocab_size == 311 and tok.encode(word, add_bos=False) == [310]


def test_a_checkpoint_served_as_dot_is_named_after_its_directory(tmp_path, monkeypatch):
    """`cd ckpt && pagewalk serve .`: responses, /v1/models and the metrics' labels carried model "" (a
    review); the default id is the directory's name, as for any other path."""
    from server.model.loader import model_config

    write_hf_checkpoint(tmp_path / "ckpt", hf_config("llama"))
    monkeypatch.chdir(tmp_path / "ckpt")
    assert model_config(".").name == model_config("./").name == "ckpt"


def test_gpu_memory_utilization_on_cpu_is_said_to_size_nothing(caplog):
    """On CPU the cache has its fixed size: a --gpu-memory-utilization given there is said to do nothing,
    not silently dropped (a review)."""
    model, _ = load_model("tiny", "cpu", torch.float32)
    with caplog.at_level("WARNING", logger="server.engine.runner"):
        runner = ModelRunner(model, block_size=16, attention_backend="torch", gpu_memory_utilization=0.01)
    assert "--gpu-memory-utilization sizes a GPU's cache" in caplog.text
    caplog.clear()
    assert ModelRunner(model, block_size=16, attention_backend="torch").num_blocks == runner.num_blocks
    assert "gpu-memory-utilization" not in caplog.text
