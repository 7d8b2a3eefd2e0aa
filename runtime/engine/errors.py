"""Request-level errors: each names what is wrong and what is allowed."""


class InvalidRequest(ValueError):
    """A request parameter or prompt is invalid; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(RuntimeError):
    """The waiting queue is full; the client should retry later."""
