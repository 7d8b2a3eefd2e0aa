"""Overlapped scheduling (LLMEngine over an OverlappedSampling backend) against the same engine stepping one
step at a time: the same tokens for every request, whatever finishes them (EOS a step late, max_tokens, stop
strings, aborts, preemption under a small KV pool), never a placeholder in an output, every block back.

The backend is a stand-in whose "device" is the host: each token is a fixed function of the token before it
and its position, so any token taken from the wrong row, position or step changes the outputs. Its launch
keeps the sampled tokens of the last launch the way a GPU backend keeps them on the device, and fills the
next step's placeholders from them (tests/test_torch_backend.py runs the real torch backend's launch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.device_sampling import PLACEHOLDER, OverlappedSampling
from executors.sampling import DeviceSample, SamplingParams, SamplingState
from runtime.engine.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine

EOS = 2


def next_token(token: int, position: int, vocab: int) -> int:
    """EOS now and then (after ~1 in 23 tokens), else a token that depends on both inputs."""
    value = (token * 31 + position * 7 + 3) % vocab
    return EOS if value % 23 == 0 else max(value, 3)


class FakeDevice:
    """EngineBackend, DeviceSampling and OverlappedSampling; counts launches and synchronous steps."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config, self.num_blocks, self.vocab = config, num_blocks, config.model.vocab_size
        self.launches = self.steps = 0

    def _sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None],
                tokens_in: list[int]) -> np.ndarray:  # fmt: skip
        out = np.full(len(chunks), -1, np.int64)
        for i, (c, row) in enumerate(zip(chunks, rows, strict=True)):
            assert all(t >= 0 for t in tokens_in[i : i + 1]) and len(c.block_table) * self.config.block_size >= (
                c.past_len + len(c.token_ids)
            ), "a real token and a block for every position"
            if row is not None:
                out[i] = next_token(tokens_in[i], c.past_len + len(c.token_ids) - 1, self.vocab)
        return out

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        raise AssertionError("device sampling only")

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        self.steps += 1
        assert all(PLACEHOLDER not in c.token_ids for c in chunks), "a synchronous step has every token"
        ids = self._sample(chunks, rows, [c.token_ids[-1] for c in chunks])
        return DeviceSample(ids, [None] * len(chunks))

    def launch(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None], sources: np.ndarray,
               previous: Launched | None) -> Launched:  # fmt: skip
        self.launches += 1
        last = []
        for c, source in zip(chunks, sources, strict=True):
            tokens = list(c.token_ids)
            if source >= 0:
                assert tokens[0] == PLACEHOLDER and previous is not None and previous.ids[source] >= 0
                tokens[0] = int(previous.ids[source])
            assert PLACEHOLDER not in tokens
            last.append(tokens[-1])
        return Launched(self._sample(chunks, rows, last))


@dataclasses.dataclass
class Launched:
    ids: np.ndarray

    def result(self) -> DeviceSample:
        return DeviceSample(self.ids, [None] * len(self.ids))


