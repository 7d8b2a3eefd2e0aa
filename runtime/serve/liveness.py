"""Is the served model dead, or only busy? The supervisor's verdict from its probes and the model's heartbeat.

A health probe travels the whole request path (Triton, the stub's IPC, the model's event loop), so it
proves the model serves; but under load it waits behind work and times out although everything moves.
Stopping a busy server for that loses every request in it. So a failed probe alone never condemns the
model while its heartbeat (engine_format/serving.py, written every 0.2 s by the stub) shows it moving:

- dead at once: Triton says the stub is not healthy and its process is gone (Triton says so too when its own
  one-second check of a live stub times out, as on a loaded 2-core machine: that is a failed probe), or the
  engine loop stopped;
- dead after `frozen_s` (10 s, or `stall_s` if shorter): the heartbeat stopped and the probe fails too, so
  the stub cannot run Python at all (a stopped process, a native call holding the GIL): the heartbeat's
  thread needs nothing else (the engine's kernels release the GIL), and the probe rules out a heartbeat
  thread that alone died;
- dead after `stall_s`: the heartbeat stopped (the stub froze or died), the model's event loop ran no
  callback, or requests are unfinished and the engine ran no step;
- dead after `max_failures` failed probes in a row, when the heartbeat does not vouch for the model
  (none yet, or an idle engine: nothing for the probe to wait behind);
- otherwise alive: probes failing while the engine steps are a busy server ("slow"), reported, not killed.

Pure logic over observations with the caller's clock (tests drive it step by step).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_format.serving import ENGINE_STOPPED, Heartbeat

# What Triton answers for a model whose stub process died (python_backend) or missed its health check, and
# what the model answers when its engine loop has stopped (no later probe can succeed).
STUB_DEAD = "is not healthy"
FROZEN_S = 10.0


@dataclass(frozen=True)
class Verdict:
    dead: bool
    reason: str = ""  # why dead; or, alive, why probes fail ("slow": the model is busy), else ""


class Liveness:
    def __init__(self, max_failures: int = 3, stall_s: float = 60.0) -> None:
        self.max_failures, self.stall_s = max_failures, stall_s
        self.frozen_s = min(FROZEN_S, stall_s)
        self.failures = 0
        self._steps: int | None = None
        self._steps_changed_at = 0.0

    def observe(
        self, probe_problem: str | None, heartbeat: Heartbeat | None, now: float, stub_running: bool = False
    ) -> Verdict:
        """One round: the probe's failure (None: it answered) and the last heartbeat, at `now`
        (time.time() seconds, the clock the heartbeat is written with); `stub_running`: the process that wrote
        the heartbeat still runs."""
        self.failures = self.failures + 1 if probe_problem else 0
        fatal = ENGINE_STOPPED in (probe_problem or "") or (STUB_DEAD in (probe_problem or "") and not stub_running)
        if fatal:
            return Verdict(True, f"the model cannot serve: {probe_problem}")
        if probe_problem and heartbeat is not None and now - heartbeat.time > self.frozen_s:
            return Verdict(
                True,
                f"the model is frozen: its heartbeat stopped {now - heartbeat.time:.0f} s ago and "
                f"the health probe failed ({probe_problem})",
            )
        stalled = self._stalled(heartbeat, now)
        if stalled:
            return Verdict(True, stalled)
        if self.failures < self.max_failures:
            return Verdict(False)
        last = f"{self.failures} health probes failed in a row; last: {probe_problem}"
        if heartbeat is None or heartbeat.unfinished == 0:
            return Verdict(True, last)
        return Verdict(False, f"slow: {last}; the engine is stepping ({heartbeat.unfinished} requests unfinished)")

    def _stalled(self, heartbeat: Heartbeat | None, now: float) -> str | None:
        if heartbeat is None:
            return None
        if heartbeat.problem:
            return f"the model's {heartbeat.problem}"
        if now - heartbeat.time > self.stall_s:
            return f"the model's heartbeat stopped {now - heartbeat.time:.0f} s ago (the stub froze or died)"
        if heartbeat.time - heartbeat.loop_tick > self.stall_s:
            return f"the model's event loop has run nothing for {heartbeat.time - heartbeat.loop_tick:.0f} s"
        if heartbeat.steps != self._steps or heartbeat.unfinished == 0:
            self._steps, self._steps_changed_at = heartbeat.steps, heartbeat.time
            return None
        if heartbeat.time - self._steps_changed_at > self.stall_s:
            return (
                f"the engine ran no step for {heartbeat.time - self._steps_changed_at:.0f} s with "
                f"{heartbeat.unfinished} requests unfinished"
            )
        return None
