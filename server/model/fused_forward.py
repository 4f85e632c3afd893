"""The decoder forward on fused Triton kernels: the math of llama.py's torch modules in fewer launches.

Per layer, on the folded norms (server/model/norm_folding.py: each norm's weight lives in the projection
after it): qkv GEMM of the residual stream -> the norm's row scale + bias, RoPE(q, k), K/V store (one
kernel) -> paged attention -> o_proj GEMM that adds into the stream -> gate_up GEMM of the stream -> the
norm's row scale + bias, SiLU-and-mul (one kernel) -> down GEMM that adds into the stream. Five launches a
layer with attention, no norm kernel: the row scale rsqrt(mean(r^2) + eps) commutes with the GEMM, so the
kernel reading the GEMM's output applies it (in a decode-only step of up to 128 rows, the attention launch
itself, with the bias and RoPE, and it stores the new K/V: `attn.rope_attend`, kernels/new_token_rope.py,
one launch fewer); the residual adds are the GEMMs' own (cuBLAS, beta = 1), rounded to the model dtype once
per add as the eager `x = x + sublayer(x)`. Up to SPLITK_MAX_ROWS rows the
down GEMM is kernels/splitk_add.py's (one launch where cuBLAS takes a split-K GEMM and a reduce kernel),
rounded the same way, and the gate_up GEMM, the norm's row scale and SiLU-and-mul are one launch
(kernels/gate_up_silu.py, the row scale summed from the GEMM's own input tiles): four launches a layer. The
final norm is a kernel.

It reads the same parameters as the torch modules and needs paged attention: RoPE writes the new tokens'
K/V into the cache itself (`attn.rope_attend`), then the attention runs on the stored K/V. A decode step of
this forward is what the runner captures in a CUDA graph, the final norm included. With out_rows (a step
that reads a few rows' hidden states: a prefill step's samples), the last layer gathers those rows of the
stream and of the attention output before its o_proj, and its o_proj, MLP and the final norm run on them
alone.

One token row (the batch-1 decode step) takes another route: each projection is kernels/gemv.py's GEMV with
the ops before and after it fused in (the norms as prologues, their weights ones after folding; RoPE + K/V
store, SwiGLU and the residual adds as epilogues), five launches per layer with attention. Its rounding is
the unfused ops': every op's result is rounded to the model dtype where the unfused op rounds it.

Chosen over torch.compile by measurement (docs/benchmarks/compile_forward_h100.md): Inductor over the torch
modules, attention and cache store as one custom op, takes 1.23x / 1.07x / 1.04x / 1.00x this forward's
decode step at batch 1 / 16 / 64 / 256 on an H100, and 1.22x at 64 with max-autotune.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
from torch import nn

from kernels.activation import silu_and_mul
from kernels.checks import relative_error
from kernels.gate_up_silu import GATE_UP_SILU_MAX_ROWS, gate_up_silu
from kernels.gate_up_silu import TILE_CLASSES as GATE_UP_TILE_CLASSES
from kernels.gemv import gemv, gemv_rope_store
from kernels.new_token_rope import NewTokens
from kernels.rmsnorm import rms_norm
from kernels.splitk_add import SPLITK_MAX_ROWS, TILE_CLASSES, splitk_add
from kernels.splitk_add import warm_up as warm_up_splitk
from server.model.llama import Attention, AttentionFn, DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


def fused_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn: AttentionFn, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids, positions (T,) -> final-normed hidden states (T, H), or (R, H) of out_rows (R,), as
    LlamaForCausalLM.forward."""
    assert model.norms_folded, "the fused forward runs on folded norms (LlamaForCausalLM.prepare_decoder_ops)"
    inner = model.model
    residual = inner.embed_tokens(input_ids)  # (T, H): the residual stream, each sublayer adds in place
    cos, sin = inner.rotary.half_angles(positions)  # (T, D/2) fp32, shared by every layer
    if takes_one_row(input_ids):  # one row: out_rows, if any, is that row
        assert out_rows is None or out_rows.shape[0] == 1, "one token row has one out row"
        for layer in inner.layers:
            _layer_one_row(layer, residual, cos, sin, attn)
        return rms_norm(residual, inner.norm.weight, inner.norm.eps)
    *layers, last = inner.layers
    for layer in layers:
        _layer(layer, residual, cos, sin, attn)
    residual = _layer(last, residual, cos, sin, attn, out_rows)  # (T or R, H)
    return rms_norm(residual, inner.norm.weight, inner.norm.eps)


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


