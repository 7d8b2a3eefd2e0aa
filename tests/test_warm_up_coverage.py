"""No kernel compile while serving: every Triton variant a served workload launches was launched by the torch
backend's warm-up.

On an H100 the first run after start was 2.4x slower than the second (benchmarks/results/gpu-h100-2026-11-26):
steps batching several prompts' chunks needed variants the warm-up had not compiled. Here the kernels run in
Triton's interpreter and tests/kernel_keys.py computes each launch's specialization key as the JIT would; the
workload mixes chunked prefills of odd and even lengths, prefix-cache hits, prefill+decode steps and decode
batches of every size, so that sizes and index-array offsets take every divisibility class."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

from builder.build import BuildOptions, build_engine  # noqa: E402
from executors.sampling import SamplingParams  # noqa: E402
from runtime.engine.engine_args import EngineArgs  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402
from tests.kernel_keys import describe, record_keys  # noqa: E402
from tests.test_torch_backend import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="records interpreted launches (CPU only)")

MAX_SEQS, STEP_TOKENS = 4, 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A head_dim-32 Llama (the fused prologue's path), GQA 2:1."""
    root = tmp_path_factory.mktemp("warm-up")
    out = root / "engine"
    build_engine(BuildOptions(model=str(make_checkpoint("llama", root / "checkpoint")), output=out, max_batch_size=8,
                              max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE))  # fmt: skip
    return out


def serve(llm: LLMEngine, vocab: int) -> None:
    """Arrivals over time: odd/even prompt lengths, a shared prefix (cache hits resume mid-prompt), chunks
    split by the step budget and batched with decodes, then decode batches shrinking 4 -> 1."""
    prompts = random_prompts(vocab, [3, 17, 40, 9, 33, 26, 1], seed=11)
    prompts.append(prompts[2][:24] + prompts[1])  # 24 cached tokens (3 blocks), then 17 new
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 5, 7, 3, 6, 4, 8, 5)]
    pending = list(zip(prompts, params, strict=True))
    while pending or llm.has_unfinished_requests():
        for _ in range(2 if pending else 0):  # two arrivals a step while any are left
            if pending:
                llm.add_request(*pending.pop(0))
        llm.step()


def test_serving_launches_only_warmed_variants(engine):
    llm = LLMEngine(engine, EngineArgs(backend="torch", max_num_seqs=MAX_SEQS, max_num_batched_tokens=STEP_TOKENS,
                                       num_kv_blocks=64, itl_target_ms=None))  # fmt: skip
    with record_keys() as warmed:
        llm.backend.warm_up(MAX_SEQS, STEP_TOKENS, interpreted=True)
    with record_keys() as served:
        serve(llm, llm.config.model.vocab_size)
    assert served, "no launch was recorded: the recorder is not wired to the interpreter"
    missing = served - warmed
    assert not missing, "variants compiled while serving:\n" + "\n".join(describe(missing))


def test_the_check_catches_a_warm_up_that_misses_a_class(engine):
    """Without its longer prefills the warm-up misses the prefill kernel's tiles: the comparison says so."""
    llm = LLMEngine(engine, EngineArgs(backend="torch", max_num_seqs=MAX_SEQS, max_num_batched_tokens=STEP_TOKENS,
                                       num_kv_blocks=64, itl_target_ms=None))  # fmt: skip
    with record_keys() as warmed:
        llm.backend.warm_up(MAX_SEQS, 1, interpreted=True)  # decode buckets and a one-token prefill only
    with record_keys() as served:
        serve(llm, llm.config.model.vocab_size)
    assert any(key[0] == "paged_prefill_kernel" for key in served - warmed)
