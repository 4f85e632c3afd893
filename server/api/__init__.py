"""HTTP layer: the OpenAI-compatible FastAPI app over an AsyncEngine (no tensors here)."""

from server.api.app import create_app

__all__ = ["create_app"]
