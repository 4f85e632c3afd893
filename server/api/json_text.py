"""JSON text as RFC 8259 has it, read from clients and from the model alike.

Python's json module goes past the RFC both ways: it reads NaN, Infinity and -Infinity, reads numbers past
the float range (1e400) as inf and writes them back as `Infinity`, and decodes the escape of a lone UTF-16
surrogate ("\\ud800") into a str that UTF-8 cannot encode. Whatever this server reads as JSON refuses the
first two (as msgspec does); whatever it writes back stays encodable."""

from __future__ import annotations

import json
import math


class NonFiniteNumber(ValueError):
    """NaN, Infinity, -Infinity or a number past the float range in a JSON text."""


def _non_finite(text: str) -> float:
    raise NonFiniteNumber(f"{text} is not a JSON number.")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"{text} is out of the float range.")
    return value


# raw_decode for texts that hold several values (a reply of calls separated by ";")
FINITE_DECODER = json.JSONDecoder(parse_constant=_non_finite, parse_float=_finite_float)


def loads_finite(text: str | bytes) -> object:
    """json.loads refusing what is no JSON number: NaN, Infinity, -Infinity and numbers past the float range
    raise NonFiniteNumber (a ValueError, as a syntax error's JSONDecodeError is)."""
    return json.loads(text, parse_constant=_non_finite, parse_float=_finite_float)


def is_unicode(text: str) -> bool:
    """Whether a str is valid Unicode: json.loads makes an unpaired surrogate of the escape "\\ud800"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dumps_unicode(value: object) -> str:
    """A decoded value -> JSON text that UTF-8 carries: characters as they are, unless some str holds an
    unpaired surrogate; then every non-ASCII character as its escape (the surrogate's as it was written)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if is_unicode(text) else json.dumps(value)
