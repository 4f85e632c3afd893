"""config.json read as transformers reads it, on tiny random checkpoints (fp32, CPU): the spellings real
configs carry where transformers and a plain reading part ways (a review found each; before, the first three
served different logits without an error and the last two refused valid checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import hf_config, write_hf_checkpoint

from server.model import load_model
from server.model.loader import model_config

transformers = pytest.importorskip("transformers")

IDS = list(range(3, 63))
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
DELETE = object()


def checkpoint(tmp_path: Path, arch: str = "llama", edits: dict | None = None, **overrides) -> Path:
    """A tiny random checkpoint of `arch`, its config.json then edited (DELETE drops a key)."""
    path = tmp_path / "ckpt"
    write_hf_checkpoint(path, hf_config(arch, **overrides))
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    for key, value in (edits or {}).items():
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    f.write_text(json.dumps(cfg))
    return path


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def logits_error(path: Path, ids: list[int] = IDS, last_only: bool = False) -> float:
    """Max |ours - transformers'| over max |transformers'| of the logits at every position (or the last)."""
    model, _ = load_model(str(path), "cpu", torch.float32)
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
        theirs = hf_model(path)(torch.tensor([ids])).logits[0].float()
    if last_only:
        ours, theirs = ours[-1], theirs[-1]
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_a_legacy_rope_scaling_replaces_rope_parameters_whole(tmp_path):
    # both spellings: transformers takes rope_scaling's llama3; merged, rope_parameters' "default" hid it
    path = checkpoint(tmp_path, edits={"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                                       "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert logits_error(path) < 1e-4
    path = checkpoint(tmp_path / "linear", edits={"rope_parameters": {"rope_type": "default"},
                                                  "rope_scaling": {"type": "linear", "factor": 4.0}})
    with pytest.raises(ValueError, match="linear"):  # not served as plain RoPE
        model_config(str(path))


def test_a_top_level_original_max_position_embeddings_comes_first(tmp_path):
    path = checkpoint(tmp_path, edits={"original_max_position_embeddings": 8},
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3,
                                       "original_max_position_embeddings": 64})
    assert logits_error(path) < 1e-4


def test_a_missing_sliding_window_is_transformers_default(tmp_path):
    # Mistral windows every layer at 4096 where config.json omits the key (an explicit null: no window)
    path = checkpoint(tmp_path, "mistral", edits={"sliding_window": DELETE}, sliding_window=None,
                      max_position_embeddings=8192, num_hidden_layers=1)
    assert model_config(str(path)).sliding_window == 4096
    assert logits_error(path, [(i * 7919) % 317 + 3 for i in range(4200)], last_only=True) < 1e-4
    qwen2 = checkpoint(tmp_path / "qwen2", "qwen2", edits={"use_sliding_window": True, "max_window_layers": 0,
                                                           "sliding_window": DELETE, "layer_types": DELETE})
    assert model_config(str(qwen2)).sliding_window == 4096


def test_swish_is_silu_and_model_type_names_the_architecture(tmp_path):
    assert logits_error(checkpoint(tmp_path, edits={"hidden_act": "swish"})) < 1e-4
    assert logits_error(checkpoint(tmp_path / "bare", "qwen2", edits={"architectures": DELETE})) < 1e-4


@pytest.mark.parametrize("arch,flag", [("mistral", "attention_bias"), ("mistral", "mlp_bias"),
                                       ("qwen2", "mlp_bias"), ("qwen2", "attention_bias")])
def test_bias_flags_count_for_llama_only_as_in_transformers(tmp_path, arch, flag):
    """transformers builds Mistral's projections without biases and Qwen2's with q/k/v biases only,
    whatever config.json's attention_bias / mlp_bias say: such a checkpoint loads and serves as there
    (before, it was refused for the bias tensors the flag named: a review)."""
    path = checkpoint(tmp_path, arch, edits={flag: True})
    config = model_config(str(path))
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (arch == "qwen2", False, False)
    assert logits_error(path) < 1e-4
    # ... and with the bias tensors the flag names stored, as a checkpoint saved with it carries them:
    # transformers drops them (unexpected keys), and so does the loader, with a warning (a review)
    names = {"attention_bias": [f"self_attn.{p}_proj" for p in "qkvo"],
             "mlp_bias": [f"mlp.{p}_proj" for p in ("gate", "up", "down")]}[flag]
    with_biases(path, [f"model.layers.{i}.{n}.bias" for i in range(2) for n in names
                       if not (arch == "qwen2" and n[-6] in "qkv" and n.startswith("self_attn"))])
    assert logits_error(path) < 1e-4


def with_biases(path: Path, names: list[str]) -> None:
    """Adds random bias tensors of these names to the checkpoint's weights."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in names:
        tensors[name] = torch.randn(tensors[name.replace(".bias", ".weight")].shape[0])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_a_llama_bias_its_config_turns_off_is_still_an_unexpected_tensor(tmp_path):
    path = checkpoint(tmp_path, "llama")
    with_biases(path, ["model.layers.0.self_attn.o_proj.bias"])
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        load_model(str(path), "cpu", torch.float32)


@pytest.mark.parametrize("arch,kv_heads", [("llama", 16), ("mistral", 8)])
def test_a_missing_num_key_value_heads_is_transformers_default(tmp_path, arch, kv_heads):
    """Llama's default is num_attention_heads, Mistral's 8 (Qwen2's 32): a Mistral checkpoint of 16 heads
    over 8 without the key was read as 16 KV heads and refused for its k_proj's shape (a review)."""
    path = checkpoint(tmp_path, arch, edits={"num_key_value_heads": DELETE}, hidden_size=128,
                      num_attention_heads=16, num_key_value_heads=kv_heads, sliding_window=None)
    assert model_config(str(path)).num_kv_heads == kv_heads
    assert logits_error(path) < 1e-4


@pytest.mark.parametrize("arch,model_type", [("mistral", "llama"), ("llama", "mistral"), ("qwen2", "llama")])
def test_architectures_and_model_type_that_disagree_are_refused(tmp_path, arch, model_type):
    """transformers builds by model_type, vLLM by architectures: a Mistral class over a "llama" type (a
    window one reads and the other does not) served logits 1.3x off transformers' (a review)."""
    path = checkpoint(tmp_path, arch, edits={"model_type": model_type})
    with pytest.raises(ValueError, match="architectures .* and model_type .* name different models"):
        model_config(str(path))
    assert model_config(str(checkpoint(tmp_path / "same", arch))).num_layers >= 1  # agreeing: served


def test_qwen2_sliding_layer_types_without_use_sliding_window_are_refused(tmp_path):
    """Qwen2Config nulls the window without use_sliding_window and transformers then fails on the layers
    marked sliding; pagewalk served them with the window (a review)."""
    path = checkpoint(tmp_path, "qwen2", edits={"use_sliding_window": False, "sliding_window": 5,
                                                "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="use_sliding_window is false"):
        model_config(str(path))
