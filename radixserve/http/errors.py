"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from radixserve.protocol import MAX_ERROR_CHARS

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class HTTPError(Exception):
    """Raised by a route; the app turns it into the OpenAI error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The same error as one server-sent event (a failure after the stream began)."""
        return f"data: {json.dumps(self.body())}\n\n"


def from_validation(err: ValidationError) -> HTTPError:
    """A 400 naming every bad field of the body (pydantic's own wording)."""
    parts, param = [], None
    for e in err.errors(include_url=False):
        # loc may hold a client's own keys (an unknown field's name): never echo much of it
        where = short_text(".".join(str(x) for x in e["loc"]))
        if e["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON: {e['ctx'].get('error', e['msg'])}")
            continue
        param = param or (str(e["loc"][0]) if e["loc"] else None)
        parts.append(f"{where}: {e['msg']}" if where else e["msg"])
    message = "; ".join(parts)
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return HTTPError(400, message, param and short_text(param))


def short_text(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
