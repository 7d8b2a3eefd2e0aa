"""How often `trtserve serve` may restart a child that died: exponential backoff and a cap per window.

A child that dies once (a crash under load, a killed process) is restarted after `base_s`; one that keeps
dying waits twice as long each time (up to `max_s`), and past `max_per_window` restarts within `window_s`
the server gives up (exit code 3) and leaves the decision to an orchestrator, rather than spinning on a
fault that a restart does not cure (a broken engine, a port taken by another process).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartBudget:
    max_per_window: int = 5
    window_s: float = 60.0
    base_s: float = 0.5
    max_s: float = 8.0
    _times: deque[float] = field(default_factory=deque, repr=False)

    def delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart at `now`, or None when the budget is spent."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_per_window:
            return None
        return min(self.base_s * 2 ** len(self._times), self.max_s)

    def record(self, now: float) -> None:
        self._times.append(now)

    @property
    def recent(self) -> int:
        """Restarts counted in the current window."""
        return len(self._times)
