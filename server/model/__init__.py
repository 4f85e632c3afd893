"""The Llama-family decoder, its presets, weight loading and tokenizers."""

from server.model.config import PRESETS, ModelConfig
from server.model.detokenizer import IncrementalDetokenizer
from server.model.loader import load_model

__all__ = ["load_model", "ModelConfig", "PRESETS", "IncrementalDetokenizer"]
