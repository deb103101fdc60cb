"""Constraints are checked once, where SamplingParams is built: a bad one is refused naming its field."""

from __future__ import annotations

import pytest

from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.structured.constraint import StructuredOutputs


@pytest.mark.parametrize("kwargs, field", [
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar"),          # an undefined rule
    ({"choice": ()}, "structured_outputs.choice"),
    ({"choice": ("a", "")}, "structured_outputs.choice"),
    ({}, "structured_outputs"),                                          # no kind at all
    ({"regex": "a", "choice": ("b",)}, "structured_outputs"),            # two kinds
])
def test_bad_constraints_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputs(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("schema", ['{"type": "strin"}', "{not json", "[1, 2]",
                                    {"type": "object", "properties": {"a": {"type": "nope"}}}])
def test_bad_schemas_name_their_field(schema: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputs.from_schema(schema, "response_format.json_schema")
    assert e.value.field.startswith("response_format.json_schema")


def test_good_constraints_build_and_key_the_cache() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    one, two = StructuredOutputs.from_schema(schema), StructuredOutputs.from_schema(dict(schema))
    assert one == two and one.grammar_text == two.grammar_text and one.kind == "json"
    assert one.json.index('"b"') < one.json.index('"a"')  # the schema's key order is the output's
    for c in (StructuredOutputs(json_object=True), StructuredOutputs(regex=r"\d+"),
              StructuredOutputs(choice=('say "hi"', "no\\")), StructuredOutputs(grammar='start: "x"+')):
        assert c.grammar_text
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="ab"))
    assert params.sample(1).structured_outputs == params.structured_outputs  # every sample keeps it


def test_sampling_params_refuse_a_raw_dict() -> None:
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
