"""The request fields of structured outputs -> one :class:`StructuredOutputsParams`, with 400s
naming the field and the way to fix it.

A request may constrain its output with one of: OpenAI's ``response_format`` (``json_object``,
``json_schema``; ``text`` is no constraint), vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (``guided_whitespace_pattern`` sets the whitespace a
JSON constraint allows between tokens), or vLLM's ``structured_outputs`` (a dict of
StructuredOutputsParams' fields). Structural tags (xgrammar's) are a 400.
``guided_decoding_backend`` is ignored (regexes and schemas go through outlines-core, grammars
through llguidance). :meth:`Serving.structured_constraint` compiles the result.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..structured_outputs import StructuredOutputsParams
from .errors import APIError, bad_request
from .protocol import SamplingFields

#: vLLM's ``guided_*`` fields -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
#: ``response_format`` types taken
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

_NO_STRUCTURAL_TAGS = ("(xgrammar's structural tags) is not supported; express the output as a "
                       "grammar (guided_grammar, Lark or GBNF), a JSON schema (guided_json, or "
                       "response_format of type json_schema) or a regular expression (guided_regex)")


def requested_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint and the field that sent it, or None without one; 400
    naming the field for a bad value and for more than one constraint."""
    found: dict[str, StructuredOutputsParams] = {}
    from_format = response_format_params(req.response_format)
    if from_format is not None:
        found["response_format"] = from_format
    for name, key in GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            found[name] = _params(name, {key: getattr(req, name)})
    if req.structured_outputs is not None:
        found["structured_outputs"] = _params("structured_outputs", req.structured_outputs)
    if len(found) > 1:
        names = ", ".join(found)
        raise bad_request(f"a request takes one output constraint, and this one sends {len(found)} "
                          f"({names}); send only one of them", next(iter(found)))
    if not found:
        return None  # guided_whitespace_pattern alone constrains nothing (as in vLLM)
    name, params = found.popitem()
    pattern = req.guided_whitespace_pattern
    if pattern is not None and params.whitespace_pattern is None:
        params = replace(params, whitespace_pattern=pattern)
    return params, name


def response_format_params(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a constraint: None for ``text`` (or none sent)."""
    if not value:
        return None
    kind = value.get("type")
    if kind == "structural_tag":
        raise bad_request(f"response_format of type 'structural_tag' {_NO_STRUCTURAL_TAGS}", "response_format")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                          f"got {kind!r:.80}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise bad_request('response_format of type json_schema needs the schema, as {"type": '
                          '"json_schema", "json_schema": {"name": ..., "schema": {...}}}; it is '
                          "missing json_schema.schema", "response_format")
    return _params("response_format", {"json": spec["schema"]})


def _params(param: str, fields: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams of ``fields`` (a dict of its fields, as ``structured_outputs``
    sends); a ValueError is a 400 naming ``param``."""
    try:
        return StructuredOutputsParams.of(fields)
    except ValueError as e:
        raise bad_request(in_request_terms(str(e), param), param) from None


#: where a request sends the JSON schema, by field (the others send it as the field itself)
_SCHEMA_PATHS = {"response_format": "response_format.json_schema.schema"}


def in_request_terms(message: str, param: str, path: str | None = None) -> str:
    """A StructuredOutputsParams error ``message`` in the terms of the request's field ``param``
    (``StructuredOutputsParams.json`` is ``guided_json``, ``structured_outputs.json``, ...);
    ``path``: where in the request the schema is, for fields that hold it deeper (a tool's
    ``tools[0].function.parameters``)."""
    if param == "structured_outputs":
        return message.replace("StructuredOutputsParams", "structured_outputs")
    key = {**GUIDED_FIELDS, "response_format": "json"}.get(param, "json")
    return message.replace(f"StructuredOutputsParams.{key}", path or _SCHEMA_PATHS.get(param, param))


def compile_error(error: Exception, param: str, path: str | None = None) -> APIError:
    """The 400 for a constraint ``param`` sent that does not compile (a ValueError or TypeError:
    a bad schema, regex, grammar or whitespace pattern), or for a server without outlines-core
    or llguidance (an
    ImportError, whose message says what to install); ``path`` as :func:`in_request_terms`."""
    if isinstance(error, ImportError):
        return bad_request(f"{param}: {error} on the server (and restart it); until then leave "
                           f"{param} out", param)
    message = in_request_terms(str(error), param, path)
    if not message.startswith(param):
        message = f"{param}: {message}"
    return bad_request(f"{message}; fix the constraint (outlines-core's JSON schema and regular "
                       "expression syntax, llguidance's Lark or GBNF grammars)", param)
