"""A checkpoint's JSON files (config.json, generation_config.json, tokenizer_config.json, ...): an object,
or one error line naming the file."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, required: bool = False) -> dict:
    """The JSON object in `path`; {} when the file is absent and not `required` (FileNotFoundError when it
    is); ValueError naming the file for text that is not JSON or not an object."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} not found")
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # a traceback at start-up before (a review)
        raise ValueError(f"{path} nests too deeply to read") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
