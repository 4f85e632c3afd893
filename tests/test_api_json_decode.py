"""server/api/parsing._load_json decodes with msgspec first and json.loads for what msgspec refuses: every
body must come out exactly as the json.loads-only decoder gave it, or be refused with the same 400."""

import json
import math
import random

import pytest

from server.api.errors import APIError
from server.api.parsing import _load_json


def _reference(raw: bytes):
    """What json.loads refusing non-finite numbers gives: the value, or the kind of its 400."""
    try:
        data = json.loads(raw, parse_constant=_refuse, parse_float=_finite)
    except (ValueError, UnicodeDecodeError):
        return ("refused", "json")
    except RecursionError:
        return ("refused", "deep")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return ("refused", "surrogate")
    except RecursionError:
        return ("refused", "deep")
    return ("ok", data)


def _refuse(text: str):
    raise ValueError(text)


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(text)
    return value


def _decoded(raw: bytes):
    try:
        return ("ok", _load_json(raw))
    except APIError as e:
        text = str(e.body["error"]["message"]) if hasattr(e, "body") else str(e)
        return ("refused", "surrogate" if "surrogate" in text else "deep" if "deep" in text else "json")


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 != 1.0 != True here; floats by repr); iterative, so
    nesting past Python's recursion limit compares too."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif isinstance(x, float):
            if repr(x) != repr(y):
                return False
        elif x != y:
            return False
    return True


TRICKY = [b"{}", b"[]", b'"\\ud800"', b'{"a": "\\ud83d\\ude00"}', b'["\\udc00x"]', b"NaN", b"[1e400]",
          b"-Infinity", b'{"a": 1, "a": 2}', b'"\xff"', b"[" * 999 + b"]" * 999, b"[" * 1000 + b"]" * 1000,
          b"[" * 5000 + b"]" * 5000, b'{"a":' * 600 + b"1" + b"}" * 600, b"12345678901234567890123",
          b"-0", b"1.5e-320", b"1E5", b"[01]", b"", b"  ", b'{"a": 1} x', b"\xef\xbb\xbf{}", b'"\\u0000"',
          b'{"prompt": [1, 2, 3], "max_tokens": 4}', b"tru", b'{"a": .5}', b'"\\x41"', b"[1,]"]


@pytest.mark.parametrize("raw", TRICKY, ids=range(len(TRICKY)))
def test_tricky_bodies_decode_as_json_loads_did(raw):
    ref, got = _reference(raw), _decoded(raw)
    assert ref[0] == got[0] and (ref[1] == got[1] if ref[0] == "refused" else _same(ref[1], got[1]))


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.randrange(-(1 << 70), 1 << 70) if rng.random() < 0.2 else rng.randrange(-1000, 130000)
    if kind == 1:
        return rng.uniform(-1e6, 1e6) * 10.0 ** rng.randrange(-320, 300)
    if kind == 2:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD7FF),
                                       rng.randrange(0xE000, 0x10FFFF), rng.randrange(0, 32)]))
                       for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return [rng.randrange(0, 128256) for _ in range(rng.randrange(600))]
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{rng.randrange(20)}": _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def test_random_bodies_decode_as_json_loads_did():
    rng = random.Random(20261201)
    for _ in range(1500):
        value = {"model": "m", "prompt": _random_value(rng, 0), "x": _random_value(rng, 0)}
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        if rng.random() < 0.3:                                   # whitespace the encoder would not write
            raw = raw.replace(b", ", b" ,\n\t").replace(b": ", b" :  ")
        ref, got = _reference(raw), _decoded(raw)
        assert ref[0] == got[0] == "ok" and _same(ref[1], got[1]), raw[:200]


@pytest.mark.parametrize("raw", [b'{"schema": {"enum": [NaN]}}', b'{"a": [1, {"b": -Infinity}]}',
                                 b'{"a": 1e400}', b'{"a": -1E+999}'])
def test_non_finite_numbers_are_refused_at_any_depth(raw):
    """NaN, Infinity and numbers past the float range are no JSON numbers: refused inside free-form objects
    (a JSON schema, a tool's parameters) too, which no float field's own check sees."""
    with pytest.raises(APIError) as e:
        _load_json(raw)
    assert (e.value.status, e.value.code) == (400, "invalid_json")
    assert "not a JSON number" in e.value.message or "out of the float range" in e.value.message


def test_a_structural_tag_as_json_text_refuses_non_finite_numbers():
    from server.api.protocol import _json_text

    with pytest.raises(ValueError, match="not a JSON number"):
        _json_text('{"format": {"type": "const_string", "value": NaN}}')
    assert _json_text('{"a": 1.5e300}') == {"a": 1.5e300}
