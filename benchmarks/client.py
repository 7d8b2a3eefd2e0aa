"""Streaming load generator over HTTP server-sent events (aiohttp, one event loop).

Why SSE over aiohttp rather than tritonclient's gRPC stream: the client shares the 2 cores
with the server, so its cost per token is charged to the engine. One asyncio loop parsing a
small JSON line per token is cheaper than tritonclient.grpc (a stream thread, protobuf
tensors and numpy per response), and it is the same transport and parser vLLM's OpenAI server
is measured with, so the two servers pay the same client overhead. Measured here, 4 streams x
12 tokens against trtserve: 0.011 s client CPU over SSE vs 0.030 s over tritonclient.grpc
(callback thread included); both saw the same token arrival pattern. Client CPU seconds are
recorded with every run.

Arrivals: a fixed number of requests in flight (`concurrency`), or Poisson arrivals at
`rate` requests/s (optionally capped at `concurrency` in flight).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np

from benchmarks.datasets import BenchRequest, ChatRequest
from benchmarks.metrics import RequestRecord

Sender = Callable[[aiohttp.ClientSession, BenchRequest], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class Endpoint:
    # "triton" (generate_stream), "triton-whole" (the same, "stream": false: one response per request),
    # "openai" (vLLM's /v1/completions) or "gateway" (trtserve's); "openai-chat" / "gateway-chat": their
    # /v1/chat/completions (requests are datasets.ChatRequest)
    kind: str
    url: str  # http://host:port
    model: str = "llm"
    metrics_url: str | None = None  # the server's Prometheus /metrics, where known


async def _sse_events(response: aiohttp.ClientResponse):
    """JSON payloads of `data:` lines; tolerates events split across network chunks."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            # Read the body's end too, as the openai SDK does: aiohttp closes a connection whose response was
            # left unfinished, and a reconnect per request would be charged to the server under test.
            await response.content.read()
            return
        yield json.loads(payload)


async def send_triton(
    session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest, stream: bool = True
) -> RequestRecord:
    """Without `stream` the answer comes as one event: its time is the first (and last) token's."""
    body = {"text_input": req.prompt, "max_tokens": req.max_tokens, "stream": stream, "temperature": 0.0,
            "ignore_eos": req.ignore_eos}  # fmt: skip
    url = f"{endpoint.url}/v2/models/{endpoint.model}/generate_stream"
    return await _stream(session, url, body, req, lambda event: event)


