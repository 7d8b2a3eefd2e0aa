"""The torch backend (executors/torch/) against HF eager and the ONNX Runtime backends.

Here (no GPU) its Triton kernels run in Triton's interpreter: the same kernel code a GPU
compiles, on tiny models so that a step takes well under a second. The head_dim-32 variants of
the tiny Llama / Qwen2 (random biases) / Mistral (sliding window 24) go through the fused
prologue kernel; the conftest tiny models (head_dim 16) through the unfused torch prologue.
Tolerance as tests/test_engine_parity.py: float32 on both sides, ATOL 1e-4 (a mask, position or
slot error moves logits by O(0.1)). `gpu` tests: SmolLM2 in fp16/bf16 on CUDA against HF eager
on the same GPU, skipped here with the reason. On a GPU machine the other tests run on CUDA with
compiled kernels (and real CUDA graphs in test_decode_buckets_and_padding_match_eager).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it)

from builder.build import BuildOptions, build_engine  # noqa: E402
from builder.sources import load_checkpoint, resolve_model  # noqa: E402
from engine_format import EngineConfig, EngineLoadError  # noqa: E402
from executors import DeviceSampling, create_backend  # noqa: E402
from executors.base import SequenceChunk  # noqa: E402
from executors.greedy import greedy_generate  # noqa: E402
from executors.sampling import SamplingParams  # noqa: E402
from runtime.engine.engine_args import EngineArgs  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN  # noqa: E402
from tests.helpers import hf_greedy, hf_logits, random_prompts  # noqa: E402

ATOL = 1e-4
DEVICE = "cuda" if CUDA else "cpu"
# head_dim 32 (the fused prologue's minimum): GQA 2:1 with q wider than hidden, MHA with biases, MQA + window.
HEADS = {
    "llama": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "qwen2": {"num_attention_heads": 2, "num_key_value_heads": 2},
    "mistral": {"num_attention_heads": 2, "num_key_value_heads": 1},
}


def make_checkpoint(arch: str, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from builder.tiny import _COMMON, TINY_MODELS, make_tokenizer

    model_type, overrides = TINY_MODELS[f"tiny-{arch}"]
    tokenizer = make_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **{**_COMMON, **overrides, **HEADS[arch]})
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith("bias"):  # random biases: zeros would test nothing
                param.normal_(0.0, 0.15)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=sorted(HEADS))
def wide(request, tmp_path_factory):
    """(engine dir, HF model) of a head_dim-32 tiny model."""
    root = tmp_path_factory.mktemp(f"wide-{request.param}")
    checkpoint = make_checkpoint(request.param, root / "checkpoint")
    engine = root / "engine"
    build_engine(BuildOptions(model=str(checkpoint), output=engine, max_batch_size=8, max_seq_len=TINY_MAX_SEQ_LEN,
                              block_size=TINY_BLOCK_SIZE))  # fmt: skip
    model, _ = load_checkpoint(resolve_model(str(checkpoint)))
    return engine, model


def torch_backend(engine: Path, num_blocks: int = 64, **kwargs):
    from executors.torch import TorchBackend

    try:
        return TorchBackend(EngineConfig.load(engine), num_blocks, device=DEVICE, **kwargs)
    except EngineLoadError as exc:  # on a GPU machine, after another module switched Triton to its interpreter
        pytest.skip(f"run this file in its own pytest process: {exc}")


def test_steps_match_hf_and_ort(wide):
    """Chunked prefill, then one ragged step mixing a decode with another sequence's prefill,
    then two decodes together: every step's logits against HF eager and the ORT graph backend."""
    engine, model = wide
    backend, ort = torch_backend(engine), create_backend(EngineConfig.load(engine), 64, kind="graph")
    a, b = random_prompts(backend.config.model.vocab_size, [31, 21], seed=5)
    table_a, table_b = [7, 3, 9, 12], [20, 21, 22]
    steps = [
        [SequenceChunk(a[:13], 0, table_a)],
        [SequenceChunk(a[13:29], 13, table_a)],
        [SequenceChunk(a[29:30], 29, table_a), SequenceChunk(b[:20], 0, table_b)],
        [SequenceChunk(a[30:31], 30, table_a), SequenceChunk(b[20:21], 20, table_b)],
    ]
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    for chunks in steps:
        got = backend.step(chunks)
        np.testing.assert_allclose(got, ort.step(chunks), atol=ATOL)
        for row, chunk in zip(got, chunks, strict=True):
            ref = ref_a if chunk.block_table is table_a else ref_b
            np.testing.assert_allclose(row, ref[chunk.past_len + len(chunk.token_ids) - 1], atol=ATOL)


