"""What a request's output must match: a JSON schema, any JSON object, a regular expression or
one of a list of strings. Plain data that travels inside SamplingParams; the runner compiles it
against the tokenizer (workers/runner/grammar_matchers.py), the server checks it first (`check`).

The grammar library is xgrammar. Measured on the 2-core CPU (benchmarks/grammar_backends.py,
one JSON schema, benchmarks/RESULTS.md "Host side"): a token mask took 7 us at the tiny model's
1,000-token vocabulary and 59 us at a 100k-token one against llguidance's 44 us and 627 us; a
schema's compile (81 ms at 100k tokens, llguidance: none up front) is cached per schema by the
compiler. xgrammar brings transformers and triton along; llguidance would bring nothing.

xgrammar lets a string with minLength/maxLength (and no pattern) hold control characters,
which JSON forbids (a random-weights model emitted "\x1c"); such strings are compiled as the
pattern of characters other than control characters, '"' and backslash instead (`_json_safe`).

JSON is generated without free whitespace (", " and ": " between items): a model may otherwise
emit whitespace until max_tokens, as a random-weights model does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

KINDS = ("json_schema", "json_object", "regex", "choice")
# xgrammar's messages start with a time stamp and the C++ source position of the check.
_LIBRARY_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutput:
    """kind json_schema: `spec` is the schema's JSON text; with `strict`, objects have only the
    properties the schema names (additionalProperties false unless it says otherwise).
    json_object: any JSON object (`spec` unused). regex: `spec` is the expression (the whole
    output matches it). choice: `spec` is a JSON list of the strings one of which is the output."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    spec: str = ""
    strict: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool, strict: bool = True) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema), strict)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))

    def grammar(self):
        """The xgrammar Grammar (no tokenizer needed); a ValueError says what is wrong."""
        import xgrammar

        try:
            if self.kind == "json_schema":
                return xgrammar.Grammar.from_json_schema(
                    self._schema_text(), any_whitespace=False, strict_mode=self.strict
                )
            if self.kind == "json_object":
                return xgrammar.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if self.kind == "regex":
                return xgrammar.Grammar.from_regex(self.spec)
            return xgrammar.Grammar.from_ebnf(_choice_ebnf(json.loads(self.spec)))
        except RuntimeError as error:
            raise ValueError(library_message(error)) from None

    def compile(self, compiler):
        """The CompiledGrammar for an xgrammar GrammarCompiler's tokenizer (the compiler caches
        it by spec); a ValueError says what is wrong."""
        try:
            if self.kind == "json_schema":
                return compiler.compile_json_schema(
                    self._schema_text(), any_whitespace=False, strict_mode=self.strict
                )
            if self.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if self.kind == "regex":
                return compiler.compile_regex(self.spec)
            return compiler.compile_grammar(_choice_ebnf(json.loads(self.spec)))
        except RuntimeError as error:
            raise ValueError(library_message(error)) from None

    def _schema_text(self) -> str:
        try:
            schema = json.loads(self.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not JSON: {error}") from None
        return json.dumps(_json_safe(schema))

    def check(self) -> None:
        """Raise ValueError (its message fit for a 400) when the grammar cannot be built."""
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("must be a non-empty list of non-empty strings")
        self.grammar()


def library_message(error: Exception) -> str:
    """xgrammar's message without its time stamp and source position."""
    return _LIBRARY_PREFIX.sub("", str(error).strip().splitlines()[0])


def _json_safe(schema):
    """The schema with every length-bounded string without pattern, format, enum or const as
    that pattern of plain characters (the bounds kept)."""
    if isinstance(schema, list):
        return [_json_safe(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _json_safe(value) for key, value in schema.items()}
    is_bounded = "minLength" in schema or "maxLength" in schema
    is_free = not any(key in schema for key in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and is_bounded and is_free:
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'
    return schema


def _choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
