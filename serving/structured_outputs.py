"""What an OpenAI-API request constrains its output to (host side, no jax): OpenAI's `response_format`
and vLLM's `structured_outputs` extra, both made one `StructuredOutputs` for SamplingParams.

    response_format  {"type": "text"}                         nothing
                     {"type": "json_object"}                  any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": b}}
    structured_outputs  {"json": schema} | {"regex": r} | {"choice": [...]} | {"grammar": lark}
                        | {"json_object": true}               (vLLM's names; one of them)

`strict` is accepted either way: the output always follows the schema (the grammar is the schema's).
Errors name the field as the client sent it (`response_format.json_schema.schema`, ...).
"""

from __future__ import annotations

from typing import Any

from jaxcpp.errors import InvalidRequestError
from jaxcpp.structured.constraint import StructuredOutputs

EXTRA_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def request_constraint(response_format: dict[str, Any] | None,
                       structured_outputs: dict[str, Any] | None) -> StructuredOutputs | None:
    """The request's constraint, or None; InvalidRequestError naming the field for a bad one."""
    from_format = _response_format(response_format) if response_format is not None else None
    from_extra = _extra(structured_outputs) if structured_outputs is not None else None
    if from_format is not None and from_extra is not None:
        raise InvalidRequestError("structured_outputs", "set response_format or structured_outputs, not both")
    return from_format or from_extra


def _response_format(fmt: dict[str, Any]) -> StructuredOutputs | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, field_name="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format.json_schema", "must be an object with a schema")
        return StructuredOutputs.from_schema(spec["schema"], "response_format.json_schema.schema")
    raise InvalidRequestError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _extra(extra: dict[str, Any]) -> StructuredOutputs:
    given = {k: v for k, v in extra.items() if k in EXTRA_KINDS and v not in (None, False)}
    unknown = sorted(set(extra) - set(EXTRA_KINDS) - {"disable_any_whitespace", "whitespace_pattern",
                                                      "disable_fallback", "disable_additional_properties"})
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]}", "is not supported")
    if len(given) != 1:
        raise InvalidRequestError("structured_outputs", f"set exactly one of {', '.join(EXTRA_KINDS)}; got "
                                  f"{sorted(given) or 'none'}")
    (kind, value), = given.items()
    if kind == "json":
        return StructuredOutputs.from_schema(value, "structured_outputs")
    if kind == "choice":
        if not isinstance(value, list):
            raise InvalidRequestError("structured_outputs.choice", "must be a list of strings")
        return StructuredOutputs(choice=tuple(value))
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if not isinstance(value, str):
        raise InvalidRequestError(f"structured_outputs.{kind}", "must be a string")
    return StructuredOutputs(regex=value) if kind == "regex" else StructuredOutputs(grammar=value)