def scratch_new_tokens(model: LlamaForCausalLM) -> Callable[[int], NewTokens]:
    """rows -> zero decode rows with padding slots, shaped as this forward's decode steps pass them to
    `attn.rope_attend` (server.engine.attention.warm_up_attention compiles that decode variant with them)."""
    cfg, layer = model.config, model.model.layers[0]
    return partial(NewTokens.scratch, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, norm_width=cfg.hidden_size, bias=layer.self_attn.qkv_proj.bias,
                   eps=layer.input_layernorm.eps, dtype=model.dtype, device=model.device)


def warm_up_mlp(model: LlamaForCausalLM) -> None:
    """Makes the split-K down projection's tile counters (before any graph capture) and compiles the MLP's
    Triton GEMMs (the fused gate_up + SiLU, the split-K down projection) for every tile class on scratch rows
    (layer 0's weights), so that an eager server compiles none mid-serving. The fused gate_up + SiLU is
    checked against the two launches it replaces on the way; where it disagrees, this device keeps them."""
    mlp = model.model.layers[0].mlp
    weight = mlp.down_proj.weight  # (H, I)
    warm_up_splitk(weight.device)
    for rows in _warm_up_rows(TILE_CLASSES):
        act = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        out = torch.zeros(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        splitk_add(out, act, weight)
    eps = model.model.layers[0].post_attention_layernorm.eps
    if fuses_gate_up_silu(GATE_UP_SILU_MAX_ROWS, mlp.gate_up_proj):
        err = _gate_up_silu_error(mlp.gate_up_proj.weight, eps)
        if not err <= GATE_UP_SILU_TOLERANCE:
            _GATE_UP_SILU_REFUSED.add(weight.device)
            logger.warning("the fused gate_up + SiLU kernel is %.2g off the cuBLAS GEMM + SiLU-and-mul on %s "
                           "(Triton %s): the MLP keeps the two launches there", err, weight.device,
                           triton.__version__)


# Where the fused gate_up + SiLU disagreed with the two launches it replaces at start-up (warm_up_mlp).
# Why a check at all: its first version computed wrong results at 64-row tiles on Hopper, from a Triton
# pipelining hazard that no CPU test can see (kernels/gate_up_silu.py); a compiler of another version may
# bring another, and a wrong MLP would serve wrong tokens without an error.
_GATE_UP_SILU_REFUSED: set[torch.device] = set()
GATE_UP_SILU_TOLERANCE = 2e-2  # max abs error / max abs value: bf16 rounds to ~4e-3; the hazard: 0.1-0.5


def _gate_up_silu_error(weight: torch.Tensor, eps: float) -> float:
    """The fused kernel's largest relative error against F.linear + silu_and_mul over random rows of every
    tile class and row-count specialisation (which this compiles, as the warm-up must)."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    worst = 0.0
    for rows in _warm_up_rows(GATE_UP_TILE_CLASSES):
        x = (torch.randn(rows, weight.shape[1], generator=gen, device=weight.device) * 2).to(weight.dtype)
        want = _two_launches(x, weight, eps).float()
        got = gate_up_silu(x, weight, eps).float()
        worst = max(worst, relative_error(got, want))
    return worst


def _warm_up_rows(tile_classes) -> list[int]:
    """Row counts that launch every Triton specialisation of a kernel with these tile classes: each class's
    fewest rows past one and most rows (Triton specialises M on M % 16 == 0; one row takes the GEMVs)."""
    rows, least = [], 1
    for most, _ in tile_classes:
        rows += sorted({max(least, 2), most})
        least = most + 1
    return rows


def takes_one_row(input_ids: torch.Tensor) -> bool:
    """Whether the forward takes the one-row GEMV route (tools/decode_forward_bench times the GEMM route at
    one row too, by replacing this)."""
    return input_ids.shape[0] == 1


def _layer(layer: DecoderLayer, residual: torch.Tensor, cos, sin, attn: AttentionFn,
           out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """residual (T, H) gains this layer's attention and MLP outputs, in place (folded norms) -> residual;
    with out_rows (R,) past the attention only those rows go on, gathered: -> a new (R, H) stream."""
    mod, mlp = layer.self_attn, layer.mlp
    qkv = F.linear(residual, mod.qkv_proj.weight)  # (T, (Hq + 2 Hkv) D): the un-normed stream's projection
    attended = _rope_attend(layer, qkv, residual, cos, sin, attn)  # (T, Hq D)
    if out_rows is not None:
        residual, attended = residual.index_select(0, out_rows), attended.index_select(0, out_rows)
    _add_projection(residual, attended, mod.o_proj)
    act = _mlp_activation(residual, mlp.gate_up_proj, layer.post_attention_layernorm.eps)  # (T, I)
    _add_down_projection(residual, act, mlp.down_proj)
    return residual


def _mlp_activation(residual: torch.Tensor, proj: nn.Linear, eps: float) -> torch.Tensor:
    """residual (T, H), the un-normed stream -> silu(gate) * up (T, I) of its normed rows: up to
    GATE_UP_SILU_MAX_ROWS rows kernels/gate_up_silu.py's one launch (the GEMM with the norm's row scale and
    the activation in its epilogue); else cuBLAS's GEMM, then the SiLU-and-mul kernel applies both."""
    if fuses_gate_up_silu(residual.shape[0], proj):
        return gate_up_silu(residual, proj.weight, eps)
    return _two_launches(residual, proj.weight, eps, proj.bias)