def run_cached_prefix(engine: Path, kind: str, prompts: list[list[int]],
                      params: SamplingParams) -> tuple[list[list[int]], LLMEngine]:  # fmt: skip
    """Each prompt's tokens through LLMEngine(backend=kind) with 16-token steps and 8 KV blocks: the first
    prompt alone, the others once its blocks are cached; and the engine."""
    llm = LLMEngine(engine, EngineArgs(backend=kind, num_kv_blocks=8, max_num_batched_tokens=16, itl_target_ms=None))
    tokens: dict[str, list[int]] = {}
    ids = [llm.add_request(prompts[0], params)]
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        if len(ids) == 1 and tokens:  # the first prompt's blocks are cached by now
            ids += [llm.add_request(p, params) for p in prompts[1:]]
    return [tokens[i] for i in ids], llm


def test_engine_greedy_matches_hf_and_ort(wide):
    """Through LLMEngine(backend="torch"): 16-token steps chunk the prompts, the third prompt
    shares the first one's two full blocks (a prefix-cache hit), and 8 KV blocks cannot hold the
    three sequences as they grow (a preemption, recomputed later). Tokens equal HF generate's
    and the ORT engine's."""
    engine, model = wide
    vocab = EngineConfig.load(engine).model.vocab_size
    first, second, tail = random_prompts(vocab, [17, 15, 2], seed=11)
    prompts = [first, second, first[:16] + tail]
    params = SamplingParams(temperature=0.0, max_tokens=10)

    got, llm = run_cached_prefix(engine, "torch", prompts, params)
    assert type(llm.backend).__name__ == "TorchBackend" and llm.backend.rows.rewrites > 0, "the persistent batch"
    stats = llm.stats()
    assert stats.preemptions >= 1 and stats.prefix_cache_hits >= 1, stats
    assert got == [hf_greedy(model, p, 10, tuple(llm.eos_token_ids)) for p in prompts]
    ort_tokens, ort = run_cached_prefix(engine, "graph", prompts, params)
    assert type(ort.backend).__name__ == "OrtGraphBackend"
    assert ort_tokens == got


@pytest.mark.parametrize(("name", "method"), [("tiny-qwen2", "int4-rtn"), ("tiny-llama", "fp8")])
def test_quantized_engines(name, method, tmp_path):
    """Q/DQ weights dequantized at load, FP8 activations quantized per tensor: INT4 against HF with
    the same fake-quantized weights (ORT's MatMulNBits quantizes activations to int8, so it is not
    the reference), FP8 against ORT's Q/DQ graph."""
    from calibration.quantize import QuantConfig, quantize_model
    from tests.test_quantization import _build_quantized, _permissive_gate

    engine = tmp_path / "engine"
    _build_quantized(name, method, engine, _permissive_gate(tmp_path))
    backend = torch_backend(engine)
    tokens = random_prompts(backend.config.model.vocab_size, [30], seed=8)[0]
    chunks = [[SequenceChunk(tokens[:29], 0, [4, 5, 6, 7])], [SequenceChunk(tokens[29:], 29, [4, 5, 6, 7])]]
    if method == "fp8":
        ort = create_backend(backend.config, 64, kind="graph")
        for step in chunks:
            np.testing.assert_allclose(backend.step(step), ort.step(step), atol=ATOL)
        return
    model, _ = load_checkpoint(resolve_model(name))
    quantize_model(model, backend.config.model, QuantConfig(method), [])  # fake-quantizes the HF weights in place
    ref = hf_logits(model, tokens)
    for step, row in zip(chunks, (28, 29), strict=True):
        np.testing.assert_allclose(backend.step(step)[0], ref[row], atol=ATOL)


