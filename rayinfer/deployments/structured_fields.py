"""The request fields that constrain a reply: OpenAI's `response_format`, `tools` and
`tool_choice`, and vLLM's `structured_outputs` (and its older `guided_json` / `guided_regex` /
`guided_choice`). Each is checked where it is given (a schema that does not compile answers 400
naming `response_format.json_schema.schema`) and becomes one StructuredOutput for the engine.

Tool choice `required` constrains the output to a JSON list of `{"name", "parameters"}` objects,
one of the tools each; a named function constrains it to that function's arguments (its
`parameters` schema), as vLLM does; both strictly (no properties the schemas do not name, unless
they allow them). `auto` leaves the output free (deployments/tool_calls.py
parses it); `none` shows the model no tools.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from rayinfer.engine.structured_output import StructuredOutput

ANY_OBJECT = {"type": "object"}
# The request's nested objects take JSON's types as the body does (request_body.STRICT):
# `"strict": "true"` is refused, not read as true.
STRICT = ConfigDict(strict=True)


def _schema_shape(value, text_allowed: bool):
    """One message for a schema of the wrong type (the union's errors would name its members).
    text_allowed: vLLM's fields also take the schema as JSON text."""
    if value is None or isinstance(value, dict) or (text_allowed and isinstance(value, str)):
        return value
    if not text_allowed and isinstance(value, bool):
        return value
    kinds = "an object or its JSON text" if text_allowed else "an object or a boolean"
    raise ValueError(f"must be a JSON schema: {kinds}")


def _checked(structured: StructuredOutput) -> StructuredOutput:
    structured.check()  # ValueError: pydantic names the field
    return structured


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, strict=True)

    name: str = Field("response", description="the schema's name (informational)")
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(ANY_OBJECT, alias="schema")
    strict: bool | None = Field(None, description="objects hold only the named properties")

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_type(cls, value):
        return _schema_shape(value, text_allowed=False)

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, value, info: ValidationInfo):
        _checked(StructuredOutput.json_schema(value))
        return value

    def structured_output(self) -> StructuredOutput:
        return StructuredOutput.json_schema(self.schema_, strict=bool(self.strict))


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is read only with type 'json_schema'")
        return value

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("type 'json_schema' needs a json_schema object")
            return self.json_schema.structured_output()
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_type(cls, value):
        return _schema_shape(value, text_allowed=True)

    def structured_output(self) -> StructuredOutput | None:
        given = [key for key in ("json_", "regex", "choice") if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError("give one of json, regex, choice")
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return _checked(StructuredOutput.json_schema(schema))
        if self.regex is not None:
            return _checked(StructuredOutput("regex", self.regex))
        if self.choice is not None:
            return _checked(StructuredOutput.choice(self.choice))
        return None


class GuidedFields(BaseModel):
    """vLLM's extensions, on completions and chat alike."""

    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): the output matches a JSON schema, regex or choice"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM's)")
    guided_regex: str | None = Field(None, description="extension (vLLM's)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM's)")

    @field_validator("guided_json", mode="before")
    @classmethod
    def _schema_type(cls, value):
        return _schema_shape(value, text_allowed=True)

    @field_validator("structured_outputs")
    @classmethod
    def _one_kind(cls, value):
        if value is not None:
            value.structured_output()
        return value

    @field_validator("guided_json", "guided_regex", "guided_choice")
    @classmethod
    def _guided_compiles(cls, value, info: ValidationInfo):
        if value is not None:
            key = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
            try:
                given = StructuredOutputs.model_validate({key[info.field_name]: value})
            except ValidationError as error:
                raise ValueError(error.errors()[0]["msg"]) from None
            given.structured_output()
        return value

    def structured_output(self) -> StructuredOutput | None:
        """What the reply must match (the first one given), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_output()
        legacy = {"json": self.guided_json, "regex": self.guided_regex}
        legacy["choice"] = self.guided_choice
        given = {key: value for key, value in legacy.items() if value is not None}
        return StructuredOutputs.model_validate(given).structured_output() if given else None


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(ANY_OBJECT))
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_compile(cls, value):
        _checked(StructuredOutput.json_schema(value, strict=False))
        return value


class ChatTool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: ToolChoiceFunction


class ResponseFormatFields(GuidedFields):
    """OpenAI's response_format: chat's field, which completions take too (as vLLM does)."""

    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (strict or not)"
    )

    @field_validator("response_format")
    @classmethod
    def _format_complete(cls, value):
        if value is not None:
            value.structured_output()
        return value

    def structured_output(self) -> StructuredOutput | None:
        if self.response_format is not None:
            return self.response_format.structured_output()
        return super().structured_output()


class ChatOutputFields(ResponseFormatFields):
    """Chat's response_format, tools and tool_choice."""

    tools: list[ChatTool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call ('required')")

    @field_validator("tools")
    @classmethod
    def _names_differ(cls, value):
        first_of = {}  # name -> index of the first tool with it
        for index, tool in enumerate(value or ()):
            name = tool.function.name
            if name in first_of:
                raise ValueError(
                    f"tools[{index}].function.name {name!r} is also tools[{first_of[name]}]'s; "
                    "each tool needs its own name"
                )
            first_of[name] = index
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, value):
        """One message for any malformed choice (pydantic would name a member of the union)."""
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            isinstance(function, dict)
            and value.get("type") == "function"
            and isinstance(function.get("name"), str)
        ):
            return value
        raise ValueError(
            "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
            '{"name": ...}}'
        )

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value, info: ValidationInfo):
        tools = info.data.get("tools") or []
        names = [tool.function.name for tool in tools]
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(
                f"names function {value.function.name!r}, which is not among tools "
                f"({', '.join(map(repr, names)) or 'none given'})"
            )
        if value == "required" and not tools:
            raise ValueError("'required' needs tools")
        return value

    @property
    def tool_call_mode(self) -> str:
        """'none', 'auto', 'required' or 'named': how the reply may call tools."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def called_function(self) -> str | None:
        """The function a named tool_choice calls."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them, or None when the model is shown none."""
        if self.tool_call_mode == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_output(self) -> StructuredOutput | None:
        mode = self.tool_call_mode
        if mode == "named":
            name = self.called_function
            function = next(t.function for t in self.tools if t.function.name == name)
            return StructuredOutput.json_schema(function.parameters)
        if mode == "required":
            schema = required_calls_schema(self.tools, self.parallel_tool_calls)
            return StructuredOutput.json_schema(schema)
        return super().structured_output()


def required_calls_schema(tools: list[ChatTool], parallel: bool = True) -> dict:
    """A JSON list of one or more calls (one without `parallel`), each `{"name": one tool,
    "parameters": its arguments}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}
