"""LoRA adapters with prefill/decode disaggregation, two workers in one process with real NIXL agents: the prompt
runs under the request's adapter on the prefill worker, the KV handle names that adapter (its content digest),
and a decode worker continues it only for the same adapter as it holds it; the tokens equal HF eager + PEFT.
A decode worker whose adapter slots are all in use queues the request from what it read; prefix-cache hits on
the decode worker are keyed by adapter too."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from builder.sources import load_checkpoint, resolve_model
from engine_format.kv_handle import KVHandle
from runtime import EngineArgs, InvalidRequest, LLMEngine, SamplingParams
from runtime.engine.disagg import HANDOFF
from runtime.engine.request import RequestStatus
from tests.helpers import hf_greedy, make_lora_adapter, random_prompts, with_lora

pytest.importorskip("nixl_cu12", reason="NIXL is the extra trtserve[disagg]")

NEW_TOKENS = 8


def greedy(lora: str | None, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=lora)


@pytest.fixture(scope="module")
def hf_model():
    return load_checkpoint(resolve_model("tiny-llama"))[0]


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "qv": make_lora_adapter(hf_model, root / "qv", ["q_proj", "v_proj"], 8, 16, seed=1),
        "kv": make_lora_adapter(hf_model, root / "kv", ["k_proj", "v_proj", "o_proj"], 16, 16, seed=2),
    }


@pytest.fixture(scope="module")
def workers(llama_engine, adapters):
    """(prefill, decode) on the tiny Llama serving both adapters; the decode worker has one adapter slot."""
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    args = EngineArgs(backend="cpu", max_num_batched_tokens=32, lora_modules=modules)
    prefill = LLMEngine(llama_engine, dataclasses.replace(args, role="prefill", kv_pin_timeout_s=60))
    decode = LLMEngine(llama_engine, dataclasses.replace(args, role="decode", max_loras=1))
    yield prefill, decode
    for engine in (prefill, decode):
        engine.disagg.close()


def run(engine: LLMEngine, request_ids: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    while any(r in engine.requests for r in request_ids):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        engine.check_invariants()
    return tokens


def hand_off(prefill: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[int, str]:
    """The prefill worker's first token and KV handle for the request."""
    prefill.disagg.export(request_id)
    prefill.add_request(prompt, params, request_id)
    last = None
    while request_id in prefill.requests:
        last = next((o for o in prefill.step() if o.request_id == request_id), last)
    assert last is not None and last.finish_reason == HANDOFF and last.kv_handle
    return last.token_ids[0], last.kv_handle


def pull(decode: LLMEngine, request_id: str, handle: str, lora: str | None) -> None:
    asyncio.run(decode.disagg.pull(decode.disagg.expect(request_id, handle, None, lora)))


def test_each_adapter_is_continued_by_the_decode_worker_as_hf_peft(workers, hf_model, adapters):
    prefill, decode = workers
    prompts = random_prompts(hf_model.config.vocab_size, [9, 21, 30], seed=3)
    for i, (lora, prompt) in enumerate(zip([None, "qv", "kv"], prompts, strict=True)):
        first, handle = hand_off(prefill, prompt, greedy(lora), f"a{i}")
        assert KVHandle.from_json(handle).lora == (None if lora is None else prefill.loras.digest(lora))
        pull(decode, f"a{i}", handle, lora)
        decode.add_request(prompt, greedy(lora), f"a{i}")
        tokens = [first, *run(decode, [f"a{i}"])[f"a{i}"]]
        reference = hf_greedy(with_lora(hf_model, adapters.get(lora or "")), prompt, NEW_TOKENS, (10**9,))
        assert tokens == reference, lora
    assert decode.loras.stats().requests == {"qv": 1, "kv": 1}