def test_unfused_prologue_greedy_matches_ort(llama_engine):
    """head_dim 16 (conftest's tiny Llama): the prologue in torch, attention still the kernel."""
    backend = torch_backend(llama_engine)
    ort = create_backend(backend.config, 64, kind="graph")
    prompts = random_prompts(backend.config.model.vocab_size, [12, 9, 17], seed=3)
    run = lambda b: greedy_generate(b, prompts, 5, prefill_chunk=7)  # noqa: E731
    assert run(backend) == run(ort)


def test_decode_buckets_and_padding_match_eager(llama_engine):
    """The CUDA-graph path's buffers, run eagerly here: 3 decoding sequences padded to bucket 4
    give the eager step's logits, and the padding row writes only the scratch block."""
    # The eager side without graphs on CUDA too (their default there): its scratch block must stay untouched.
    graphs = torch_backend(llama_engine, cuda_graphs=True, graph_buckets=(1, 2, 4))
    eager = torch_backend(llama_engine, cuda_graphs=False)
    prompts = random_prompts(graphs.config.model.vocab_size, [10, 3, 12], seed=4)
    tables = [[0, 1], [5], [9, 2]]
    for backend in (graphs, eager):
        backend.step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    for past, token in ((0, 7), (1, 8)):
        chunks = [SequenceChunk([token], len(p) + past, t) for p, t in zip(prompts, tables, strict=True)]
        assert graphs.graphs is not None and graphs.graphs.bucket(chunks) == 4
        np.testing.assert_allclose(graphs.step(chunks), eager.step(chunks), atol=1e-5)
    assert sorted(graphs.graphs.graphs) == [4]
    real = graphs.num_blocks
    # Padding changes the matmuls' row count, so float32 rounding may differ (2e-6 on an AMD EPYC).
    torch.testing.assert_close(graphs.pool[:, :, :real], eager.pool[:, :, :real], atol=1e-5, rtol=0)
    assert graphs.pool[:, :, real].abs().sum() > 0 and eager.pool[:, :, real].abs().sum() == 0


def test_warm_up_runs_every_decode_bucket_on_cuda_and_nothing_here(llama_engine):
    """Off CUDA nothing is compiled (0 s); on a GPU every graph bucket up to max_num_seqs is captured before
    the first request, so none waits for a capture."""
    backend = torch_backend(llama_engine, cuda_graphs=True, graph_buckets=(1, 2, 4, 8))
    seconds = backend.warm_up(max_num_seqs=4, max_num_batched_tokens=32)
    assert backend.graphs is not None
    if CUDA:
        assert seconds > 0 and sorted(backend.graphs.graphs) == [1, 2, 4]
    else:
        assert seconds == 0.0 and backend.graphs.graphs == {}


