"""The async engine with its core on a thread of this process (tests/test_engine_process.py: in a process of
its own, the default): streaming deltas, cancellation that frees blocks, errors up front.

The engine loop runs ahead of the stream's reader on its own thread (the tiny engine makes
hundreds of tokens in the time a reader takes to wake), so a test that acts mid-stream first
holds the loop (`hold_after`): what it does then cannot race the rest of the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from runtime import AsyncLLM, EngineArgs, InvalidRequest, SamplingParams
from runtime.request_ids import caller_id

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_engine):
    finished = []
    llm = AsyncLLM(llama_engine, EngineArgs(engine_process=False), on_finished=finished.append)
    llm.finished_outputs = finished
    yield llm
    llm.shutdown()


async def collect(engine: AsyncLLM, prompt, params=GREEDY, request_id=None):
    return [d async for d in engine.generate(prompt, params, request_id)]


@contextlib.contextmanager
def hold_after(engine: AsyncLLM, request_id: str, num_tokens: int):
    """Once `request_id` has `num_tokens` output tokens, the engine loop takes no further step
    until the block exits (its outputs so far are handed to the output thread; the next step waits).
    Yields an event set once the loop waits."""
    real_step = engine.engine.step_tokens
    reached, parked, release = threading.Event(), threading.Event(), threading.Event()

    def step():
        if reached.is_set():
            parked.set()
            release.wait(timeout=60)  # bounded: a failing test must not hang the engine thread
        outputs = real_step()
        if any(caller_id(o.request_id) == request_id and o.num_output_tokens >= num_tokens for o in outputs):
            reached.set()
        return outputs

    engine.engine.step_tokens = step
    try:
        yield parked
    finally:
        release.set()
        del engine.engine.step_tokens  # the class's method again


def test_stream_concatenates_to_the_full_completion(engine):
    deltas = asyncio.run(collect(engine, [11, 12, 13]))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 24
    text = "".join(d.text for d in deltas)
    assert text == engine.engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_many_concurrent_streams_match_their_solo_runs(engine):
    prompts = [[20 + i, 30 + i, 40 + i] for i in range(12)]

    async def main():
        solo = [await collect(engine, p) for p in prompts[:3]]
        together = await asyncio.gather(*(collect(engine, p) for p in prompts))
        return solo, together

    solo, together = asyncio.run(main())
    flat = [[t for d in run for t in d.token_ids] for run in together]
    assert flat[:3] == [[t for d in run for t in d.token_ids] for run in solo]
    assert engine.engine.kv.pool.counts()["used"] == 0


def test_leaving_the_stream_early_aborts_and_frees_blocks(engine):
    async def main():
        stream = engine.generate(list(range(5, 80)), SamplingParams(max_tokens=150, ignore_eos=True), "quitter")
        async for delta in stream:
            if delta.num_output_tokens >= 3:
                break
        await stream.aclose()

    with hold_after(engine, "quitter", 3):  # still running when the stream is left
        asyncio.run(main())
    assert "quitter" not in engine.engine.requests
    assert engine.engine.kv.pool.counts()["used"] == 0
    assert [o.finish_reason for o in engine.finished_outputs if o.request_id == "quitter"] == ["abort"]
    engine.engine.check_invariants()


def test_abort_by_id_ends_the_stream(engine):
    async def main():
        deltas = []
        async for delta in engine.generate([9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True), "by-id"):
            deltas.append(delta)
            if len(deltas) == 2:
                assert engine.abort("by-id")
        return deltas

    with hold_after(engine, "by-id", 2):  # still running when it is aborted
        deltas = asyncio.run(main())
    assert [(d.num_output_tokens, d.finish_reason) for d in deltas] == [(1, None), (2, None), (2, "abort")]
    assert engine.engine.kv.pool.counts()["used"] == 0


def test_a_stream_interval_sends_the_first_token_then_that_many_tokens_a_delta(engine):
    every_token = asyncio.run(collect(engine, [11, 12, 13], dataclasses.replace(GREEDY, logprobs=1)))
    deltas = asyncio.run(collect(engine, [11, 12, 13], dataclasses.replace(GREEDY, logprobs=1, stream_interval=5)))
    assert [len(d.token_ids) for d in every_token] == [1] * 24
    assert [len(d.token_ids) for d in deltas] == [1, 5, 5, 5, 5, 3]  # the last: what was left at max_tokens
    assert [d.num_output_tokens for d in deltas] == [1, 6, 11, 16, 21, 24]
    assert [d.finished for d in deltas] == [False] * 5 + [True]
    for field in ("token_ids", "logprobs"):  # the same tokens and logprobs, only fewer deltas
        assert [x for d in deltas for x in getattr(d, field)] == [x for d in every_token for x in getattr(d, field)]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in every_token)


def test_the_servers_stream_interval_is_a_floor_that_a_request_may_raise(llama_engine):
    llm = AsyncLLM(llama_engine, EngineArgs(stream_interval=4, engine_process=False))
    try:
        sizes = {ask: [len(d.token_ids) for d in asyncio.run(collect(llm, [5, 6, 7], dataclasses.replace(
            GREEDY, stream_interval=ask)))] for ask in (None, 2, 10)}  # fmt: skip
    finally:
        llm.shutdown()
    assert sizes == {None: [1, 4, 4, 4, 4, 4, 3], 2: [1, 4, 4, 4, 4, 4, 3], 10: [1, 10, 10, 3]}


def test_an_abort_delivers_the_tokens_held_back_by_the_stream_interval(engine):
    async def main(parked: threading.Event):
        stream = engine.generate(
            [9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True, stream_interval=100), "held"
        )
        deltas = [await stream.__anext__()]
        await asyncio.to_thread(parked.wait, 60)  # 5 tokens made, 4 of them held back
        assert engine.abort("held")
        return deltas + [d async for d in stream]

    with hold_after(engine, "held", 5) as parked:
        deltas = asyncio.run(main(parked))
    assert [(len(d.token_ids), d.num_output_tokens, d.finish_reason) for d in deltas] == [(1, 1, None), (4, 5, "abort")]
    assert engine.engine.kv.pool.counts()["used"] == 0


def test_admission_errors_raise_before_streaming(engine):
    with pytest.raises(InvalidRequest, match="prompt"):
        asyncio.run(collect(engine, ""))
    # The engine keeps serving.
    assert asyncio.run(collect(engine, [1, 2, 3]))[-1].finished


def test_random_sampling_streams_valid_utf8(engine):
    """Sampled byte-level tokens split multi-byte characters; the stream never shows U+FFFD
    beyond what decoding the whole output gives."""
    params = SamplingParams(temperature=1.5, max_tokens=120, ignore_eos=True, seed=3)
    deltas = asyncio.run(collect(engine, [3, 4, 5], params))
    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    full = engine.engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == full
    assert sum(d.text.count("\ufffd") for d in deltas) == full.count("\ufffd")


def test_duplicate_request_id_is_rejected_and_the_first_stream_completes(engine):
    async def main():
        first = engine.generate([7, 7, 7], GREEDY, "dup")
        head = await first.__anext__()
        with pytest.raises(InvalidRequest, match="request_id"):
            await collect(engine, [8, 8, 8], GREEDY, "dup")
        return [head] + [d async for d in first]

    deltas = asyncio.run(main())
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == GREEDY.max_tokens


def test_engine_is_built_on_the_thread_that_steps_it(llama_engine, monkeypatch):
    """OpenMP keeps a worker pool per thread that starts parallel work; building on the caller's thread and
    stepping on the engine's made two pools and slowed cpu-bf16 steps by ~80% (runtime/async_llm.py)."""
    import runtime.engine.llm_engine as llm_engine

    built_on = []
    real = llm_engine.prepare_backend

    def recording(*args, **kwargs):
        built_on.append(("prepared", threading.current_thread().name))
        build = real(*args, **kwargs)

        def recorded_build():
            built_on.append(("built", threading.current_thread().name))
            return build()

        return recorded_build

    monkeypatch.setattr(llm_engine, "prepare_backend", recording)
    llm = AsyncLLM(llama_engine, EngineArgs(engine_process=False))
    try:
        assert built_on == [("prepared", "trtserve-engine"), ("built", "trtserve-engine")]
        assert llm._thread.name == "trtserve-engine"
    finally:
        llm.shutdown()


def test_a_failing_engine_build_raises_in_the_caller(tmp_path):
    from engine_format import EngineLoadError

    with pytest.raises(EngineLoadError):
        AsyncLLM(tmp_path)  # no engine there