def _two_launches(residual: torch.Tensor, weight: torch.Tensor, eps: float, bias=None) -> torch.Tensor:
    """The same as gate_up_silu (plus the bias) as cuBLAS's GEMM (T, 2I), then the SiLU-and-mul kernel."""
    return silu_and_mul(F.linear(residual, weight), norm_of=residual, eps=eps, bias=bias)


def gate_up_silu_refused(device: torch.device) -> bool:
    """Whether the start-up check turned the fused gate_up + SiLU off on `device` (warm_up_mlp)."""
    return torch.device(device) in _GATE_UP_SILU_REFUSED


def fuses_gate_up_silu(rows: int, proj: nn.Linear) -> bool:
    """Whether `rows` rows take the fused gate_up + SiLU launch (tools/decode_forward_bench times the
    separate GEMM and SiLU-and-mul too, by replacing this)."""
    return (proj.bias is None and rows <= GATE_UP_SILU_MAX_ROWS
            and proj.weight.device not in _GATE_UP_SILU_REFUSED)


def _add_down_projection(residual: torch.Tensor, act: torch.Tensor, proj: nn.Linear) -> None:
    """residual (T, H) += act (T, I) W^T: up to SPLITK_MAX_ROWS rows kernels/splitk_add.py's one launch (its
    split-K merge adds into the stream), which beats cuBLAS's split-K GEMM + reduce kernel there; else the
    addmm."""
    if proj.bias is None and residual.shape[0] <= SPLITK_MAX_ROWS:
        splitk_add(residual, act, proj.weight)
    else:
        _add_projection(residual, act, proj)


def _add_projection(residual: torch.Tensor, x: torch.Tensor, proj: nn.Linear) -> None:
    """residual (T, H) += x (T, K) W^T (+ b), in place: one GEMM with beta = 1 (no bias: every preset and
    Llama/Qwen2/Mistral checkpoint) rounds the sum once, as the eager add does."""
    if proj.bias is None:
        residual.addmm_(x, proj.weight.t())
    else:
        residual.add_(F.linear(x, proj.weight, proj.bias))


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


def _rope_attend(layer: DecoderLayer, qkv: torch.Tensor, residual: torch.Tensor, cos, sin,
                 attn: AttentionFn) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) D), the projection of the un-normed stream residual (T, H) -> the attention
    output (T, Hq D): the norm's row scale, the bias and RoPE applied, the new K/V stored (attn.rope_attend:
    in the decode launch itself on a decode-only step)."""
    mod = layer.self_attn
    o = attn.rope_attend(mod.layer_idx, qkv, cos, sin, mod.num_heads, residual, layer.input_layernorm.eps,
                         mod.qkv_proj.bias)  # (T, Hq, D)
    return o.reshape(qkv.shape[0], mod.q_size)


def _attend(mod: Attention, qkv: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) D), rotated and stored -> the attention output (T, Hq D), before o_proj."""
    T = qkv.shape[0]
    heads = qkv.view(T, mod.num_heads + 2 * mod.num_kv_heads, mod.head_dim)
    q, k, v = heads.split([mod.num_heads, mod.num_kv_heads, mod.num_kv_heads], dim=1)  # strided views
    o = attn.attend(mod.layer_idx, q, k, v)  # (T, Hq, D)
    return o.reshape(T, mod.q_size)