def test_the_persistent_batch_gives_the_tokens_of_packing_every_table(llama_engine):
    """Overlapped launches, seeded sampling, preemption (6 KV blocks for four sequences) and an abort mid-way,
    through the torch backend's persistent batch and again without it (each chunk's table packed every step):
    the same tokens. tests/test_persistent_batch.py compares the packed steps themselves."""
    vocab = EngineConfig.load(llama_engine).model.vocab_size
    prompts = random_prompts(vocab, [9, 14, 5, 20], seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=14, ignore_eos=True)
    runs = []
    for persistent in (True, False):
        llm = LLMEngine(llama_engine, EngineArgs(backend="torch", num_kv_blocks=6, itl_target_ms=None))
        assert llm.overlap is not None, "overlapped launches"
        if not persistent:
            llm.backend.rows = None
        ids = [llm.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while llm.has_unfinished_requests():
            for out in llm.step():
                tokens[out.request_id] += out.token_ids
            if len(tokens[ids[1]]) >= 4 and ids[1] in llm.requests:
                llm.abort(ids[1])
        runs.append(([tokens[i] for i in ids], llm.stats().preemptions))
    assert runs[0] == runs[1] and runs[0][1] > 0, runs


def test_broken_inputs_are_caught_before_any_kernel(llama_engine):
    backend = torch_backend(llama_engine, num_blocks=16)
    before = backend.pool.clone()
    bad = {
        "covers 16 positions, 20 needed": SequenceChunk(list(range(3, 23)), 0, [0, 1]),
        "names block 16, outside the pool": SequenceChunk([5, 6, 7], 0, [16]),
        "names block -1": SequenceChunk([5], 8, [3, -1]),
        "token ids must be in": SequenceChunk([5, 10**6], 0, [0]),
        "must fit in 1..256 positions": SequenceChunk([5], 256, list(range(16)) * 3),
    }
    for message, chunk in bad.items():
        with pytest.raises(ValueError, match=message):
            backend.step([SequenceChunk([4], 0, [2]), chunk])  # a valid chunk beside it is not run either
    assert torch.equal(backend.pool, before)


def test_engine_samples_on_the_device_like_the_numpy_sampler(llama_engine):
    """A seeded request with logprobs through LLMEngine: the torch backend samples on its device
    (step_sample), the graph backend returns logits to the numpy sampler; same tokens."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=2, max_tokens=5, ignore_eos=True)
    outs = {}
    for kind in ("torch", "graph"):
        llm = LLMEngine(llama_engine, EngineArgs(backend=kind))
        assert isinstance(llm.backend, DeviceSampling) == (kind == "torch")
        llm.add_request([5, 9, 33, 70, 12], params)
        outs[kind] = [o for _ in range(5) for o in llm.step()]
    got, want = outs["torch"], outs["graph"]
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and got[-1].finished
    for g, w in zip(got, want, strict=True):
        assert g.logprobs is not None and w.logprobs is not None
        assert [t for t, _ in g.logprobs[0].top] == [t for t, _ in w.logprobs[0].top]
        np.testing.assert_allclose(g.logprobs[0].logprob, w.logprobs[0].logprob, atol=1e-4)


def test_generate_cli_with_backend_torch(llama_engine):
    from click.testing import CliRunner

    from runtime.cli import main

    args = ["generate", "--engine", str(llama_engine), "--prompt", "Paris is", "--max-tokens", "3", "--backend"]
    torch_run, graph_run = (CliRunner().invoke(main, [*args, kind]) for kind in ("torch", "graph"))
    assert torch_run.exit_code == 0 and torch_run.output == graph_run.output, torch_run.output
    bad = CliRunner().invoke(main, [*args, "cuda"])
    assert bad.exit_code == 2 and "'cuda' is not one of" in bad.output


def test_default_backend_prefers_torch_on_a_gpu_without_tensorrt(llama_engine, monkeypatch):
    import dataclasses

    import executors.factory as backends
    from executors.cpus import amx_bf16, int8_simd

    config = EngineConfig.load(llama_engine)
    verified = config.verified_backends  # the CPU's own rules: tests/test_cpu_bf16_default.py, test_cpu_int8.py
    cpu = "cpu-bf16" if "cpu-bf16" in verified and amx_bf16() else "cpu-int8" if "cpu-int8" in verified and (
        int8_simd()) else "cpu"  # fmt: skip
    engines = (config, dataclasses.replace(config, target="tensorrt"))
    cases = {  # (a CUDA device, TensorRT installed): defaults for (an ORT engine, a TensorRT engine)
        (False, False): (cpu, "tensorrt"),  # the TensorRT backend then refuses, naming what is missing
        (True, False): ("torch", "torch"),
        (True, True): ("torch", "tensorrt"),
    }
    for (cuda, trt), want in cases.items():
        monkeypatch.setattr(backends, "cuda_present", lambda c=cuda: c)
        monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name, t=trt: object() if t else None)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert tuple(backends.default_backend(e) for e in engines) == want
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # this process runs Triton interpreted: no GPU default
        assert backends.default_backend(config) == cpu


def test_compiled_kernels_on_cpu_are_refused():
    """Kernels imported without TRITON_INTERPRET are GPU code: a CPU backend says so, it does not crash."""
    code = ("import plugins_cuda.kv_write, torch\nfrom executors.torch.kernels import load_kernels\n"
            "load_kernels(torch.device('cpu'))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0 and "imported compiled in this process" in result.stderr, result.stderr[-2000:]


# ---- GPU -------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
CHAT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in a language model, briefly.",
    "Describe the water cycle to a ten-year-old.",
    # ~600 tokens: its decode steps split the key range (split-KV + merge kernel), eager and in graphs
    "Summarize in one sentence: " + "Keys and values of past tokens are cached in fixed-size blocks. " * 45,
]
# Max |logit - HF| relative to the largest |HF logit|, per dtype: both sides round every op to
# 10 (fp16) or 7 (bf16) mantissa bits but in different orders (fused kernels, split-KV).
GPU_TOLERANCE = {"float16": 3e-2, "bfloat16": 6e-2}


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_a_launched_steps_tokens_come_back_without_waiting_for_the_next_launch():
    """Overlap: reading step N's tokens must not wait for step N+1, launched meanwhile (here ~0.5 s of
    device sleep). A `.cpu()` at read time queues behind it: the check fails on that."""
    from executors.torch.backend import _Launched

    step = _Launched(torch.arange(4, device="cuda"))
    torch.cuda._sleep(1_000_000_000)  # the next launch: ~1e9 cycles of device time
    next_done = torch.cuda.Event()
    next_done.record()
    assert step.result().token_ids.tolist() == [0, 1, 2, 3]
    assert not next_done.query(), "reading step N's tokens waited for step N+1"
    torch.cuda.synchronize()


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
@pytest.mark.parametrize("dtype", sorted(GPU_TOLERANCE))
def test_smollm2_on_cuda_matches_hf_eager(smollm2_engine, smollm2_hf, dtype):
    """Greedy tokens on chat prompts, from the greedy loop (logits back) and from LLMEngine (CUDA
    graphs, device sampling), equal HF eager's on the same GPU and dtype; a divergence is allowed
    only where HF's own top-2 logits are within the tolerance (a near tie). The prompt's last
    logits are within GPU_TOLERANCE of HF's."""
    import copy

    from executors.torch import TorchBackend
    from runtime.engine.tokenizer import encode_prompt, stop_token_ids

    model, tokenizer = smollm2_hf
    hf = copy.deepcopy(model).to("cuda", getattr(torch, dtype))
    config = EngineConfig.load(smollm2_engine)
    backend = TorchBackend(config, device="cuda", dtype=dtype)
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in CHAT]
    stop = stop_token_ids(tokenizer, config)
    loop = greedy_generate(backend, prompts, 32, stop)
    llm = LLMEngine(smollm2_engine, EngineArgs(), backend=backend)
    ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=32)) for p in prompts]
    engine: dict[str, list[int]] = {i: [] for i in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            engine[out.request_id] += out.token_ids
    for prompt, a, b in zip(prompts, loop, [engine[i] for i in ids], strict=True):
        want = _hf_greedy_cuda(hf, prompt, 32, stop)
        ref = _hf_logits_cuda(hf, prompt + want)
        atol = GPU_TOLERANCE[dtype] * float(np.abs(ref).max())
        table = list(range(-(-len(prompt) // config.block_size)))
        mine = backend.step([SequenceChunk(prompt, 0, table)])[0]
        np.testing.assert_allclose(mine, ref[len(prompt) - 1], atol=atol, rtol=0)
        for got in (a, b):
            first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
            if first is not None:  # HF's own margin at the first difference must be a near tie
                top2 = np.sort(ref[len(prompt) + first - 1])[-2:]
                assert top2[1] - top2[0] < atol, (first, tokenizer.decode(got), tokenizer.decode(want))
            else:
                assert len(got) == len(want)
    backend.close()


def _hf_greedy_cuda(model, prompt: list[int], n: int, stop: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=list(stop), pad_token_id=stop[0])  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _hf_logits_cuda(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens], device="cuda")).logits[0].float().cpu().numpy()
