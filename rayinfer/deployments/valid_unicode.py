"""Request text must be valid Unicode: JSON may write a lone UTF-16 surrogate (`"\\ud800"`),
which Python's JSON parser turns into a str that no UTF-8 encoder takes (the tokenizer, the
grammar compiler, or the error body that quotes it would fail with a 500). `check_text` finds
the first such string anywhere in a request body (keys too) and refuses it, naming its field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticCustomError

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
INVALID_TEXT = "invalid_unicode"  # the pydantic error type; its ctx names the field


def check_text(body: Any) -> Any:
    """`body` unchanged, or PydanticCustomError(INVALID_TEXT) naming the first field whose text
    holds a lone surrogate (ctx: field, the field as an error names it)."""
    field = first_invalid_text(body)
    if field is not None:
        raise PydanticCustomError(
            INVALID_TEXT,
            "{field}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair); "
            "send valid Unicode text",
            {"field": field or "body"},
        )
    return body


def first_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `value` that holds a lone
    surrogate, a dict key counting as its value's path; None when every string is valid."""
    if isinstance(value, str):
        return path if LONE_SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and LONE_SURROGATE.search(key):
                return path or "body"
            found = first_invalid_text(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = first_invalid_text(item, f"{path}[{index}]")
                if found is not None:
                    return found
    return None
