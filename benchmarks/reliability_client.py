"""The reliability benchmark's client: sends the planned jobs through the OpenAI door and records what each got.

aiohttp on one event loop (benchmarks.client's reasons: cheap per token on cores shared with the server).
Outcomes (`classify`): completed; refused (429/503 with a reason in OpenAI's error body); cancelled by the
client; failed having produced nothing; cut after producing deltas. Lost = failed + cut: anything neither
completed, refused with a reason, nor cancelled by the client.

Retries: only a request that got no HTTP response at all (connection refused, not accepted within
`connect_timeout_s`, or dropped before the status line: the gateway process itself was down, or swamped) is
sent again, with backoff, for up to `retry_window_s` from its
first such failure (a request may have waited minutes in a queue before) -- the openai SDK retries such
connection errors too. A 429/503 is never retried here (it is a refusal, counted with its reason), nor a stream
that failed after its 200: what the gateway does about a restarting replica is what is measured. Requests that
needed a retry are counted (`attempts`).

Patience: like the openai SDK's default, a client waits up to `read_timeout_s` (600 s) for the next bytes of an
answer (for a whole answer, or a stream's first delta, that is its whole wait), then gives up: failed or cut,
reason "client timeout" -- an overloaded server that queues without bound loses requests that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field

import aiohttp

from benchmarks.reliability_workload import Job, Prompts

COMPLETED, REFUSED, CANCELLED, FAILED, CUT = "completed", "refused", "cancelled", "failed", "cut"
OUTCOMES = (COMPLETED, REFUSED, CANCELLED, FAILED, CUT)
LOST = (FAILED, CUT)
REFUSALS = (429, 503)


@dataclass
class Result:
    index: int
    kind: str
    stream: bool
    max_tokens: int
    cancel_after: int | None
    start: float  # seconds after the load started (first attempt)
    end: float = 0.0
    first_delta: float | None = None  # first content chunk (streams), or the whole answer's arrival
    deltas: int = 0  # content chunks received
    completion_tokens: int | None = None  # the server's usage count
    status: int | None = None  # HTTP status of the last attempt (None: no response)
    reason: str | None = None  # the error's message: a refusal's, an error event's, or the transport's
    code: str | None = None  # OpenAI error code, where one came
    error_event: bool = False  # a stream ended with an error event
    finished: bool = False  # a finish reason, and for streams [DONE]
    cancelled: bool = False  # the client cancelled it mid-stream
    attempts: int = 1
    tenant: str | None = None
    retry_after_s: float | None = None  # a refusal's Retry-After (retry-after-ms where given)
    text: str = field(default="", repr=False)

    @property
    def outcome(self) -> str:
        return classify(self)

    def to_json(self) -> dict:
        out = asdict(self)
        del out["text"]
        return {**out, "outcome": self.outcome}


def classify(r: Result) -> str:
    """A request's outcome from what its client saw (the order matters: a cancel after the last token is a
    completion; a refusal needs its reason)."""
    if r.finished and r.status == 200 and not r.error_event:
        return COMPLETED
    if r.cancelled:
        return CANCELLED
    if r.status in REFUSALS and r.deltas == 0 and r.reason:
        return REFUSED
    return CUT if r.deltas > 0 else FAILED


class NoResponse(Exception):
    """The request got no HTTP response (refused, reset, or dropped before the status line)."""


def new_result(job: Job, body: dict, t0: float) -> Result:
    return Result(
        job.index, job.kind, job.stream, body["max_tokens"], job.cancel_after, time.monotonic() - t0, tenant=job.tenant
    )


async def send(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict,
    r: Result,
    t0: float,
    retry_window_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
) -> Result:
    """Send `r`'s request through the gateway, again only while it gets no response at all (see the module
    doc); fills `r` in as it goes (a caller that gives up on it still has how far it got)."""
    delay, first_failure = 0.5, None
    while True:
        try:
            await _attempt(session, url + path, body, r, t0, headers)
            break
        except NoResponse as exc:
            r.reason = str(exc)[:300]
            first_failure = first_failure or time.monotonic()
            if time.monotonic() - first_failure + delay > retry_window_s:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)
            r.attempts += 1
    r.end = time.monotonic() - t0
    return r


async def _attempt(
    session: aiohttp.ClientSession, url: str, body: dict, r: Result, t0: float, headers: Mapping[str, str] | None
) -> None:
    try:
        response = await session.post(url, json=body, headers=headers)
    except aiohttp.ConnectionTimeoutError as exc:  # not connected: nothing was sent
        raise NoResponse(f"{type(exc).__name__}: {exc}") from None
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one
        r.reason = "client timeout: no response within the read timeout"
        return
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise NoResponse(f"{type(exc).__name__}: {exc}") from None
    r.status = response.status
    try:
        if response.status != 200:
            r.retry_after_s = retry_after_s(response.headers)
            _refusal(r, await response.text())
        elif r.stream:
            await _read_stream(response, r, t0)
        else:
            _whole(r, await response.json(), t0)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        r.reason = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    finally:
        response.close()  # a cancelled stream's connection closes: the server sees the client leave


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The wait a refusal asks for: retry-after-ms (the openai SDK's first choice), else Retry-After seconds."""
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        with contextlib.suppress(KeyError, ValueError):
            return float(headers[name]) * scale
    return None


