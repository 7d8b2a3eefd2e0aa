"""Property: any mix of requests and aborts leaves zero used blocks and intact invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import EngineArgs, LLMEngine, SamplingParams

# One operation per engine step: add a request, abort a live one, or just step.
add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(3, 487), min_size=1, max_size=40),  # prompt token ids
    st.integers(1, 8),  # max_tokens
    st.sampled_from([0.0, 0.8]),  # temperature
    st.integers(-1, 1),  # priority
)
abort_op = st.tuples(st.just("abort"), st.integers(0, 10_000))
operations = st.lists(st.one_of(add_op, add_op, abort_op, st.just(("step",))), min_size=100, max_size=100)


@pytest.fixture(scope="module")
def engine(llama_engine):
    # A tight pool (16 blocks x 8 tokens) so preemption and prefix eviction happen too.
    return LLMEngine(llama_engine, EngineArgs(num_kv_blocks=16, max_num_batched_tokens=48))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_random_requests_and_aborts_leave_no_used_blocks(engine, ops):
    """12 examples x 100 operations: about 1,000 requests and aborts per run."""
    finished: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, temperature, priority = op
            engine.add_request(
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=temperature, priority=priority, seed=0),
            )
        elif op[0] == "abort" and engine.requests:
            live = sorted(engine.requests)
            engine.abort(live[op[1] % len(live)])
        for delta in engine.step():
            assert delta.request_id not in finished, "output after finish"
            if delta.finished:
                finished.add(delta.request_id)
        engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    counts = engine.kv.pool.counts()
    assert counts["used"] == 0 and counts["free"] + counts["cached"] == engine.kv.pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
