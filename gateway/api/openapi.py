"""The gateway's OpenAPI 3.1 document, served at `GET /openapi.json`.

The request bodies' schemas are generated from the models that parse them
(`gateway/requests/protocol.py` and `responses.py`, pydantic), so the document cannot drift
from the parser. The limits of this gateway's flags (served model name, context length,
`--max-n`, stop limits), which the parser checks at run time, are written into those schemas
here, so that clients and API fuzzers (tests/test_hostile_input.py runs schemathesis on it)
see what is enforced. Every error answer has OpenAI's error shape (`ErrorResponse`). Streaming
answers (`stream: true`) are `text/event-stream` with one JSON chunk per `data:` line (and, for
/v1/responses, its event's type in an `event:` line before it).
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.config import ADMIN, INFERENCE, GatewayConfig
from gateway.requests.protocol import (
    BODIES,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    NativeSamplingFields,
    TokenizeBody,
)
from gateway.requests.responses import ResponsesBody

Schema = dict[str, Any]
_REFS = "#/components/schemas/{model}"
_BODIES = (*BODIES, ResponsesBody)


def _ref(name: str) -> Schema:
    return {"$ref": _REFS.format(model=name)}


def _request_schemas(config: GatewayConfig) -> dict[str, Schema]:
    _, top = models_json_schema([(m, "validation") for m in _BODIES], ref_template=_REFS)
    schemas: dict[str, Schema] = top["$defs"]
    _add_flag_limits(schemas, config)
    return schemas


def _branches(field: Schema, of_type: str) -> list[Schema]:
    """The alternatives of a field's schema (`anyOf` or not) of JSON type `of_type`."""
    return [b for b in field.get("anyOf", [field]) if b.get("type") == of_type]


def _add_flag_limits(schemas: dict[str, Schema], config: GatewayConfig) -> None:
    limits, room = config.limits, config.model.context_length - 1  # a prompt has >= 1 token
    fields = {
        m.__name__: schemas[m.__name__]["properties"] for m in (*_BODIES, NativeSamplingFields)
    }
    maxima: list[tuple[Schema, int]] = []  # integer fields and their flag's limit
    for name in (CompletionBody.__name__, ChatBody.__name__, NativeSamplingFields.__name__):
        for text in _branches(fields[name]["stop"], "string"):
            text["maxLength"] = limits.max_stop_chars
        for array in _branches(fields[name]["stop"], "array"):
            array.update(maxItems=limits.max_stop)
            array["items"]["maxLength"] = limits.max_stop_chars
    for name in (CompletionBody.__name__, ChatBody.__name__, ResponsesBody.__name__):
        fields[name]["model"]["enum"] = [config.model.served_name]
        if "n" in fields[name]:
            maxima.append((fields[name]["n"], limits.max_n))
        for length in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if length in fields[name]:
                maxima.append((fields[name][length], room))
    for name in (TokenizeBody.__name__, DetokenizeBody.__name__):
        for text in _branches(fields[name]["model"], "string"):
            text["enum"] = [config.model.served_name]
    maxima.append((fields[NativeSamplingFields.__name__]["max_new_tokens"], room))
    for field, limit in maxima:
        for part in _branches(field, "integer"):
            part["maximum"] = limit
    for part in _branches(fields[GenerateBody.__name__]["input_ids"], "array"):
        part["maxItems"] = room
    for part in _branches(fields[CompletionBody.__name__]["prompt"], "array"):
        is_ids = part["items"].get("type") == "integer"
        part["maxItems"] = room if is_ids else limits.max_n  # prompts x n <= --max-n


_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _errors(*statuses: int) -> dict[str, Schema]:
    json = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {str(s): {"description": _ERROR_MEANINGS[s], "content": json} for s in statuses}


_ERROR_MEANINGS = {
    400: "a field is invalid: the message names it and the limit",
    401: "missing or wrong API key",
    403: "the API key lacks the route's scope",
    404: "unknown model (/v1/responses: or unknown `previous_response_id`)",
    413: "the body exceeds --max-body-bytes",
    429: "at the --max-inflight limit: retry after Retry-After seconds",
    499: "the client disconnected",
    502: "a node failed after tokens were sent",
    503: "no node can take the request now: retry after Retry-After seconds",
}


def _post(summary: str, request: str, answer: Schema, *errors: int) -> Schema:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": [INFERENCE]}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": answer, **_errors(*errors)},
        }
    }


def _generation(summary: str, request: str) -> Schema:
    answer = {
        "description": "the answer (JSON), or SSE chunks when `stream` is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return _post(summary, request, answer, 400, 401, 403, 404, 413, 429, 502, 503)


def _text_route(summary: str, request: str, answer: Schema) -> Schema:
    content = {"application/json": {"schema": answer}}
    return _post(
        summary, request, {"description": "the answer", "content": content},
        400, 401, 403, 404, 413, 429,
    )  # fmt: skip


def _object(**properties: Schema) -> Schema:
    return {"type": "object", "required": list(properties), "properties": properties}


def openapi_document(config: GatewayConfig) -> Schema:
    models = _object(object={"type": "string"}, data={"type": "array"})
    card = _object(id={"type": "string"}, object={"type": "string"})
    ids = {"type": "array", "items": {"type": "integer"}}
    tokens = _object(
        count={"type": "integer"},
        max_model_len={"type": "integer"},
        tokens=ids,
        token_strs={"type": ["array", "null"], "items": {"type": "string"}},
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve gateway", "version": "1"},
        "paths": {
            "/v1/completions": _generation("OpenAI completions", CompletionBody.__name__),
            "/v1/chat/completions": _generation("OpenAI chat", ChatBody.__name__),
            "/generate": _generation("native generation", GenerateBody.__name__),
            "/v1/responses": _generation("OpenAI responses", ResponsesBody.__name__),
            "/v1/models": {
                "get": {
                    "summary": "the served model",
                    "security": [{"bearer": [INFERENCE]}],
                    "responses": {
                        "200": {
                            "description": "one model card",
                            "content": {"application/json": {"schema": models}},
                        },
                        **_errors(401, 403),
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "the served model's card (404 for another id)",
                    "security": [{"bearer": [INFERENCE]}],
                    "parameters": [
                        {
                            "name": "model_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "the model card",
                            "content": {"application/json": {"schema": card}},
                        },
                        **_errors(401, 403, 404),
                    },
                }
            },
            "/tokenize": _text_route(
                "a prompt or messages to token ids", TokenizeBody.__name__, tokens
            ),
            "/detokenize": _text_route(
                "token ids to text", DetokenizeBody.__name__, _object(prompt={"type": "string"})
            ),
            "/health": {
                "get": {
                    "summary": "200 while a decode node is live, else 503 (no key needed)",
                    "responses": {
                        "200": {"description": "node counts per role"},
                        "503": {"description": "no decode node"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus text; needs an admin key once one is configured",
                    "security": [{"bearer": [ADMIN]}],
                    "responses": {
                        "200": {"description": "metrics", "content": {"text/plain": {}}},
                        **_errors(401, 403),
                    },
                }
            },
        },
        "components": {
            "schemas": {**_request_schemas(config), "ErrorResponse": _ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
