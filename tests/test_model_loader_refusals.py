"""Checkpoints that would load wrong, or fail only once serving, are refused at start-up with one line that
names what is wrong (cases from a review): an odd head_dim, a config far larger than its weights, an index
naming shards outside the directory, weights that are not finite in the serving dtype, JSON or a chat
template nested past Python's stack, ill-typed RoPE fields and shard names."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.model.config import ModelConfig
from server.model.loader import checkpoint_files, load_model
from tests.model_fixtures import hf_config, write_hf_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("base") / "llama"
    write_hf_checkpoint(d, hf_config("llama"))  # hidden 64, 4 heads (head_dim 16), 2 kv heads, 2 layers
    return d


@pytest.fixture
def ckpt(base_dir, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(base_dir, d)
    return d


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


def edit_weights(d: Path, fn) -> None:
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_an_odd_head_dim_is_refused():
    """RoPE rotates a head's halves: head_dim 15 built an engine whose every forward failed."""
    cfg = json.loads(json.dumps(hf_config("llama").to_dict()))
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig.from_hf({**cfg, "head_dim": 15}, "m")


@pytest.mark.parametrize("change, says", [
    ({"num_hidden_layers": 5000}, "5000 layers"),
    ({"vocab_size": 10**9}, "vocab_size 1000000000"),
])
def test_a_config_larger_than_its_checkpoint_is_refused_before_the_model_is_built(ckpt, change, says):
    """Checked against the safetensors headers: 5,000 layers over a 2-layer checkpoint were refused only
    after 13 s of allocation, a vocabulary of 10^9 failed in the allocator."""
    edit_config(ckpt, **change)
    start = time.monotonic()
    with pytest.raises(ValueError, match=says):
        load_model(str(ckpt), "cpu", "float32")
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("spelling", ["relative", "absolute", "number"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(ckpt, tmp_path, spelling):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(ckpt / "model.safetensors", elsewhere / "w.safetensors")
    name = {"relative": "../elsewhere/w.safetensors", "absolute": str(elsewhere / "w.safetensors"),
            "number": 5}[spelling]
    keys = load_file(elsewhere / "w.safetensors").keys()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in keys}}))
    with pytest.raises(ValueError, match="shards are file names in its directory"):
        checkpoint_files(ckpt)


def test_a_shard_that_is_a_symlink_in_the_directory_loads(ckpt, tmp_path):
    """The Hugging Face cache links each file of a snapshot to its blob."""
    blob = tmp_path / "blob"
    shutil.move(ckpt / "model.safetensors", blob)
    (ckpt / "model.safetensors").symlink_to(blob)
    keys = load_file(blob).keys()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors"
                                                                                  for k in keys}}))
    load_model(str(ckpt), "cpu", "float32")


@pytest.mark.parametrize("dtype, value", [("float32", float("nan")), ("float16", 1e5)])
def test_weights_not_finite_in_the_serving_dtype_are_refused(ckpt, dtype, value):
    """A NaN stored, or fp32 past fp16's 65504 served in fp16: every reply was token 0 on repeat."""
    def poison(sd):
        sd["model.layers.0.mlp.down_proj.weight"][0, 0] = value
    edit_weights(ckpt, poison)
    with pytest.raises(ValueError, match="down_proj.weight.*NaN or infinite"):
        load_model(str(ckpt), "cpu", dtype)
    if dtype == "float16":
        load_model(str(ckpt), "cpu", "float32")  # 1e5 is in fp32's range: it loads


@pytest.mark.parametrize("what", ["config.json", "chat template"])
def test_input_nested_past_pythons_stack_is_one_start_up_line(ckpt, what):
    if what == "config.json":
        (ckpt / "config.json").write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}"
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(ckpt), "--device", "cpu",
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert proc.returncode == 1
    assert len(lines) == 1 and "nests too deeply" in lines[0], proc.stderr[-1500:]


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta"),
    ({"rope_scaling": "llama3"}, "rope_scaling"),
])
def test_an_ill_typed_rope_field_is_named(base_dir, change, field):
    cfg = json.loads((base_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=f"config.json's {field}"):
        ModelConfig.from_hf({**cfg, **change}, "m")


def test_finite_weights_in_range_load_as_before(ckpt):
    model, _ = load_model(str(ckpt), "cpu", "float16")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_template_that_loops_on_every_input_stops_start_up(monkeypatch):
    """A template that never finishes rendering held the API's event loop at its first chat request (a
    review): start-up renders a conversation in a thread and gives up after its timeout."""
    import time as clock

    from server.model.chat_template import ChatTemplate

    template = ChatTemplate("{{ messages[0]['content'] }}", "a test")
    template.check_renders()  # renders in about a millisecond
    monkeypatch.setattr(ChatTemplate, "_render", lambda self, context: clock.sleep(2))
    with pytest.raises(ValueError, match="did not render a two-message conversation in 0 s"):
        template.check_renders(timeout_s=0.2)


def test_a_template_asking_for_too_many_range_elements_fails_its_request():
    """The sandbox bounds each range() at 100,000, not a range in a range: one render makes at most
    MAX_RANGE_ELEMENTS, and each render starts afresh."""
    from server.model.chat_template import MAX_RANGE_ELEMENTS, ChatTemplate, ChatTemplateError

    looping = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                           "{{ messages[0]['content'] }}", "a test")
    with pytest.raises(ChatTemplateError, match="range"):
        looping.render([{"role": "user", "content": "hi"}])
    per_render = ChatTemplate(f"{{% for i in range({MAX_RANGE_ELEMENTS // 20}) %}}{{% endfor %}}ok", "a test")
    for _ in range(30):  # more than MAX_RANGE_ELEMENTS over the renders, within it in each
        assert per_render.render([{"role": "user", "content": "hi"}]) == "ok"
