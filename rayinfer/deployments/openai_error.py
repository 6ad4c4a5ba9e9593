"""The OpenAI error: the exception a request's failure becomes, and the body it answers with.

The message is what a client may read (`client_message`); what went wrong in detail stays in the
server log under the request id (deployments/errors.py classifies failures).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field


class OpenAIError(Exception):
    """Answered as `{"error": {...}}` with this HTTP status. The message is what a client may
    read: one line, no terminal escapes, at most MAX_ERROR_CHARS (the traceback, when there is
    one, goes to the server log under `request_id`: deployments/errors.py)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        request_id: str | None = None,
        retry_after_s: int | None = None,
    ):
        """retry_after_s: a 503's Retry-After header (default 1)."""
        message = client_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    @property
    def error_type(self) -> str:
        if self.status == 404:
            return "NotFoundError"
        if self.status == 503:
            return "ServiceUnavailableError"
        return "invalid_request_error" if self.status < 500 else "internal_server_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
                "request_id": self.request_id,
            }
        }


MAX_ERROR_CHARS = 500
_TERMINAL_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


def client_message(text: str) -> str:
    """`text` as an error body may carry it: its first line, escapes and control characters
    removed, a lone surrogate written as its escape (a body with one cannot be encoded), cut at
    MAX_ERROR_CHARS."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    line = _TERMINAL_ESCAPES.sub("", text).strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else f"{line[: MAX_ERROR_CHARS - 3]}..."


class ErrorDetail(BaseModel):
    message: str = Field(description="one line, for the client")
    type: str
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None
    request_id: str | None = Field(description="the server log keeps the details under it")


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer's body, as OpenAI's (`OpenAIError.body`)."""

    error: ErrorDetail
