"""Request-level errors: each names what is wrong and what is allowed. InvalidRequest is the request
contract's (engine_format/requests.py), raised at every door with the same words."""

from engine_format.requests import InvalidRequest

__all__ = ["InvalidRequest", "Overloaded"]


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
