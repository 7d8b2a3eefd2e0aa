"""Structured output through the engine (tiny Llama): every guided field's output matches its grammar, greedy
and sampled; a grammar compiles once however many requests use it, off the engine loop and within its
bound (a slow one refused, never stalling other streams); a bad one is refused naming its field; requests
without one touch none of it; preemption (recompute) and n-gram speculation give the same greedy output,
drafts the grammar refuses rejected in verification."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from engine_format.grammars import GrammarSpec
from runtime import AsyncLLM, EngineArgs, InvalidRequest, LLMEngine, SamplingParams
from runtime.engine.grammar_cache import GrammarCache
from tests.helpers import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
}
GUIDED = {
    "json": dict(guided_json=json.dumps(SCHEMA)),
    "regex": dict(guided_regex=r"[a-f]{3}-[0-9]{2,4}"),
    "choice": dict(guided_choice=["alpha", "beta", "gamma delta"]),
    "gbnf": dict(guided_grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
}
SPEC = dict(speculative="ngram", num_speculative_tokens=4, speculative_disable_batch_size=8, itl_target_ms=None,
            speculative_adaptive=False)  # fmt: skip


def matches(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "choice":
        return text in GUIDED["choice"]["guided_choice"]
    pattern = GUIDED["regex"]["guided_regex"] if kind == "regex" else r"\(([0-9]|x)(,([0-9]|x))*\)"
    return re.fullmatch(pattern, text) is not None


def generate(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list[tuple[str, str, list[int]]]:
    """(text, finish reason, tokens) per prompt, all added at once; KV invariants checked every step."""
    ids = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params, strict=True))}
    texts, reasons, tokens = [""] * len(prompts), [""] * len(prompts), [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = ids[out.request_id]
            texts[i] += out.text
            tokens[i] += out.token_ids
            reasons[i] = out.finish_reason or reasons[i]
        engine.check_invariants()
    return list(zip(texts, reasons, tokens, strict=True))


@pytest.fixture(scope="module")
def prompts(llama_engine):
    vocab = LLMEngine(llama_engine).config.model.vocab_size
    return random_prompts(vocab, [12, 9, 15, 11, 7, 13, 10, 8], seed=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_guided_field_is_obeyed(llama_engine, prompts, temperature):
    engine = LLMEngine(llama_engine)
    kinds = sorted(GUIDED) * 2
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, **GUIDED[k]) for i, k in enumerate(kinds)]
    results = generate(engine, prompts, params)
    for kind, (text, reason, _) in zip(kinds, results, strict=True):
        assert reason == "stop" and matches(kind, text), (kind, text, reason)
    stats = engine.stats().grammar
    assert (stats.requests, stats.compiles, stats.violations) == (8, 4, 0)
    assert stats.cache_hits == 4 and stats.masked_steps >= sum(len(t) for _, _, t in results)


def test_the_outputs_differ_without_the_grammar(llama_engine, prompts):
    """The tiny random model writes none of these on its own: the checks above can fail."""
    engine = LLMEngine(llama_engine)
    results = generate(engine, prompts[:4], [SamplingParams(temperature=0, max_tokens=40)] * 4)
    assert not any(matches(k, text) for k in GUIDED for text, _, _ in results)
    assert engine.grammars._pool is None and engine.stats().grammar.masked_steps == 0  # it paid nothing


def test_a_bad_grammar_is_refused_naming_its_field_and_remembered(llama_engine, prompts):
    engine = LLMEngine(llama_engine)
    for field, value, says in [
        ("guided_json", json.dumps({"type": "objec"}), "Invalid type"),
        ("guided_regex", "(unclosed", "unclosed group"),
        ("guided_grammar", 'root ::= "a" missing', "missing"),
    ]:
        for _ in range(2):
            with pytest.raises(InvalidRequest, match=says) as error:
                engine.add_request(prompts[0], SamplingParams(**{field: value}))
            assert error.value.field == field
    stats = engine.stats()
    assert stats.grammar.compile_failures == 3 and stats.grammar.cache_hits == 3 and stats.rejected_invalid == 6
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="give only one") as error:
        SamplingParams(guided_regex="a", guided_choice=["b"])
    assert error.value.field == "guided_choice"
    with pytest.raises(InvalidRequest, match="cannot be combined") as error:
        SamplingParams(guided_regex="a", ignore_eos=True)
    assert error.value.field == "ignore_eos"


class Gate:
    """A compile that waits for the test: deterministic 'slow' grammars."""

    def __init__(self, real) -> None:
        self.real, self.open, self.calls = real, threading.Event(), 0

    def __call__(self, spec: GrammarSpec):
        self.calls += 1
        assert self.open.wait(60), "the test never opened the gate"
        return self.real(spec)


def test_a_compile_past_the_bound_is_refused_then_cached(llama_engine, prompts):
    engine = LLMEngine(llama_engine, EngineArgs(grammar_compile_timeout_s=0.05))
    gate = Gate(engine.grammars._compile_fn)
    engine.grammars._compile_fn = gate
    params = SamplingParams(temperature=0, max_tokens=40, **GUIDED["regex"])
    for _ in range(2):  # the second waits on the same compile: one compile, not two
        with pytest.raises(InvalidRequest, match=r"did not compile within 0\.05 s") as error:
            engine.add_request(prompts[0], params)
        assert error.value.field == "guided_regex"
    gate.open.set()
    engine.grammars._future(params.grammar).result(timeout=60)  # the compile ran on, and is cached
    [(text, reason, _)] = generate(engine, prompts[:1], [params])
    assert matches("regex", text) and reason == "stop"
    stats = engine.stats().grammar
    assert (gate.calls, stats.compiles, stats.compile_timeouts) == (1, 1, 2)


def test_a_slow_grammar_never_stalls_other_streams(llama_engine, prompts):
    async def scenario(engine: AsyncLLM, gate: Gate) -> None:
        async def collect(prompt, params) -> str:
            return "".join([d.text async for d in engine.generate(prompt, params)])

        slow = asyncio.create_task(collect(prompts[0], SamplingParams(temperature=0, max_tokens=60,
                                                                      **GUIDED["json"])))  # fmt: skip
        await asyncio.sleep(0)
        plain = await collect(prompts[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert len(plain) > 0 and not slow.done() and gate.calls == 1  # served while the compile waits
        gate.open.set()
        assert matches("json", await slow)

    engine = AsyncLLM(llama_engine, EngineArgs(grammar_compile_timeout_s=60, engine_process=False))
    try:
        gate = Gate(engine.engine.grammars._compile_fn)
        engine.engine.grammars._compile_fn = gate
        asyncio.run(scenario(engine, gate))
    finally:
        engine.shutdown()


def test_preemption_recomputes_to_the_same_constrained_output(llama_engine, prompts):
    kinds = sorted(GUIDED) * 2
    params = [SamplingParams(temperature=0, max_tokens=60, **GUIDED[k]) for k in kinds]
    want = generate(LLMEngine(llama_engine), prompts, params)
    storm = LLMEngine(llama_engine, EngineArgs(num_kv_blocks=10, max_num_batched_tokens=64))
    got = generate(storm, prompts, params)
    assert storm.stats().preemptions > 0
    assert got == want and all(matches(k, text) for k, (text, _, _) in zip(kinds, got, strict=True))
    assert storm.stats().grammar.violations == 0


def copy_heavy(prompts: list[list[int]]) -> list[list[int]]:
    return [p + p for p in prompts]


def test_ngram_speculation_gives_the_same_greedy_constrained_output(llama_engine, prompts):
    kinds = sorted(GUIDED) * 2
    params = [SamplingParams(temperature=0, max_tokens=60, **GUIDED[k]) for k in kinds]
    want = generate(LLMEngine(llama_engine, EngineArgs(itl_target_ms=None)), copy_heavy(prompts), params)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC))
    assert generate(engine, copy_heavy(prompts), params) == want
    spec = engine.stats().spec_decode
    assert spec is not None and spec.accepted_tokens > 0
    assert engine.stats().grammar.violations == 0


def test_drafts_the_grammar_refuses_are_rejected_in_verification(llama_engine, prompts, monkeypatch):
    """Draft trimming off and a proposer that always guesses a refused token first: every step's drafts are
    verified and rejected, and the output is the plain greedy one."""
    params = [SamplingParams(temperature=0, max_tokens=30, **GUIDED["regex"])] * 2
    want = generate(LLMEngine(llama_engine, EngineArgs(itl_target_ms=None)), prompts[:2], params)
    engine = LLMEngine(llama_engine, EngineArgs(**SPEC))
    refused = engine.tokenizer.encode("Z")[0]
    monkeypatch.setattr("executors.sampling.grammar.GrammarState.valid_prefix", lambda self, drafts: len(drafts))
    monkeypatch.setattr(engine.spec.proposer, "propose", lambda contexts, k, *a: [[refused] * n for n in k])
    assert generate(engine, prompts[:2], params) == want
    spec = engine.stats().spec_decode
    assert spec.draft_tokens > 0 and spec.accepted_tokens == 0
    assert engine.stats().grammar.violations == 0


def test_the_cache_keeps_one_compile_per_distinct_grammar():
    compiled: list[str] = []

    class Pristine:
        def deep_copy(self):
            return self

    def fake(spec: GrammarSpec):
        compiled.append(spec.text)
        return Pristine()

    cache = GrammarCache(None, 64, [2], timeout_s=5, compile_fn=fake)
    for text in ["a+", "b+", "a+", "a+", "b+"]:
        assert cache.matcher(SamplingParams(guided_regex=text)) is not None
    assert cache.matcher(SamplingParams()) is None
    assert sorted(compiled) == ["a+", "b+"]
    stats = cache.stats()
    assert (stats.requests, stats.compiles, stats.cache_hits) == (5, 2, 3)
    assert len(cache.take_compile_seconds()) == 2 and cache.take_compile_seconds() == []
    cache.close()


def test_async_requests_compile_before_they_queue(llama_engine, prompts):
    async def scenario(engine: AsyncLLM) -> list[str]:
        async def collect(params) -> str:
            return "".join([d.text async for d in engine.generate(prompts[2], params)])

        return await asyncio.gather(*(collect(SamplingParams(temperature=t, seed=1, max_tokens=80, **GUIDED["json"]))
                                      for t in np.linspace(0.0, 1.0, 4)))  # fmt: skip

    engine = AsyncLLM(llama_engine)
    try:
        texts = asyncio.run(scenario(engine))
        assert all(matches("json", t) for t in texts)
        assert engine.stats().grammar.compiles == 1
    finally:
        engine.shutdown()
