"""Speculative decoding end to end on the tiny engines: the multi-row step interface against HF
eager, greedy outputs identical to the plain greedy loop (executors.greedy, itself checked
against HF eager) with prefix caching, chunked prefill and a preemption storm, exact KV rollback,
the prefix cache never holding a rejected draft, aborts and deadlines with drafts in flight, and the
acceptance metrics. Scripted proposers (an oracle that knows the reference tokens) make accepted
and rejected counts exact."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from engine_format import EngineConfig
from executors import create_backend
from executors.base import SequenceChunk
from executors.greedy import greedy_generate
from runtime import EngineArgs, LLMEngine, SamplingParams
from runtime.engine.outputs import CompletionOutput
from runtime.engine.spec import rejection_sampler as rejection_module
from runtime.engine.spec.rejection_sampler import VerifyResult
from tests.helpers import FLOAT32_BACKEND, hf_logits, random_prompts, run_with_arrivals

ATOL = 1e-4  # as test_engine_parity: float32 both sides, summation order only
# itl_target_ms=None: schedules from the token budget alone, never from measured step times; not adaptive:
# every step below the disable size carries drafts (the governor's choices: test_spec_governor.py).
SPEC = dict(speculative="ngram", num_speculative_tokens=4, speculative_disable_batch_size=8, itl_target_ms=None,
            speculative_adaptive=False, backend=FLOAT32_BACKEND)  # fmt: skip


def blocks(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


@pytest.mark.parametrize("kind", ["graph", "plugin", "cpu"])
def test_every_requested_logit_row_matches_hf(tiny_engine, tiny_hf, kind):
    """A verify chunk (num_logits = its length), a decode and a prompt with 3 rows in one step, then
    a lone verify chunk (the CPU backend's whole-graph path): every row against HF eager."""
    model, _ = tiny_hf
    backend = create_backend(EngineConfig.load(tiny_engine), num_blocks=64, kind=kind)
    a, b, c = random_prompts(backend.config.model.vocab_size, [30, 21, 12], seed=21)
    backend.step([SequenceChunk(a[:25], 0, blocks(0, 4)), SequenceChunk(b[:20], 0, blocks(4, 3))])
    got = backend.step([
        SequenceChunk(a[25:], 25, blocks(0, 4), num_logits=5),
        SequenceChunk(b[20:], 20, blocks(4, 3)),
        SequenceChunk(c, 0, blocks(7, 2), num_logits=3),
    ])  # fmt: skip
    ref_a = hf_logits(model, a)
    assert got.shape == (9, backend.config.model.vocab_size)
    np.testing.assert_allclose(got[:5], ref_a[25:30], atol=ATOL)
    np.testing.assert_allclose(got[5], hf_logits(model, b)[20], atol=ATOL)
    np.testing.assert_allclose(got[6:], hf_logits(model, c)[9:12], atol=ATOL)
    lone = backend.step([SequenceChunk(a[25:], 25, blocks(0, 4), num_logits=5)])
    np.testing.assert_allclose(lone, ref_a[25:30], atol=ATOL)
    assert np.abs(got[1:5] - ref_a[25:29]).max() > 100 * ATOL  # an off-by-one row would be caught


def test_a_chunk_asking_for_more_rows_than_tokens_is_refused(llama_engine):
    from executors.device_sampling import check_chunks

    config = EngineConfig.load(llama_engine)
    with pytest.raises(ValueError, match=r"num_logits 3 must be in 1\.\.2"):
        check_chunks([SequenceChunk([5, 6], 0, [0], num_logits=3)], config, 8)


@pytest.fixture(scope="module")
def reference(llama_engine):
    """Greedy tokens ignoring EOS, one prompt at a time, straight on the graph backend."""
    backend = create_backend(EngineConfig.load(llama_engine), kind="graph")
    return lambda prompt, n: greedy_generate(backend, [prompt], n)[0]


def run(engine: LLMEngine, prompts, params, arrivals=None) -> list[list[int]]:
    """Add prompt i at step arrivals[i] (default all at once); invariants checked every step."""
    out = run_with_arrivals(engine, prompts, params, arrivals or [0] * len(prompts))
    assert engine.kv.pool.counts()["used"] == 0
    return [out[i] for i in range(len(prompts))]


def copy_heavy_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Each prompt repeats its first half: n-gram matches from the start."""
    return [p + p[: len(p) // 2] for p in random_prompts(vocab, lengths, seed=seed)]


CASES = {
    "prefix-caching": dict(max_num_batched_tokens=256),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),  # drafts compete with prefill chunks for 16 tokens
    "preemption-storm": dict(num_kv_blocks=12, max_num_batched_tokens=64),  # 12 blocks of 8 for 10 sequences
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_speculation_gives_the_reference_tokens(llama_engine, reference, case):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC, **CASES[case]))
    prompts = copy_heavy_prompts(engine.config.model.vocab_size, [14, 20, 9, 16, 24, 12, 18, 8, 10, 22], seed=5)
    prompts[3] = prompts[0][:10] + prompts[3]  # shares a prefix block with prompt 0
    got = run(engine, prompts, params, arrivals=[0, 0, 1, 2, 3, 5, 8, 13, 13, 20])
    assert got == [reference(p, 24) for p in prompts]
    stats = engine.stats().spec_decode
    assert stats is not None and stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens
    if case == "preemption-storm":
        assert engine.stats().preemptions > 0


def test_accepting_every_draft_is_caught(llama_engine, reference, monkeypatch):
    """The comparison above fails for a verifier that keeps drafts the target would not emit."""

    def accept_all(self, logits, drafts, states, draft_probs=None, rows=None) -> VerifyResult:
        ends = np.cumsum([len(d) + 1 for d in drafts]) - 1
        last_rows = ends if rows is None else rows[ends]
        tokens = [[*d, int(np.argmax(logits[e]))] for d, e in zip(drafts, last_rows, strict=True)]
        return VerifyResult(tokens, np.array([len(d) for d in drafts]), [None] * len(drafts))

    monkeypatch.setattr(rejection_module.RejectionSampler, "verify", accept_all)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC))
    prompts = copy_heavy_prompts(engine.config.model.vocab_size, [14, 20, 9], seed=5)
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert got != [reference(p, 24) for p in prompts]


class Oracle:
    """Proposes the reference continuation for its own request: per call, plan[i] = (correct drafts,
    total drafts); the wrong ones are the reference token + 1. Other requests, or no plan left: none."""

    caught_up = 0  # stateless

    def __init__(self, prompt: list[int], ref: list[int], plan: list[tuple[int, int]], vocab: int) -> None:
        self.prompt, self.ref, self.plan, self.vocab = prompt, ref, list(plan), vocab

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        request_ids: Sequence[str] = (),
        remaining: Sequence[int] = (),
    ) -> list[list[int]]:
        return [self._one(list(c), k) for c, k in zip(contexts, max_tokens, strict=True)]

    def release(self, request_id: str) -> None:
        pass

    def _one(self, context: list[int], k: int) -> list[int]:
        done = len(context) - len(self.prompt)
        if not self.plan or context != self.prompt + self.ref[:done]:
            return []
        good, total = self.plan.pop(0)
        want = self.ref[done : done + total]
        return (want[:good] + [(t + 1) % self.vocab for t in want[good:]])[:k]


def spec_engine(llama_engine, prompt, ref, plan, **args) -> LLMEngine:
    engine = LLMEngine(llama_engine, EngineArgs(**{**SPEC, **args}))
    assert engine.spec is not None
    engine.spec.proposer = Oracle(prompt, ref, plan, engine.config.model.vocab_size)
    return engine


def record_chunks(engine: LLMEngine) -> list[list[SequenceChunk]]:
    seen: list[list[SequenceChunk]] = []
    step = engine.backend.step

    def recording(chunks):
        seen.append(list(chunks))
        return step(chunks)

    engine.backend.step = recording  # type: ignore[method-assign]
    return seen


def test_rejected_drafts_roll_back_to_exact_blocks(llama_engine, reference):
    prompt = random_prompts(488, [6], seed=31)[0]
    ref = reference(prompt, 12)
    # Block size 8. After the 6-token prefill: 4 wrong drafts (positions 7..10, block 1), then 3 right + 1 wrong.
    engine = spec_engine(llama_engine, prompt, ref, [(0, 4), (3, 4)])
    seen = record_chunks(engine)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    request = engine.requests[rid]
    assert [d.token_ids for d in engine.step()] == [ref[:1]]
    wrong = [(t + 1) % 488 for t in ref[1:5]]
    assert request.block_ids == [0] and request.draft_token_ids == wrong
    assert [d.token_ids for d in engine.step()] == [ref[1:2]]  # all 4 rejected: the target's own token
    last = seen[-1][0]  # the verify chunk: the last token and 4 drafts at positions 6..10, blocks 0 and 1
    assert list(last.token_ids) == [ref[0], *wrong] and last.past_len == 6
    assert list(last.block_table) == [0, 1] and last.num_logits == 5
    # 8 tokens (positions 0..7) fit block 0: block 1 held only rejected drafts and is back in the pool.
    assert request.num_computed_tokens == 7 and request.block_ids == [0]
    assert engine.kv.pool.counts() == {"free": engine.kv.pool.num_blocks - 1, "cached": 0, "used": 1}
    assert [d.token_ids for d in engine.step()] == [ref[2:6]]  # 3 accepted + the target's token
    # 12 tokens need a second block: the free queue's front is 2 (block 1 went back to its tail).
    assert request.num_computed_tokens == 11 and request.block_ids == [0, 2]
    engine.check_invariants()
    stats = engine.stats().spec_decode
    assert stats is not None
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position) == (
        2, 8, 3, (1, 1, 1, 0)
    )  # fmt: skip
    assert stats.acceptance_rate == 3 / 8 and stats.mean_acceptance_length == 1 + 3 / 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.counts()["used"] == 0


def test_all_accepted_drafts_emit_k_plus_one_tokens_per_step(llama_engine, reference):
    prompt = random_prompts(488, [9], seed=32)[0]
    ref = reference(prompt, 13)
    engine = spec_engine(llama_engine, prompt, ref, [(3, 3)] * 3, num_speculative_tokens=3)
    out = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    assert out == [ref] and engine.stats().steps == 4  # prefill + 3 verifies of 4 tokens each
    stats = engine.stats().spec_decode
    assert stats is not None and stats.accepted_per_position == (3, 3, 3)
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 4.0


def test_a_prefix_cache_hit_never_includes_a_rejected_position(llama_engine, reference):
    prompt = random_prompts(488, [7], seed=33)[0]
    ref = reference(prompt, 10)
    engine = spec_engine(llama_engine, prompt, ref, [(0, 8)], num_speculative_tokens=8)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    drafts = list(engine.requests[rid].draft_token_ids)
    assert len(drafts) == 8  # positions 8..15: block 1 entirely
    engine.step()  # all rejected
    probe = [*prompt, ref[0], *drafts, 5]
    probe_id = engine.add_request(probe, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    hits = engine.kv.get_computed_blocks(engine.requests[probe_id])
    assert [b.block_id for b in hits] == [0]  # block 0 (prompt + first token) only
    out: dict[str, list[int]] = {rid: ref[:2], probe_id: []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
        engine.check_invariants()
    assert out == {rid: ref, probe_id: reference(probe, 4)}


def test_abort_while_drafts_are_verified_frees_everything(llama_engine, reference):
    prompt = random_prompts(488, [12], seed=34)[0]
    ref = reference(prompt, 20)
    engine = spec_engine(llama_engine, prompt, ref, [(2, 4)] * 5)
    other = engine.add_request(random_prompts(488, [5], seed=35)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    step = engine.backend.step
    finals = []

    def abort_during_verify(chunks):
        if any(c.num_logits > 1 for c in chunks) and not finals:
            finals.append(engine.abort(rid))  # another thread's abort while the backend runs
        return step(chunks)

    engine.backend.step = abort_during_verify  # type: ignore[method-assign]
    outputs = engine.step()
    assert finals and finals[0] is not None and finals[0].finish_reason == "abort"
    assert all(o.request_id != rid for o in outputs)
    engine.abort(other)
    engine.check_invariants()
    assert engine.kv.pool.counts()["used"] == 0 and not engine.has_unfinished_requests()


def test_a_deadline_expires_with_drafts_in_flight(llama_engine, reference):
    now = [0.0]
    prompt = random_prompts(488, [12], seed=36)[0]
    ref = reference(prompt, 20)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC), clock=lambda: now[0])
    assert engine.spec is not None
    engine.spec.proposer = Oracle(prompt, ref, [(1, 4)] * 9, 488)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, deadline_s=5))
    engine.step()
    engine.step()
    assert engine.requests[rid].draft_token_ids and len(engine.requests[rid].block_ids) == 2
    now[0] = 6.0
    (out,) = engine.step()
    assert out.finish_reason == "deadline" and engine.kv.pool.counts()["used"] == 0


def test_speculation_pauses_while_the_batch_is_large(llama_engine, reference):
    """speculative_disable_batch_size=1: no drafts while two requests run; the survivor speculates."""
    long_prompt, short_prompt = random_prompts(488, [10, 6], seed=37)
    ref = reference(long_prompt, 16)
    engine = spec_engine(llama_engine, long_prompt, ref, [(2, 2)] * 20, speculative_disable_batch_size=1)
    seen = record_chunks(engine)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    long_id = engine.add_request(long_prompt, params)
    engine.add_request(short_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        out += [t for d in engine.step() if d.request_id == long_id for t in d.token_ids]
    assert out == ref
    assert all(c.num_logits == 1 for chunks in seen if len(chunks) > 1 for c in chunks)
    assert any(c.num_logits == 3 for chunks in seen for c in chunks)
    assert engine.kv.pool.counts()["used"] == 0


def test_the_pause_size_defaults_per_method():
    """A draft engine drafts for a lone request only unless told otherwise (it lost 13-17% at c=4)."""
    assert EngineArgs(speculative="ngram").disable_batch_size == 4
    assert EngineArgs(speculative="draft", draft_engine="d").disable_batch_size == 1
    assert EngineArgs(speculative="draft", draft_engine="d", speculative_disable_batch_size=3).disable_batch_size == 3


def test_speculation_pauses_while_requests_wait(llama_engine):
    """One sequence slot, disable size 1: while a second request waits, the running one gets no drafts (a
    queue means the batch is about to grow); alone, the second speculates."""
    first, second = copy_heavy_prompts(488, [16, 16], seed=43)
    engine = LLMEngine(llama_engine, EngineArgs(**{**SPEC, "speculative_disable_batch_size": 1}, max_num_seqs=1))
    seen = record_chunks(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first_id, second_id = engine.add_request(first, params), engine.add_request(second, params)
    waited = []
    while engine.has_unfinished_requests():
        waited.append(engine.scheduler.num_waiting > 0)
        engine.step()
    by_request = [{c.num_logits for c in chunks} for chunks in seen]
    assert all(rows == {1} for rows, wait in zip(by_request, waited, strict=True) if wait)
    assert any(max(rows) > 1 for rows, wait in zip(by_request, waited, strict=True) if not wait)
    assert engine.kv.pool.counts()["used"] == 0 and {first_id, second_id}.isdisjoint(engine.requests)


def test_sampled_requests_with_logprobs_and_penalties_run_speculatively(llama_engine, reference):
    """Random rows through the engine: a seeded request samples the same tokens with speculation on
    and off (the verifier draws as the sampler does), every emitted token carries the target's
    logprobs (equal to float tolerance), KV is clean at the end; a greedy request with penalties too."""
    prompts = copy_heavy_prompts(488, [16, 12, 20], seed=41)
    # A seed whose draws accept drafts: over random weights few do (the test needs an accepted one).
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True, logprobs=1)

    def once(spec: bool):
        engine = LLMEngine(
            llama_engine, EngineArgs(**SPEC) if spec else EngineArgs(itl_target_ms=None, backend=FLOAT32_BACKEND)
        )
        ids = [engine.add_request(p, sampled if i < 2 else greedy) for i, p in enumerate(prompts)]
        outs = {i: CompletionOutput(i, []) for i in ids}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outs[delta.request_id].add(delta)
            engine.check_invariants()
        assert engine.kv.pool.counts()["used"] == 0
        return [outs[i] for i in ids], engine.stats().spec_decode

    first, stats = once(spec=True)
    plain, _ = once(spec=False)
    assert stats is not None and stats.accepted_tokens > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in plain]
    for spec_out, plain_out in zip(first, plain, strict=True):
        assert len(spec_out.token_ids) == 20
        assert [lp.token_id for lp in spec_out.logprobs or []] == spec_out.token_ids
        np.testing.assert_allclose(
            [lp.logprob for lp in spec_out.logprobs or []], [lp.logprob for lp in plain_out.logprobs or []], atol=1e-4
        )


def test_generate_command_speculates(llama_engine):
    from click.testing import CliRunner

    from runtime.cli import main as trtserve_cli

    base = ["generate", "--engine", str(llama_engine), "--prompt", "a b c a b c a b", "--no-chat", "--max-tokens", "16"]
    plain = CliRunner().invoke(trtserve_cli, base)
    spec_args = ["--speculative", "ngram", "--num-speculative-tokens", "3", "--stats"]
    spec = CliRunner().invoke(trtserve_cli, [*base, *spec_args])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "speculative:" in spec.stderr and "tokens per pass" in spec.stderr


def test_tensorrt_calls_place_verify_rows_and_refuse_too_many(llama_engine):
    """The TensorRT runner's call planning (CPU-checkable): a verify chunk runs in the prefill
    profile, its rows land at its place in the step's output, the profile's row limit is enforced."""
    from engine_format import TensorRTLimits
    from executors.tensorrt import STEP_INPUTS, input_capacity, pack_inputs, plan_calls

    config = EngineConfig.load(llama_engine)
    limits = TensorRTLimits.from_build(config.max_batch_size, config.max_seq_len, config.block_size, max_step=64)
    assert limits.max_logit_rows == 64  # 8 sequences x 8 rows
    chunks = [
        SequenceChunk([5], 9, [0, 1]),
        SequenceChunk([5, 6, 7, 8], 9, [2, 3], num_logits=4),
        SequenceChunk([4], 3, [4]),
    ]
    calls = plan_calls(chunks, 8, limits)
    assert [(c.profile, c.rows, c.out_rows) for c in calls] == [(0, [0, 2], [0, 5]), (1, [1], [1, 2, 3, 4])]
    assert calls[1].tensors.logit_rows.tolist() == [0, 1, 2, 3]
    widest = [SequenceChunk(list(range(64)), 0, list(range(8 * i, 8 * i + 8)), num_logits=8) for i in range(8)]
    assert pack_inputs(plan_calls(widest, 8, limits), STEP_INPUTS)[0].size <= input_capacity(limits)
    with pytest.raises(ValueError, match="asks for 72 logit rows; optimization profile 1 returns at most 64"):
        plan_calls([SequenceChunk(list(range(9)), 0, [2 * i, 2 * i + 1], num_logits=9) for i in range(8)], 8, limits)


def test_torch_backend_returns_every_requested_row(llama_engine):
    """The torch backend (Triton kernels, interpreted here) against HF eager on a verify step,
    and its device sampler refusing multi-row chunks (verify steps go through step())."""
    pytest.importorskip("torch")
    from builder.sources import load_checkpoint, resolve_model

    model, _ = load_checkpoint(resolve_model("tiny-llama"))
    backend = create_backend(EngineConfig.load(llama_engine), num_blocks=16, kind="torch")
    a, b = random_prompts(backend.config.model.vocab_size, [14, 9], seed=51)
    backend.step([SequenceChunk(a[:10], 0, [0, 1]), SequenceChunk(b[:8], 0, [2, 3])])
    got = backend.step([SequenceChunk(a[10:], 10, [0, 1], num_logits=4), SequenceChunk(b[8:], 8, [2, 3])])
    np.testing.assert_allclose(got[:4], hf_logits(model, a)[10:14], atol=ATOL)
    np.testing.assert_allclose(got[4], hf_logits(model, b)[8], atol=ATOL)
    with pytest.raises(ValueError, match="verify drafts through step"):
        backend.step_sample([SequenceChunk(a[10:], 10, [0, 1], num_logits=4)], [None])


def test_more_drafts_than_a_tensorrt_plan_returns_are_refused_at_start(llama_engine):
    import dataclasses

    from engine_format import TensorRTLimits
    from runtime.engine.spec.decoding import create_spec_decoder

    config = EngineConfig.load(llama_engine)
    trt = dataclasses.replace(config, tensorrt=TensorRTLimits.from_build(8, 256, 8, max_step=64))  # 64 rows
    assert create_spec_decoder(EngineArgs(speculative="ngram", num_speculative_tokens=7), trt, 8) is not None
    with pytest.raises(ValueError, match="needs 72 logit rows per step; the TensorRT plan returns at most 64"):
        create_spec_decoder(EngineArgs(speculative="ngram", num_speculative_tokens=8), trt, 8)
    assert create_spec_decoder(EngineArgs(), trt, 8) is None


def test_random_arrivals_aborts_and_mixed_sampling_keep_the_kv_invariants(llama_engine, reference):
    """A seeded storm: copy-heavy prompts arriving at random steps into a 14-block pool, random aborts,
    greedy and sampled (penalized) requests together. Invariants hold after every step, nothing leaks,
    and every greedy request that was not aborted gets exactly its reference tokens."""
    rng = np.random.default_rng(61)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC, num_kv_blocks=14, max_num_batched_tokens=24))
    prompts = copy_heavy_prompts(488, rng.integers(4, 30, 16).tolist(), seed=62)
    arrivals = sorted(rng.integers(0, 40, len(prompts)).tolist())
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_k=20, frequency_penalty=0.5, max_tokens=20, ignore_eos=True, seed=1)
    ids: dict[str, int] = {}
    out: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                rid = engine.add_request(prompts[i], greedy if i % 3 else sampled)
                ids[rid], out[rid] = i, []
        live = [r for r in engine.requests if r not in aborted]
        if live and rng.random() < 0.04:
            victim = live[int(rng.integers(len(live)))]
            assert engine.abort(victim) is not None
            aborted.add(victim)
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
        engine.check_invariants()
        step += 1
    assert engine.kv.pool.counts()["used"] == 0 and aborted
    checked = [rid for rid, i in ids.items() if i % 3 and rid not in aborted]
    assert len(checked) >= 6
    assert [out[rid] for rid in checked] == [reference(prompts[ids[rid]], 20) for rid in checked]
    stats = engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.accepted_tokens > 0 and stats.preemptions > 0