async def send_openai(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest) -> RequestRecord:
    """vLLM's OpenAI completions API; token ids as the prompt; usage in every chunk gives the
    exact token count per chunk."""
    body = {"model": endpoint.model, "prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": req.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    return await _stream(session, f"{endpoint.url}/v1/completions", body, req, lambda event: event.get("usage") or {})


async def send_gateway(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest) -> RequestRecord:
    """trtserve's gateway /v1/completions with the text prompt. It has no per-chunk usage, so every chunk
    counts as one token (one upstream delta each) and the final usage chunk settles the total: a
    mismatch shows up as a multi-token last chunk or a length error, never silently."""
    body = {"model": endpoint.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": req.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = 0

    def counts(event: dict) -> dict:
        nonlocal chunks
        if event.get("usage"):
            return event["usage"]
        chunks += len(event.get("choices", []))
        return {"completion_tokens": chunks}

    return await _stream(session, f"{endpoint.url}/v1/completions", body, req, counts)


async def send_chat(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest) -> RequestRecord:
    """/v1/chat/completions, streamed, with the request's messages, temperature and seed (EOS honoured unless the
    request ignores it). vLLM ("openai-chat"): usage in every chunk (continuous_usage_stats) gives the exact
    tokens per chunk. trtserve's gateway ("gateway-chat") has no per-chunk usage: every chunk with a choice counts
    as one token (one upstream delta each; chat's first also carries the role) and the final usage chunk settles
    the total. Either way a stream without that final usage, or whose tokens differ from it, is an error."""
    if not isinstance(req, ChatRequest) or not req.messages:
        raise TypeError("chat endpoints take datasets.ChatRequest with messages")
    per_chunk = endpoint.kind == "openai-chat"
    options = {"include_usage": True, **({"continuous_usage_stats": True} if per_chunk else {})}
    body = {"model": endpoint.model, "messages": [{"role": role, "content": text} for role, text in req.messages],
            "max_tokens": req.max_tokens, "temperature": req.temperature, "stream": True,
            "stream_options": options}  # fmt: skip
    if req.seed is not None:
        body["seed"] = req.seed
    if req.ignore_eos:
        body["ignore_eos"] = True
    chunks, final = 0, None

    def counts(event: dict) -> dict:
        nonlocal chunks, final
        usage = event.get("usage")
        if usage and not event.get("choices"):  # the last chunk: the totals
            final = int(usage.get("completion_tokens", -1))
            return usage
        if per_chunk:
            return usage or {}
        chunks += len(event.get("choices", []))
        return {"completion_tokens": chunks}

    record = await _stream(session, f"{endpoint.url}/v1/chat/completions", body, req, counts)
    if record.error is None and final is None:
        record.error = "the stream ended without its usage chunk"
    elif record.error is None and final != record.output_tokens:
        record.error = f"server counted {final} completion tokens, the stream carried {record.output_tokens}"
    return record


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, req: BenchRequest, counts) -> RequestRecord:
    """POST one streaming request and time its chunks. `counts(event)` returns the dict holding
    the cumulative `completion_tokens` / `prompt_tokens` of an SSE event."""
    record = RequestRecord(start=time.perf_counter())
    seen = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for event in _sse_events(resp):
                    now = time.perf_counter()
                    if "error" in event:
                        record.error = str(event["error"])[:200]
                        break
                    usage = counts(event)
                    total = int(usage.get("completion_tokens", seen))
                    if total > seen:
                        record.chunk_times.append(now)
                        record.chunk_tokens.append(total - seen)
                        seen = total
                    record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    record.end = time.perf_counter()
    return _check(record, req)


def _check(record: RequestRecord, req: BenchRequest) -> RequestRecord:
    """A run whose prompts or lengths silently differ from the workload must not count."""
    if record.error is None and record.prompt_tokens != len(req.prompt_ids):
        record.error = f"server counted {record.prompt_tokens} prompt tokens, workload has {len(req.prompt_ids)}"
    if record.error is None and req.ignore_eos and record.output_tokens != req.max_tokens:
        record.error = f"EOS ignored but got {record.output_tokens} of {req.max_tokens} tokens"
    return record


def sender_for(endpoint: Endpoint) -> Sender:
    send = {"triton": send_triton, "triton-whole": functools.partial(send_triton, stream=False), "openai": send_openai,
            "gateway": send_gateway, "openai-chat": send_chat, "gateway-chat": send_chat}[endpoint.kind]  # fmt: skip
    return lambda session, req: send(session, endpoint, req)


def arrival_gaps(n: int, rate: float | None, seed: int = 0) -> np.ndarray:
    """Seconds to wait before each of `n` sends: exponential gaps (a Poisson process at `rate`
    requests/s, seeded), or all zero without a rate (every request sent at once)."""
    if rate is None:
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("rate must be positive")
    return np.random.default_rng(seed).exponential(1.0 / rate, n)


@dataclass(frozen=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    client_cpu_s: float


async def run_load(
    send: Sender,
    requests: Sequence[BenchRequest],
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    timeout_s: float = 1800.0,
) -> LoadResult:
    """Send every request; at most `concurrency` in flight, arrivals at Poisson `rate` if set."""
    if concurrency is None and rate is None:
        raise ValueError("give concurrency, rate, or both")
    gate = asyncio.Semaphore(concurrency or len(requests))
    gaps = arrival_gaps(len(requests), rate, seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def one(req: BenchRequest) -> RequestRecord:
            async with gate:
                return await send(session, req)

        cpu0, start = time.process_time(), time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(one(req)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return LoadResult(records, duration, time.process_time() - cpu0)


def run(endpoint: Endpoint, requests: Sequence[BenchRequest], warmup: Sequence[BenchRequest], **kwargs) -> LoadResult:
    """Warm-up requests (not measured) at the same concurrency, then the measured phase."""
    send = sender_for(endpoint)
    if warmup:
        asyncio.run(run_load(send, warmup, concurrency=kwargs.get("concurrency") or len(warmup)))
    return asyncio.run(run_load(send, requests, **kwargs))
