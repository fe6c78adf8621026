"""HTTP errors with OpenAI-style bodies: `{"error": {"message", "type", "param", "code"}}`.

Routes raise `ApiError`; the app turns it into a response. Every bad input has its own
status and a message that names the problem, never a traceback.
"""

import orjson

# status -> OpenAI error "type"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error response: status, message, and the OpenAI fields `param` and `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: list | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or []     # extra response headers, e.g. Retry-After, Allow

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}})


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_parameter")


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")
