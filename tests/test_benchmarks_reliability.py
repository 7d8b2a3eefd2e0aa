"""The reliability benchmark's harness: how a request's outcome is judged, the report built from outcomes, the
traffic it plans, what it reads from serve's output and the kernel log, its client against a fake gateway (a
refusal, an error event, a cancel, a gateway that is down); and one short chaos run against `trtserve serve`
(tiny engine, the model's stub killed once): no request that had produced nothing is lost, a restart is seen."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.reliability_client import CANCELLED, COMPLETED, CUT, FAILED, REFUSED, Result, classify, new_result, send
from benchmarks.reliability_report import first_served_after, kill_report, render, summary, targets
from benchmarks.reliability_serve import RESTARTED, kernel_crashes
from benchmarks.reliability_workload import Job, Mix, jobs, rate_at
from runtime.serve.launcher import free_port


def result(index: int = 0, start: float = 0.0, end: float = 1.0, **kw) -> Result:
    fields = {"kind": "rag", "stream": True, "max_tokens": 32, "cancel_after": None, **kw}
    return Result(index, start=start, end=end, **fields)


# --- outcomes ---


@pytest.mark.parametrize(("kw", "outcome"), [
    ({"status": 200, "finished": True, "deltas": 9, "first_delta": 0.1}, COMPLETED),
    ({"status": 200, "finished": True, "deltas": 9, "cancelled": True}, COMPLETED),  # the cancel came too late
    ({"status": 200, "deltas": 3, "cancelled": True}, CANCELLED),
    ({"status": 429, "reason": "overloaded: 1024 requests waiting", "code": "overloaded"}, REFUSED),
    ({"status": 503, "reason": "no replica was ready again within 30 s"}, REFUSED),
    ({"status": 503, "reason": None, "code": "<html>"}, FAILED),  # a refusal must say why
    ({"status": 500, "reason": "gateway error"}, FAILED),
    ({"status": None, "reason": "ClientConnectorError: refused", "attempts": 9}, FAILED),
    ({"status": 200, "deltas": 4, "error_event": True, "reason": "unreachable"}, CUT),
    ({"status": 200, "deltas": 4, "reason": "ClientPayloadError"}, CUT),
    ({"status": 200, "finished": True, "deltas": 4, "error_event": True}, CUT),
])  # fmt: skip
def test_outcome_of_what_the_client_saw(kw, outcome):
    assert classify(result(**kw)) == outcome


def test_summary_counts_lost_requests_refusals_and_retries():
    rs = [
        result(0, status=200, finished=True, deltas=5, first_delta=0.2, completion_tokens=5, end=1.0),
        result(1, status=200, finished=True, deltas=1, first_delta=2.0, stream=False, attempts=3, end=2.0),
        result(2, status=429, reason="overloaded: queue full", code="overloaded"),
        result(3, status=429, reason="overloaded: queue full again", code="overloaded"),
        result(4, status=200, deltas=2, first_delta=3.5, error_event=True, reason="cut", start=3.0, end=4.0),
        result(5, status=None, reason="refused", start=5.0, end=6.0),
        result(6, status=200, deltas=1, first_delta=0.3, cancelled=True),
    ]
    s = summary(rs)
    assert s["outcomes"] == {COMPLETED: 2, REFUSED: 2, CANCELLED: 1, FAILED: 1, CUT: 1}
    assert (s["lost"], s["lost_nothing_produced"], s["cut_with_error_event"]) == (2, 1, 1)
    assert s["refusals"] == [{"status": 429, "code": "overloaded", "count": 2,
                              "reasons": ["overloaded: queue full", "overloaded: queue full again"]}]  # fmt: skip
    assert (s["client_retried"], s["client_retried_completed"]) == (1, 1)
    assert [p["index"] for p in s["problems"]] == [4, 5] and s["problems"][1]["reason"] == "refused"
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)  # streams only: 0.2, 0.5, 0.3 s
    assert s["by_kind"]["rag whole"][COMPLETED] == 1 and s["output_tokens"] == 5


def test_recovery_is_the_first_answer_begun_after_the_kill():
    rs = [
        result(0, start=0.0, end=12.0, status=200, finished=True, deltas=3, first_delta=1.0),  # began before
        result(1, start=9.0, end=15.0, status=200, finished=True, deltas=3, first_delta=14.0),
        result(2, start=9.5, end=10.5, status=200, deltas=2, first_delta=9.6, error_event=True, reason="x"),
        result(3, start=20.0, end=21.0, status=200, finished=True, deltas=3, first_delta=20.5),
    ]
    assert first_served_after(rs, 10.0) == 15.0
    said = {"t_s": 14.0, "child": "tritonserver", "serving_again_s": 3.5}
    k = kill_report("stub", 42, 10.0, rs, said, until=30.0)
    assert (k["recovery_s"], k["affected"], k["cut"], k["lost_nothing_produced"]) == (5.0, 3, 1, 0)
    assert kill_report("stub", 42, 10.0, rs, said, until=14.0)["affected"] == 2  # #1 ends after the next kill
    assert kill_report("gateway", 7, 22.0, rs, None, 30.0)["recovery_s"] is None


def test_kill_reports_end_each_kill_at_the_next_and_a_run_without_kills_has_none():
    from benchmarks.reliability import kill_reports

    rs = [result(0, start=9.0, end=15.0, status=200, finished=True, deltas=3, first_delta=14.0)]
    kills = [{"target": t, "pid": 1, "t_kill": at, "restart": None} for t, at in (("stub", 10.0), ("gateway", 14.0))]
    assert [k["affected"] for k in kill_reports(kills, rs, end=30.0)] == [0, 1]  # #0 ended after the 2nd kill
    assert kill_reports([], rs, end=30.0) == []  # soak, burst (this raised before)


def payload(results: list[Result], mode: str = "chaos", **server) -> dict:
    s = summary(results)
    p = {
        "mode": mode, "label": "t", "command": "python -m benchmarks.reliability chaos", "serve_command": ["trtserve"],
        "machine": {"cpu": "cpu", "cores": 2}, "date_utc": "2026-01-01T00:00:00+00:00", "wall_s": 60.0,
        "workload": "w", "config": {"describe": "d"}, "load": {"arrivals_s": 50.0}, "summary": s,
        "kills": [kill_report("stub", 42, 10.0, results, None, 30.0)],
        "server": {"ready_s": 5.0, "restarts": [{"t_s": 14.0, "child": "tritonserver", "serving_again_s": 3.5}],
                   "exit_code": 0, "exit_s": 3.0, "serve_errors": ["Error: the model cannot serve"], "sample_s": 1.0,
                   "crashes": {"count": 0, "fatal_python_errors": {"/tmp/a.log": 0}, "kernel_ours": [],
                               "kernel_others": ["[1.0] python[3]: segfault"], "dmesg_readable": True},
                   "peak_rss_mib": {"tritonserver": 40, "stubs": 500, "gateway": 100, "total": 640},
                   "kv_after": {"usage_ratio": 0.0, "used_blocks": 0.0}, "healthy_after": True, **server},
    }  # fmt: skip
    p["targets"] = targets(p)
    return p


def test_targets_and_markdown():
    rs = [
        result(0, start=9.0, end=15.0, status=200, finished=True, deltas=3, first_delta=14.0),
        result(1, start=9.5, end=10.5, status=200, deltas=2, error_event=True, reason="Stream removed | x"),
    ]
    p = payload(rs)
    met = {t["name"].split(":")[0]: t["met"] for t in p["targets"]}
    assert not met["requests lost (neither completed, refused with a reason, nor cancelled)"]  # the cut stream
    assert met["stub killed"] and met["serve's exit code after SIGTERM"]
    md = render(p)
    assert "| stub (pid 42) | 10.0 | 5.0 | 4.0 | - | 2 | 1 | 0 | 0 | 0 | 1 (1) | 0 |" in md
    assert "Stream removed / x" in md and "**no**" in md and "serving again 3.5 s" in md
    assert "not counted: 1" in md  # another process's segfault is shown, not counted
    assert "**no**" in render(payload(rs, exit_code=4))
    assert "Memory per stream" not in md
    burst = render(payload(rs, mode="burst", rss_timeline_mib=[[0.5, 40, 400, 100], [1.0, 40, 410, 130], [2, 1, 1, 1]]))
    assert "the gateway grew 30 MiB from its first sample (0.5 s) to its peak with 2 streams open (15360 KiB" in burst
    assert "the stubs 10 MiB" in burst


# --- traffic ---


def test_planned_traffic_is_seeded_bursty_and_sized():
    mix = Mix()
    first = [j for _, j in zip(range(3000), jobs(1.5, mix, seed=3), strict=False)]
    assert first[:50] == [j for _, j in zip(range(50), jobs(1.5, mix, seed=3), strict=False)]
    span = first[-1].at
    assert 1.35 < len(first) / span < 1.65  # the mean rate
    calm = sum(int(j.at // mix.burst_period_s) % 2 == 0 for j in first)
    assert 1.6 < (len(first) - calm) / calm < 2.4  # bursts at twice the calm rate
    assert rate_at(0.0, 1.5, 30) == 1.0 and rate_at(31.0, 1.5, 30) == 2.0
    assert all(16 <= j.max_tokens <= 384 for j in first)
    assert sorted({j.kind for j in first}) == ["chat", "oneshot", "rag"]
    streams = [j for j in first if j.stream]
    assert 0.65 < len(streams) / len(first) < 0.75
    cancelled = [j for j in streams if j.cancel_after is not None]
    assert 0.15 < len(cancelled) / len(streams) < 0.25 and all(1 <= j.cancel_after < j.max_tokens for j in cancelled)
    assert all(j.cancel_after is None for j in first if not j.stream)


def test_mix_fits_small_engines():
    assert Mix().fit(2048) == Mix()
    small = Mix().fit(256)
    assert small.answer_tokens == (16, 64) and small.doc_tokens == 96


def test_chats_feed_earlier_answers_back_and_fit_the_engine(llama_engine):
    from benchmarks.reliability_workload import Prompts
    from runtime.engine.tokenizer import load_tokenizer

    prompts = Prompts(load_tokenizer(llama_engine), Mix().fit(256), 256, "tiny")
    chat = Job(0, 0.0, "chat", True, 40, None, 5)
    path, body, conversation = prompts.body(chat)
    assert path == "/v1/chat/completions" and body["messages"][-1]["role"] == "user" and conversation.busy
    prompts.answered(conversation, "An answer.")
    _, again, same = prompts.body(replace(chat, index=1))
    assert same is conversation and [m["role"] for m in again["messages"]] == ["user", "assistant", "user"]
    assert again["messages"][1]["content"] == "An answer."
    prompts.answered(same, None)  # not completed: the user leaves
    assert conversation not in prompts.conversations
    path, rag, _ = prompts.body(Job(2, 0.0, "rag", False, 64, None, 1))
    assert rag["messages"][0]["role"] == "system" and "stream_options" not in rag
    assert prompts.chat_tokens(rag["messages"]) + rag["max_tokens"] <= 256
    path, one, _ = prompts.body(Job(3, 0.0, "oneshot", True, 64, 4, 1))
    assert path == "/v1/completions" and one["stream_options"] == {"include_usage": True}


# --- what is read from serve and the kernel ---


def test_restart_lines_and_kernel_crashes():
    line = "the OpenAI gateway restarted: serving again 3.4 s after the failure was seen"
    m = RESTARTED.match(line)
    assert m and (m["child"], m["seconds"]) == ("the OpenAI gateway", "3.4")
    dmesg = "\n".join([
        "[ 100.5] triton_python_b[13245]: segfault at 60 ip 0000557d3e8e5260 sp 00007ffec7732b70 error 4",
        "[ 200.0] triton_python_b[555]: segfault at 60 ip 0000557d3e8e5260",
        "[ 201.0] traps: python[556] general protection fault ip:7f sp:7f error:0",
        "[ 202.0] bash[557]: segfault at 0",
        "[ 203.0] Code: ff 01 00 00 77 60",
    ])  # fmt: skip
    ours, others = kernel_crashes(dmesg, since_uptime_s=150.0, pids={555, 13245})
    assert ours == ["[ 200.0] triton_python_b[555]: segfault at 60 ip 0000557d3e8e5260"]
    assert others == ["[ 201.0] traps: python[556] general protection fault ip:7f sp:7f error:0"]


# --- the client against a fake gateway ---


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


async def fake_gateway(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "refuse":
        error = {"error": {"message": "overloaded: queue full", "code": "overloaded"}}
        return web.json_response(error, status=429, headers={"Retry-After": "3", "retry-after-ms": "2500"})
    if body["prompt"] == "whose":  # answers with the key it was sent
        error = {"error": {"message": request.headers.get("Authorization", "none"), "code": "who"}}
        return web.json_response(error, status=503, headers={"Retry-After": "7"})
    chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if body["prompt"] == "cut":
        await response.write(sse(chunk, {"error": {"message": "unreachable", "code": None}}, b"[DONE]"))
    else:
        await response.write(sse(*[chunk] * 5, last, {"choices": [], "usage": {"completion_tokens": 6}}, b"[DONE]"))
    return response


def test_client_outcomes_against_a_fake_gateway():
    async def scenario() -> list[Result]:
        app = web.Application()
        app.router.add_post("/v1/completions", fake_gateway)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url, t0, out = str(server.make_url("")).rstrip("/"), time.monotonic(), []
            for prompt, cancel_after in (("ok", None), ("ok", 2), ("refuse", None), ("cut", None)):
                job = Job(len(out), 0.0, "oneshot", True, 6, cancel_after, 0)
                body = {"prompt": prompt, "max_tokens": 6, "stream": True}
                out.append(await send(session, url, "/v1/completions", body, new_result(job, body, t0), t0))
            body = {"prompt": "whose", "max_tokens": 6, "stream": True}
            job = Job(len(out), 0.0, "oneshot", True, 6, None, 0, tenant="acme")
            headers = {"Authorization": "Bearer sk-acme"}
            out.append(await send(session, url, "/v1/completions", body, new_result(job, body, t0), t0, 1.0, headers))
            down = f"http://127.0.0.1:{free_port()}"  # nothing listens: no response, retried within the window
            r = new_result(Job(4, 0.0, "oneshot", False, 6, None, 0), {"max_tokens": 6}, t0)
            out.append(await send(session, down, "/v1/completions", {"prompt": "x"}, r, t0, retry_window_s=1.0))
            return out

    ok, cancelled, refused, cut, keyed, down = asyncio.run(scenario())
    assert ok.outcome == COMPLETED and ok.deltas == 6 and ok.completion_tokens == 6 and ok.text == "aaaaab"
    assert cancelled.outcome == CANCELLED and cancelled.deltas == 2
    assert refused.outcome == REFUSED and refused.reason == "overloaded: queue full" and refused.code == "overloaded"
    assert refused.retry_after_s == 2.5 and ok.retry_after_s is None  # retry-after-ms first, as the openai SDK
    assert (keyed.tenant, keyed.reason, keyed.retry_after_s) == ("acme", "Bearer sk-acme", 7.0)
    assert cut.outcome == CUT and cut.error_event and cut.reason == "unreachable"
    assert down.outcome == FAILED and down.status is None and down.attempts >= 2 and "Connect" in down.reason


def test_a_connection_never_accepted_is_tried_again_then_failed():
    """A swamped gateway that does not accept connections (its accept queue full) gets the request again, like a
    refused connection: nothing was sent. Here no attempt ever connects."""
    with socket.socket() as listener, socket.socket() as queued:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        queued.connect(listener.getsockname())  # fills the accept queue: later SYNs are dropped
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def scenario() -> Result:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=0.3, sock_read=5)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                t0 = time.monotonic()
                r = new_result(Job(0, 0.0, "oneshot", False, 6, None, 0), {"max_tokens": 6}, t0)
                return await send(session, url, "/v1/completions", {"prompt": "x"}, r, t0, retry_window_s=1.0)

        r = asyncio.run(scenario())
    assert r.outcome == FAILED and r.status is None and r.attempts >= 2 and "ConnectionTimeoutError" in r.reason


# --- one short chaos run against trtserve serve ---


@pytest.mark.serving
def test_a_killed_stub_loses_no_request_that_had_produced_nothing(llama_engine, tmp_path, monkeypatch):
    from benchmarks import report
    from benchmarks.reliability import Run, measure, write

    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    run = Run("chaos", llama_engine, rate=4.0, kills=("stub",), warmup_s=3.0, settle_s=2.0, drain_wait_s=60.0,
              label="test")  # fmt: skip
    p, results = measure(run, "test", log_fn=lambda message: None)
    s, kill = p["summary"], p["kills"][0]
    problems = json.dumps(s["problems"], indent=1)
    assert s["requests"] > 10 and s["outcomes"][COMPLETED] > 5, s
    assert s["lost_nothing_produced"] == 0, problems
    assert s["cut_with_error_event"] == s["outcomes"][CUT], problems  # a cut stream is told why
    assert p["server"]["restarts"] and p["server"]["restarts"][0]["child"] == "tritonserver"
    assert kill["recovery_s"] is not None and kill["recovery_s"] <= 30, kill
    assert p["server"]["crashes"]["count"] == 0 and p["server"]["exit_code"] == 0, p["server"]
    md = write(run, p, results)
    assert md == tmp_path / "reliability-chaos-test.md" and "## Kills" in md.read_text()
    assert md.with_suffix(".png").stat().st_size > 10_000
    assert (tmp_path / "logs" / "reliability-chaos-test" / "requests.jsonl").is_file()
