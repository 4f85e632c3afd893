"""Test helpers: small random Hugging Face checkpoints (transformers + a `tokenizers` tokenizer.json).

Needs the test extras (transformers); nothing in the server imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention walks a block table; flash attention keeps a running max and sum.",
    "héllo wörld — naïve café, 東京 and emoji 🙂 live here too.",
    "def f(x):\n    return x * 2  # numbers 0123456789",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def sentencepiece_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A SentencePiece-style BPE (Llama-2, Mistral): Metaspace '▁' for spaces, prepended to the first word
    only, and byte fallback (<0xHH> tokens) for characters outside the vocabulary; <s> prepended."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    spec = json.loads(tok.to_str())  # the 256 <0xHH> pieces join the vocabulary, plain tokens (Llama-2)
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def byte_bpe_tokenizer(vocab_size: int = 300, bos_post_processor: bool = False) -> Tokenizer:
    """A byte-level BPE trained on a tiny corpus; ids 0-2 are <pad>, <s>, </s>. `bos_post_processor`: its
    post-processor prepends <s> (as Llama's tokenizer.json does); without it none is added (as GPT-2's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return tok


def hf_config(arch: str, vocab_size: int = 320, **overrides):
    """A small transformers config of `arch` ("llama" | "qwen2" | "mistral")."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]  # fmt: skip
    return cls(**common)


def write_hf_checkpoint(path: Path, config, seed: int = 0, max_shard_size: str | None = None):
    """Random-init the transformers model for `config`, save it and a tokenizer; return the HF model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    byte_bpe_tokenizer(bos_post_processor=True).save(str(path / "tokenizer.json"))  # Llama-style BOS
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return model
