"""loadtest.hf_baseline on CPU: weight conversion from the pagewalk preset, timing JSON, checkpoint dirs."""

import json

import pytest
import torch

pytest.importorskip("transformers")
model_pkg = pytest.importorskip("server.model", reason="pagewalk model package not built yet")

from tools.hf_baseline import hf_state_dict, load_hf_model, main, run_baseline  # noqa: E402

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_hf():
    model, source = load_hf_model("tiny", CPU, torch.float32)
    return model, source


def test_preset_weights_convert_exactly(tiny_hf):
    hf, source = tiny_hf
    assert source.startswith("pagewalk preset tiny")
    ours, _ = model_pkg.load_model("tiny", "cpu", torch.float32)
    ids = torch.randint(32, 127, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.compute_logits(ours(ids, torch.arange(12)))  # (T, vocab)
        got = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fused_projections_are_split_in_order():
    cfg = model_pkg.PRESETS["tiny"]
    qkv = torch.arange(cfg.q_size + 2 * cfg.kv_size, dtype=torch.float32)[:, None]
    gate_up = torch.arange(2 * cfg.intermediate_size, dtype=torch.float32)[:, None]
    out = hf_state_dict({"model.layers.0.self_attn.qkv_proj.weight": qkv,
                         "model.layers.0.mlp.gate_up_proj.weight": gate_up}, cfg)  # fmt: skip
    assert out["model.layers.0.self_attn.q_proj.weight"][0, 0] == 0
    assert out["model.layers.0.self_attn.k_proj.weight"][0, 0] == cfg.q_size
    assert out["model.layers.0.self_attn.v_proj.weight"][0, 0] == cfg.q_size + cfg.kv_size
    assert out["model.layers.0.mlp.up_proj.weight"][0, 0] == cfg.intermediate_size
    assert out["model.layers.0.mlp.gate_proj.weight"].shape[0] == cfg.intermediate_size


def test_run_baseline_reports_output_throughput(tiny_hf):
    result = run_baseline(tiny_hf[0], batch_size=2, input_len=8, output_len=4, iters=1, warmup=0)
    assert (result["batch_size"], result["input_len"], result["output_len"]) == (2, 8, 4)
    assert result["output_throughput"] == pytest.approx(2 * 4 / result["latency_s"]["mean"])
    assert 0 < result["prefill_latency_s"] < result["latency_s"]["mean"]


def test_checkpoint_directory_cli(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "baseline.json"
    argv = ["--model", str(tmp_path / "ckpt"), "--batch-size", "3", "--input-len", "5", "--output-len", "3",
            "--iters", "1", "--warmup", "0", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["source"].startswith("checkpoint") and result["cache_implementation"] == "static"
    assert (result["batch_size"], result["device"], result["dtype"]) == (3, "cpu", "float32")
    assert result["output_throughput"] == pytest.approx(3 * 3 / result["latency_s"]["mean"])
    assert result["torch"] == torch.__version__ and result["transformers"]
    assert json.loads(capsys.readouterr().out) == result
