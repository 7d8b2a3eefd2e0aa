"""The draft-engine proposer: a second tiny engine (same tokenizer) drafts for the tiny Llama target.
Greedy outputs equal the plain greedy loop whatever the draft; the same model as its own draft is
(almost) always accepted; the draft's KV catches up on accepted tokens and drops rejected ones
(exact chunks); finished requests give the draft's blocks back; another vocabulary is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from engine_format import EngineConfig, EngineLoadError
from executors import create_backend
from executors.base import SequenceChunk
from executors.greedy import greedy_generate
from runtime import EngineArgs, LLMEngine, SamplingParams
from runtime.engine.spec import DraftEngineProposer
from runtime.engine.spec.draft import top_probability
from tests.conftest import build_tiny
from tests.helpers import FLOAT32_BACKEND, random_prompts
from tests.test_spec_decode import copy_heavy_prompts, run


@pytest.fixture(scope="module")
def reference(llama_engine):
    backend = create_backend(EngineConfig.load(llama_engine), kind="graph")
    return lambda prompt, n: greedy_generate(backend, [prompt], n)[0]


@pytest.fixture(scope="module")
def mistral_engine(engines_dir):
    return build_tiny("tiny-mistral", engines_dir)


def draft_args(draft_dir, **extra) -> EngineArgs:
    return EngineArgs(speculative="draft", draft_engine=str(draft_dir), num_speculative_tokens=3,
                      speculative_disable_batch_size=8, itl_target_ms=None, speculative_adaptive=False,
                      **{"draft_prompt_lookup_min": 0, "backend": FLOAT32_BACKEND, "draft_backend": FLOAT32_BACKEND,
                         **extra})  # fmt: skip  # the draft model alone


def test_the_target_as_its_own_draft_is_accepted(llama_engine, reference):
    engine = LLMEngine(llama_engine, draft_args(llama_engine))
    prompts = random_prompts(488, [12, 30, 7], seed=71)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert run(engine, prompts, params) == [reference(p, 20) for p in prompts]
    stats = engine.stats().spec_decode
    assert stats is not None and stats.drafts > 0 and stats.acceptance_rate > 0.95
    assert stats.mean_acceptance_length > 3.5  # k = 3: nearly 4 tokens per verify pass
    assert engine.spec is not None
    proposer = engine.spec.proposer
    assert isinstance(proposer, DraftEngineProposer)
    assert not proposer.runner.sequences and len(proposer.runner.free) == proposer.backend.num_blocks  # all released


@pytest.mark.parametrize("case", ["prefix-caching", "preemption-storm"])
def test_another_model_as_draft_keeps_the_greedy_tokens(llama_engine, mistral_engine, reference, case):
    extra = {"prefix-caching": {}, "preemption-storm": {"num_kv_blocks": 12, "max_num_batched_tokens": 64}}[case]
    engine = LLMEngine(llama_engine, draft_args(mistral_engine, **extra))
    prompts = copy_heavy_prompts(488, [14, 20, 9, 16, 24, 12, 18, 8], seed=72)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert run(engine, prompts, params, arrivals=[0, 0, 1, 2, 3, 5, 8, 13]) == [reference(p, 20) for p in prompts]
    stats = engine.stats().spec_decode
    assert stats is not None and stats.draft_tokens > stats.accepted_tokens  # a poor draft: rejections happen
    assert not engine.spec.proposer.runner.sequences  # type: ignore[union-attr]


def test_sampled_requests_with_a_draft_engine(llama_engine, mistral_engine):
    """Greedy drafts are a one-hot q: a seeded request samples what it samples without speculation."""
    prompts = random_prompts(488, [10, 20], seed=73)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True)
    spec = run(LLMEngine(llama_engine, draft_args(llama_engine)), prompts, params)
    plain = run(LLMEngine(llama_engine, EngineArgs(itl_target_ms=None, backend=FLOAT32_BACKEND)), prompts, params)
    assert spec == plain and all(len(o) == 16 for o in spec)


class Recording:
    """The draft backend, with every step's chunks recorded."""

    def __init__(self, backend) -> None:
        self.inner, self.config, self.num_blocks = backend, backend.config, backend.num_blocks
        self.steps: list[list[tuple[list[int], int, list[int]]]] = []

    def step(self, chunks):
        self.steps.append([(list(c.token_ids), c.past_len, list(c.block_table)) for c in chunks])
        return self.inner.step(chunks)


def test_the_draft_pool_catches_up_and_drops_rejected_drafts(llama_engine):
    backend = Recording(create_backend(EngineConfig.load(llama_engine), num_blocks=8, kind="graph"))
    proposer = DraftEngineProposer(backend)
    prompt = random_prompts(488, [6], seed=74)[0]
    (drafts,) = proposer.propose([prompt], [3], ["r"])
    # The prompt in one chunk, then drafts 1 and 2 fed one at a time (draft 3 is never fed).
    assert backend.steps == [[(prompt, 0, [0])], [([drafts[0]], 6, [0])], [([drafts[1]], 7, [0])]]
    seq = proposer.runner.sequences["r"]  # draft 3 is known, never computed
    assert seq.tokens == [*prompt, *drafts] and seq.tokens[: seq.computed] == [*prompt, *drafts[:2]]
    # The target accepted draft 1 only and added its own token 99: the draft keeps prompt + draft 1
    # and recomputes from 99 (its rejected draft 2 at position 7 is overwritten).
    backend.steps.clear()
    (again,) = proposer.propose([[*prompt, drafts[0], 99]], [2], ["r"])
    assert backend.steps == [[([99], 7, [0])], [([again[0]], 8, [0, 1])]]  # position 8 opens block 1
    proposer.release("r")
    assert not proposer.runner.sequences and list(proposer.runner.free) == list(range(8))


