"""LoRA adapters in the torch backend (executors/torch/lora.py: device pools, SGMV segments) against HF float32 +
PEFT. Here the Triton kernels run in Triton's interpreter (tiny shapes, few tokens): on the head_dim-32 tiny Llama
of tests/test_torch_backend.py, whose base steps take the fused prologue and LoRA steps the unfused one, and
through LLMEngine on the conftest tiny Llama. Tolerance as test_torch_backend: float32, ATOL 1e-4."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it)

from builder.build import BuildOptions, build_engine  # noqa: E402
from builder.sources import load_checkpoint, resolve_model  # noqa: E402
from executors.base import SequenceChunk  # noqa: E402
from executors.lora import TARGETS, AdapterError, load_adapter  # noqa: E402
from executors.sampling import SamplingParams  # noqa: E402
from runtime.engine.engine_args import EngineArgs  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN  # noqa: E402
from tests.helpers import hf_greedy, hf_logits, make_lora_adapter, random_prompts, with_lora  # noqa: E402
from tests.test_torch_backend import ATOL, make_checkpoint, torch_backend  # noqa: E402

# name -> (targets, rank, alpha, seed, LoraConfig options): ranks 8..64, rsLoRA, one adapter of every projection.
ADAPTERS = {
    "qv": (["q_proj", "v_proj"], 8, 16, 1, {}),
    "all": (list(TARGETS), 64, 32, 2, {}),
    "k-mlp": (["k_proj", "gate_proj", "down_proj"], 16, 16, 3, {"use_rslora": True}),
    "o-up": (["o_proj", "up_proj"], 32, 64, 4, {}),
}
NEW_TOKENS = 5


def make_adapters(model, root) -> dict[str, object]:
    return {name: make_lora_adapter(model, root / name, *spec[:4], **spec[4]) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(engine dir, HF model, adapter dirs) of the head_dim-32 tiny Llama."""
    root = tmp_path_factory.mktemp("wide-llama-lora")
    checkpoint = make_checkpoint("llama", root / "checkpoint")
    build_engine(
        BuildOptions(
            model=str(checkpoint),
            output=root / "engine",
            max_batch_size=8,
            max_seq_len=TINY_MAX_SEQ_LEN,
            block_size=TINY_BLOCK_SIZE,
        )
    )
    model, _ = load_checkpoint(resolve_model(str(checkpoint)))
    return root / "engine", model, make_adapters(model, root)


def loaded_backend(engine, adapters, names):
    """A torch backend (graphs' buffers and bucketing on, eager off CUDA) with `names` in slots 0, 1, ..."""
    backend = torch_backend(engine, cuda_graphs=True)
    slots = backend.enable_lora(len(names), 64)
    for slot, name in enumerate(names):
        slots.load(slot, load_adapter(name, adapters[name], backend.config.model, 64))
    return backend


def test_mixed_steps_match_hf_peft_per_chunk(wide):
    """Steps mixing four adapters (ranks 8..64, one of every projection) with base chunks: prefill chunks (two
    adjacent ones of one adapter), a chunked prefill's second chunk beside decodes, a decode-only LoRA step (not
    replayed from a graph), then a base-only decode step (from its graph), each chunk's logits against HF + PEFT.
    Each LoRA chunk's logits are far from every other adapter's (a swapped slot fails the check)."""
    engine, model, adapters = wide
    names = list(ADAPTERS)
    backend = loaded_backend(engine, adapters, names)
    # sequence -> its slot (None: the base model): base ones at both ends and between two adapters' runs
    seqs = dict(enumerate([None, 0, None, 1, 1, 2, 3, None]))
    tokens = random_prompts(backend.config.model.vocab_size, [6, 9, 5, 11, 4, 10, 7, 5], seed=3)
    models = {s: with_lora(model, None if s is None else adapters[names[s]]) for s in set(seqs.values())}
    refs = {i: hf_logits(models[s], tokens[i]) for i, s in seqs.items()}

    def chunk(i: int, start: int, end: int) -> SequenceChunk:
        return SequenceChunk(tokens[i][start:end], start, list(range(4 * i, 4 * i + 4)), end - start, None, seqs[i])

    def check(chunks: list[SequenceChunk], order: list[int]) -> np.ndarray:
        got, row = backend.step(chunks), 0
        for i, c in zip(order, chunks, strict=True):
            end = c.past_len + len(c.token_ids)
            np.testing.assert_allclose(got[row : row + c.num_logits], refs[i][end - c.num_logits : end], atol=ATOL)
            row += c.num_logits
        return got

    prefill = [0, 1, 2, 3, 4, 5, 6, 7]
    got = check([chunk(i, 0, len(tokens[i]) - (3 if i == 5 else 1)) for i in prefill], prefill)
    row = 0
    for i in prefill:  # the comparison tells the adapters apart: any other slot would fail it
        n = len(tokens[i]) - (3 if i == 5 else 1)
        for j in set(models) - {seqs[i]}:
            other = hf_logits(models[j], tokens[i][:n])
            assert np.abs(got[row : row + n] - other).max() > 100 * ATOL, (i, j)
        row += n
    assert backend.graphs is not None and not backend.graphs.graphs
    check([chunk(5, 7, 9), chunk(0, 5, 6), chunk(1, 8, 9)], [5, 0, 1])  # a prefill's second chunk, decodes
    decodes = [3, 4, 5, 2, 6]
    check([chunk(i, len(tokens[i]) - 1, len(tokens[i])) for i in decodes], decodes)  # LoRA decodes: eager
    assert not backend.graphs.graphs, "a LoRA step never replays a graph"
    check([chunk(7, 4, 5)], [7])  # base only, after LoRA steps: its graph (eager replay off CUDA)
    assert list(backend.graphs.graphs) == [1]


