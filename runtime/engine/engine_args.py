"""EngineArgs: how an engine is sized and scheduled (validated at construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Inter-token latency target (ms) while requests decode. SmolLM2-135M on the 2-core CPU: a decode
# step of 8 / 32 streams takes ~45 / ~95 ms and a prefill token ~0.8 ms, so a 512-token chunk
# stalled every decode ~0.5-1 s (ITL p99 1.1 s at concurrency 8). 150 ms still leaves ~120
# prefill tokens per step at 8 streams (a 500-token prompt in ~4 steps) and keeps ITL under the
# benchmark's 200 ms TPOT objective with room for the server's own overhead.
DEFAULT_ITL_TARGET_MS = 150.0


@dataclass(frozen=True)
class EngineArgs:
    num_kv_blocks: int | None = None  # default: max_batch_size sequences of max_seq_len
    max_num_seqs: int | None = None  # default (and cap): the engine's max_batch_size
    max_num_batched_tokens: int = 512  # per-step token budget (decodes + prefill chunks)
    enable_prefix_caching: bool = True
    max_waiting: int = 1024  # waiting-queue bound; beyond it requests get Overloaded
    threads: int | None = None  # backend compute threads (default: all cores)
    backend: str | None = None  # runtime.backends.BACKENDS: "cpu", "graph", "plugin", "tensorrt", "torch"
    # While requests decode, a step carries only the prefill its learned cost keeps within this
    # target (None: the fixed max_num_batched_tokens budget, whatever the decodes wait).
    itl_target_ms: float | None = DEFAULT_ITL_TARGET_MS
    min_prefill_tokens: int = 64  # prefill per step however busy decoding is, so prompts progress

    def __post_init__(self) -> None:
        names = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "threads",
                 "min_prefill_tokens")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineArgs.{name} must be a positive integer (got {value!r})")
        target = self.itl_target_ms
        if target is not None and (not isinstance(target, int | float) or not 0 < target < math.inf):
            raise ValueError(f"EngineArgs.itl_target_ms must be a positive number of ms or None (got {target!r})")