def test_a_request_near_its_end_is_not_caught_up_over_its_whole_context(llama_engine):
    backend = Recording(create_backend(EngineConfig.load(llama_engine), num_blocks=8, kind="graph"))
    proposer = DraftEngineProposer(backend)
    prompt = random_prompts(488, [9], seed=76)[0]
    # 9 context tokens to catch up with 2 tokens left to generate: over CATCH_UP_PER_TOKEN x 2 = 8, nothing runs.
    assert proposer.propose([prompt], [1], ["r"], remaining=[2]) == [[]]
    assert backend.steps == [] and proposer.runner.sequences["r"].tokens == []
    # With 3 left (a limit of 12) the same context is caught up and drafted.
    (drafts,) = proposer.propose([prompt], [1], ["r"], remaining=[3])
    assert backend.steps == [[(prompt, 0, [0, 1])]] and len(drafts) == 1  # 9 tokens: two 8-token blocks
    # Once current, only the new tokens run, however few are left.
    backend.steps.clear()
    (again,) = proposer.propose([[*prompt, drafts[0], 5]], [1], ["r"], remaining=[1])
    assert backend.steps == [[([drafts[0], 5], 9, [0, 1])]] and len(again) == 1
    proposer.release("r")
    assert list(proposer.runner.free) == list(range(8))


def test_top_probability_is_the_softmax_of_the_argmax():
    logits = np.array([[2.0, 1.0, -1.0], [0.0, 0.0, 0.0], [50.0, -50.0, 0.0]], np.float32)
    exact = [np.exp(r.max()) / np.exp(r.astype(np.float64)).sum() for r in logits]
    np.testing.assert_allclose(top_probability(logits), exact, rtol=1e-6)


def test_the_confidence_stop_drops_doubted_drafts_and_never_feeds_them(llama_engine):
    backend = Recording(create_backend(EngineConfig.load(llama_engine), num_blocks=8, kind="graph"))
    prompt = random_prompts(488, [6], seed=74)[0]
    (sure,) = DraftEngineProposer(backend).propose([prompt], [3], ["r"])
    confidence = top_probability(backend.inner.step([SequenceChunk(prompt, 0, [7])]))[0]
    backend.steps.clear()
    doubting = DraftEngineProposer(backend, min_confidence=min(0.999, confidence + 1e-3))
    assert doubting.propose([prompt], [3], ["r"]) == [[]]  # the first guess is below the bar: no drafts
    seq = doubting.runner.sequences["r"]  # the doubted draft was never fed
    assert (
        backend.steps == [[(prompt, 0, [0])]] and seq.computed == len(prompt) and seq.tokens[: seq.computed] == prompt
    )
    assert len(sure) == 3


def test_a_confidence_bar_keeps_greedy_tokens_with_fewer_drafts(llama_engine, mistral_engine, reference):
    prompts = copy_heavy_prompts(488, [14, 20, 9], seed=75)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    drafted = []
    for bar in (0.0, 0.5):
        engine = LLMEngine(llama_engine, draft_args(mistral_engine, draft_min_confidence=bar))
        assert run(engine, prompts, params) == [reference(p, 16) for p in prompts]
        drafted.append(engine.stats().spec_decode.draft_tokens)  # type: ignore[union-attr]
    assert drafted[1] < drafted[0]


def test_a_full_draft_pool_proposes_nothing_instead_of_failing(llama_engine):
    backend = create_backend(EngineConfig.load(llama_engine), num_blocks=2, kind="graph")
    proposer = DraftEngineProposer(backend)
    a, b = random_prompts(488, [12, 10], seed=75)
    got = proposer.propose([a, b], [3, 3], ["a", "b"])
    assert len(got[0]) == 3 and got[1] == []  # a holds both blocks; b had none left
    assert "b" not in proposer.runner.sequences


def test_a_draft_of_another_vocabulary_is_refused(llama_engine, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(llama_engine, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model"]["vocab_size"] += 1
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineLoadError, match="another vocabulary than the target"):
        DraftEngineProposer.load(other, EngineConfig.load(llama_engine))
    with pytest.raises(ValueError, match="draft_engine"):
        EngineArgs(speculative="draft")


def test_generate_command_with_a_draft_engine(llama_engine, mistral_engine):
    from click.testing import CliRunner

    from runtime.cli import main as trtserve_cli

    base = ["generate", "--engine", str(llama_engine), "--prompt", "a b c a b c", "--no-chat", "--max-tokens", "12"]
    plain = CliRunner().invoke(trtserve_cli, base)
    spec = CliRunner().invoke(trtserve_cli, [*base, "--speculative", "draft", "--draft-engine", str(mistral_engine),
                                             "--stats"])  # fmt: skip
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "speculative:" in spec.stderr
    missing = CliRunner().invoke(trtserve_cli, [*base, "--speculative", "draft"])
    assert missing.exit_code == 2 and "--speculative draft needs --draft-engine" in missing.output


def test_draft_and_target_sessions_stop_spinning_when_a_run_returns(llama_engine, mistral_engine):
    """Target and draft runs alternate on the same cores: a session's workers spinning after its run would
    take them from the other's (measured: INT4 draft step 10 -> 18 ms, target verify 28 -> 51 ms)."""
    llm = LLMEngine(llama_engine, draft_args(mistral_engine))
    draft = llm.spec.proposer.backend
    sessions = [llm.backend.small_steps.session, *llm.backend.segments, draft.small_steps.session]
    entries = [s.get_session_options().get_session_config_entry("session.force_spinning_stop") for s in sessions]
    assert entries == ["1"] * len(sessions)
