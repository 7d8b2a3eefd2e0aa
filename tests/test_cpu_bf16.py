"""The cpu-bf16 backend (bfloat16 dense layers on torch/oneDNN, our kernel for attention) on every
tiny architecture.

Tolerance: bfloat16 keeps 8 bits of mantissa, so no fixed atol fits every model. The reference is
HF eager in float32, and the bound is HF's own bfloat16 forward of the same checkpoint: this
backend's logits must be no further from float32 than HF-bfloat16's are (x BF16_HEADROOM: rounding
lands differently in fused matmuls). Measured on the tiny models: 0.08-0.14 for both, logits up to
~5. A fault (a wrong block table, position or pool slot) moves logits by O(1), which
`test_wrong_block_table_is_caught` shows the bound catches.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from engine_format import EngineConfig, EngineLoadError
from executors import create_backend
from executors.base import SequenceChunk
from runtime import LLM, SamplingParams
from tests.helpers import NEEDS_BF16_MATMUL, hf_logits, random_prompts

pytestmark = NEEDS_BF16_MATMUL

BF16_HEADROOM = 1.5


@pytest.fixture(scope="module")
def backend(tiny_engine):
    return create_backend(EngineConfig.load(tiny_engine), num_blocks=64, kind="cpu-bf16")


@pytest.fixture(scope="module")
def references(tiny_hf):
    """(HF float32 logits, the bound) for a 43-token random prompt, keyed by the model."""
    model, _ = tiny_hf
    cache: dict[int, tuple[list[int], np.ndarray, float]] = {}

    def get(vocab: int) -> tuple[list[int], np.ndarray, float]:
        if vocab not in cache:
            tokens = random_prompts(vocab, [43])[0]
            ref32 = hf_logits(model, tokens)
            ref16 = hf_logits(copy.deepcopy(model).to(torch.bfloat16), tokens)  # the fixture's model is shared
            cache[vocab] = (tokens, ref32, BF16_HEADROOM * float(np.abs(ref16 - ref32).max()))
        return cache[vocab]

    return get


def error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max())


def test_prefill_then_decodes_as_close_to_float32_as_hf_bfloat16(backend, references):
    tokens, ref, bound = references(backend.config.model.vocab_size)
    table = list(range(6))
    got = [backend.step([SequenceChunk(tokens[:40], 0, table)])[0]]
    got += [backend.step([SequenceChunk([tokens[p]], p, table)])[0] for p in range(40, 43)]  # read the pool
    assert error(np.stack(got), ref[39:43]) <= bound


def test_prompt_logits_every_row(backend, references):
    tokens, ref, bound = references(backend.config.model.vocab_size)
    assert error(backend.prompt_logits(SequenceChunk(tokens, 0, list(range(10, 16)))), ref) <= bound


def test_ragged_batch_equals_single_sequences(backend):
    """Rows do not see each other: a decode, a prefill chunk and a verify chunk (3 logit rows) batched
    give each sequence's logits alone, to bfloat16 rounding of the batch's matmul shapes."""
    vocab = backend.config.model.vocab_size
    a, b, c = random_prompts(vocab, [20, 13, 30], seed=7)
    backend.step([SequenceChunk(a[:19], 0, [20, 21, 22])])
    backend.step([SequenceChunk(c[:24], 0, [30, 31, 32, 33])])
    chunks = [SequenceChunk(a[19:], 19, [20, 21, 22]), SequenceChunk(b, 0, [40, 41]),
              SequenceChunk(c[24:], 24, [30, 31, 32, 33], num_logits=3)]  # fmt: skip
    batched = backend.step(chunks)
    alone = np.concatenate([backend.step([chunk]) for chunk in chunks])
    assert batched.shape == alone.shape == (5, vocab)
    np.testing.assert_allclose(batched, alone, atol=0.05)
    assert (batched.argmax(-1) == alone.argmax(-1)).all()


def test_wrong_block_table_is_caught(backend, references):
    """The check above can fail: decoding over blocks that hold another sequence's K/V."""
    tokens, ref, bound = references(backend.config.model.vocab_size)
    backend.step([SequenceChunk(tokens[:40], 0, list(range(6)))])
    other = random_prompts(backend.config.model.vocab_size, [40], seed=11)[0]
    backend.step([SequenceChunk(other, 0, list(range(50, 56)))])
    wrong = backend.step([SequenceChunk([tokens[40]], 40, [0, 1, 52, 53, 4, 5])])[0]
    assert error(wrong, ref[40]) > bound


def test_int8_kv_cache_reads_like_the_float_backend(llama_engine):
    """A quantized pool through this backend's K/V writes and the kernel: as the fp32 `cpu` backend on
    the same int8 pool, to bfloat16 rounding."""
    config = dataclasses.replace(EngineConfig.load(llama_engine), kv_cache_dtype="int8")
    tokens = random_prompts(config.model.vocab_size, [37], seed=5)[0]
    logits = {}
    for kind in ("cpu", "cpu-bf16"):
        be = create_backend(config, num_blocks=16, kind=kind)
        be.step([SequenceChunk(tokens[:36], 0, [3, 4, 5, 6, 7])])
        logits[kind] = be.step([SequenceChunk(tokens[36:], 36, [3, 4, 5, 6, 7])])[0]
        assert be.kv.scales is not None and (be.kv.scales[0, 0, 3] != 1).any()  # the scales were written
    assert error(logits["cpu-bf16"], logits["cpu"]) < 0.25
    assert logits["cpu-bf16"].argmax() == logits["cpu"].argmax()


def test_refuses_engines_it_cannot_run(llama_engine):
    config = EngineConfig.load(llama_engine)
    with pytest.raises(EngineLoadError, match="float32 or bfloat16 engine"):
        create_backend(dataclasses.replace(config, dtype="float16"), kind="cpu-bf16")
    from executors.torch.weights import Linear
    from executors.torch_cpu import _packed

    with pytest.raises(EngineLoadError, match="FP8"):  # an FP8 engine's activation Q/DQ
        _packed(Linear(torch.zeros(8, 8, dtype=torch.bfloat16), input_scale=0.5), rows_hint=8)


def test_engine_serves_on_it(llama_engine):
    """The whole engine on this backend: chunked prefill, a shared prefix from the cache, every block back."""
    llm = LLM(llama_engine, backend="cpu-bf16", max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8] * 6 + [9, 10], [5, 6, 7, 8] * 6 + [11]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert llm.engine.kv.pool.usage == 0
