"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from http import HTTPStatus

from pydantic import ValidationError
from starlette.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    499: "ClientDisconnectedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error that becomes one OpenAI-style JSON error response.

    ``status`` is the HTTP status, ``param`` the offending request field (or ``None``).
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status)
        if error_type is None:
            try:
                error_type = HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
            except ValueError:
                error_type = "Error"
        return {"error": {"message": self.message, "type": error_type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(error: ValidationError) -> APIError:
    """Turn a pydantic validation error into a 400 naming the first offending field."""
    parts = []
    param = None
    for item in error.errors():
        loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        param = param or loc or None
        parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
    return APIError(400, "invalid request: " + "; ".join(parts), param)
