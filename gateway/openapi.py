"""The gateway's OpenAPI 3.0 document, served at `GET /openapi.json`.

It describes the real routes and the request fields `gateway/protocol.py` accepts, with the
limits of this gateway's configuration (served model name, context length, `--max-n`, stop
limits), so that clients and API fuzzers (tests/test_hostile_input.py runs schemathesis on it)
see what the parser enforces. Every error answer has OpenAI's error shape (`ErrorResponse`).
Streaming answers (`stream: true`) are `text/event-stream` with one JSON chunk per `data:` line.
"""

from __future__ import annotations

from typing import Any

from gateway.config import ADMIN, INFERENCE, GatewayConfig
from gateway.protocol import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _number(low: float, high: float | None = None, *, exclusive_low: bool = False) -> Schema:
    schema: Schema = {"type": "number", "minimum": low, "nullable": True}
    if exclusive_low:
        schema["exclusiveMinimum"] = True
    if high is not None:
        schema["maximum"] = high
    return schema


def _sampling_fields(config: GatewayConfig) -> dict[str, Schema]:
    limits = config.limits
    stop_string: Schema = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    return {
        "temperature": _number(0.0, 2.0),
        "top_p": _number(0.0, 1.0, exclusive_low=True),
        "top_k": {"type": "integer", "minimum": -1, "nullable": True},
        "min_p": _number(0.0, 1.0),
        "frequency_penalty": _number(-2.0, 2.0),
        "presence_penalty": _number(-2.0, 2.0),
        "repetition_penalty": _number(0.0, exclusive_low=True),
        "seed": {"type": "integer", "nullable": True},
        "stop": {
            "nullable": True,
            "oneOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": limits.max_stop},
            ],
        },
        "stop_token_ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0},
            "maxItems": MAX_STOP_TOKEN_IDS,
        },
        "ignore_eos": {"type": "boolean", "nullable": True},
    }


def _openai_common(config: GatewayConfig) -> dict[str, Schema]:
    context = config.model.context_length
    return {
        "model": {"type": "string", "enum": [config.model.served_name]},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": context, "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": config.limits.max_n, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean"}},
        },
        **_sampling_fields(config),
    }


def _token_ids(max_items: int) -> Schema:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": max_items}


def _length_and_logprobs(length_field: str, context: int) -> dict[str, Schema]:
    """The new-token limit (named `length_field`) and the logprobs fields of a request."""
    return {
        length_field: {"type": "integer", "minimum": 1, "maximum": context, "nullable": True},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_TOP_LOGPROBS,
            "nullable": True,
        },
    }


def _request_schemas(config: GatewayConfig) -> dict[str, Schema]:
    context = config.model.context_length
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {
                                "type": {"type": "string", "enum": ["text"]},
                                "text": {"type": "string"},
                            },
                        },
                    },
                ]
            },
        },
    }
    prompt = {
        "oneOf": [
            {"type": "string"},
            {**_token_ids(context), "minItems": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
        ]
    }
    return {
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **_openai_common(config),
                "prompt": prompt,
                "echo": {"type": "boolean", "nullable": True},
                "logprobs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_TOP_LOGPROBS,
                    "nullable": True,
                },
            },
        },
        "ChatRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **_openai_common(config),
                "messages": {"type": "array", "minItems": 1, "items": message},
                **_length_and_logprobs("max_completion_tokens", context),
            },
        },
        "GenerateRequest": {
            "type": "object",
            "description": "Exactly one of `text` and `input_ids`.",
            "properties": {
                "text": {"type": "string"},
                "input_ids": _token_ids(context),
                "rid": {"type": "string"},
                "stream": {"type": "boolean", "nullable": True},
                "sampling_params": {
                    "type": "object",
                    "properties": {
                        **_length_and_logprobs("max_new_tokens", context),
                        **_sampling_fields(config),
                    },
                },
            },
        },
    }


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
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
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
    404: "unknown model",
    413: "the body exceeds --max-body-bytes",
    429: "at the --max-inflight limit: retry after Retry-After seconds",
    499: "the client disconnected",
    502: "a node failed after tokens were sent",
    503: "no node can take the request now: retry after Retry-After seconds",
}


def _generation(summary: str, request: str, scope: str) -> Schema:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": [scope]}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "the answer (JSON), or SSE chunks when `stream` is true",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 403, 404, 413, 429, 502, 503),
            },
        }
    }


def openapi_document(config: GatewayConfig) -> Schema:
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"type": "string"}, "data": {"type": "array"}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "pdserve gateway", "version": "1"},
        "paths": {
            "/v1/completions": _generation("OpenAI completions", "CompletionRequest", INFERENCE),
            "/v1/chat/completions": _generation("OpenAI chat", "ChatRequest", INFERENCE),
            "/generate": _generation("native generation", "GenerateRequest", INFERENCE),
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
