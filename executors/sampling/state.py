"""What both samplers read and return: a request's sampling state, and a step's sampled tokens.

One set of types for the numpy sampler (the engine samples host logits) and the torch sampler (a GPU
backend samples on its device), so that a seeded request draws the same tokens from either, and the
engine reads the same result whichever sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from executors.sampling.grammar import GrammarState
from executors.sampling.params import SamplingParams

# Read once at import: ONNX Runtime flushes denormals on the engine thread, where numpy would
# warn that "the smallest subnormal is zero" when it first builds float32's finfo. Both samplers
# clamp temperature to it.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@dataclass
class SamplingState:
    """Per-request sampling state that lives as long as the request (survives preemption).

    The caller append()s each token it keeps; sampling only advances the rng, so tokens a caller
    discards (e.g. rejected speculative drafts) never reach the penalty counts or the grammar's matcher.
    Both samplers draw one `rng.random()` per random row per step, so a seeded request's stream is the same on either.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    vocab_size: int
    grammar: GrammarState | None = None  # structured output: the matcher both samplers mask by (grammar.py)
    rng: np.random.Generator = field(init=False, repr=False)
    # Sized [V] only when a penalty is active (else empty): big for 150k-token vocabularies.
    output_counts: np.ndarray = field(init=False, repr=False)  # int32 [V]
    seen: np.ndarray = field(init=False, repr=False)  # bool [V]: prompt ∪ output
    # A penalty is active (the params are frozen: decided once, read for every token).
    penalized: bool = field(init=False, repr=False)
    # logit_bias as arrays: ids (int64) and the biases added to their logits (float32); empty without one.
    bias_ids: np.ndarray = field(init=False, repr=False)
    bias_values: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        self.penalized = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.rng = np.random.default_rng(self.params.seed)  # seed None -> fresh OS entropy
        size = self.vocab_size if self.penalized else 0
        self.output_counts = np.zeros(size, dtype=np.int32)
        self.seen = np.zeros(size, dtype=bool)
        bias = p.logit_bias or {}
        self.bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))
        if self.bias_ids.size and self.bias_ids.max() >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if self.penalized:
            ids = np.asarray(self.prompt_token_ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
            self.seen[ids] = True

    @property
    def argmax_only(self) -> bool:
        """Greedy, without penalties, a logit bias or logprobs: the token is the raw logits' argmax, nothing else
        is computed."""
        return self.params.greedy and not self.penalized and not self.bias_ids.size and self.params.logprobs is None

    @property
    def tracks_tokens(self) -> bool:
        """append() must see every kept token: penalty counts or a grammar's matcher depend on them."""
        return self.penalized or self.grammar is not None

    @property
    def host_sampled(self) -> bool:
        """Its tokens must be sampled from host state holding every earlier token (penalties, a grammar) or
        come back with logprobs (its prompt's too), or a logit bias (which only the non-overlapped samplers add):
        never left on the device for an overlapped step."""
        params = self.params
        return (
            self.tracks_tokens
            or params.logprobs is not None
            or params.prompt_logprobs is not None
            or params.logit_bias is not None
        )

    def append(self, token_id: int) -> None:
        """Record a generated token (updates the penalty counts; advances the grammar's matcher)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.output_counts.size:
            self.output_counts[token_id] += 1
            self.seen[token_id] = True


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # top-n (token_id, logprob), n = params.logprobs, sorted descending
    texts: dict[int, str] = field(default_factory=dict)  # the sampled and top tokens' texts (the engine's output)


@dataclass(frozen=True)
class SampleResult:
    token_ids: np.ndarray  # [B] int64
    logprobs: list[TokenLogprobs | None]  # per row, None when params.logprobs is None


@dataclass(frozen=True)
class DeviceSample(SampleResult):
    """A step sampled on the backend's device (`DeviceSampling.step_sample`): one row per chunk, token
    -1 and logprobs None where the chunk was not sampled (a prompt chunk short of its prompt's end).
    A type of its own so that the engine tells a sampled step from host logits."""


def check_batch(shape: tuple[int, ...], states: Sequence[SamplingState]) -> None:
    """ValueError unless logits of `shape` are [len(states), the states' vocab_size]."""
    if len(shape) != 2 or shape[0] != len(states):
        raise ValueError(f"logits must be [batch={len(states)}, vocab] (got {tuple(shape)})")
    bad = [s.vocab_size for s in states if s.vocab_size != shape[1]]
    if bad:
        raise ValueError(f"logits vocab {shape[1]} != request vocab_size {bad[0]}")
