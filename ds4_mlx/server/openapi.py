"""`/openapi.json`: the endpoints this server answers, with their main request fields."""

from ds4_mlx.server.sessions_api import SESSIONS_SCHEMA


def _post(summary: str, required: list[str], properties: dict) -> dict:
    schema = {"type": "object", "required": required, "properties": properties}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": "the answer, JSON or server-sent events when stream is true"},
                                   "400": {"description": "malformed JSON or a field of the wrong type"},
                                   "404": {"description": "unknown model"},
                                   "413": {"description": "the prompt does not fit the context"},
                                   "422": {"description": "a well-typed field with an unusable value"}}}}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


S, I, N, B, A, O = ({"type": t} for t in ("string", "integer", "number", "boolean", "array", "object"))
SAMPLING = {"temperature": N, "top_p": N, "top_k": I, "min_p": N, "seed": I}
THINKING = {"thinking": {"oneOf": [B, O]}, "reasoning_effort": S}
# vLLM's field: requests reuse each other's sessions only under the same API key and the same salt
SALT = {"cache_salt": {"type": "string", "minLength": 1}}


def openapi_spec(info) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "ds4-mlx", "version": "0.1.0",
                 "description": f"DeepSeek V4 Flash on MLX serving '{info.model_id}' with a {info.ctx}-token context; "
                                "requests reuse live sessions that share their token prefix."},
        "paths": {
            "/health": _get("server status: slots (busy or not), queue length; 503 while loading or if the worker died"),
            "/v1/models": _get("the served model, with its context_length"),
            "/metrics": _get("Prometheus metrics: requests, prompt tokens reused and computed, prefill and decode "
                             "speed, queue, memory (text exposition format); with API keys, only the "
                             "--metrics-key reads it"),
            "/tokenize": _post("token ids of a text, as is (special-token strings become their ids unless "
                               "parse_special is false; add_special puts BOS first)", ["content"], {
                "content": S, "with_pieces": B, "add_special": B, "parse_special": B}),
            "/detokenize": _post("the text of token ids", ["tokens"], {"tokens": {"type": "array", "items": I}}),
            "/v1/sessions": {"get": {
                "summary": "the live session slots (tokens held, bytes, idle seconds, the last request's figures) "
                           "and recent requests' figures: prompt tokens reused, replayed and computed, prefill "
                           "and decode tokens/s; counts only, never text",
                "parameters": [{"name": "cache_salt", "in": "query", "required": False, "schema": SALT["cache_salt"],
                                "description": "show the slots of this salt's namespace as the caller's"}],
                "responses": {"200": {"description": "OK",
                                      "content": {"application/json": {"schema": SESSIONS_SCHEMA}}}}}},
            "/v1/chat/completions": _post("OpenAI chat completion", ["messages"], {
                "model": S, "messages": A, "tools": A, "tool_choice": {"oneOf": [S, O]}, "stream": B,
                "stream_options": O, "max_tokens": I, "max_completion_tokens": I, "stop": {"oneOf": [S, A]},
                "logprobs": B, "top_logprobs": I, "response_format": O, "logit_bias": O, **SAMPLING, **THINKING, **SALT}),
            "/v1/completions": _post("OpenAI completion of raw text (no chat template), a choice per prompt",
                                     ["prompt"], {
                "model": S, "prompt": {"oneOf": [S, A]}, "echo": B, "logprobs": I, "stream": B, "stream_options": O,
                "max_tokens": I, "stop": {"oneOf": [S, A]}, "logit_bias": O, **SAMPLING, **SALT}),
            "/v1/messages": _post("Anthropic messages", ["messages", "max_tokens"], {
                "model": S, "system": {"oneOf": [S, A]}, "messages": A, "tools": A, "tool_choice": O,
                "stream": B, "max_tokens": I, "stop_sequences": A, "thinking": O, "output_config": O,
                "temperature": N, "top_p": N, "top_k": I, **SALT}),
            "/v1/messages/count_tokens": _post("Anthropic token count of a messages request", ["messages"], {
                "model": S, "system": {"oneOf": [S, A]}, "messages": A, "tools": A}),
            "/v1/responses": _post("OpenAI Responses, stateless: replay the whole input", ["input"], {
                "model": S, "input": {"oneOf": [S, A]}, "instructions": S, "tools": A,
                "tool_choice": {"oneOf": [S, O]}, "stream": B, "max_output_tokens": I, "reasoning": O,
                "text": O, "temperature": N, "top_p": N, **SALT}),
        },
    }