def test_kv_of_one_adapter_is_refused_for_another(workers, hf_model):
    """At expect, before anything is staged: another adapter, the base model, an adapter this worker lacks."""
    prefill, decode = workers
    prompt = random_prompts(hf_model.config.vocab_size, [14], seed=4)[0]
    _, handle = hand_off(prefill, prompt, greedy("qv"), "b1")
    for lora, words in (("kv", "adapter 'kv' as this worker holds it"), (None, "the base model")):
        with pytest.raises(InvalidRequest, match=f"kv_handle: the KV was computed under an adapter .*{words}"):
            decode.disagg.expect("b1", handle, None, lora)
    with pytest.raises(InvalidRequest, match="lora: adapter 'nope' is not loaded"):
        decode.disagg.expect("b1", handle, None, "nope")
    _, base_handle = hand_off(prefill, prompt, greedy(None), "b2")
    with pytest.raises(InvalidRequest, match="computed under the base model, this request asks for adapter 'qv'"):
        decode.disagg.expect("b2", base_handle, None, "qv")
    assert decode.disagg.stats().staged_blocks == 0
    decode.check_invariants()


def test_a_request_for_another_adapter_than_it_was_expected_under_is_refused(workers, hf_model):
    """The adapter is checked again when the request arrives: its blocks are freed, nothing runs."""
    prefill, decode = workers
    prompt = random_prompts(hf_model.config.vocab_size, [17], seed=5)[0]
    _, handle = hand_off(prefill, prompt, greedy("qv"), "c1")
    pull(decode, "c1", handle, "qv")
    with pytest.raises(InvalidRequest, match="kv_handle: the KV was computed under an adapter"):
        decode.add_request(prompt, greedy("kv"), "c1")
    assert decode.disagg.stats().staged_blocks == 0 and "c1" not in decode.requests
    decode.check_invariants()


def test_the_decode_worker_waits_for_an_adapter_slot(workers, hf_model, adapters):
    """One slot, held by a running 'kv' request: a pulled 'qv' request queues (its read blocks cached) and runs
    once the slot frees; both answers are their adapter's."""
    prefill, decode = workers
    long_prompt, prompt = random_prompts(hf_model.config.vocab_size, [11, 26], seed=6)
    decode.add_request(long_prompt, greedy("kv", 2 * NEW_TOKENS), "d0")
    started = [t for o in decode.step() for t in o.token_ids]  # its prompt fits one step: its first token
    assert decode.requests["d0"].lora_slot is not None
    first, handle = hand_off(prefill, prompt, greedy("qv"), "d1")
    pull(decode, "d1", handle, "qv")
    decode.add_request(prompt, greedy("qv"), "d1")
    assert decode.requests["d1"].status is RequestStatus.WAITING
    tokens = run(decode, ["d0", "d1"])
    assert started + tokens["d0"] == hf_greedy(
        with_lora(hf_model, adapters["kv"]), long_prompt, 2 * NEW_TOKENS, (10**9,)
    )
    assert [first, *tokens["d1"]] == hf_greedy(with_lora(hf_model, adapters["qv"]), prompt, NEW_TOKENS, (10**9,))


def test_the_decode_workers_prefix_cache_is_keyed_by_adapter(workers, hf_model):
    """A prompt read under the base model is read again in full under an adapter; read again under that
    adapter, only its last (partial) block is read."""
    prefill, decode = workers
    prompt = random_prompts(hf_model.config.vocab_size, [28], seed=7)[0]  # 3 full blocks of 8 and a partial
    per_block = decode.disagg.connector.memory.bytes_per_block()
    for i, (lora, blocks_read) in enumerate([(None, 4), ("qv", 4), ("qv", 1)]):
        _, handle = hand_off(prefill, prompt, greedy(lora), f"e{i}")
        before = decode.disagg.stats().pulled_bytes
        pull(decode, f"e{i}", handle, lora)
        assert decode.disagg.stats().pulled_bytes - before == blocks_read * per_block, (lora, i)
        decode.add_request(prompt, greedy(lora), f"e{i}")
        run(decode, [f"e{i}"])
