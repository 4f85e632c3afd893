"""Seeded random weights for the presets (tiny: drawn on CPU, identical on any machine)."""

from __future__ import annotations

import torch

from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM

CPU_DRAW_MAX_PARAMS = 50_000_000


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    """Norm weights 1, biases 0, every matrix ~ N(0, init_std), drawn in `named_parameters()` order.

    Small models (`tiny`) draw from one CPU generator seeded with cfg.seed, in fp32, then cast and copy:
    identical weights on any machine and device. Large ones (`bench`) on an accelerator draw on the device
    itself (seeded, so reproducible per device type): 1.2B CPU normals would cost tens of seconds.
    """
    num_params = sum(p.numel() for p in model.parameters())
    on_device = model.device.type != "cpu" and num_params > CPU_DRAW_MAX_PARAMS
    gen = torch.Generator(device=model.device if on_device else "cpu").manual_seed(cfg.seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif on_device:
            param.normal_(0.0, cfg.init_std, generator=gen)
        else:
            weights = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, cfg.init_std, generator=gen)
            param.copy_(weights)


@torch.no_grad()
def restrict_to_printable(model: LlamaForCausalLM) -> None:
    """Give the ids that are not printable ASCII, newline, BOS or EOS (byte vocab) a logit of -inf.

    A random decoder picks among all ids (259, or 128256 for `bench`); this keeps the presets' sampled text
    readable at any temperature: a masked id has probability zero, so no lone UTF-8 byte (U+FFFD) is drawn.
    The mask is an lm_head bias, so eager and graph-captured steps apply it alike.
    """
    from server.model.tokenizer import ByteTokenizer

    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[[ByteTokenizer.BOS, ByteTokenizer.EOS]] = True
    keep[ByteTokenizer.OFFSET + ord("\n")] = True
    keep[ByteTokenizer.OFFSET + 32 : ByteTokenizer.OFFSET + 127] = True
    bias = torch.zeros(model.config.vocab_size).masked_fill_(~keep, float("-inf"))  # (V,)
    model.lm_head.bias = torch.nn.Parameter(bias.to(model.device, model.dtype), requires_grad=False)
