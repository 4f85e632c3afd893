"""The Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU, optional qkv bias.

Attention is pluggable: the runner passes an `attn` (AttentionFn) that writes K/V into the paged cache and
attends over it; without one, each forward is a single contiguous sequence (dense causal).
Parameter names follow transformers, except that q/k/v and gate/up are fused (the loader stacks them).

The decoder ops are chosen per forward and logged when the choice changes: over paged attention on CUDA
with the Triton backend, server/model/fused_forward.py (the same math in fused Triton kernels); otherwise
the torch modules below, which are also the reference the fused path is tested against.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from server.model.config import ModelConfig
from server.model.layers import RMSNorm, SwiGLU, causal_attention
from server.model.rope import RotaryEmbedding, apply_rope

log = logging.getLogger(__name__)

DECODER_OPS = ("auto", "torch", "fused")


class AttentionFn(Protocol):
    """Paged attention of one step. `attn(i, q, k, v)` stores the new tokens' K/V, then attends; a fused
    kernel that stores K/V itself (RoPE + store) asks `kv_destination(i)` where to, then calls `attend`;
    `rope_attend` takes the qkv projection as it is and does RoPE, the store and the attention."""

    backend: str  # the kernels' backend: "triton" or "torch"

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the flat batch -> (T, Hq, D)."""
        ...

    def kv_destination(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> k_cache, v_cache (N, block_size, Hkv, D) and the slot mapping (T,) of the new tokens."""
        ...

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """As __call__, with the new tokens' K/V already stored."""
        ...

    def rope_attend(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_q_heads: int, norm_of: torch.Tensor | None, eps: float,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """qkv (T, (Hq + 2 Hkv) D), the projection before its row scale, bias and RoPE (as
        kernels.rope_store.rope_store_kv takes it) -> (T, Hq, D), the new K/V stored."""
        ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn | None,
                out_rows: torch.Tensor | None = None):
        """x (T, H) -> (T, H), or with out_rows (R,) the o_proj of those rows only (R, H): every row's K/V
        and attention are computed (the cache needs them), the projection only where it is read."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (Hq + 2 Hkv) D)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)  # one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, Hq, D), (T, Hkv, D): strided views
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D), strided
        if attn is None:
            o = causal_attention(q, k, v, self.sliding_window)
        else:
            o = attn(self.layer_idx, q, k, v)  # (T, Hq, D)
        o = o.reshape(T, self.q_size)
        return self.o_proj(o if out_rows is None else o.index_select(0, out_rows))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, attn: AttentionFn | None, out_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x (T, H) -> (T, H); with out_rows (R,) -> (R, H): those rows past the attention (see Attention)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, out_rows)
        x = (x if out_rows is None else x.index_select(0, out_rows)) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.decoder_ops = "auto"  # see set_decoder_ops
        self._logged_ops: str | None = None
        self.norms_folded = False  # server/model/norm_folding.py: the fused forward runs on folded norms

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (needed again after materialising from the meta device)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def set_decoder_ops(self, ops: str) -> None:
        """"auto": fused Triton kernels over paged attention on CUDA with the Triton backend, torch modules
        otherwise; "fused" / "torch" force one (tests run "fused" on CPU under the Triton interpreter).
        "fused" folds the norms (prepare_decoder_ops)."""
        if ops not in DECODER_OPS:
            raise ValueError(f"decoder ops must be one of {DECODER_OPS}, got {ops!r}")
        self.decoder_ops = ops
        if ops == "fused":
            self.prepare_decoder_ops("fused")

    def prepare_decoder_ops(self, ops: str) -> None:
        """Readies the weights for forwards on `ops` (before any is run or captured): the fused forward's
        folded norms (server/model/norm_folding.py; the torch modules compute the same function on them)."""
        if ops == "fused":
            from server.model.norm_folding import fold_norms

            fold_norms(self)

    def resolve_decoder_ops(self, attn: AttentionFn | None) -> str:
        """"fused" or "torch" for a forward over `attn`; the contiguous (attn None) path is always torch."""
        return "torch" if attn is None else self.decoder_ops_for(attn.backend)

    def decoder_ops_for(self, attention_backend: str) -> str:
        """"fused" or "torch" for a forward over paged attention on `attention_backend`."""
        if self.decoder_ops != "auto":
            return self.decoder_ops
        return "fused" if self.device.type == "cuda" and attention_backend == "triton" else "torch"

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, H); with out_rows (R,) int64 only those
        rows' (R, H), in that order (repeats allowed). The last layer then runs its attention for every row
        (their K/V go to the cache) and the rest of the layer (o_proj, MLP) and the final norm for the out
        rows only: a prefill step reads the hidden state of each chunk's last token alone, so the rest of the
        last layer's work on a step of T prompt tokens and R samples shrinks by T / R."""
        if attn is not None:
            ops = self.resolve_decoder_ops(attn)
            if ops != self._logged_ops:
                log.info("model: decoder ops %s (%s device, %s attention backend)", ops, self.device.type,
                         attn.backend)
                self._logged_ops = ops
            if ops == "fused":
                # imported here: it imports triton, which a CPU-only install may lack
                from server.model.fused_forward import fused_forward

                return fused_forward(self, input_ids, positions, attn, out_rows)
        x = self.model.embed_tokens(input_ids)  # (T, H)
        cos, sin = self.model.rotary(positions, x.dtype)  # (T, 1, D)
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(last(x, cos, sin, attn, out_rows))  # (T or R, H)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden (N, H) -> (N, vocab) fp32
        return self.lm_head(hidden).float()

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """hidden (N, H) -> the lm_head's (N, vocab) in the model dtype, written into `out` (a captured
        decode step's static output: no copy of N x vocab logits after the GEMM, 31 us at batch 256 on an
        H200)."""
        head = self.lm_head
        if head.bias is None:
            torch.mm(hidden, head.weight.t(), out=out)
        else:  # the presets' mask of unprintable ids (random_init)
            torch.addmm(head.bias, hidden, head.weight.t(), out=out)
