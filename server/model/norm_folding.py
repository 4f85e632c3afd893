"""Folding each decoder layer's RMSNorm weights into the projection that reads the normed stream.

RMSNorm(x) W^T = (s x * g) W^T = s (x W'^T) with W' = W diag(g) and s = rsqrt(mean(x^2) + eps) one scalar
per row. With g folded into W (and the norm's weight set to ones, so the torch modules compute the same
function as before), the fused forward (server/model/fused_forward.py) runs the qkv and gate_up GEMMs on
the residual stream itself and applies s afterwards, in the kernels that read those GEMMs' outputs
(kernels/rope_store.py, kernels/activation.py); the residual adds join the o_proj and down GEMMs (cuBLAS
with beta = 1). A layer then launches no norm kernel of its own: 32 fewer launches per step for 16 layers.

The final norm is not folded: lm_head is shared with the embedding in tied models. W' is rounded once to
the model dtype (in fp32 the fold changes the function by float rounding only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from server.model.llama import LlamaForCausalLM


@torch.no_grad()
def fold_norms(model: LlamaForCausalLM) -> None:
    """Folds every layer's input_layernorm weight into its qkv_proj and its post_attention_layernorm weight
    into its gate_up_proj, in place; the norms' weights become ones. Idempotent (model.norms_folded)."""
    if model.norms_folded:
        return
    for layer in model.model.layers:
        for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                           (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            proj.weight.copy_(proj.weight.float() * norm.weight.float()[None, :])  # (N, H) * (1, H)
            norm.weight.fill_(1.0)
    model.norms_folded = True
