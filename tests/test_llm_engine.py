"""The engine loop on the tiny Llama engine: continuous batching, prefix caching,
preemption, aborts, admission control. References are computed independently with the
sequential greedy loop, which test_engine_parity checks against HF eager."""

from __future__ import annotations

import numpy as np
import pytest

from engine_format import EngineConfig
from executors import create_backend
from executors.greedy import greedy_generate
from runtime import LLM, EngineArgs, InvalidRequest, LLMEngine, Overloaded, SamplingParams
from runtime.engine.tokenizer import load_tokenizer, stop_token_ids
from tests.helpers import FLOAT32_BACKEND, random_prompts, run_with_arrivals

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def reference(llama_engine):
    """Sequential greedy generation, one prompt at a time, straight on the backend (executors.greedy)."""
    config = EngineConfig.load(llama_engine)
    backend = create_backend(config, kind="graph")
    stops = stop_token_ids(load_tokenizer(llama_engine), config)

    def run(prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
        return greedy_generate(backend, [prompt], max_tokens, stops)[0]

    return run


def shared_prefix_prompts(vocab: int, n: int, prefix_len: int = 37, seed: int = 0) -> list[list[int]]:
    prefix = random_prompts(vocab, [prefix_len], seed=seed)[0]
    tails = random_prompts(vocab, [int(x) for x in np.random.default_rng(seed).integers(1, 20, n)], seed + 1)
    return [prefix + t for t in tails]


def test_continuous_batching_with_random_arrivals_matches_sequential(llama_engine, reference):
    engine = LLMEngine(llama_engine, EngineArgs(max_num_batched_tokens=40, backend=FLOAT32_BACKEND))
    rng = np.random.default_rng(1)
    prompts = random_prompts(engine.config.model.vocab_size, rng.integers(1, 90, 24).tolist(), seed=2)
    arrivals = rng.integers(0, 30, len(prompts)).tolist()
    got = run_with_arrivals(engine, prompts, GREEDY, arrivals)
    assert [got[i] for i in range(len(prompts))] == [reference(p) for p in prompts]
    assert engine.kv.pool.counts()["used"] == 0
    stats = engine.stats()
    assert stats.finished and stats.running == 0 and stats.waiting == 0 and stats.steps > 0


def test_prefix_cache_on_and_off_give_identical_outputs(llama_engine):
    prompts = shared_prefix_prompts(488, 16)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(llama_engine, EngineArgs(enable_prefix_caching=caching, max_num_batched_tokens=64))
        results[caching] = run_with_arrivals(engine, prompts, GREEDY, list(range(len(prompts))))
        stats = engine.stats()
        assert (stats.prefix_cache_hits > 0) == caching
    assert results[True] == results[False]


def test_prefix_hits_are_counted_exactly(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(max_num_batched_tokens=256))
    prompts = shared_prefix_prompts(engine.config.model.vocab_size, 5)
    run_with_arrivals(engine, prompts, GREEDY, [0, 5, 10, 15, 20])  # one at a time: prefix is cached
    stats = engine.stats()
    # 37-token shared prefix, block 8: every request after the first hits 4 blocks (32 tokens).
    assert stats.prefix_cache_hits == 4 * 32
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)


