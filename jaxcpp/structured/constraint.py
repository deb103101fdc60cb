"""What a request constrains its output to (host side, no jax): a JSON schema, any JSON object, a regex,
a choice among strings, or a grammar; checked once, where the request is built.

Names follow vLLM's `StructuredOutputsParams` (`json`, `json_object`, `regex`, `choice`, `grammar`); the
OpenAI API's `response_format` maps onto `json` / `json_object` (`serving.openai_protocol`). Every kind
becomes one grammar of the library behind `jaxcpp.structured.grammar` (llguidance): `grammar_text` is
what it compiles, and the cache key of the compiled grammar. A constraint the library cannot parse
(a bad schema, regex or grammar, a feature it does not support) is refused here with an error naming
the field, before the request reaches the engine, so no page is ever allocated for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from jaxcpp.errors import InvalidRequestError

MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None                 # a JSON schema (as JSON text: frozen, hashable, the cache key)
    json_object: bool = False               # any JSON object
    regex: str | None = None                # the whole output matches it
    choice: tuple[str, ...] | None = None   # the whole output is one of these
    grammar: str | None = None              # a Lark grammar (llguidance's dialect; `start` is the root)
    field_name: str = field(default="structured_outputs", compare=False)  # named in errors

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(self.field_name, "set exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {kinds or 'none'}")
        if self.choice is not None and not (0 < len(self.choice) <= MAX_CHOICES
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(self._where("choice"), f"must be 1 to {MAX_CHOICES} non-empty strings")
        error = _validate(self.grammar_text)
        if error:
            raise InvalidRequestError(self._where(kinds[0]), f"cannot be compiled: {error.strip()}")

    @staticmethod
    def from_schema(schema: Any, field_name: str = "structured_outputs") -> StructuredOutputs:
        """A JSON schema given as an object (a dict, or True for any JSON) or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(_field(field_name, "json"), f"is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(_field(field_name, "json"), f"must be a JSON schema object, got {schema!r}")
        return StructuredOutputs(json=json.dumps(schema), field_name=field_name)

    def _where(self, kind: str) -> str:
        return _field(self.field_name, kind)  # key order kept: it is the output's

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @cached_property
    def grammar_text(self) -> str:
        """The library's grammar for this constraint (JSON without free whitespace: compact output)."""
        from llguidance import LLMatcher

        compact: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions (a TypedDict)
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=compact)
            except ValueError as e:
                raise InvalidRequestError(self._where(self.kind), str(e)) from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark's too (escapes included)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return LLMatcher.grammar_from_lark(self.grammar)


def _field(field_name: str, kind: str) -> str:
    """The field an error names: `<field_name>.<kind>`, or the field itself where the front end named the
    schema's own field (`response_format.json_schema.schema`, `tools[0].function.parameters`)."""
    return field_name if field_name.endswith((".schema", ".parameters")) else f"{field_name}.{kind}"


def _validate(grammar_text: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar_text)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a constraint's token bitmask over `vocab_size` tokens (the model's, padded
    or not): the one layout the grammar fills, the engine sends and the sampler unpacks."""
    return (vocab_size + 31) // 32
