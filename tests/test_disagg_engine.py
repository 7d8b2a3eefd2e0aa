"""Prefill/decode disaggregation in the engine, two workers in one process with real NIXL agents (UCX over host
memory): a prefill engine runs the prompt and hands its KV on, a decode engine reads it and goes on; the
result equals one `both` engine token for token. The handshake refuses a peer with another layout; pins end
when read, when told, or at their deadline; a read from a peer that is gone fails and frees what it staged.
The pool invariant (every reference accounted for, pins and staged pulls included) is checked throughout.

The clock is the engines' fake one where a deadline is tested: nothing waits on wall-clock time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine_format import EngineConfig
from engine_format.kv_handle import KVHandle, with_recompute
from engine_format.kv_identity import kv_layout
from executors.kv_transfer import KVTransferError, PeerMismatch, kv_memory
from runtime import EngineArgs, InvalidRequest, LLMEngine, SamplingParams
from runtime.engine.disagg import HANDOFF
from tests.helpers import random_prompts

pytest.importorskip("nixl_cu12", reason="NIXL is the extra trtserve[disagg]")

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def workers(llama_engine):
    """(prefill, decode, both) engines on the tiny Llama; the transfer roles get their own NIXL agents."""
    args = EngineArgs(max_num_batched_tokens=32)  # prompts run in several chunks
    clock = FakeClock()
    prefill = LLMEngine(llama_engine, dataclasses.replace(args, role="prefill", kv_pin_timeout_s=60), clock=clock)
    decode = LLMEngine(llama_engine, dataclasses.replace(args, role="decode"))
    both = LLMEngine(llama_engine, args)
    yield prefill, decode, both, clock
    for engine in (prefill, decode):
        engine.disagg.close()


def run(engine: LLMEngine, request_id: str) -> list:
    outputs = []
    while request_id in engine.requests:
        outputs += [o for o in engine.step() if o.request_id == request_id]
        engine.check_invariants()
    return outputs


def prefill_step(prefill: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str):
    prefill.disagg.export(request_id)
    prefill.add_request(prompt, params, request_id)
    [*_, last] = run(prefill, request_id)
    return last


def decode_step(decode: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str, handle: str) -> list:
    imp = decode.disagg.expect(request_id, handle, params.cache_salt)
    asyncio.run(decode.disagg.pull(imp))
    decode.check_invariants()
    decode.add_request(prompt, params, request_id)
    return run(decode, request_id)


def disaggregated(prefill, decode, prompt, params, request_id) -> tuple[list[int], str]:
    first = prefill_step(prefill, prompt, params, request_id)
    if first.finish_reason != HANDOFF:
        return first.token_ids, first.text
    outs = decode_step(decode, prompt, params, request_id, first.kv_handle)
    tokens = first.token_ids + [t for o in outs for t in o.token_ids]
    return tokens, first.text + "".join(o.text for o in outs)


def whole(both, prompt, params, request_id) -> tuple[list[int], str]:
    both.add_request(prompt, params, request_id)
    outs = run(both, request_id)
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


def test_prefill_then_decode_equals_one_worker_token_for_token(workers):
    prefill, decode, both, _ = workers
    prompts = random_prompts(prefill.config.model.vocab_size, [5, 8, 9, 40, 71], seed=3)
    for i, prompt in enumerate(prompts):
        assert disaggregated(prefill, decode, prompt, GREEDY, f"d{i}") == whole(both, prompt, GREEDY, f"w{i}")
    stats = prefill.disagg.stats()
    assert stats.handoffs == len(prompts)
    assert decode.disagg.stats().pulls == len(prompts)


def test_seeded_sampling_goes_on_as_one_stream(workers):
    prefill, decode, both, _ = workers
    params = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    prompt = random_prompts(prefill.config.model.vocab_size, [23], seed=4)[0]
    assert disaggregated(prefill, decode, prompt, params, "s1")[0] == whole(both, prompt, params, "s2")[0]


def test_pins_end_when_the_decode_worker_has_read(workers):
    prefill, decode, _, _ = workers
    prompt = random_prompts(prefill.config.model.vocab_size, [30], seed=5)[0]
    wait_until(lambda: prefill.disagg.stats().pinned_blocks == 0)  # earlier tests' reads released
    first = prefill_step(prefill, prompt, GREEDY, "p1")
    pinned = prefill.disagg.stats().pinned_blocks
    assert pinned == len(KVHandle.from_json(first.kv_handle).block_ids) == 4  # 30 tokens, blocks of 8
    prefill.check_invariants()
    decode_step(decode, prompt, GREEDY, "p1", first.kv_handle)
    wait_until(lambda: prefill.disagg.stats().pinned_blocks == 0)  # the reaper's notification round
    prefill.check_invariants()
    assert prefill.kv.pool.counts()["used"] == 0


def test_a_decode_worker_reads_only_what_its_prefix_cache_lacks(workers):
    prefill, decode, _, _ = workers
    base = random_prompts(prefill.config.model.vocab_size, [48], seed=6)[0]
    for i, prompt in enumerate([[*base, 5, 6, 7], [*base, 9, 10]]):
        first = prefill_step(prefill, prompt, GREEDY, f"x{i}")
        before = decode.disagg.stats().pulled_bytes
        decode_step(decode, prompt, GREEDY, f"x{i}", first.kv_handle)
        pulled = decode.disagg.stats().pulled_bytes - before
        per_block = decode.disagg.connector.memory.bytes_per_block()
        assert pulled == (7 if i == 0 else 1) * per_block  # the second shares 6 full blocks, read once


def test_pins_expire_when_nobody_reads_them(workers):
    prefill, _, _, clock = workers
    prompt = random_prompts(prefill.config.model.vocab_size, [20], seed=8)[0]
    wait_until(lambda: prefill.disagg.stats().pinned_blocks == 0)  # earlier tests' reads released
    prefill_step(prefill, prompt, GREEDY, "e1")
    assert prefill.disagg.stats().pinned_blocks == 3
    clock.now += 61  # past kv_pin_timeout_s
    wait_until(lambda: prefill.disagg.stats().pinned_blocks == 0)
    prefill.check_invariants()
    assert prefill.disagg.stats().pins_expired >= 1


def test_the_handshake_refuses_a_peer_with_another_layout(workers):
    prefill, decode, _, _ = workers
    prompt = random_prompts(prefill.config.model.vocab_size, [12], seed=9)[0]
    first = prefill_step(prefill, prompt, GREEDY, "m1")
    handle = KVHandle.from_json(first.kv_handle)
    for field, value in (("block_size", 16), ("dtype", "float16")):
        other = dataclasses.replace(
            handle, agent=f"other-{field}", layout=dataclasses.replace(handle.layout, **{field: value})
        )
        imp = decode.disagg.expect("m2", other.to_json(), None)
        with pytest.raises(PeerMismatch, match=f"handshake refused: KV layout differs: .*{field}"):
            asyncio.run(decode.disagg.pull(imp))
        decode.check_invariants()
        assert decode.disagg.stats().staged_blocks == 0
    weights = dataclasses.replace(
        handle, agent="other-weights", identity={**handle.identity, "weights_sha256": "0" * 64}
    )
    imp = decode.disagg.expect("m3", weights.to_json(), None)
    with pytest.raises(PeerMismatch, match=r"engine differs: .*weights_sha256"):
        asyncio.run(decode.disagg.pull(imp))
    decode.check_invariants()


def test_the_layout_names_the_pools_element_dtype_not_the_engines(llama_engine):
    """The torch backend's float pool holds its compute dtype (--dtype): a bfloat16 pool over a float32 engine
    must not pass the handshake with a float16 or float32 one."""
    torch = pytest.importorskip("torch")
    config = EngineConfig.load(llama_engine)
    layout = kv_layout(config)
    shape = (layout.num_layers, 2, 4, layout.block_size, layout.kv_width)
    pool = SimpleNamespace(kv=SimpleNamespace(data=torch.zeros(shape, dtype=torch.bfloat16)))
    assert (layout.dtype, kv_memory(pool, layout).layout.dtype) == ("float32", "bfloat16")
    assert kv_memory(SimpleNamespace(kv=SimpleNamespace(data=np.zeros(shape, np.float32))), layout).layout == layout


def test_a_read_from_a_killed_peer_fails_and_frees_its_blocks(workers, llama_engine):
    """The prefill worker is a process of its own, killed after it answered with the handle: the read fails
    (UCX reports the peer disconnected), nothing stays staged, and the peer is forgotten."""
    _, decode, _, _ = workers
    prompt = random_prompts(decode.config.model.vocab_size, [26], seed=10)[0]
    peer = subprocess.Popen([sys.executable, "-m", "tests.disagg_peer", str(llama_engine), json.dumps(prompt)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        handle = next((line.split(" ", 1)[1] for line in peer.stdout if line.startswith("HANDLE ")), "").strip()
        assert handle, "the peer printed no handle"
        peer.kill()
        peer.wait()
        imp = decode.disagg.expect("g1", handle, None)
        with pytest.raises(KVTransferError, match="peer agent"):
            asyncio.run(decode.disagg.pull(imp))
    finally:
        peer.kill()
        peer.wait()
    decode.check_invariants()
    assert decode.disagg.stats().staged_blocks == 0 and decode.kv.pool.counts()["used"] == 0
    assert decode.disagg.stats().pull_failures >= 1


def test_a_recompute_handle_continues_after_the_first_token_on_any_worker(workers):
    prefill, _, both, _ = workers
    prompt = random_prompts(prefill.config.model.vocab_size, [33], seed=11)[0]
    first = prefill_step(prefill, prompt, GREEDY, "r1")
    both.disagg.expect("r1", with_recompute(first.kv_handle), None)
    both.add_request(prompt, GREEDY, "r1")
    outs = run(both, "r1")
    tokens = first.token_ids + [t for o in outs for t in o.token_ids]
    assert tokens == whole(both, prompt, GREEDY, "r2")[0]
    assert both.disagg.stats().recomputes == 1


def test_roles_refuse_what_they_do_not_do(workers):
    prefill, decode, both, _ = workers
    with pytest.raises(InvalidRequest, match="prefill_only: this worker's role is 'decode'"):
        decode.disagg.export("z1")
    prompt = random_prompts(prefill.config.model.vocab_size, [9], seed=12)[0]
    first = prefill_step(prefill, prompt, GREEDY, "z2")
    for worker in (both, prefill):  # only a decode worker reads KV
        with pytest.raises(InvalidRequest, match=r"kv_handle: this worker reads no KV .*--role decode"):
            worker.disagg.expect("z2", first.kv_handle, None)
    with pytest.raises(InvalidRequest, match="kv_handle: malformed"):
        decode.disagg.expect("z3", "{not json", None)


def test_a_prompt_that_differs_from_the_handle_is_refused_and_freed(workers):
    prefill, decode, _, _ = workers
    prompt = random_prompts(prefill.config.model.vocab_size, [17], seed=13)[0]
    first = prefill_step(prefill, prompt, GREEDY, "q1")
    imp = decode.disagg.expect("q1", first.kv_handle, None)
    asyncio.run(decode.disagg.pull(imp))
    with pytest.raises(InvalidRequest, match="kv_handle: the handle's prompt"):
        decode.add_request([*prompt[:-1], prompt[-1] + 1], GREEDY, "q1")
    decode.check_invariants()
    assert decode.disagg.stats().staged_blocks == 0


def wait_until(condition, rounds: int = 500) -> None:
    """Polls the reaper's work (it runs every 20 ms) a bounded number of rounds: no wall-clock deadline."""
    import time

    for _ in range(rounds):
        if condition():
            return
        time.sleep(0.01)
    assert condition()


@pytest.mark.slow
def test_smollm2_prefill_then_decode_equals_one_worker(smollm2_engine):
    """The real model, a chat prompt long enough for several blocks and prefill chunks, greedy."""
    args = EngineArgs(max_num_batched_tokens=64)
    prefill = LLMEngine(smollm2_engine, dataclasses.replace(args, role="prefill"))
    decode = LLMEngine(smollm2_engine, dataclasses.replace(args, role="decode"))
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        prompt = prefill.tokenize([{"role": "user", "content": "Explain in three sentences why the sky is blue. " * 3}])
        tokens, text = disaggregated(prefill, decode, prompt, params, "s")
        both = LLMEngine(smollm2_engine, args)
        assert (tokens, text) == whole(both, prompt, params, "w")
        assert len(tokens) > 1 and decode.disagg.stats().pulled_bytes > 0
    finally:
        prefill.disagg.close()
        decode.disagg.close()
