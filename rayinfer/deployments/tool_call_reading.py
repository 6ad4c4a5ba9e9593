"""Reading tool calls out of a prefix of a reply, as far as they have come.

Every reader returns the calls of a text so far as PartialCalls, and is monotonic in the text:
read over a longer text, the calls it found keep their names and their arguments only grow (the
shorter text's are a prefix). A stream sends what each new read adds, and the whole reply reads
the finished text with the same reader, so the two agree by construction. What may still turn
out to be a closing marker, or whitespace at the end, is held back until the text shows it is not.

Two helpers build the arguments' JSON text: `json_calls` reads `{"name", "arguments"}` objects
from JSON as the model wrote it (the arguments are the model's own JSON text), `params_json`
writes the key/value parameters of the markup formats (GLM, DSML) as JSON as they close.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from rayinfer.engine.stop_checker import streamable_length

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI's and Llama 3's name for the arguments
_SCALAR = re.compile(r"[-+0-9.eEa-z]+")  # numbers, true, false, null
# What scanning a string, or brackets, must look at (the rest is skipped at the regex's speed)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: linear time
_STRING_STOP = re.compile(r'["\\]')
_BRACKET_STOP = re.compile(r'[\[\]{}"]')
# value start -> (where its scan stopped, bracket depth, inside a string): for a text that only
# grows (a stream's), the scan of a bracketed value goes on from there
ScanMemo = dict[int, tuple[int, int, bool]]


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has come
    arguments: str = ""  # the arguments' JSON text so far (grows, never changes)
    is_complete: bool = False  # the call's closing marker has come


def until(text: str, end: str, start: int = 0) -> tuple[str, bool]:
    """(text[start:] up to the first `end`, whether `end` came); a suffix that may still become
    `end` is held back."""
    found = text.find(end, start)
    if found >= 0:
        return text[start:found], True
    rest = text[start:]
    return rest[: streamable_length(rest, (end,))], False


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def stripped_so_far(text: str, is_complete: bool) -> str:
    """text without its leading whitespace and, until it is complete, without its trailing
    whitespace either (more text may follow it, or not)."""
    return text.strip() if is_complete else text.lstrip().rstrip(WHITESPACE)


# --- JSON ------------------------------------------------------------------------------------
def json_value_end(text: str, start: int, memo: ScanMemo | None = None) -> int | None:
    """End (exclusive) of the JSON value that starts at text[start], None while it has not
    ended; a ValueError where no JSON value starts. Only brackets (any closer closes) and
    strings are matched: arguments are the model's text, which the client validates. memo: where
    earlier reads of a shorter text stopped, so that a stream scans each character once."""
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _bracket_end(text, start, {} if memo is None else memo)
    scalar = _SCALAR.match(text, start)
    if scalar is None:
        raise ValueError(f"no JSON value at {text[start : start + 10]!r}")
    return scalar.end() if scalar.end() < len(text) else None  # more digits may follow


def _string_end(text: str, start: int) -> int | None:
    whole = _STRING.match(text, start)
    return whole.end() if whole is not None else None


def _bracket_end(text: str, start: int, memo: ScanMemo) -> int | None:
    position, depth, in_string = memo.pop(start, (start, 0, False))
    while True:
        found = (_STRING_STOP if in_string else _BRACKET_STOP).search(text, position)
        if found is None or (found.group() == "\\" and found.end() == len(text)):
            # out of text (an escape's character still to come: resume at its backslash)
            memo[start] = (len(text) if found is None else found.start(), depth, in_string)
            return None
        char, position = found.group(), found.end()
        if char == "\\":
            position += 1  # past the escaped character
        elif char == '"':
            in_string = not in_string
        else:
            depth += 1 if char in "{[" else -1
            if depth == 0:
                return position


def json_calls(text: str, memo: ScanMemo | None = None) -> list[PartialCall]:
    """The `{"name", "arguments" | "parameters"}` objects of text, alone, in a list or separated
    by `,` or `;`, until the first thing that is not one. memo: as for json_value_end (one per
    text that grows)."""
    calls = []
    position = skip_whitespace(text, 0)
    if text.startswith("[", position):
        position += 1
    while position is not None:
        position = skip_whitespace(text, position)
        while text.startswith((",", ";"), position):
            position = skip_whitespace(text, position + 1)
        if not text.startswith("{", position):
            return calls
        call, position = _json_call(text, position, memo)
        if call.name is not None or position is None:  # a whole nameless object is no call
            calls.append(call)
    return calls


def _json_call(text: str, start: int, memo: ScanMemo | None) -> tuple[PartialCall, int | None]:
    """The call of the object at text[start] and where it ends; None where reading stops there:
    the text ran out, or stopped being JSON (the call keeps what came before)."""
    call, key_of_arguments = PartialCall(None), None
    position = start + 1
    try:
        while True:
            position = skip_whitespace(text, position)
            if position == len(text):
                return call, None
            if text[position] == "}":
                call.is_complete = True
                call.arguments = call.arguments or "{}"
                return call, position + 1
            key, value_start = _member_key(text, position)
            if key is None:
                return call, None
            value_end = None
            if value_start < len(text):
                value_end = json_value_end(text, value_start, memo)
            if key == "name" and call.name is None and value_end is not None:
                name = json.loads(text[value_start:value_end])
                call.name = name if isinstance(name, str) else None
            elif key in ARGUMENT_KEYS and key_of_arguments is None:
                key_of_arguments = key  # the first of the keys to come is the arguments
                call.arguments = _arguments_so_far(text, value_start, value_end)
            if value_end is None:
                return call, None
            position = skip_whitespace(text, value_end)
            if text.startswith(",", position):
                position += 1
            elif not text.startswith("}", position) and position < len(text):
                return call, None
    except ValueError:  # json.JSONDecodeError included
        return call, None


def _member_key(text: str, position: int) -> tuple[str | None, int]:
    """(the member's key, where its value starts); None while the key or its ':' has not come."""
    if text[position] != '"':
        raise ValueError(f"expected a key at {position}")
    key_end = _string_end(text, position)
    if key_end is None:
        return None, len(text)
    colon = skip_whitespace(text, key_end)
    if colon == len(text):
        return None, len(text)
    if text[colon] != ":":
        raise ValueError(f"expected ':' at {colon}")
    return json.loads(text[position:key_end]), skip_whitespace(text, colon + 1)


def _arguments_so_far(text: str, start: int, end: int | None) -> str:
    """An object or list streams as the model writes it; a string (JSON text inside a string)
    or another value counts once it is whole."""
    if start == len(text):
        return ""
    if text[start] in "{[":
        return text[start:end]
    if end is None:
        return ""
    value = json.loads(text[start:end])
    return value if isinstance(value, str) else text[start:end]


# --- Key/value parameters --------------------------------------------------------------------
@dataclass
class Param:
    key: str
    value: str  # the raw text so far
    is_string: bool  # the raw text is the string itself (else it is JSON text, or a bare word)
    is_complete: bool = False

    def json_value(self) -> str:
        if self.is_string:
            return json.dumps(self.value, ensure_ascii=False)
        try:
            return json.dumps(json.loads(self.value), ensure_ascii=False)
        except json.JSONDecodeError:  # a bare word where JSON was due: the word, as a string
            return json.dumps(self.value.strip(), ensure_ascii=False)


def params_json(params: list[Param], is_closed: bool) -> str:
    """The arguments' JSON text of these parameters so far, spaced as json.dumps spaces it: whole
    parameters, then an open string parameter's characters so far (a value of another type
    counts once it is whole), and the closing brace once the call closed."""
    members = []
    for param in params:
        key = json.dumps(param.key, ensure_ascii=False)
        if param.is_complete:
            members.append(f"{key}: {param.json_value()}")
            continue
        if param.is_string:
            members.append(f"{key}: {json.dumps(param.value, ensure_ascii=False)[:-1]}")
        break
    text = "{" + ", ".join(members) if members else ""
    return (text or "{") + "}" if is_closed else text