def test_a_swapped_slot_is_caught(wide):
    """Two chunks with their slots swapped: each matches the other adapter's reference, not its own."""
    engine, model, adapters = wide
    backend = loaded_backend(engine, adapters, ["qv", "o-up"])
    a, b = random_prompts(backend.config.model.vocab_size, [4, 3], seed=9)
    got = backend.step([SequenceChunk(a, 0, [0], 4, None, 1), SequenceChunk(b, 0, [1], 3, None, 0)])
    for rows, prompt, own, swapped in ((got[:4], a, "qv", "o-up"), (got[4:], b, "o-up", "qv")):
        np.testing.assert_allclose(rows, hf_logits(with_lora(model, adapters[swapped]), prompt), atol=ATOL)
        assert np.abs(rows - hf_logits(with_lora(model, adapters[own]), prompt)).max() > 100 * ATOL


def test_pools_follow_the_slots(wide):
    """Pools are allocated per (layer, group) by the first adapter that updates it, sized max_rank x modules; a
    slot's rows are replaced whole by the next adapter (zero where it updates nothing) and zeroed on clear."""
    engine, _, adapters = wide
    backend = torch_backend(engine)
    slots = backend.enable_lora(2, 64)
    spec = backend.config.model
    slots.load(0, load_adapter("qv", adapters["qv"], spec, 64))
    assert sorted(slots.pools) == [(0, "qkv"), (1, "qkv")]
    assert slots.pools[0, "qkv"].a.shape == (2, 3 * 64, spec.hidden_size)
    slots.load(1, load_adapter("all", adapters["all"], spec, 64))
    slots.load(0, load_adapter("all", adapters["all"], spec, 64))
    assert len(slots.pools) == 8 and slots.pools[1, "gate_up"].b.shape == (2, 2 * spec.intermediate_size, 128)
    slots.load(0, load_adapter("o-up", adapters["o-up"], spec, 64))  # no q/k/v, gate or down
    for (_, group), pool in slots.pools.items():
        assert bool(pool.a[0].any()) == (group in ("o_proj", "gate_up")) and bool(pool.a[1].any())
    assert not slots.pools[0, "gate_up"].b[0, : spec.intermediate_size].any()  # gate's columns
    slots.clear(1)
    assert not any(pool.a[1].any() or pool.b[1].any() for pool in slots.pools.values())
    assert slots.names == ["o-up", None]
    with pytest.raises(ValueError, match="chunk 0: LoRA slot 1 holds no adapter"):
        backend.step([SequenceChunk([5, 6], 0, [0], 1, None, 1)])
    narrow = backend.enable_lora(1, 16)
    with pytest.raises(AdapterError, match="r: rank 64 is above the torch backend's pool rank 16"):
        narrow.check(load_adapter("all", adapters["all"], spec, 64))


def test_engine_greedy_matches_hf_peft_in_a_mixed_batch(llama_engine, tmp_path):
    """LLMEngine(backend="torch") with three adapters in two slots (one paged out for another) and base requests
    in one batch, through the overlapped launches: each request's greedy tokens are HF + PEFT's for its adapter."""
    model = load_checkpoint(resolve_model("tiny-llama"))[0]
    adapters = make_adapters(model, tmp_path)
    served = ("qv", "k-mlp", "o-up")  # ranks 8..32; q, k, v, o, gate, up, down between them
    modules = ",".join(f"{name}={adapters[name]}" for name in served)
    args = EngineArgs(backend="torch", lora_modules=modules, max_loras=2, max_lora_rank=32, itl_target_ms=None)
    llm = LLMEngine(llama_engine, args)
    assert llm.overlap is not None and llm.backend.lora.max_rank == 32, "the engine's rank limit sizes the pools"
    launch, launched = llm.backend.launch, []

    def spy(chunks, *rest):  # the overlapped path: whether each launch had a LoRA chunk
        launched.append(any(c.lora_slot is not None for c in chunks))
        return launch(chunks, *rest)

    llm.backend.launch = spy
    names = [None, "qv", "o-up", None, "k-mlp", "qv"]
    prompts = random_prompts(model.config.vocab_size, [5, 7, 6, 4, 8, 3], seed=4)
    ids = {}
    for name, prompt in zip(names, prompts, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, lora=name)
        ids[llm.add_request(prompt, params)] = (name, prompt)
    got: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    for request_id, (name, prompt) in ids.items():
        reference = with_lora(model, None if name is None else adapters[name])
        assert got[request_id] == hf_greedy(reference, prompt, NEW_TOKENS, (10**9,)), name
    stats = llm.stats().lora
    assert stats is not None and stats.slot_evictions >= 1
    assert sum(launched) >= NEW_TOKENS, launched
