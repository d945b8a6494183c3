"""`/openapi.json`: the endpoints this server answers, with every request field it accepts (from
`ds4_mlx.server.schema`, which the validation reads too)."""

from ds4_mlx.server import schema
from ds4_mlx.server.sessions_api import SESSIONS_SCHEMA


def _post(summary: str, path: str) -> dict:
    """A POST endpoint whose body is `schema.ENDPOINTS[path]`: every accepted field, its type and range."""
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": schema.body_schema(schema.ENDPOINTS[path])}}},
                     "responses": {"200": {"description": "the answer, JSON or server-sent events when stream is true"},
                                   "400": {"description": "malformed JSON, or a field of the wrong type, out of "
                                                          "its range or that this server cannot honour"},
                                   "404": {"description": "unknown model"},
                                   "413": {"description": "the prompt does not fit the context"},
                                   "422": {"description": "a well-typed field with an unusable value"}}}}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


SALT = {"cache_salt": schema.json_schema(schema.SALT["cache_salt"])}


def openapi_spec(info) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "ds4-mlx", "version": "0.1.0",
                 "description": f"DeepSeek V4 Flash on MLX serving '{info.model_id}' with a {info.ctx}-token context; "
                                "requests reuse live sessions that share their token prefix."},
        "paths": {
            "/health": _get("server status: slots (busy or not), queue length; 503 while loading or if the worker died"),
            "/v1/models": _get("the names the served model answers to, each with its context_length"),
            "/metrics": _get("Prometheus metrics: requests, prompt tokens reused and computed, prefill and decode "
                             "speed, queue, memory (text exposition format); with API keys, only the "
                             "--metrics-key reads it"),
            "/tokenize": _post("token ids of a text, as is (special-token strings become their ids unless "
                               "parse_special is false; add_special puts BOS first)", "/tokenize"),
            "/detokenize": _post("the text of token ids", "/detokenize"),
            "/v1/sessions": {"get": {
                "summary": "the live session slots (tokens held, bytes, idle seconds, the last request's figures) "
                           "and recent requests' figures: prompt tokens reused, replayed and computed, prefill "
                           "and decode tokens/s; counts only, never text",
                "parameters": [{"name": "cache_salt", "in": "query", "required": False, "schema": SALT["cache_salt"],
                                "description": "show the slots of this salt's namespace as the caller's"}],
                "responses": {"200": {"description": "OK",
                                      "content": {"application/json": {"schema": SESSIONS_SCHEMA}}}}}},
            "/v1/chat/completions": _post("OpenAI chat completion", "/v1/chat/completions"),
            "/v1/completions": _post("OpenAI completion of raw text (no chat template), a choice per prompt",
                                     "/v1/completions"),
            "/v1/messages": _post("Anthropic messages", "/v1/messages"),
            "/v1/messages/count_tokens": _post("Anthropic token count of a messages request",
                                               "/v1/messages/count_tokens"),
            "/v1/responses": _post("OpenAI Responses, stateless: replay the whole input", "/v1/responses"),
        },
    }
