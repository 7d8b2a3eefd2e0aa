"""The engine core's outputs on their way to the front end, never holding up the next step.

The step loop only hands each step's outputs over (`put`); a thread of the core's sends them. The front end
acknowledges each message once it has turned it into text (`ack`), and at most CREDITS messages are ahead of
it: while it catches up, the steps that come are merged into one output per request (`merge_steps`), so a
front end slower than the device receives fewer, longer outputs instead of a queue that grows, and its work
per step shrinks as it falls behind (vLLM's output collector does the same on the other side of its socket).
What waits here is bounded by the live requests' tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from runtime.engine.core_wire import pack_outputs
from runtime.engine.outputs import TokenOutput, merge_steps

CREDITS = 2  # messages in flight: one the front end is reading, one waiting for it

Send = Callable[[tuple], None]


class Outbox:
    def __init__(self, send: Send) -> None:
        """`send`: one message to the front end (raises OSError once it is gone)."""
        self._send = send
        self._cond = threading.Condition()
        self._steps: list[list[TokenOutput]] = []  # handed over, not yet merged
        self._counts = (0, 0)  # (steps, unfinished requests) as of the last `put`
        self._news = False  # something to send: outputs, or steps run since the last message
        self._credits = CREDITS
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="trtserve-core-outbox", daemon=True)
        self._thread.start()

    def put(self, outputs: list[TokenOutput], steps: int, unfinished: int) -> None:
        """A step's outputs (an empty list too: the front end counts steps), or an abort's final one."""
        with self._cond:
            if outputs:
                self._steps.append(outputs)
            self._counts, self._news = (steps, unfinished), True
            self._cond.notify()

    def ack(self) -> None:
        """The front end has taken a message: one more may go."""
        with self._cond:
            self._credits += 1
            self._cond.notify()

    def close(self) -> None:
        """Send what is left (credits or not) and stop; returns once it went, or the front end is gone."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        merged: dict[str, TokenOutput] = {}
        while True:
            with self._cond:
                while not (self._steps or self._closing or (self._news and self._credits > 0)):
                    self._cond.wait()
                steps, self._steps = self._steps, []
                sending = self._news and (self._credits > 0 or self._closing)
                if sending:
                    self._credits -= 1
                    self._news = False
                closing, (count, unfinished) = self._closing, self._counts
            merge_steps(steps, merged)  # (outside the lock: the step loop's `put` never waits for it)
            if sending:
                try:
                    self._send(("out", count, unfinished, pack_outputs(list(merged.values()))))
                except OSError:  # the front end is gone: nobody to tell (the reader stops the core)
                    return
                merged = {}
            if closing and not merged:
                with self._cond:
                    if not self._steps and not self._news:
                        return
