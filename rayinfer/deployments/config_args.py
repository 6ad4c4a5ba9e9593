"""How the Serve app's arguments are read: dotted CLI keys nested into sections, the values only
the CLI writes as strings (true/false/auto, a JSON object of resources), and a validation error
turned into one message that names each bad key and what is allowed."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from rayinfer.config import ConfigError


class Strict(BaseModel):
    """A section of the app config: unknown keys fail, and a validated config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# Resources Ray itself accounts for, which a phase's other fields already ask for.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
ResourceAmount = Annotated[float, Field(gt=0)]


def parse_resources(value: Any) -> Any:
    """A JSON object given as one string (`decode.resources='{"decode_box": 1}'`) as a mapping;
    anything else as given (dotted keys arrive as a mapping already)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                'use a JSON object such as {"decode_box": 1}, or one dotted key per resource '
                "(decode.resources.decode_box=1)"
            ) from None
    return value


def check_resource_names(resources: dict[str, float]) -> dict[str, float]:
    for name in resources:
        if not name or name in RAY_BUILTIN_RESOURCES:
            raise ValueError(
                f"{name!r} is not a custom resource; a worker's CPUs and GPUs are "
                "cpus_per_worker and gpus_per_worker"
            )
    return resources


# A phase's or the ingress's custom Ray resources: a mapping, or one JSON string of it
Resources = Annotated[
    dict[str, ResourceAmount],
    BeforeValidator(parse_resources),
    AfterValidator(check_resource_names),
]


def parse_bool_or_auto(value: Any) -> bool | str:
    """CLI strings and YAML values alike: true/false (1/0, on/off, yes/no) or auto."""
    if isinstance(value, bool) or value is None:
        return "auto" if value is None else value
    words = {"true": True, "1": True, "on": True, "yes": True, "false": False, "0": False,
             "off": False, "no": False, "auto": "auto"}  # fmt: skip
    parsed = words.get(str(value).strip().lower())
    if parsed is None:
        raise ValueError("use true, false or auto")
    return parsed


def nest_dotted_keys(args: dict[str, Any]) -> dict[str, Any]:
    """{"decode.autoscaling.max_replicas": "2"} -> {"decode": {"autoscaling": {...: "2"}}}."""
    nested: dict[str, Any] = {}
    for key, value in args.items():
        *parents, leaf = str(key).split(".")
        node = nested
        for depth, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{'.'.join(parents[: depth + 1])} is set to {child!r} and also used as a "
                    f"section by {key}; set one or the other"
                )
            node = child
        if isinstance(value, dict):
            value = nest_dotted_keys(value)
            existing = node.get(leaf)
            if isinstance(existing, dict):
                value = {**existing, **value}
        node[leaf] = value
    return nested


def describe_validation_error(error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            allowed = ", ".join(_allowed_keys(model, item["loc"][:-1]))
            lines.append(f"{key}: unknown key; allowed here: {allowed}")
        else:
            lines.append(_describe_value_error(item))
    return "invalid rayinfer app config: " + "; ".join(lines)


def _describe_value_error(item: dict) -> str:
    """`key=value: why`; a typed config's own check (its message starts with the key inside the
    section, "overlap.first_share=...") is named by its full key instead of the section's."""
    loc = [str(part) for part in item["loc"]]
    message = item["msg"].removeprefix("Value error, ")
    for start in range(len(loc)):
        if message.startswith(".".join(loc[start:]) + "."):
            return ".".join([*loc[:start], message])
    where = f"{'.'.join(loc)}={item.get('input')!r}: " if loc else ""
    return f"{where}{message}"


def _allowed_keys(model: type, loc: tuple) -> list[str]:
    """The keys of the section at `loc`: a pydantic model's fields, or a config dataclass's
    (the typed configs PhaseConfig holds as they are)."""
    for part in loc:
        annotation = _field_types(model).get(str(part))
        if not isinstance(annotation, type) or not _field_types(annotation):
            return []
        model = annotation
    return list(_field_types(model))


def _field_types(model: type) -> dict[str, Any]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {name: field.annotation for name, field in model.model_fields.items()}
    if dataclasses.is_dataclass(model):
        hints = typing.get_type_hints(model)
        return {f.name: hints[f.name] for f in dataclasses.fields(model)}
    return {}
