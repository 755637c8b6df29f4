"""JSON request bodies, for both APIs: parsed with limits that keep every later step safe
(depth, huge integers, lone surrogates), errors naming the field; and the OpenAPI operation
class that documents a body a handler parses itself."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from controlplane import memory
from controlplane.http.errors import APIError, invalid, printable

# Deeper than any real request (chat content parts are 4 levels); also keeps recursive code
# (the chat template, config flattening) far from Python's recursion limit.
MAX_JSON_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Object(dict):
    """A JSON object that named some keys more than once (json.loads keeps the last value)."""

    __slots__ = ("duplicates",)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    out = _Object(obj)
    out.duplicates = tuple(dict.fromkeys(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def load_json(raw: bytes, unique_keys: bool = False) -> Any:
    """Parse a request body, refusing what would fail later: nesting deeper than
    MAX_JSON_DEPTH, integers of more than 4300 digits (Python refuses to convert them) and
    strings or field names with lone surrogates (not encodable as UTF-8). Errors name the
    field, as `invalid` does. `unique_keys`: a key given twice in one object is a 422 naming
    it (the admin API's changes: which of two values was meant cannot be known)."""
    memory.note_body(len(raw))  # its parse leaves freed heap: arm the idle trim
    try:
        body = json.loads(raw, object_pairs_hook=_unique_pairs if unique_keys else None)
    except RecursionError:
        raise invalid("body", f"is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise invalid("body", f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise invalid("body", f"is not valid JSON ({exc})") from None
    except ValueError:  # Python refuses to convert integers this long (CVE-2020-10735)
        limit = sys.get_int_max_str_digits()
        raise invalid("body", f"holds an integer of more than {limit} digits") from None
    check_json(body)
    return body


def check_json(body: Any, where: str = "body", max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk the parsed body without recursion: depth, and UTF-8-safe strings and keys.
    `where`: a field holding JSON text parsed on its own (errors name it, not the body)."""
    # (value, its path for messages, the top-level field it is in, its depth)
    todo: list[tuple[Any, str, str, int]] = [(body, where, where, 0)]
    while todo:
        value, path, top, depth = todo.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= max_depth:
            # The top-level field, not the 32-level path: short and still says where.
            raise invalid(printable(top), f"is nested deeper than {max_depth} levels")
        if isinstance(value, list):
            todo.extend((v, f"{path}[{i}]", top, depth + 1) for i, v in enumerate(value))
            continue
        for key in getattr(value, "duplicates", ()):
            name = printable(key if depth == 0 and where == "body" else f"{path}.{key}")
            raise APIError(422, f"{name}: given twice in one JSON object", param=name)
        for key, v in value.items():
            name = key if depth == 0 and where == "body" else f"{path}.{key}"
            if _SURROGATE.search(key):
                raise invalid(printable(name), "field name is not valid UTF-8 (lone surrogate)")
            todo.append((v, name, key if depth == 0 and where == "body" else top, depth + 1))


def _check_text(text: str, path: str) -> None:
    m = _SURROGATE.search(text)
    if m:
        raise invalid(
            printable(path),
            f"is not valid UTF-8: lone surrogate {printable(m.group())} at character {m.start()}",
        )


def openapi_body(schema: dict[str, Any]) -> type:
    """A Litestar OpenAPI operation class documenting a JSON request body that the handler
    parses itself (so that every error names its field the OpenAI way)."""
    from litestar.openapi.spec import Operation

    @dataclass
    class WithBody(Operation):
        def to_schema(self) -> dict[str, Any]:
            out = super().to_schema()
            content = {"application/json": {"schema": schema}}
            out["requestBody"] = {"required": True, "content": content}
            return out

    return WithBody
