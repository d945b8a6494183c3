"""Request errors and how each API spells them.

Handlers raise `APIError`; the app turns it into the error body of the API the client called
(OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error", "error": {...}}`) with its status.
"""

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}

    def openai_body(self) -> dict:
        error = {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                 "param": self.param, "code": self.code, **self.extra}
        return {"error": error}

    def anthropic_body(self) -> dict:
        return {"type": "error",
                "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                          "message": self.message}}


def context_exceeded(prompt_tokens: int, ctx: int, param: str) -> APIError:
    return APIError(413, f"the prompt has {prompt_tokens} tokens, the context holds {ctx}",
                    param=param, code="context_length_exceeded",
                    extra={"n_prompt_tokens": prompt_tokens, "n_ctx": ctx})
