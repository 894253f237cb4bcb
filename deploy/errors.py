"""The API's one error type, answered as an OpenAI error body with its HTTP status, and the error of a
failed generation (one mapping of a :class:`worker.outputs.FailureKind` to a status, for both the
non-streamed response and a stream's error event), or of one the server aborted (a drain's timeout)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from deploy import openai_protocol as p
from worker.outputs import FailureKind


class ApiError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def __reduce__(self):  # crosses the request preprocessing pool's process boundary
        return ApiError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def generation_failed(result) -> ApiError:
    """The error of a request that ended with finish_reason "error" (its output or final event):
    504 ``timeout_error`` past its deadline, else 500 ``internal_error``."""
    message = f"generation failed: {result.error or 'the request failed'}"
    if result.failure is FailureKind.DEADLINE:
        return ApiError(504, message, "timeout_error")
    return ApiError(500, message, "internal_error")


def server_aborted(result) -> ApiError | None:
    """The error of a request the server ended with finish_reason "abort" and a reason (``error``: a
    drain's timeout): 503 ``service_unavailable``, code ``draining``. None for any other ending, a
    plain abort (a client's disconnect) included."""
    if result.finish_reason != "abort" or not result.error:
        return None
    return ApiError(503, f"request aborted: {result.error}", "service_unavailable", code="draining")
