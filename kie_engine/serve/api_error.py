"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}."""
from ..errors import KieError


class ApiError(KieError):
    """A request the server refuses: the HTTP status and the OpenAI error fields."""

    def __init__(self, status, message, type="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message, param=None, code="invalid_value"):
    return ApiError(400, message, param=param, code=code)
