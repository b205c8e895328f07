"""Every error the server returns, mapped in one table: exception type -> (HTTP status,
OpenAI error type, code). The body is always ``{"error": {"message", "type", "param", "code"}}``.

The engine thread reports failures as ``Failed(kind=<exception class name>)`` events; they map
through the same table by class name, never by matching message text.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..distributed import GroupFailed
from ..engine import EngineBusy, Failed, PrefillTimeout
from ..errors import BadRequest, Cancelled, ContextTooLong, InvalidPrompt, MlxSpecError

RETRY_AFTER_S = 1


class InvalidField(BadRequest):
    """A request field (``param``) is missing, mistyped or out of range."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(BadRequest):
    """The request names a model this server does not serve."""

    param = "model"


class PayloadTooLarge(BadRequest):
    """The request body exceeds the server's limit."""


class UnsupportedMediaType(BadRequest):
    """The body is not JSON (``Content-Type`` other than application/json)."""


class Unauthorized(MlxSpecError):
    """Missing or wrong API key."""


class NotReady(MlxSpecError):
    """The engine is still loading (or failed to load)."""


TABLE: dict[type[BaseException], tuple[int, str, str | None]] = {
    Unauthorized: (401, "authentication_error", "invalid_api_key"),
    ModelNotFound: (404, "invalid_request_error", "model_not_found"),
    PayloadTooLarge: (413, "invalid_request_error", "request_too_large"),
    UnsupportedMediaType: (415, "invalid_request_error", "unsupported_media_type"),
    InvalidPrompt: (400, "invalid_request_error", "invalid_value"),
    ContextTooLong: (400, "invalid_request_error", "context_length_exceeded"),
    InvalidField: (400, "invalid_request_error", "invalid_value"),
    BadRequest: (400, "invalid_request_error", None),
    EngineBusy: (503, "server_error", "server_busy"),
    PrefillTimeout: (503, "server_error", "prefill_timeout"),
    GroupFailed: (503, "server_error", "group_failed"),
    NotReady: (503, "server_error", "model_not_ready"),
    Cancelled: (503, "server_error", "cancelled"),
    MlxSpecError: (500, "server_error", None),
}
_BY_NAME = {cls.__name__: cls for cls in TABLE} | {"EngineFailed": NotReady}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def lookup(exc: BaseException) -> tuple[int, str, str | None]:
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return 500, "server_error", None


def to_body(exc: BaseException) -> tuple[int, dict]:
    status, type_, code = lookup(exc)
    message = str(exc) if isinstance(exc, MlxSpecError) else f"internal error: {type(exc).__name__}"
    return status, body(message, type_, getattr(exc, "param", None), code)


def to_response(exc: BaseException) -> JSONResponse:
    status, content = to_body(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(content, status_code=status, headers=headers)


def from_failed(ev: Failed) -> MlxSpecError:
    """Rebuild the engine's failure as an exception of the same type (by class name)."""
    cls = _BY_NAME.get(ev.kind)
    if cls is None or cls is MlxSpecError:
        return MlxSpecError(f"generation failed: {ev.kind}: {ev.error}")
    return cls(ev.error)


def http_error(status: int, detail: str) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(body(detail, type_, None, HTTP_CODES.get(status)), status_code=status)
