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


def _is_union_tag(part: object) -> bool:
    """A ``loc`` part that may name one alternative of a union (``str``, ``list[int]``, a model
    class) rather than a field, an index or a dict key; see :func:`from_validation_error`."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES or part[:1].isupper())


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


def from_validation_error(error: ValidationError) -> APIError:
    """Turn a pydantic validation error into a 400 naming the first offending field.

    A field of several shapes (``prompt``, ``stop``, message ``content``) that matches none is
    named as sent, once, with the shapes it accepts: pydantic reports one error per shape, under
    ``loc`` ``(field, shape, ...)``; a union always has two shapes or more, which tells them from
    dict keys (``logit_bias``) that merely look like one."""
    items = [([p for p in item.get("loc", ()) if p != "body"], item) for item in error.errors()]
    shapes: dict[tuple, set] = {}  # loc prefix -> the candidate shape names seen after it
    for loc, _ in items:
        for i, part in enumerate(loc):
            if _is_union_tag(part):
                shapes.setdefault(tuple(loc[:i]), set()).add(part)
    messages: dict[str, list[str]] = {}  # field path -> its errors, or the shapes it accepts
    sent: dict[str, str] = {}  # field path of several shapes -> the JSON type sent
    for loc, item in items:
        tag = next((i for i, p in enumerate(loc) if _is_union_tag(p)
                    and len(shapes[tuple(loc[:i])]) > 1), None)
        path = ".".join(str(p) for p in (loc if tag is None else loc[:tag]))
        found = messages.setdefault(path, [])
        text = str(item.get("msg")) if tag is None else str(loc[tag])
        if tag is not None:
            sent.setdefault(path, "a value")
            if len(loc) == tag + 1:  # the shape was tried on the value itself
                sent[path] = _JSON_TYPES.get(type(item.get("input")), sent[path])
        if text not in found:
            found.append(text)
    parts = []
    for path, found in messages.items():
        message = (f"expected one of {', '.join(found)}; got {sent[path]}" if path in sent
                   else "; ".join(found))
        parts.append(f"{path}: {message}" if path else message)
    return APIError(400, "invalid request: " + "; ".join(parts), next(iter(messages), None) or None)
