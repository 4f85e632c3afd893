"""server/model/norm_folding.py: folding the layers' RMSNorm weights into qkv_proj / gate_up_proj leaves the
model's function unchanged (to fp32 rounding), makes the norms' weights ones, runs once, and is what the
fused forward requires."""

from __future__ import annotations

import pytest
import torch

from server.model import load_model
from server.model.norm_folding import fold_norms


def tiny_with_norm_weights(seed: int = 0):
    """The tiny preset (fp32) with random norm weights (a preset's are ones, which would fold to nothing)."""
    model, _ = load_model("tiny", "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    return model


def test_folding_keeps_the_function_and_moves_the_weights():
    model = tiny_with_norm_weights()
    ids = torch.randint(3, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11)
    layer = model.model.layers[1]
    gamma, qkv = layer.input_layernorm.weight.clone(), layer.self_attn.qkv_proj.weight.clone()
    gamma2, gate_up = layer.post_attention_layernorm.weight.clone(), layer.mlp.gate_up_proj.weight.clone()
    final = model.model.norm.weight.clone()
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions))  # (T, V): the contiguous torch path
    assert not model.norms_folded
    fold_norms(model)
    assert model.norms_folded
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv * gamma[None, :])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up * gamma2[None, :])
    for lay in model.model.layers:
        assert (lay.input_layernorm.weight == 1).all() and (lay.post_attention_layernorm.weight == 1).all()
    assert torch.equal(model.model.norm.weight, final)  # the final norm is not folded
    with torch.inference_mode():
        after = model.compute_logits(model(ids, positions))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    weights = [p.clone() for p in model.parameters()]
    fold_norms(model)  # a second fold changes nothing
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_the_fused_forward_needs_folded_norms_and_fused_ops_fold_them():
    from server.model.fused_forward import fused_forward

    model = tiny_with_norm_weights(2)
    with pytest.raises(AssertionError, match="folded norms"):
        fused_forward(model, torch.tensor([5, 6]), torch.tensor([0, 1]), attn=None)
    model.set_decoder_ops("fused")
    assert model.norms_folded
    model.set_decoder_ops("auto")