def test_preemption_storm_completes_with_identical_outputs(llama_engine, reference):
    # 12 blocks of 8 tokens for 8 concurrent sequences that each need up to 5 blocks.
    engine = LLMEngine(llama_engine, EngineArgs(num_kv_blocks=12, max_num_batched_tokens=64, backend=FLOAT32_BACKEND))
    prompts = random_prompts(engine.config.model.vocab_size, [20, 25, 30, 18, 22, 27, 31, 19, 24, 26], seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = run_with_arrivals(engine, prompts, params, [0] * len(prompts))
    assert engine.stats().preemptions > 0
    want = [greedy_ignoring_eos(reference, p, 16) for p in prompts]
    assert [got[i] for i in range(len(prompts))] == want
    assert engine.kv.pool.counts()["used"] == 0


def greedy_ignoring_eos(reference, prompt, n):
    out: list[int] = []
    while len(out) < n:  # the reference stops at EOS: continue past it the way ignore_eos does
        out += reference(prompt + out, n - len(out))
    return out[:n]


def test_abort_mid_stream_frees_blocks_at_once(llama_engine):
    engine = LLMEngine(llama_engine)
    keep = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    victim = engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    held = len(engine.requests[victim].block_ids)
    used = engine.kv.pool.counts()["used"]
    final = engine.abort(victim)
    assert final.finished and final.finish_reason == "abort"
    assert engine.kv.pool.counts()["used"] == used - held
    engine.check_invariants()
    assert engine.abort(victim) is None  # already gone
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.counts()["used"] == 0
    assert keep not in engine.requests


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(max_tokens=-1), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams.from_dict({"max_tokens": 4, "beam_width": 2}), "beam_width"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(stop=[""]), "stop"),
        (lambda: SamplingParams(stream_interval=0), "stream_interval"),
    ],
)
def test_bad_parameters_are_rejected_with_the_field_named(make, field):
    with pytest.raises(InvalidRequest) as info:
        make()
    assert info.value.field == field and field in str(info.value)


def test_bad_requests_rejected_while_others_continue(llama_engine, reference):
    engine = LLMEngine(llama_engine, EngineArgs(backend=FLOAT32_BACKEND))
    good_prompt = [10, 11, 12, 13]
    good = engine.add_request(good_prompt, GREEDY)
    tokens = [t for d in engine.step() for t in d.token_ids]
    bad = [
        ("", "prompt"),
        ([], "prompt"),
        ([1, 2, 10_000], "prompt"),
        ([{"role": "wizard", "content": "hi"}], "messages[0]"),
        (list(range(3, 250)), "max_tokens"),  # 247 + 12 > max_seq_len 256
    ]
    for prompt, field in bad:
        with pytest.raises(InvalidRequest) as info:
            engine.add_request(prompt, GREEDY)
        assert info.value.field == field
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(good_prompt, GREEDY, request_id=good)
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == reference(good_prompt)
    assert engine.stats().rejected_invalid == len(bad)


def test_request_larger_than_pool_is_rejected_at_admission(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(num_kv_blocks=4))  # 32 tokens
    with pytest.raises(InvalidRequest, match="exceeds the KV cache"):
        engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=10))


def test_overload_rejects_at_once(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(max_waiting=3))
    for _ in range(3):
        engine.add_request([4, 5, 6], GREEDY)
    with pytest.raises(Overloaded, match="overloaded"):
        engine.add_request([4, 5, 6], GREEDY)
    assert engine.stats().rejected_overloaded == 1


def test_priority_classes_run_first_then_fcfs(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(max_num_seqs=1))
    order = []
    low = [engine.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=2, priority=5)) for _ in range(2)]
    high = engine.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=2, priority=-1))
    while engine.has_unfinished_requests():
        order += [d.request_id for d in engine.step() if d.finished]
    assert order == [high, *low]