def _refusal(r: Result, text: str) -> None:
    try:
        error = json.loads(text)["error"]
        r.reason, r.code = error.get("message") or None, error.get("code")
    except (ValueError, KeyError, TypeError):
        r.reason = None  # no reason given: not a refusal
        r.code = text[:200]


def _whole(r: Result, answer: dict, t0: float) -> None:
    choice = answer["choices"][0]
    r.text = choice["message"]["content"] if "message" in choice else choice["text"]
    r.first_delta, r.deltas = time.monotonic() - t0, 1
    r.completion_tokens = answer.get("usage", {}).get("completion_tokens")
    r.finished = choice.get("finish_reason") is not None


async def _read_stream(response: aiohttp.ClientResponse, r: Result, t0: float) -> None:
    finish = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            r.finished = finish is not None
            return
        event = json.loads(payload)
        if "error" in event:
            r.error_event, r.reason, r.code = True, str(event["error"].get("message"))[:300], event["error"].get("code")
            continue
        if event.get("usage"):
            r.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices", []):
            r.text += choice.get("delta", {}).get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
            r.deltas += 1
            if r.first_delta is None:
                r.first_delta = time.monotonic() - t0
        if r.cancel_after is not None and r.deltas >= r.cancel_after and finish is None:
            r.cancelled = True
            return
    r.reason = r.reason or "the stream ended without [DONE]"


@dataclass
class Load:
    """The traffic's state while it runs: its results as they complete (the chaos controller watches them)."""

    url: str
    prompts: Prompts
    api_keys: Mapping[str, str] = field(default_factory=dict)  # tenant -> its key; a job of no tenant sends none
    read_timeout_s: float = 600.0  # the openai SDK's default: the longest a client waits for the next bytes
    connect_timeout_s: float = 5.0  # the openai SDK's default
    retry_window_s: float = 30.0
    results: list[Result] = field(default_factory=list)
    in_flight: int = 0
    t0: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, planned: Iterator[Job], until: Callable[[Job], bool], drain_wait_s: float) -> float:
        """Send each planned job at its time until `until(job)`; then wait up to `drain_wait_s` for those in
        flight. Returns when the last job was sent (seconds after the start)."""
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                        sock_read=self.read_timeout_s)  # fmt: skip
        last = 0.0
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks: set[asyncio.Task[None]] = set()
            for job in planned:
                wait = job.at - self.now()
                if wait > 0:
                    await asyncio.sleep(wait)
                if until(job):
                    break
                task = asyncio.create_task(self._one(session, job))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                last = job.at
            if tasks:
                await asyncio.wait(set(tasks), timeout=drain_wait_s)
            for task in set(tasks):  # still running past the wait: their records say how far they got
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return last

    async def _one(self, session: aiohttp.ClientSession, job: Job) -> None:
        path, body, conversation = self.prompts.body(job)
        result = new_result(job, body, self.t0)
        self.in_flight += 1
        try:
            key = self.api_keys.get(job.tenant) if job.tenant is not None else None
            headers = {"Authorization": f"Bearer {key}"} if key else None
            await send(session, self.url, path, body, result, self.t0, self.retry_window_s, headers)
        except asyncio.CancelledError:  # past the drain wait
            result.reason, result.end = "still running when the client stopped waiting", self.now()
        finally:
            self.in_flight -= 1
            self.results.append(result)
        self.prompts.answered(conversation, result.text if result.outcome == COMPLETED else None)
