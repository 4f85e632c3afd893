"""Model configuration: one dataclass for every supported Llama-family decoder, plus the presets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# a config.json without `architectures`: transformers' Auto classes go by model_type
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1 / 3.2). `rope_type` "default" means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: always; Llama: attention_bias
    o_bias: bool = False  # Llama attention_bias also biases o_proj
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral (and Qwen2 with use_sliding_window)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    init_std: float = 0.02  # std of seeded random weights (presets only)
    seed: int = 0
    printable_output: bool = False  # presets: unembedding limited to printable ASCII + newline + EOS

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        eps = self.rms_norm_eps
        if not (isinstance(eps, int | float) and not isinstance(eps, bool) and 0 < eps < 1):
            raise ValueError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
        w = self.sliding_window
        if w is not None and not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {w!r}")
        if self.head_dim % 2:  # RoPE rotates the halves of a head (transformers refuses it as well)
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.rope_theta > 0:  # its inverse frequencies would not be finite: NaN logits
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling.rope_type == "llama3" and not self.rope_scaling.factor > 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.rope_scaling.factor!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, name: str) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x and 5.x spellings). ValueError for
        anything it cannot use, a missing or ill-typed field included."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        try:
            return cls._from_hf(cfg, name)
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"config.json has a field of the wrong type: {e}") from None

    @classmethod
    def _from_hf(cls, cfg: dict, name: str) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if not archs:
            arch = ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type"))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        by_type = ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type"))
        if by_type not in (None, arch):  # transformers builds by model_type (vLLM by architectures): the two
            # read a window, biases and defaults differently, so such a config has no one meaning
            raise ValueError(f"config.json's architectures ({arch}) and model_type ({cfg['model_type']!r}, "
                             f"{by_type}) name different models; make them agree")
        if cfg.get("quantization_config"):  # its tensors would not load as this decoder's weights
            method = cfg["quantization_config"].get("quant_method", "?") \
                if isinstance(cfg["quantization_config"], dict) else "?"
            raise ValueError(f"config.json describes a quantized checkpoint ({method}); pagewalk serves "
                             "bf16 / fp16 / fp32 weights only")
        for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            if cfg.get(flag) is not None and not isinstance(cfg[flag], bool):  # bool("false") is True
                raise ValueError(f"config.json's {flag} must be true or false, got {cfg[flag]!r}")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # (transformers' swish is SiLU)
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu (SwiGLU) is supported")
        num_heads = cfg["num_attention_heads"]
        if not (isinstance(num_heads, int) and num_heads >= 1):  # before head_dim divides by it
            raise ValueError(f"num_attention_heads must be an integer >= 1, got {num_heads!r}")
        rope = _rope_params(cfg)
        max_positions = cfg.get("max_position_embeddings", DEFAULT_POSITIONS[arch])
        # transformers reads attention_bias and mlp_bias for Llama only: Mistral's projections never have a
        # bias, Qwen2's q/k/v always do (a config's flags there are ignored, and so the tensors they would
        # name: a review found such a Mistral checkpoint refused, or served with its biases applied)
        is_llama, is_qwen2 = arch == "LlamaForCausalLM", arch == "Qwen2ForCausalLM"
        attention_bias = is_llama and bool(cfg.get("attention_bias", False))
        sliding = _sliding_window(cfg, arch)
        eos = cfg.get("eos_token_id")
        return cls(
            name=name,
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or DEFAULT_KV_HEADS.get(arch, num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=max_positions,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=_rope_scaling(rope, cfg.get("original_max_position_embeddings"), max_positions),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
        )


# transformers' config defaults where config.json omits max_position_embeddings (LlamaConfig, MistralConfig
# 4096 * 32, Qwen2Config)
DEFAULT_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 131072, "Qwen2ForCausalLM": 32768}
# transformers' defaults for a config without num_key_value_heads (or null): Llama's is num_attention_heads
DEFAULT_KV_HEADS = {"MistralForCausalLM": 8, "Qwen2ForCausalLM": 32}
QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default: the layers from here on slide
DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig and Qwen2Config default (an explicit null: none)


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The window every layer uses, or None, as transformers applies it: Llama attends fully whatever
    `sliding_window` says (its attention never reads it); Mistral windows every layer; Qwen2 the layers
    from `max_window_layers` on when `use_sliding_window`; `layer_types`, where given, says which. This
    decoder has one window for all its layers, so a checkpoint that mixes windowed and full layers is
    refused rather than served wrong."""
    if arch == "LlamaForCausalLM":
        return None
    window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"config.json's layer_types names {len(types)} layers, num_hidden_layers is "
                             f"{num_layers}")
        sliding = [t == "sliding_attention" for t in types]
        if arch == "Qwen2ForCausalLM" and any(sliding) and not cfg.get("use_sliding_window", False):
            # Qwen2Config nulls the window without use_sliding_window, and transformers then fails on the
            # sliding layers: no meaning to serve (it was served with the window, a review)
            raise ValueError("config.json's layer_types give sliding layers but use_sliding_window is false")
    elif arch == "Qwen2ForCausalLM":
        windowed = cfg.get("use_sliding_window", False)
        first = cfg.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS) if windowed else num_layers
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [window is not None] * num_layers
    if window is None or not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(f"config.json gives a sliding window to {sum(sliding)} of {len(sliding)} layers "
                         "(layer_types / max_window_layers); pagewalk serves one window for every layer or "
                         "none")
    return window


def _rope_params(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`. Read as transformers
    reads them: a `rope_scaling` replaces `rope_parameters` whole (where a config holds both, merging them
    let the latter's "rope_type": "default" hide the former's "type": "llama3", a review), and the dict's
    rope_theta comes before the top level's."""
    given = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(given, dict):  # dict("llama3") failed with a line naming nothing (a review)
        raise ValueError(f"config.json's rope_scaling must be an object, got {given!r}")
    params = dict(given)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ValueError(f"config.json's rope_theta must be a number, got {theta!r}")
    return params


def _rope_scaling(rope: dict, top_level_original: int | None, max_positions: int) -> RopeScaling:
    """The pretraining length llama3 scales from, as transformers takes it: the config's top-level
    original_max_position_embeddings, else the rope dict's, else max_position_embeddings."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: 'default', 'llama3'")
    return RopeScaling(
        rope_type="llama3",
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(top_level_original if top_level_original is not None else
                                             rope.get("original_max_position_embeddings", max_positions)),
    )


BYTE_VOCAB_SIZE = 259  # 3 specials (PAD 0, BOS 1, EOS 2) + 256 bytes; see tokenizer.ByteTokenizer

PRESETS: dict[str, ModelConfig] = {
    # A toy decoder for tests and `make serve` on a laptop: byte-level vocab, seeded random weights.
    "tiny": ModelConfig(
        name="tiny",
        architecture="LlamaForCausalLM",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        init_std=0.1,  # large enough that attention matters: greedy text does not fall into a loop at once
        printable_output=True,
    ),
    # Llama-3.2-1B shapes (random weights) for benchmarks; the byte tokenizer uses ids < 259.
    "bench": ModelConfig(
        name="bench",
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        init_std=0.02,
        printable_output=True,  # ids >= 259 would decode to nothing
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
