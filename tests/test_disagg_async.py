"""Disaggregation through AsyncLLM, as the Triton model drives it (runtime/triton_model/kv_door.py), with the
engine core in a process of its own (the default) and on a thread: a prefill worker hands its KV on, a decode
worker reads it and goes on, and the answer equals one `both` worker's token for token. A read whose caller
left is cancelled in the core; a late cleanup keeps the mark of a request started under the same id.
Real NIXL agents (UCX over host memory), the tiny Llama.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_format import EngineConfig
from runtime import AsyncLLM, EngineArgs, SamplingParams
from runtime.engine.disagg import HANDOFF
from runtime.triton_model import kv_door
from runtime.triton_model.inputs import ParsedRequest
from tests.helpers import random_prompts
from tests.triton_helpers import wait_for

pytest.importorskip("nixl_cu12", reason="NIXL is the extra trtserve[disagg]")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MODES = pytest.mark.parametrize("engine_process", [True, False], ids=["process", "thread"])


def prompt_of(engine_dir, length: int, seed: int) -> list[int]:
    return random_prompts(EngineConfig.load(engine_dir).model.vocab_size, [length], seed=seed)[0]


async def answer(llm: AsyncLLM, parsed: ParsedRequest, request_id: str) -> list:
    async with kv_door.disaggregated(llm, parsed, request_id):
        return [o async for o in llm.generate(parsed.prompt, parsed.params, request_id=request_id)]


@MODES
def test_prefill_then_decode_answers_as_one_worker(llama_engine, engine_process):
    prefill = AsyncLLM(llama_engine, EngineArgs(role="prefill", engine_process=engine_process))
    decode = AsyncLLM(llama_engine, EngineArgs(role="decode", engine_process=engine_process))
    both = AsyncLLM(llama_engine, EngineArgs(engine_process=False))
    prompts = [prompt_of(llama_engine, n, seed) for n, seed in ((9, 1), (40, 2))]

    async def main():
        answers = []
        for i, prompt in enumerate(prompts):
            first = await answer(prefill, ParsedRequest(prompt, GREEDY, stream=True, prefill_only=True), f"r{i}")
            assert first[-1].finish_reason == HANDOFF and first[-1].kv_handle is not None
            handle = first[-1].kv_handle
            rest = await answer(decode, ParsedRequest(prompt, GREEDY, stream=True, kv_handle=handle), f"r{i}")
            one = await answer(both, ParsedRequest(prompt, GREEDY, stream=True), f"r{i}")
            answers.append((first + rest, one))
        return answers

    try:
        for split, one in asyncio.run(main()):
            assert [t for o in split for t in o.token_ids] == [t for o in one for t in o.token_ids]
            assert "".join(o.text for o in split) == "".join(o.text for o in one)
        assert prefill.disagg.stats().handoffs == decode.disagg.stats().pulls == len(prompts)
        assert wait_for(lambda: prefill.disagg.stats().pinned_blocks == 0, 30, 0.01)  # read: unpinned
        assert decode.disagg.stats().staged_blocks == 0
    finally:
        for llm in (prefill, decode, both):
            llm.shutdown()


@MODES
def test_a_read_whose_caller_left_is_cancelled_and_the_worker_serves_on(llama_engine, engine_process):
    """The decode worker's pool cannot take the prompt, so the read waits for room; its caller leaves (a client
    disconnect cancels the Triton model's coroutine): the read ends as a failure at once, not when the handle
    expires, and the worker answers the next request."""
    prefill = AsyncLLM(llama_engine, EngineArgs(role="prefill", kv_pin_timeout_s=60, engine_process=engine_process))
    decode = AsyncLLM(llama_engine, EngineArgs(role="decode", num_kv_blocks=4, engine_process=engine_process))
    long_prompt, short_prompt = prompt_of(llama_engine, 60, 3), prompt_of(llama_engine, 5, 4)  # 8 blocks of 8

    async def main():
        first = await answer(prefill, ParsedRequest(long_prompt, GREEDY, stream=True, prefill_only=True), "big")
        parsed = ParsedRequest(long_prompt, GREEDY, stream=True, kv_handle=first[-1].kv_handle)
        reading = asyncio.ensure_future(answer(decode, parsed, "big"))
        await asyncio.sleep(0.2)  # (the read cannot end meanwhile: there is never room)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert wait_for(lambda: decode.disagg.stats().pull_failures == 1, 30, 0.01)  # (work after the reply)
        return await answer(decode, ParsedRequest(short_prompt, GREEDY, stream=True), "small")

    try:
        after = asyncio.run(main())
        assert after[-1].num_output_tokens == GREEDY.max_tokens
        assert decode.disagg.stats().staged_blocks == 0 and decode.disagg.stats().pulls == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


@MODES
def test_a_late_cleanup_keeps_the_mark_of_a_request_started_under_the_same_id(llama_engine, engine_process):
    """A client may reuse its request id once its stream ended, before the door's cleanup of the request before
    ran: that cleanup forgets the engine id its own request was given, and the new request under the id stays
    prefill-only."""
    llm = AsyncLLM(llama_engine, EngineArgs(role="prefill", kv_pin_timeout_s=60, engine_process=engine_process))
    prompt = prompt_of(llama_engine, 9, 14)
    parsed = ParsedRequest(prompt, GREEDY, stream=True, prefill_only=True)

    async def main():
        first_door, second_door = kv_door.disaggregated(llm, parsed, "x"), kv_door.disaggregated(llm, parsed, "x")
        await first_door.__aenter__()
        before = [o async for o in llm.generate(prompt, GREEDY, request_id="x")]
        await second_door.__aenter__()  # the same caller's id again, the first request's door not yet closed
        await first_door.__aexit__(None, None, None)
        after = [o async for o in llm.generate(prompt, GREEDY, request_id="x")]
        await second_door.__aexit__(None, None, None)
        return before, after

    try:
        before, after = asyncio.run(main())
        assert before[-1].finish_reason == after[-1].finish_reason == HANDOFF
        assert after[-1].kv_handle is not None and llm.disagg.stats().handoffs == 2
    finally:
        llm.shutdown()
