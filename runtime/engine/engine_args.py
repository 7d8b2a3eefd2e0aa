"""EngineArgs: how an engine is sized and scheduled (validated at construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Inter-token latency target (ms): the longest gap a decoding stream should see; a step that carries
# decodes takes only the prefill its learned cost keeps within it. 200 = the goodput TPOT objective,
# so a stream whose gaps are on target meets it by construction, with 50 ms left under the ITL p99
# <= 250 ms objective for prediction error and the server. SmolLM2-135M on the 2-core Xeon
# (benchmarks/results/slo.md): ITL p99 206 / 211 / 245 ms at 8 / 16 / 32 streams, c=32 throughput 105%
# of the fixed budget's. 150 left prefill under half of a step from 16 streams (c=32: 86%).
DEFAULT_ITL_TARGET_MS = 200.0
# Prefill a step carries however busy decoding is, so prompts progress. In tokens, so its time
# scales with the machine: 96 gained ~1.5% throughput at c=32 on the Xeon, but on a 2x slower CPU
# it alone made steps ~250 ms; 64 stays.
DEFAULT_MIN_PREFILL_TOKENS = 64
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DRAFT_MIN_CONFIDENCE = 0.0  # measured in benchmarks/results/spec_decode.md
# Shortest prompt-lookup match the `draft` method takes instead of its draft model's guess (runtime/engine/
# spec/lookup_first.py): 3 measured best on chat (2 and 4 both lost ~0.1x of decode speed-up).
DEFAULT_DRAFT_PROMPT_LOOKUP_MIN = 3
# Measured through tritonserver at concurrency 4 (benchmarks/results/spec_decode_*_c4.md): n-gram drafts
# still pay (copy-heavy 1.6x, chat 1.05x); an INT4 draft engine of the same model costs 13-17% (its steps
# for several requests and its catch-up on each new prompt outweigh the tokens it saves), so it drafts
# for a lone request only.
DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE = {"ngram": 4, "draft": 1}
DISABLE_BATCH_SIZE_DEFAULTS = ", ".join(f"{n} with {m}" for m, n in DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE.items())


@dataclass(frozen=True)
class EngineArgs:
    num_kv_blocks: int | None = None  # default: max_batch_size sequences of max_seq_len
    max_num_seqs: int | None = None  # default (and cap): the engine's max_batch_size
    max_num_batched_tokens: int = 512  # per-step token budget (decodes + prefill chunks)
    enable_prefix_caching: bool = True
    max_waiting: int = 1024  # waiting-queue bound; beyond it requests get Overloaded
    threads: int | None = None  # backend compute threads (default: all cores)
    backend: str | None = None  # runtime.backends.BACKENDS: "cpu", "cpu-bf16", "graph", "plugin", "tensorrt", "torch"
    # While requests decode, a step carries only the prefill its learned cost keeps within this
    # target (None: the fixed max_num_batched_tokens budget, whatever the decodes wait).
    itl_target_ms: float | None = DEFAULT_ITL_TARGET_MS
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS  # per step however busy decoding is
    # Speculative decoding (runtime/engine/spec/): "ngram" (prompt lookup), "draft" (a second engine
    # of the same tokenizer, `draft_engine`) or None (off). Each decoding request gets up to
    # num_speculative_tokens drafts per step, verified in one pass.
    speculative: str | None = None
    draft_engine: str | None = None  # engine directory of the draft model ("draft")
    draft_backend: str | None = None  # its backend (default: as runtime.backends.default_backend picks)
    num_speculative_tokens: int = 4
    # A draft engine stops proposing for a request at its first guess below this probability (its own
    # softmax): a doubted guess is mostly rejected, and each draft step costs a draft forward pass.
    draft_min_confidence: float = DEFAULT_DRAFT_MIN_CONFIDENCE
    # "draft": a request whose text ends in this many or more tokens seen earlier in it takes the prompt-lookup
    # guess (free) instead of the draft model's (a forward pass per token); 0: the draft model always.
    draft_prompt_lookup_min: int = DEFAULT_DRAFT_PROMPT_LOOKUP_MIN
    ngram_prompt_lookup_min: int = 1  # shortest suffix the n-gram proposer matches
    ngram_prompt_lookup_max: int = 4  # longest (tried first)
    # Speculation pauses while more than this many requests run or wait (None: the method's default,
    # DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE): a verify pass costs (k + 1) tokens per sequence, which a
    # large batch pays in compute rather than hides behind memory-bound decode.
    speculative_disable_batch_size: int | None = None
    # Below that: speculate only where measured steps with drafts cost less per emitted token than steps
    # without, per batch size (runtime/engine/spec/governor.py); False: always.
    speculative_adaptive: bool = True
    # Streamed responses carry this many tokens (the first token and the last response go at once), as
    # vLLM's --stream-interval: each response costs the server a hand-off, a Triton response and an SSE
    # event, paid per token when 1. A request may ask for a longer interval, not a shorter one.
    stream_interval: int = 1

    @property
    def disable_batch_size(self) -> int:
        """speculative_disable_batch_size, or the speculative method's default."""
        if self.speculative_disable_batch_size is not None:
            return self.speculative_disable_batch_size
        return DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE[self.speculative or "ngram"]

    def __post_init__(self) -> None:
        names = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "threads",
                 "min_prefill_tokens", "num_speculative_tokens", "ngram_prompt_lookup_min", "ngram_prompt_lookup_max",
                 "speculative_disable_batch_size", "stream_interval")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineArgs.{name} must be a positive integer (got {value!r})")
        target = self.itl_target_ms
        if target is not None and (not isinstance(target, int | float) or not 0 < target < math.inf):
            raise ValueError(f"EngineArgs.itl_target_ms must be a positive number of ms or None (got {target!r})")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"EngineArgs.speculative must be 'ngram', 'draft' or None (got {self.speculative!r})")
        if (self.speculative == "draft") != (self.draft_engine is not None):
            raise ValueError("EngineArgs.draft_engine names the draft engine of speculative='draft' (and only then)")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"EngineArgs.speculative_adaptive must be a bool (got {self.speculative_adaptive!r})")
        if not isinstance(self.draft_min_confidence, int | float) or not 0 <= self.draft_min_confidence < 1:
            raise ValueError(f"EngineArgs.draft_min_confidence must be in [0, 1) (got {self.draft_min_confidence!r})")
        lookup = self.draft_prompt_lookup_min
        if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 0:
            raise ValueError(f"EngineArgs.draft_prompt_lookup_min must be an integer >= 0 (got {lookup!r})")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"EngineArgs.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("EngineArgs.ngram_prompt_lookup_min must be <= ngram_prompt_lookup_max")
