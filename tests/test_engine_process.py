"""The engine core in a process of its own (EngineArgs.engine_process): the same streams as the engine in this
process, its errors raised here with their fields, aborts and stop strings that free the core's blocks, a
drained shutdown, and a core that dies failing its streams instead of hanging them.

Where a request must still run when the test acts, the core steps a simulated device (benchmarks/overlap.py)
that takes 10 ms a step: a 240-token answer takes over 2 s, an abort or a kill arrives within milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import threading
import time

import pytest

from benchmarks.overlap import SimulatedDevice
from engine_format import EngineConfig
from engine_format.kv_handle import KVHandle, KVLayout
from executors.lora import AdapterError
from executors.sampling import TokenLogprobs
from runtime import AsyncLLM, EngineArgs, InvalidRequest, SamplingParams
from runtime.delta_streams import DeltaStream
from runtime.engine.core_outbox import CREDITS, Outbox
from runtime.engine.core_wire import pack_outputs, rebuild_error, unpack_outputs
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.outputs import RequestOutput, TokenOutput, merge_steps
from runtime.engine.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SLOW_BLOCKS = 256
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


@pytest.fixture(scope="module")
def here(llama_engine):
    llm = AsyncLLM(llama_engine, EngineArgs(engine_process=False))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def apart(llama_engine):
    llm = AsyncLLM(llama_engine, EngineArgs())  # the default for role both
    yield llm
    llm.shutdown()


def slow_core(engine_dir, engine_process: bool = True) -> AsyncLLM:
    """A core over a simulated device of 10 ms a step (its tokens: the null backend's, always 7), in its own process
    or on a thread of this one."""
    args = EngineArgs(num_kv_blocks=SLOW_BLOCKS, engine_process=engine_process)
    if not engine_process:
        return AsyncLLM(engine_dir, args, backend=SimulatedDevice(EngineConfig.load(engine_dir), SLOW_BLOCKS, 0.01))
    device = functools.partial(SimulatedDevice, num_blocks=SLOW_BLOCKS, device_s=0.01)
    return AsyncLLM(engine_dir, args, backend_factory=device)


async def collect(llm: AsyncLLM, prompt, params=GREEDY, request_id=None) -> list[RequestOutput]:
    return [d async for d in llm.generate(prompt, params, request_id)]


def answer(deltas: list[RequestOutput]) -> tuple[list[int], str, str | None]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason


def test_streams_match_the_engine_in_this_process(here, apart):
    sampled = dataclasses.replace(GREEDY, temperature=0.9, top_p=0.8, seed=11)
    requests = [([20 + i, 30 + i, 40 + i], GREEDY) for i in range(10)] + [([5, 6, 7], sampled), ("Hello", GREEDY)]

    async def run(llm):
        return await asyncio.gather(*(collect(llm, prompt, params) for prompt, params in requests))

    expected, got = asyncio.run(run(here)), asyncio.run(run(apart))
    assert [answer(d) for d in got] == [answer(d) for d in expected]
    assert all(d[-1].finished and d[-1].num_output_tokens == 24 for d in got)
    assert apart.stats().finished["length"] >= len(requests)


def test_a_stop_string_ends_the_answer_here_and_the_request_in_the_core(here, apart):
    text = answer(asyncio.run(collect(here, [3, 4, 5])))[1]
    stop = text[len(text) // 2 :][:3]  # three characters from the middle of the greedy answer
    params = dataclasses.replace(GREEDY, stop=(stop,))
    expected = answer(asyncio.run(collect(here, [3, 4, 5], params)))
    before = sum(apart.stats().finished.values())
    observed: list[RequestOutput] = []
    told = threading.Event()
    apart.on_finished = lambda final: (observed.append(final), told.set())
    try:
        deltas = asyncio.run(collect(apart, [3, 4, 5], params, request_id="stopped"))
        got = answer(deltas)
        assert got == expected and got[2] == "stop" and stop not in got[1]
        # The core was told: the request is finished there too, its blocks freed ("stop"; or "length" when the
        # core, running ahead, had computed every token before the text was read); its final output brought the
        # request's timing to the observer (metrics), once.
        assert told.wait(timeout=30)
    finally:
        apart.on_finished = None
    stats = apart.stats()
    assert sum(stats.finished.values()) == before + 1 and stats.running == 0 and stats.kv_usage == 0
    [final] = observed
    assert final.request_id == "stopped" and final.finish_reason == "stop" and final.text == deltas[-1].text
    assert final.stats is not None and final.stats["ttft_s"] is not None and final.stats["e2e_s"] is not None


def test_admission_errors_cross_with_their_field(apart):
    with pytest.raises(InvalidRequest) as caught:
        asyncio.run(collect(apart, [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=100_000)))
    assert caught.value.field == "max_tokens" and "max sequence length" in str(caught.value)
    with pytest.raises(InvalidRequest, match="prompt: must not be empty"):  # refused here, untokenized
        asyncio.run(collect(apart, ""))
    with pytest.raises(AdapterError) as adapter:  # an engine without LoRA: the core's error, rebuilt
        asyncio.run(apart.add_lora("a", "/nowhere"))
    assert adapter.value.field == "enable_lora" and apart.list_loras() == {}
    assert asyncio.run(collect(apart, [1, 2, 3]))[-1].finished  # and it keeps serving


def test_a_both_workers_doors_refuse_what_needs_a_kv_transfer_naming_the_field(apart):
    with pytest.raises(InvalidRequest) as caught:  # the core's own check, raised here
        apart.disagg.expect("r", "{}", None)
    assert caught.value.field == "kv_handle"
    with pytest.raises(InvalidRequest, match="prefill_only"):
        apart.disagg.export("r")


def test_a_recompute_handle_continues_after_the_first_token(here, apart):
    """A gateway's fallback when a decode worker cannot read a prefill worker's KV: a `both` worker computes the
    prompt again and goes on after the first token the client already has."""
    prompt = [7, 8, 9, 10]
    expected = answer(asyncio.run(collect(here, prompt)))[0]
    layout = KVLayout(1, 8, 8, 1, "float32", "auto")
    blocks = (0,)  # a prefill worker's: never read, the prompt is computed again
    handle = KVHandle(
        "h1", "nixl", "gone", "", {}, layout, (), blocks, tuple(prompt), expected[0], time.time() + 600, recompute=True
    )

    async def main():
        imp = apart.disagg.expect("rc", handle.to_json(), None)
        await apart.disagg.pull(imp)
        try:
            return await collect(apart, prompt, GREEDY, "rc")
        finally:
            apart.disagg.forget(imp.request_id)

    rest = asyncio.run(main())
    assert [expected[0], *answer(rest)[0]] == expected and apart.disagg.stats().recomputes == 1
    assert rest[-1].num_output_tokens == GREEDY.max_tokens  # the handle's first token counted, as in the core


@pytest.mark.parametrize("engine_process", [True, False], ids=["process", "thread"])
def test_an_id_reused_at_once_gets_its_own_stream_not_the_late_outputs_of_the_request_before(
    llama_engine, engine_process
):
    """A caller leaves while the core runs on (a step's outputs on their way, the abort's final after them) and
    reuses the id at once: the new stream carries only its own tokens (the core knows each by an id of its own)."""
    llm = slow_core(llama_engine, engine_process)
    short = dataclasses.replace(LONG, max_tokens=5)

    async def main():
        for _ in range(3):
            first = llm.generate([9, 9, 9], LONG, "same")
            await first.__anext__()
            await first.aclose()  # aborted in the core; its outputs since are late
            again = await collect(llm, [8, 8, 8], short, "same")
            assert [d.num_output_tokens for d in again][-1] == 5 and again[-1].finish_reason == "length"
            assert sum(len(d.token_ids) for d in again) == 5

    try:
        asyncio.run(main())
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats.finished["abort"] == 3 and stats.finished["length"] == 3 and stats.kv_usage == 0


def test_a_stop_string_request_whose_id_is_reused_at_once_reaches_the_metrics_with_its_stats(llama_engine):
    """Its stream ends here a step before the core's final output (its stats) comes; by then the caller has
    reused the id. The metrics get both requests, the stopped one with its timing. (Token 7, the simulated
    device's every token, reads "%".)"""
    llm = slow_core(llama_engine)
    observed: list[RequestOutput] = []
    finished = threading.Semaphore(0)
    llm.on_finished = lambda final: (observed.append(final), finished.release())

    async def main():
        stopped = await collect(llm, [9, 9, 9], dataclasses.replace(LONG, stop=("%%",)), "same")
        return stopped, await collect(llm, [8, 8, 8], dataclasses.replace(LONG, max_tokens=3), "same")

    try:
        stopped, again = asyncio.run(main())
        assert finished.acquire(timeout=30) and finished.acquire(timeout=30)
    finally:
        llm.shutdown()
    assert answer(stopped)[2] == "stop" and answer(again)[2] == "length"
    by_reason = {final.finish_reason: final for final in observed}
    assert sorted(by_reason) == ["length", "stop"] and {final.request_id for final in observed} == {"same"}
    assert by_reason["stop"].stats is not None and by_reason["stop"].stats["e2e_s"] is not None


def test_a_build_error_is_raised_here_with_its_class_and_words_and_no_process_is_left(llama_engine):
    before = _cores()
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        AsyncLLM(llama_engine, EngineArgs(engine_process=True, max_num_seqs=4, max_num_batched_tokens=2))
    assert _cores() == before


def test_an_abort_and_a_stream_left_early_free_the_cores_blocks(llama_engine):
    llm = slow_core(llama_engine)

    async def main():
        aborted = []
        async for delta in llm.generate([9, 9, 9], LONG, "by-id"):
            aborted.append(delta)
            if len(aborted) == 2:
                assert llm.abort("by-id")
        left = llm.generate([8, 8, 8], LONG, "left")
        await left.__anext__()
        await left.aclose()  # the caller leaves: the request is aborted in the core
        return aborted

    try:
        aborted = asyncio.run(main())
        stats = llm.stats()  # answered after the abort: the core reads its messages in order
    finally:
        llm.shutdown()
    assert aborted[-1].finish_reason == "abort" and aborted[-1].num_output_tokens < LONG.max_tokens
    assert stats.finished["abort"] == 2 and stats.running == 0 and stats.kv_usage == 0


def test_shutdown_drains_running_requests_then_the_process_exits(llama_engine):
    llm = slow_core(llama_engine)

    async def main():
        stream = llm.generate([4, 4, 4], LONG)
        first = await stream.__anext__()
        stopping = asyncio.create_task(asyncio.to_thread(llm.shutdown, 60.0))
        second = await stream.__anext__()
        draining = await asyncio.to_thread(llm.stats)  # calls are answered while the core drains
        rest = [d async for d in stream]
        await stopping
        return [first, second, *rest], draining

    deltas, draining = asyncio.run(main())
    assert draining.running == 1 and not draining.finished
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == LONG.max_tokens
    assert llm._core is not None and llm._core.process.returncode == 0
    # A model's last metrics, after the core has gone: as it closed (a take_ call's records once).
    assert llm.stats().finished == {"length": 1} and llm.stats().generation_tokens == LONG.max_tokens
    assert len(llm.take_step_records()) >= LONG.max_tokens and llm.take_step_records() == []
    with pytest.raises(RuntimeError, match="shutting down"):
        asyncio.run(collect(llm, [1]))


def test_a_core_that_dies_fails_its_streams_and_says_why(llama_engine):
    llm = slow_core(llama_engine)
    assert llm._core is not None

    async def main():
        stream = llm.generate([4, 4, 4], LONG)
        await stream.__anext__()
        os.kill(llm._core.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            async for _ in stream:
                pass

    try:
        asyncio.run(main())
        assert "exited with code -9" in (llm.progress().problem or "")
        with pytest.raises(RuntimeError, match="engine loop died"):
            asyncio.run(collect(llm, [1]))
    finally:
        llm.shutdown()


# ---- the wire and the streams, alone --------------------------------------------------------


def test_outputs_cross_as_columns_and_whole_ones_after_in_order():
    plain = [TokenOutput(f"r{i}", [100 + i], None, 5, i + 1) for i in range(3)]
    merged = TokenOutput("r7", [3, 4], None, 5, 9)  # steps merged for a front end behind: a column too
    final = TokenOutput("r9", [2], None, 5, 7, finish_reason="stop", stats={"ttft_s": 0.1})  # type: ignore[typeddict-item]
    lp = TokenLogprobs(6, -0.5, [(6, -0.5)])
    logprobs = TokenOutput("r8", [6], [lp], 5, 9)
    packed = pack_outputs([plain[0], final, plain[1], merged, logprobs, plain[2]])
    assert packed[:5] == (["r0", "r1", "r7", "r2"], [100, 101, 3, 4, 102], [1, 1, 2, 1], [5] * 4, [1, 2, 9, 3])
    assert unpack_outputs(packed) == [plain[0], plain[1], merged, plain[2], final, logprobs]
    one_each = pack_outputs(plain)
    assert unpack_outputs(one_each) == plain
    for broken in (
        (one_each[0], one_each[1][:2], [1, 1], *one_each[3:]),  # a column short: refused, not misaligned
        (packed[0], packed[1][:4], *packed[2:]),  # a token missing from a merged output
    ):
        with pytest.raises(ValueError):
            unpack_outputs(broken)  # type: ignore[arg-type]


def test_steps_merge_into_one_output_per_request_in_order():
    lp = [TokenLogprobs(t, -1.0, [(t, -1.0)]) for t in range(4)]
    steps = [
        [TokenOutput("a", [1], None, 5, 1, prompt_logprobs=[None]), TokenOutput("b", [2], [lp[0]], 3, 1)],
        [TokenOutput("b", [3], [lp[1]], 3, 2), TokenOutput("c", [9], None, 4, 1)],
        [TokenOutput("a", [4], None, 5, 2, finish_reason="length", stats={"ttft_s": 0.2})],  # type: ignore[typeddict-item]
    ]
    merged = merge_steps(steps)
    assert list(merged) == ["a", "b", "c"]
    a, b, c = merged.values()
    assert (a.token_ids, a.num_output_tokens, a.finish_reason, a.prompt_logprobs) == ([1, 4], 2, "length", [None])
    assert a.stats == {"ttft_s": 0.2}
    assert (b.token_ids, b.logprobs, b.num_output_tokens, b.finish_reason) == ([2, 3], lp[:2], 2, None)
    assert c.token_ids == [9]
    more = merge_steps([[TokenOutput("c", [10], None, 4, 2)]], merged)  # a later message continues them
    assert more["c"].token_ids == [9, 10] and more["c"].num_output_tokens == 2


def test_the_outbox_merges_steps_while_the_front_end_has_not_answered():
    sent: list[tuple] = []
    arrived = threading.Semaphore(0)

    def send(message: tuple) -> None:
        sent.append(message)
        arrived.release()

    outbox = Outbox(send)
    for step in range(1, CREDITS + 1):  # as many messages as credits go at once, one per step
        outbox.put([TokenOutput("r", [step], None, 5, step)], steps=step, unfinished=1)
        assert arrived.acquire(timeout=10)
    for step in range(CREDITS + 1, CREDITS + 4):  # no answer: these wait, merged
        outbox.put([TokenOutput("r", [step], None, 5, step)], steps=step, unfinished=1)
    outbox.put([], steps=CREDITS + 4, unfinished=1)  # an empty step: counted
    assert len(sent) == CREDITS
    outbox.ack()
    assert arrived.acquire(timeout=10)
    assert [unpack_outputs(m[3])[0].token_ids for m in sent] == [[1], [2], [3, 4, 5]]
    assert sent[-1][1:3] == (CREDITS + 4, 1)
    outbox.put([TokenOutput("r", [9], None, 5, 6, finish_reason="abort")], steps=CREDITS + 4, unfinished=0)
    outbox.close()  # what is left goes, credits or not
    assert unpack_outputs(sent[-1][3])[0].finish_reason == "abort" and len(sent) == CREDITS + 2


def test_a_stop_string_finish_is_observed_once_with_the_stats_of_the_cores_final_output(llama_engine):
    tokenizer = load_tokenizer(llama_engine)
    token = next(
        t for t in range(100, 1000) if len(tokenizer.decode([t]).strip()) > 1 and tokenizer.decode([t]).isalpha()
    )
    params = SamplingParams(max_tokens=8, stop=(tokenizer.decode([token]).strip(),))
    observed: list[RequestOutput] = []
    outputs = OutputProcessor(tokenizer, lambda request_id: None, observed.append)  # the core finishes it later
    for request_id in ("a", "b"):
        outputs.add(request_id, [3, 4, 5], params)
        [final] = outputs.process([TokenOutput(request_id, [token, token], None, 3, 2)])
        assert final.finished and final.finish_reason == "stop" and final.stats is None and observed == []
    stats = {"ttft_s": 0.5, "e2e_s": 1.0}
    outputs.process([TokenOutput("a", [token, 7], None, 3, 2, finish_reason="abort", stats=stats)])  # type: ignore[typeddict-item]
    assert [(o.request_id, o.finish_reason, o.stats) for o in observed] == [("a", "stop", stats)]
    outputs.add("b", [3, 4, 5], params)  # "b" names a new request: the one before is observed without its stats
    assert [(o.request_id, o.stats) for o in observed[1:]] == [("b", None)]


def test_errors_cross_as_their_class_with_their_attributes():
    error = rebuild_error(("engine_format.requests", "InvalidRequest", "max_tokens: too many", {"field": "max_tokens"}))
    assert isinstance(error, InvalidRequest) and error.field == "max_tokens" and str(error) == "max_tokens: too many"
    unknown = rebuild_error(("nowhere.module", "Gone", "why", {}))
    assert type(unknown) is RuntimeError and str(unknown) == "nowhere.module.Gone: why"


def test_a_stream_behind_takes_what_came_meanwhile_as_one_delta():
    async def main():
        loop = asyncio.get_running_loop()
        merged, kept = DeltaStream(loop, 1, coalesce=True), DeltaStream(loop, 1, coalesce=False)
        deltas = [RequestOutput("r", t, [i], num_output_tokens=i + 1) for i, t in enumerate("abc")]
        for stream in (merged, kept):
            for delta in deltas:
                stream.put(delta)
            stream.put(ValueError("ended"))
        one = await merged.get()
        three = [await kept.get() for _ in deltas]
        for stream in (merged, kept):  # the error comes after the deltas, not merged into them
            with pytest.raises(ValueError, match="ended"):
                await stream.get()
        return one, three

    one, three = asyncio.run(main())
    assert (one.text, one.token_ids, one.num_output_tokens) == ("abc", [0, 1, 2], 3)
    assert [d.text for d in three] == ["a", "b", "c"]


def _cores() -> set[int]:
    """This process's children that are engine cores (the module's own core among them)."""
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()]
    return {pid for pid in children if "runtime.engine.core_process" in _cmdline(pid)}


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
