"""The decoder forward on fused Triton kernels: the math of llama.py's torch modules in fewer launches.

Per layer: add + RMSNorm -> qkv GEMM -> RoPE(q, k) + K/V store -> paged attention -> o_proj -> add + RMSNorm
-> gate_up GEMM -> SiLU-and-mul -> down GEMM. Each sublayer's output joins the residual stream inside the
next norm's kernel (the final norm included), so the stream is read once per norm rather than three times,
and it stays in the model dtype, rounded after every add, as in the eager
`x = x + sublayer(x)`.

It reads the same parameters as the torch modules and needs paged attention: RoPE writes the new tokens'
K/V into the cache itself, then `attn.attend` runs on the stored K/V. A decode step of this forward is what
the runner captures in a CUDA graph, the final norm included.

One token row (the batch-1 decode step) takes another route: each projection is kernels/gemv.py's GEMV with
the ops before and after it fused in (the norms as prologues; RoPE + K/V store, SwiGLU and the residual
adds as epilogues), five launches per layer with attention, where the GEMM route runs nine or ten. Its
rounding is the same: every op's result is rounded to the model dtype where the unfused op rounds it.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul
from kernels.gemv import gemv, gemv_rope_store
from kernels.rmsnorm import rms_norm
from kernels.rope_store import rope_store_kv
from server.model.llama import Attention, AttentionFn, DecoderLayer, LlamaForCausalLM


def fused_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn: AttentionFn) -> torch.Tensor:
    """input_ids, positions (T,) -> final-normed hidden states (T, H), as LlamaForCausalLM.forward."""
    inner = model.model
    residual = inner.embed_tokens(input_ids)  # (T, H): the residual stream, advanced in place by the norms
    cos, sin = inner.rotary.half_angles(positions)  # (T, D/2) fp32, shared by every layer
    if takes_one_row(input_ids):
        for layer in inner.layers:
            _layer_one_row(layer, residual, cos, sin, attn)
        return rms_norm(residual, inner.norm.weight, inner.norm.eps)
    out = None  # the previous layer's MLP output; None before the first layer
    for layer in inner.layers:
        out = _layer(layer, out, residual, cos, sin, attn)
    return rms_norm(out, inner.norm.weight, inner.norm.eps, residual=residual)


def warm_up_one_row(model: LlamaForCausalLM, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Compiles the one-row route's kernel variants with the arguments a step passes (layer 0's weights and
    caches: every layer has the same shapes and strides), so that an eager server's first single-sequence
    step does not compile them mid-serving (a Triton compile stalls every stream for about a second; with
    CUDA graphs the capture compiles them anyway). It writes scratch rows only: slot -1 stores no K/V."""
    inner = model.model
    layer = inner.layers[0]
    mod, mlp = layer.self_attn, layer.mlp
    row = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=model.device)
    cos, sin = inner.rotary.half_angles(torch.zeros(1, dtype=torch.long, device=model.device))
    slots = torch.full((1,), -1, dtype=torch.long, device=model.device)
    norm = layer.input_layernorm
    gemv_rope_store(row, mod.qkv_proj.weight, mod.qkv_proj.bias, norm_weight=norm.weight, eps=norm.eps,
                    cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                    num_q_heads=mod.num_heads, num_kv_heads=mod.num_kv_heads)
    attn_out = torch.zeros(1, mod.q_size, dtype=model.dtype, device=model.device)
    gemv(attn_out, mod.o_proj.weight, mod.o_proj.bias, residual=row)
    norm = layer.post_attention_layernorm
    act = gemv(row, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=norm.weight, eps=norm.eps,
               gated=True)
    gemv(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=row)
    rms_norm(row, inner.norm.weight, inner.norm.eps)


def takes_one_row(input_ids: torch.Tensor) -> bool:
    """Whether the forward takes the one-row GEMV route (tools/decode_forward_bench times the GEMM route at
    one row too, by replacing this)."""
    return input_ids.shape[0] == 1


def _layer(layer: DecoderLayer, prev: torch.Tensor | None, residual: torch.Tensor, cos, sin,
           attn: AttentionFn) -> torch.Tensor:
    """-> this layer's MLP output (T, H); residual gains prev and the attention output."""
    norm = layer.input_layernorm
    if prev is None:
        x = rms_norm(residual, norm.weight, norm.eps)  # the embeddings: nothing to add yet
    else:
        x = rms_norm(prev, norm.weight, norm.eps, residual=residual)
    x = _attention(layer.self_attn, x, cos, sin, attn)  # (T, H)
    norm = layer.post_attention_layernorm
    x = rms_norm(x, norm.weight, norm.eps, residual=residual)
    mlp = layer.mlp
    return mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))  # (T, 2I) -> (T, I) -> (T, H)


def _layer_one_row(layer: DecoderLayer, residual: torch.Tensor, cos, sin, attn: AttentionFn) -> None:
    """residual (1, H) gains this layer's attention and MLP outputs, in place."""
    mod, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    k_cache, v_cache, slots = attn.kv_destination(mod.layer_idx)
    qkv = gemv_rope_store(residual, mod.qkv_proj.weight, mod.qkv_proj.bias, norm_weight=norm.weight,
                          eps=norm.eps, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                          slot_mapping=slots, num_q_heads=mod.num_heads, num_kv_heads=mod.num_kv_heads)
    gemv(_attend(mod, qkv, attn), mod.o_proj.weight, mod.o_proj.bias, residual=residual)
    norm = layer.post_attention_layernorm
    act = gemv(residual, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=norm.weight,
               eps=norm.eps, gated=True)  # (1, I)
    gemv(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=residual)


def _attention(mod: Attention, x: torch.Tensor, cos, sin, attn: AttentionFn) -> torch.Tensor:
    return mod.o_proj(_rope_attend(mod, mod.qkv_proj(x), cos, sin, attn))


def _rope_attend(mod: Attention, qkv: torch.Tensor, cos, sin, attn: AttentionFn) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) D) -> the attention output (T, Hq D), before o_proj; stores the new K/V."""
    k_cache, v_cache, slots = attn.kv_destination(mod.layer_idx)
    rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, mod.num_heads, mod.num_kv_heads)  # q, k in place
    return _attend(mod, qkv, attn)


def _attend(mod: Attention, qkv: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) D), rotated and stored -> the attention output (T, Hq D), before o_proj."""
    T = qkv.shape[0]
    heads = qkv.view(T, mod.num_heads + 2 * mod.num_kv_heads, mod.head_dim)
    q, k, v = heads.split([mod.num_heads, mod.num_kv_heads, mod.num_kv_heads], dim=1)  # strided views
    o = attn.attend(mod.layer_idx, q, k, v)  # (T, Hq, D)
    return o.reshape(T, mod.q_size)
