"""The device sampler (executors/sampling/torch_sampler.py) against the numpy sampler
(executors/sampling/numpy_sampler.py) on the same logits and seeds: identical tokens, logprobs within
float32 rounding, over several steps so that penalties see earlier tokens. Runs on CPU torch;
the `gpu` test repeats it on CUDA tensors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from executors.sampling import Sampler, SamplingParams, SamplingState, TokenLogprobs  # noqa: E402
from executors.sampling.torch_sampler import TorchSampler  # noqa: E402

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=10, seed=2),
    SamplingParams(temperature=1.0, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, min_p=0.1, seed=4),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05, seed=5, logprobs=3),
    SamplingParams(
        temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=6, logprobs=2
    ),
    SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.5),
    SamplingParams(temperature=1e-6, seed=7),  # everything but the top token overflows to -inf
    SamplingParams(temperature=2.0, top_k=1, seed=8),
    SamplingParams(temperature=2.0, top_p=1e-9, seed=9, logprobs=0),
    SamplingParams(temperature=0.8, seed=10, logit_bias={3: 5.0, 4: -100.0}, logprobs=2),
    SamplingParams(temperature=0.0, logit_bias={7: 100.0}, repetition_penalty=1.2),
]


def states(params: list[SamplingParams], vocab: int = VOCAB) -> list[SamplingState]:
    prompt = list(range(5, 40, 3))
    return [SamplingState(p, prompt, vocab) for p in params]


def run_both(logits: np.ndarray, numpy_states: list[SamplingState], torch_states: list[SamplingState],
             device: str = "cpu"):  # fmt: skip
    want = Sampler().sample(logits, numpy_states)
    got = TorchSampler(torch.device(device)).sample(torch.from_numpy(logits).to(device), torch_states)
    return want, got


def assert_same(want, got) -> None:
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    for w, g in zip(want.logprobs, got.logprobs, strict=True):
        assert (w is None) == (g is None)
        if w is not None and g is not None:
            assert isinstance(g, TokenLogprobs) and not g.texts  # the engine fills the texts
            assert g.token_id == w.token_id
            np.testing.assert_allclose(g.logprob, w.logprob, atol=1e-5)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-5)


@pytest.mark.parametrize("vocab", [VOCAB, 32_000])
def test_same_tokens_and_logprobs_as_numpy_over_steps(vocab, device="cpu"):
    rng = np.random.default_rng(0)
    numpy_states, torch_states = states(PARAMS, vocab), states(PARAMS, vocab)
    drawn = []
    for _ in range(6):
        logits = (rng.standard_normal((len(PARAMS), vocab)) * 3).astype(np.float32)
        want, got = run_both(logits, numpy_states, torch_states, device)
        assert_same(want, got)
        for a, b, token in zip(numpy_states, torch_states, want.token_ids, strict=True):
            a.append(int(token))
            b.append(int(token))
        drawn.append(want.token_ids)
    assert len({tuple(t) for t in np.stack(drawn).T[2:8]}) > 1  # the random rows really vary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_same_tokens_on_cuda():
    """CUDA's expf and scans round differently from numpy's: still the same draws (SmolLM2's vocab)."""
    test_same_tokens_and_logprobs_as_numpy_over_steps(49_152, device="cuda")


def test_all_greedy_fast_path_is_argmax():
    logits = np.random.default_rng(1).standard_normal((4, VOCAB)).astype(np.float32)
    want, got = run_both(
        logits, states([SamplingParams(temperature=0.0)] * 4), states([SamplingParams(temperature=0.0)] * 4)
    )
    assert_same(want, got)
    np.testing.assert_array_equal(got.token_ids, logits.argmax(axis=1))


def test_seeded_request_ignores_its_batch():
    """The same seeded request alone and beside others draws the same tokens (its own stream)."""
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((5, 4, VOCAB)) * 2).astype(np.float32)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone, batched = states([seeded]), states([SamplingParams(temperature=1.0, seed=1), seeded, SamplingParams()])
    sampler = TorchSampler(torch.device("cpu"))
    for step in range(5):
        a = sampler.sample(torch.from_numpy(logits[step, 1:2]), alone).token_ids[0]
        b = sampler.sample(torch.from_numpy(logits[step, :3]), batched).token_ids[1]
        assert a == b


def test_rows_without_state_are_not_sampled():
    logits = torch.from_numpy(np.random.default_rng(3).standard_normal((3, VOCAB)).astype(np.float32))
    [greedy] = states([SamplingParams(temperature=0.0, logprobs=1)])
    result = TorchSampler(torch.device("cpu")).sample_rows(logits, [None, greedy, None])
    assert result.token_ids.tolist() == [-1, int(logits[1].argmax()), -1]
    assert result.logprobs[0] is None and result.logprobs[2] is None and result.logprobs[1] is not None


def test_broken_logits_are_refused():
    sampler, two = TorchSampler(torch.device("cpu")), states([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="batch=2"):
        sampler.sample(torch.zeros(3, VOCAB), two)
    with pytest.raises(ValueError, match="vocab 299 != request vocab_size 300"):
        sampler.sample(torch.zeros(2, VOCAB - 1), two)


def test_tokens_left_on_the_device_are_the_host_samplers_and_refuse_host_state_rows():
    """sample_on_device (an overlapped step's sampling) against the numpy sampler: the same tokens, the same
    seeded draws in row order, -1 where a row is not sampled; a row needing host state is refused."""
    plain = [p for p in PARAMS if p.logprobs is None and p.repetition_penalty == 1.0]
    rows: list[SamplingState | None] = [*states(plain[:2]), None, *states(plain[2:])]
    reference = states(plain)
    logits = (np.random.default_rng(3).standard_normal((len(rows), VOCAB)) * 3).astype(np.float32)
    sampled = [i for i, r in enumerate(rows) if r is not None]
    want = Sampler().sample(logits[sampled], reference).token_ids
    got = TorchSampler(torch.device("cpu")).sample_on_device(torch.from_numpy(logits), rows).numpy()
    assert got[2] == -1 and got[sampled].tolist() == want.tolist()
    with pytest.raises(ValueError, match="not left on the device"):
        TorchSampler(torch.device("cpu")).sample_on_device(torch.from_numpy(logits[:3]), states(PARAMS[:3]))