class FakeClock:
    """The engine's clock (seconds), moved only by the test: no step races wall time."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_deadline_finishes_request_mid_generation(llama_engine):
    """Three steps inside a 1 s deadline (the third exactly at it: only *more* than deadline_s
    after arrival expires), then the clock passes it: finish_reason "deadline" with exactly the
    3 tokens generated, blocks freed, and the timing stats read from the same clock."""
    clock = FakeClock()
    engine = LLMEngine(llama_engine, clock=clock)
    request_id = engine.add_request([3, 4], SamplingParams(max_tokens=200, ignore_eos=True, deadline_s=1.0))
    for elapsed in (0.25, 0.5, 1.0):  # one token a step: the 2-token prompt is prefilled by the first
        clock.now = 100.0 + elapsed
        (delta,) = engine.step()
        assert (delta.request_id, delta.finished, len(delta.token_ids)) == (request_id, False, 1)
    clock.advance(0.25)
    (final,) = engine.step()
    assert (final.request_id, final.finished, final.finish_reason) == (request_id, True, "deadline")
    assert final.num_output_tokens == 3 and final.token_ids == []
    assert final.stats == {
        "queue_time_s": 0.25,
        "ttft_s": 0.25,
        "e2e_s": 1.25,
        "inter_token_latencies_s": [0.25, 0.5],
        "num_preemptions": 0,
    }
    assert not engine.has_unfinished_requests() and engine.kv.pool.counts()["used"] == 0
    assert engine.stats().finished == {"deadline": 1}


def test_deadline_expires_a_request_that_is_still_waiting(llama_engine):
    """One sequence slot, held by another request: the deadline request never runs, and it is
    finished the first step after its deadline passes, with no tokens and no scheduling time."""
    clock = FakeClock()
    engine = LLMEngine(llama_engine, EngineArgs(max_num_seqs=1), clock=clock)
    busy = engine.add_request([5, 6], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    late = engine.add_request([7, 8], SamplingParams(max_tokens=4, deadline_s=0.5))
    clock.advance(0.5)  # exactly at the deadline: not expired
    assert [(d.request_id, d.finished) for d in engine.step()] == [(busy, False)]
    assert engine.stats().waiting == 1
    clock.advance(0.125)
    expired, delta = engine.step()
    assert (expired.request_id, expired.finish_reason, expired.num_output_tokens) == (late, "deadline", 0)
    assert expired.stats["queue_time_s"] is None and expired.stats["ttft_s"] is None
    assert expired.stats["e2e_s"] == 0.625
    assert (delta.request_id, delta.finished, delta.num_output_tokens) == (busy, False, 2)
    assert engine.stats().waiting == 0 and list(engine.requests) == [busy]


def test_llm_generate_batch_api(llama_engine, reference):
    llm = LLM(llama_engine, backend=FLOAT32_BACKEND)
    prompts = random_prompts(488, [5, 17, 40], seed=4)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [reference(p) for p in prompts]
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        # The real clock only promises order; exact values are checked with a fake clock above.
        assert 0 <= o.stats["queue_time_s"] <= o.stats["ttft_s"] <= o.stats["e2e_s"]
        assert len(o.stats["inter_token_latencies_s"]) == len(o.token_ids) - 1


def test_seeded_sampling_is_independent_of_batch(llama_engine):
    llm = LLM(llama_engine)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[20, 21, 22]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=10, seed=s) for s in range(5)]
    crowd = llm.generate([[20, 21, 22], *random_prompts(488, [4, 9, 30, 2, 12])], [seeded, *others])
    assert crowd[0].token_ids == alone
    other_seed = llm.generate([[20, 21, 22]], SamplingParams(**{**seeded.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != alone  # the seed matters: the check above can fail


def test_logprobs_are_returned(llama_engine):
    out = LLM(llama_engine).generate([[30, 31]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][0] == token  # greedy = top-1
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_stop_string_ends_generation_and_is_excluded(llama_engine):
    llm = LLM(llama_engine)
    full = llm.generate([[40, 41, 42]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([[40, 41, 42]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_a_failing_backend_step_fails_only_its_requests(llama_engine, reference):
    """A backend error finishes the step's requests with finish_reason "error" and frees their
    blocks; requests added afterwards are served normally."""
    engine = LLMEngine(llama_engine, EngineArgs(backend=FLOAT32_BACKEND))  # compared with HF float32
    doomed = engine.add_request([5, 6, 7], GREEDY)
    real_step = engine.backend.step
    engine.backend.step = lambda chunks: (_ for _ in ()).throw(RuntimeError("injected backend failure"))
    [out] = engine.step()
    assert out.request_id == doomed and out.finish_reason == "error" and "injected" in out.error
    assert engine.kv.pool.counts()["used"] == 0 and not engine.has_unfinished_requests()
    engine.backend.step = real_step
    engine.add_request([8, 9, 10], GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == reference([8, 9, 10])


@pytest.mark.parametrize(
    "field", ["max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "max_waiting", "stream_interval"]
)
def test_engine_args_must_be_positive(field):
    with pytest.raises(ValueError, match=f"EngineArgs.{field} must be a positive integer"):
        EngineArgs(**{field: 0})


def test_token_budget_must_cover_every_running_sequence(llama_engine):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        LLMEngine(llama_engine, EngineArgs(max_num_batched_tokens=4))