def engine(llama_engine, overlap: bool, num_blocks: int = 64, **args) -> tuple[LLMEngine, FakeDevice]:
    config = EngineConfig.load(llama_engine)
    device = FakeDevice(config, num_blocks)
    assert isinstance(device, OverlappedSampling)
    engine_args = EngineArgs(num_kv_blocks=num_blocks, overlap_scheduling=overlap, itl_target_ms=None, **args)
    return LLMEngine(llama_engine, engine_args, backend=device), device


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
        abort_after: dict[int, int] | None = None) -> list[tuple[list[int], str]]:  # fmt: skip
    """Every request's token ids and finish reason; request i is aborted once it has `abort_after[i]` tokens (in
    steps, an overlapped engine is a step behind: a token in flight when its request is aborted is never output)."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    while eng.has_unfinished_requests():
        outputs = eng.step()
        for index, count in (abort_after or {}).items():
            if len(tokens[ids[index]]) + sum(len(o.token_ids) for o in outputs if o.request_id == ids[index]) >= count:
                aborted = eng.abort(ids[index])
                outputs += [aborted] if aborted is not None else []
        for out in outputs:
            assert PLACEHOLDER not in out.token_ids, "a placeholder reached an output"
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason or ""
    eng.check_invariants()
    assert eng.kv.pool.counts()["used"] == 0, "every block back"
    return [(tokens[i], reasons[i]) for i in ids]


PROMPTS = [[5 + i, 9, 13 + i % 4, 17][: 2 + i % 3] * (1 + i % 5) for i in range(12)]


def test_overlapped_steps_give_the_same_tokens_as_steps_one_by_one(llama_engine):
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * (i % 4)) for i in range(len(PROMPTS))]
    sync, sync_device = engine(llama_engine, overlap=False)
    overlapped, device = engine(llama_engine, overlap=True)
    expected = run(sync, PROMPTS, params)
    assert run(overlapped, PROMPTS, params) == expected
    assert sync_device.launches == 0 and device.steps == 0 and device.launches > 0
    assert {reason for _, reason in expected} == {"stop", "length"}, "EOS and max_tokens both finish some"


def test_a_small_pool_preempts_and_recomputes_the_same_tokens(llama_engine):
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    expected = run(engine(llama_engine, overlap=False, num_blocks=24)[0], PROMPTS, params)
    overlapped, _ = engine(llama_engine, overlap=True, num_blocks=24)
    assert run(overlapped, PROMPTS, params) == expected
    assert overlapped.scheduler.num_preemptions > 0


def test_aborts_and_stop_strings_while_a_step_is_in_flight(llama_engine):
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=("zz",) if i % 3 == 0 else ())
              for i in range(len(PROMPTS))]  # fmt: skip
    aborts = {1: 3, 4: 5, 7: 1}
    expected = run(engine(llama_engine, overlap=False)[0], PROMPTS, params, aborts)
    assert run(engine(llama_engine, overlap=True)[0], PROMPTS, params, aborts) == expected


@pytest.mark.parametrize("host_sampled", [{"logprobs": 1}, {"repetition_penalty": 1.2}])
def test_a_request_that_samples_from_host_state_makes_steps_run_one_by_one(llama_engine, host_sampled):
    """Logprobs and penalties read the host's per-request state, which must hold the previous step's token."""
    eng, device = engine(llama_engine, overlap=True)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request([5, 6, 7], plain)
    eng.step(), eng.step()
    assert device.launches == 2 and device.steps == 0
    eng.add_request([8, 9], dataclasses.replace(plain, **host_sampled))
    while eng.has_unfinished_requests():
        launches = device.launches
        eng.step()
        assert device.launches == launches, "no launch while it is live"
    assert device.steps > 0
    eng.check_invariants()


def test_the_check_catches_a_token_taken_from_the_wrong_row(llama_engine, monkeypatch):
    """A launch that fills a placeholder from another row gives other tokens: the comparison above fails."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in PROMPTS[:4]]
    expected = run(engine(llama_engine, overlap=False)[0], PROMPTS[:4], params)
    eng, _ = engine(llama_engine, overlap=True)
    real = FakeDevice.launch

    def shifted(self, chunks, rows, sources, previous):
        return real(self, chunks, rows, np.where(sources >= 0, (sources + 1) % max(len(sources), 1), -1), previous)

    monkeypatch.setattr(FakeDevice, "launch", shifted)
    assert run(eng, PROMPTS[:4], params) != expected


@pytest.mark.parametrize("overlap", [False, True])
def test_each_token_output_counts_the_tokens_output_so_far(llama_engine, overlap):
    """TokenOutput.num_output_tokens is the request's count after this output, not counting the placeholder of
    a step launched meanwhile."""
    eng, _ = engine(llama_engine, overlap=overlap)
    for prompt in PROMPTS[:4]:
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    counts: dict[str, int] = {}
    while eng.has_unfinished_requests():
        for out in eng.step_tokens():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            assert out.num_output_tokens == counts[out.request_id]
    assert set(counts.values()) == {9}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_only_request_ends_with_its_first_token_its_blocks_still_held(llama_engine, overlap):
    """Disaggregation's prefill side, through the step update: a prefill-only request ends as "handoff" with its
    first token, one step at a time and overlapped alike (where a step with its placeholder is already in flight);
    the hook that pins its blocks runs while the request still holds them, and its handle reaches the output."""
    eng, _ = engine(llama_engine, overlap=overlap)
    handed = []

    def kv_handle(request) -> str:
        held = all(eng.kv.pool.blocks[b].ref_cnt >= 1 for b in request.block_ids)
        handed.append((request.request_id, request.all_token_ids[request.num_prompt_tokens :], held))
        return f"handle of {request.request_id}"

    eng.update.kv_handle = kv_handle
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [eng.add_request(prompt, params) for prompt in PROMPTS[:3]]
    eng.requests[ids[1]].prefill_only = True  # what add_request sets for a request the door exported
    outputs: dict[str, list] = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for out in eng.step_tokens():
            assert PLACEHOLDER not in out.token_ids
            outputs[out.request_id].append(out)
    [final] = outputs[ids[1]]
    assert (final.finish_reason, final.kv_handle, len(final.token_ids)) == ("handoff", f"handle of {ids[1]}", 1)
    assert handed == [(ids[1], final.token_ids, True)], "pinned once, before its own references went"
    assert [sum(len(o.token_ids) for o in outputs[i]) for i in (ids[0], ids[2])] == [8, 8], "the others go on"
    eng.check_invariants()
