"""The torch backend over an int8/fp8 KV cache (executors/torch/kv_cache.py: plugins_cuda/kv_write_quant.py
and paged_attention_quant.py) against the CPU backend on the same quantized engines: the same logits, the
same codes and scales in the pool (up to a rounding step); the same greedy tokens through the greedy loop and
through LLMEngine (prefix caching, preemption); the CUDA-graph buffers over a quantized pool.

Here (no GPU) the Triton kernels run in Triton's interpreter; on a GPU machine the same checks run on CUDA
with compiled kernels, in a pytest process of their own as tests/test_torch_backend.py's (Triton is
imported interpreted or compiled, once a process)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it)

from engine_format import EngineConfig  # noqa: E402
from executors import create_backend  # noqa: E402
from executors.base import SequenceChunk  # noqa: E402
from executors.greedy import greedy_generate  # noqa: E402
from executors.sampling import SamplingParams  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402
from tests.test_kv_quant_engine import LOOSE, _build, _gate  # noqa: E402
from tests.test_torch_backend import ATOL, run_cached_prefix, torch_backend  # noqa: E402


@pytest.fixture(scope="module", params=["int8", "fp8"])
def kv_engine(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"torch-kv-{request.param}")
    engine = root / "engine"
    _build(engine, request.param, _gate(root, LOOSE))
    return engine


def test_steps_match_the_cpu_backend_and_write_its_bytes(kv_engine):
    """Chunked prefill, a step mixing a decode with a prefill, two decodes: the CPU backend's logits, and
    the pool holds the CPU backend's codes (and int8 row scales) at every slot, up to rounding."""
    backend = torch_backend(kv_engine)
    config = backend.config
    cpu = create_backend(config, 64, kind="cpu")
    assert backend.pool.dtype == {"int8": torch.int8, "fp8": torch.uint8}[config.kv_cache_dtype]
    a, b = random_prompts(config.model.vocab_size, [31, 21], seed=5)
    table_a, table_b = [7, 3, 9, 12], [20, 21, 22]
    steps = [
        [SequenceChunk(a[:13], 0, table_a)],
        [SequenceChunk(a[13:29], 13, table_a)],
        [SequenceChunk(a[29:30], 29, table_a), SequenceChunk(b[:20], 0, table_b)],
        [SequenceChunk(a[30:31], 30, table_a), SequenceChunk(b[20:21], 20, table_b)],
    ]
    for chunks in steps:
        np.testing.assert_allclose(backend.step(chunks), cpu.step(chunks), atol=ATOL)
    # The K/V rows themselves come from torch's matmuls on one side and ONNX Runtime's on the other, equal
    # to the last bit or so: the codes are the CPU backend's but where a row lands on a rounding boundary.
    codes = backend.pool[:, :, :64].cpu()
    step = (codes.to(torch.int16) - torch.from_numpy(cpu.kv.data.view(codes.numpy().dtype)).to(torch.int16)).abs()
    assert step.max() <= 1 and step.count_nonzero() <= 1e-3 * step.numel()
    written = codes[:, :, table_a + table_b]
    assert written.count_nonzero() > 0.9 * written.numel()
    if config.kv_cache_dtype == "int8":
        # absmax / 127 of rows that differ in their last bits (~10 ulps after a matmul's cancellations)
        np.testing.assert_allclose(backend.kv.scales[:, :, :64].cpu().numpy(), cpu.kv.scales, rtol=1e-5, atol=0)


def test_greedy_tokens_match_the_cpu_backend(kv_engine):
    backend = torch_backend(kv_engine)
    cpu = create_backend(backend.config, 64, kind="cpu")
    prompts = random_prompts(backend.config.model.vocab_size, [12, 9, 17], seed=3)
    run = lambda b: greedy_generate(b, prompts, 6, prefill_chunk=7)  # noqa: E731
    assert run(backend) == run(cpu)


def test_engine_with_prefix_caching_and_preemption_matches_the_cpu_engine(kv_engine):
    """Through LLMEngine: 16-token steps chunk the prompts, the third prompt shares the first one's two
    full blocks (a prefix-cache hit), and 8 KV blocks cannot hold the three sequences as they grow."""
    vocab = EngineConfig.load(kv_engine).model.vocab_size
    first, second, tail = random_prompts(vocab, [17, 15, 2], seed=11)
    prompts = [first, second, first[:16] + tail]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    got, llm = run_cached_prefix(kv_engine, "torch", prompts, params)
    assert type(llm.backend).__name__ == "TorchBackend"
    stats = llm.stats()
    assert stats.preemptions >= 1 and stats.prefix_cache_hits >= 1, stats
    assert got == run_cached_prefix(kv_engine, "cpu", prompts, params)[0]


def test_decode_buckets_over_a_quantized_pool_match_eager(kv_engine):
    """The CUDA-graph path's buffers (run eagerly here): 3 decodes padded to bucket 4 give the eager
    step's logits; the padding row writes its codes (and scales) into the scratch block only."""
    graphs, eager = torch_backend(kv_engine, cuda_graphs=True, graph_buckets=(1, 2, 4)), torch_backend(kv_engine)
    prompts = random_prompts(graphs.config.model.vocab_size, [10, 3, 12], seed=4)
    tables = [[0, 1], [5], [9, 2]]
    for backend in (graphs, eager):
        backend.step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    for past, token in ((0, 7), (1, 8)):
        chunks = [SequenceChunk([token], len(p) + past, t) for p, t in zip(prompts, tables, strict=True)]
        assert graphs.graphs is not None and graphs.graphs.bucket(chunks) == 4
        np.testing.assert_allclose(graphs.step(chunks), eager.step(chunks), atol=1e-5)
    real = graphs.num_blocks
    # Padding changes the matmuls' row count, so float32 rounding may differ (2e-6 on an AMD EPYC): a
    # value on a rounding boundary may take the neighbouring code (adjacent bit patterns, int8 and E4M3).
    step = (graphs.pool[:, :, :real].to(torch.int16) - eager.pool[:, :, :real].to(torch.int16)).abs()
    assert step.max() <= 1 and step.count_nonzero() <= 1e-3 * step.numel()
    assert graphs.pool[:, :, real].any() and not eager.pool[:, :, real].any()
    if graphs.config.kv_cache_dtype == "int8":
        assert graphs.kv.scales is not None and eager.kv.scales is not None
        torch.testing.assert_close(graphs.kv.scales[:, :, :real], eager.kv.scales[:, :, :real], atol=0, rtol=1e-5)
