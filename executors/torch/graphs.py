"""Decode steps replayed from CUDA graphs, one per batch-size bucket (GPU only).

A decode step (every chunk one token) of B sequences runs the graph of the smallest bucket
>= B. The graphs read fixed device buffers: each step the host fills one pinned staging array
laid out like them (real rows first; padding rows: token 0 at position 0 whose K/V go to the
pool's scratch block, the one block past `num_blocks` that no sequence owns) and copies it
over in one transfer, then replays. Block tables are as wide as a max_seq_len sequence needs,
so a bucket's launch shapes (and its split-KV count) never change.

Graphs are captured lazily, the first time a bucket is used (Triton compiles in the warm-up
run before capture), all in one memory pool: a graph's temporaries are dead once its logits
have been read, and nothing replays concurrently (one engine thread).

Graphs are keyed on whether a LoRA is present, and hold base-model steps only: a decode step with a LoRA chunk
runs eagerly (backend.py `_run`), so a graph captured without the adapters' kernels is never replayed for it.
(Capturing LoRA decodes too would put the segments in static buffers and capture per bucket again; not done.)

The capture itself is the only CUDA-specific part: `EagerReplay` runs the same static buffers
eagerly, which is how the CPU tests check the bucketing and padding (tests/test_torch_backend.py).

UNVERIFIED: torch.cuda.CUDAGraph capture of the Triton launches has not run (no GPU here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from executors.base import SequenceChunk
from executors.torch.model import HostStep, StepTensors

Forward = Callable[[StepTensors], torch.Tensor]


def default_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = {1, 2, 4, *range(8, max_batch + 1, 8), max_batch}
    return tuple(sorted(s for s in sizes if s <= max_batch))


class Replay(Protocol):
    def __call__(self) -> torch.Tensor: ...


class EagerReplay:
    """A stand-in graph: runs the forward on the static buffers each time (CPU tests)."""

    def __init__(self, forward: Forward, inputs: StepTensors) -> None:
        self.forward, self.inputs = forward, inputs

    def __call__(self) -> torch.Tensor:
        return self.forward(self.inputs)


class CudaGraphReplay:
    """GPU only: the forward captured once with torch.cuda.CUDAGraph, replayed on the same buffers."""

    def __init__(self, forward: Forward, inputs: StepTensors, pool: Any) -> None:  # torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(inputs)  # warm-up off the capture: compiles the Triton kernels, settles the allocator
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward(inputs)

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(self, forward: Forward, buckets: Sequence[int], table_width: int, scratch_block: int,
                 device: torch.device, capture: bool) -> None:  # fmt: skip
        """`capture`: real CUDA graphs (False: EagerReplay)."""
        self.forward, self.buckets = forward, tuple(sorted(buckets))
        self.capture, self.scratch = capture, scratch_block
        self.max_batch, self.width = self.buckets[-1], table_width
        n = self.max_batch
        # Regions: input_ids, positions, kv_block, kv_offset [n]; block_tables [n, width]. Two pinned host
        # buffers taken in turn: an overlapped step's copy may still read one while the next is packed.
        pinned = device.type == "cuda"
        self.hosts = [torch.empty(4 * n + n * table_width, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self.static = torch.empty_like(self.hosts[0], device=device)
        self.fixed = torch.arange(n + 1, dtype=torch.int64, device=device)  # query_start; logit_rows = [:-1]
        for host in self.hosts:
            self._fill_padding(host.numpy())
        self.static.copy_(self.hosts[0])
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[int, Replay] = {}

    def bucket(self, chunks: Sequence[SequenceChunk]) -> int | None:
        """The bucket a step runs in; None: not a decode step, or too large."""
        if len(chunks) > self.max_batch or any(len(c.token_ids) != 1 for c in chunks):
            return None
        return next(b for b in self.buckets if b >= len(chunks))

    def run(self, step: HostStep, bucket: int, fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [step.batch, vocab] of a decode step already validated and packed (HostStep). `fill`: writes
        placeholder tokens into the input ids on the device, once they are there (an overlapped launch)."""
        self._turn ^= 1
        staging = self.hosts[self._turn]
        b, n, host, packed = step.batch, self.max_batch, staging.numpy(), step.packed
        self._fill_padding(host)
        for region in range(4):  # input_ids, positions, kv_block, kv_offset: one row per sequence
            host[region * n : region * n + b] = packed[region * b : (region + 1) * b]
        tables = host[4 * n :].reshape(n, self.width)
        tables[:b, : step.table_width] = packed[6 * b + 1 :].reshape(b, step.table_width)  # rows == b: decodes
        self.static.copy_(staging, non_blocking=True)  # the step's one host -> device copy
        if fill is not None:
            fill(self.static[:b])
        graph = self.graphs.get(bucket) or self._make(bucket)
        return graph()[:b]

    def _fill_padding(self, host: np.ndarray) -> None:
        n = self.max_batch
        host[: 4 * n] = 0
        host[2 * n : 3 * n] = self.scratch  # padding rows write their K/V into the scratch block
        host[4 * n :] = self.scratch

    def _make(self, bucket: int) -> Replay:
        n, s = self.max_batch, self.static
        inputs = StepTensors(
            input_ids=s[:bucket], positions=s[n : n + bucket], kv_block=s[2 * n : 2 * n + bucket],
            kv_offset=s[3 * n : 3 * n + bucket], query_start=self.fixed[: bucket + 1], logit_rows=self.fixed[:bucket],
            block_tables=s[4 * n :].view(n, self.width)[:bucket], max_rows=1,
        )  # fmt: skip
        graph: Replay
        graph = CudaGraphReplay(self.forward, inputs, self.pool) if self.capture else EagerReplay(self.forward, inputs)
        self.graphs[bucket] = graph
        return graph
