"""Seeded random weights for the presets: identical on any machine (drawn on CPU, then moved)."""

from __future__ import annotations

import torch

from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    """Norm weights 1, biases 0, every matrix ~ N(0, init_std) from one CPU generator seeded with cfg.seed.

    Parameters are drawn in `named_parameters()` order (tied weights once), in fp32, then cast and copied.
    """
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            weights = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, cfg.init_std, generator=gen)
            param.copy_(weights)


@torch.no_grad()
def restrict_to_printable(model: LlamaForCausalLM) -> None:
    """Zero the unembedding rows of byte ids that are not printable ASCII, newline or EOS (byte vocab).

    A random decoder picks among all 259 ids; this keeps the toy's greedy text readable (zero logit vs. the
    random logits of the ~97 kept ids), without touching anything the paging or kernels depend on.
    """
    from server.model.tokenizer import ByteTokenizer

    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[ByteTokenizer.EOS] = True
    keep[ByteTokenizer.OFFSET + ord("\n")] = True
    keep[ByteTokenizer.OFFSET + 32 : ByteTokenizer.OFFSET + 127] = True
    model.lm_head.weight[~keep.to(model.device)] = 0.0
