"""Request-level errors: each names what is wrong and what is allowed."""


class InvalidRequest(ValueError):
    """A request parameter or prompt is invalid; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(RuntimeError):
    """The engine cannot take the request now; the client should retry later.

    `reason`: "queue_full" (max_waiting requests wait) or "slo" (the prefill queued ahead cannot
    be cleared within the request's ttft_target_s even at full speed). `retry_after_s`: a hint,
    when the engine can estimate one. Messages start with "overloaded" (clients match on it).
    """

    def __init__(self, message: str, retry_after_s: float | None = None, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason
