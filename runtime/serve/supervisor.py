"""`trtserve serve`'s watch over its tritonserver (and gateway): health probes and the graceful drain.

Triton keeps answering "ready" after the `llm` stub process dies (every request then fails with "Stub
process is not healthy", in-flight ones never end), so readiness cannot come from Triton: every
`probe_interval_s` the supervisor sends the model a health probe (runtime.serve.lifecycle) through
Triton's HTTP generate endpoint. After `max_failures` failures in a row the model cannot serve:
`watch()` returns the reason and the caller kills tritonserver (its clients' connections close at once,
so in-flight requests end with an error and the gateway marks the replica unhealthy) and exits non-zero
for an orchestrator to restart it. A reload through Triton's model-control API was not chosen: unloading
the dead model waits for its in-flight requests, which a dead stub never finishes.

`drain()` is the shutdown: new requests are refused at once, running ones go on until the drain
deadline, the rest are cut with a final error; only then is Triton stopped, well inside its own exit
timeout, and its shared-memory regions removed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from runtime.serve.launcher import MODEL_NAME, TritonServer
from runtime.serve.lifecycle import HEALTH_PARAMETER, drain_state, request_drain

STOP_TIMEOUT_S = 15.0  # Triton's own shutdown once nothing is in flight
REPORT_GRACE_S = 10.0  # how long past the deadline the model may take to report its last request done


class Child(Protocol):
    """The gateway process (runtime.gateway.process.GatewayProcess), as far as supervision needs it."""

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class DrainResult:
    cut: int  # requests answered with the shutdown error at the deadline
    complete: bool  # the model reported every request done (else Triton's stop cut what was left)

    @property
    def clean(self) -> bool:
        return self.complete and self.cut == 0


class Supervisor:
    def __init__(self, server: TritonServer, probe_interval_s: float = 2.0, probe_timeout_s: float = 5.0,
                 max_failures: int = 3) -> None:  # fmt: skip
        self.server = server
        self.probe_interval_s, self.probe_timeout_s, self.max_failures = probe_interval_s, probe_timeout_s, max_failures

    def probe(self) -> str | None:
        """None when the model answered the health probe, else what went wrong."""
        url = f"{self.server.config.http_url}/v2/models/{MODEL_NAME}/generate"
        body = json.dumps({"parameters": {HEALTH_PARAMETER: True}}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.probe_timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            return f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError) as exc:  # refused, timed out, cut, not JSON
            return f"{type(exc).__name__}: {exc}"
        return None if answer.get("text_output") == "ok" else f"unexpected answer {answer!r}"

    def watch(self, stop: threading.Event, others: Mapping[str, Child] | None = None) -> str | None:
        """Until `stop` is set (None) or something cannot serve (the reason): tritonserver or another
        child (`others`: name -> process) exited, or the model failed `max_failures` probes in a row."""
        failures = 0
        while not stop.wait(self.probe_interval_s):
            if (code := self.server.process.poll()) is not None:
                return f"tritonserver exited (code {code}):\n{self.server.log_tail()}"
            for name, child in (others or {}).items():
                if (code := child.poll()) is not None:
                    return f"{name} exited (code {code})"
            problem = self.probe()
            failures = failures + 1 if problem else 0
            if problem and failures >= self.max_failures and not stop.is_set():
                return f"model '{MODEL_NAME}' failed {failures} health probes in a row; last: {problem}"
        return None

    def drain(self, timeout_s: float) -> DrainResult:
        """Refuse new requests, let running ones go on for `timeout_s`, cut the rest; returns once the
        model reports nothing in flight (or it stopped reporting, or tritonserver died)."""
        request_drain(self.server.model_dir, time.time() + timeout_s)
        give_up = time.monotonic() + timeout_s + REPORT_GRACE_S
        state = None
        while time.monotonic() < give_up and self.server.process.poll() is None:
            state = drain_state(self.server.model_dir)
            if state is not None and state["in_flight"] == 0:
                return DrainResult(state["cut"], complete=True)
            time.sleep(0.1)
        return DrainResult(state["cut"] if state else 0, complete=False)
