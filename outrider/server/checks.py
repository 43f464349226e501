"""Request checks both APIs share, so each rule is stated once: text must be valid Unicode,
tool schemas must be JSON Schemas of an object, stop lists and seeds are bounded (in the
request models' fields, so the OpenAPI document shows the bounds), and content the target
cannot read is refused by name instead of being dropped."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from ..chat.text import lone_surrogate_at

MAX_STOPS = 16  # OpenAI's limit for `stop` lists; Anthropic's `stop_sequences` gets the same
SEED_RANGE = (0, 2**64)  # mx.random.key takes an unsigned 64-bit seed


class CheckedRequest(BaseModel):
    """Base of every request body: unknown fields are kept (and ignored), and text with lone
    surrogates is refused before any field is read."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate; text must be valid Unicode")
        return data


def check_tool_schema(schema: Any) -> Any:
    """A tool's parameters must be a JSON Schema (of its declared draft) describing an object."""
    if schema is None:
        return schema
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise ValueError("must be a JSON Schema object")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f'must describe an object (type "object"), not {kind!r}')
    try:
        (validator_for(schema, default=None) or _default_validator()).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "top level"
        raise ValueError(f"is not a valid JSON Schema ({where}: {e.message[:200]})") from None
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    return schema


def _default_validator():
    from jsonschema import Draft202012Validator

    return Draft202012Validator
