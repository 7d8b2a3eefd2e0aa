"""The torch backend: the engine's weights in torch, trtserve's Triton kernels over a paged pool.

The second GPU path beside TensorRT (as TensorRT-LLM's PyTorch backend), needing only CUDA,
torch and Triton. The KV pool is one device tensor [layers, 2, num_blocks + 1, block_size,
kv_width] in the engine's KV dtype (float, or int8/fp8 codes with their scales: kv_cache.py); the
extra block is scratch for CUDA-graph padding rows and never handed out. A step
is packed and checked on the host (model.HostStep: a wrong block table, position or token id
raises ValueError before any kernel indexes the pool with it), copied to the device in one
transfer and run by model.Decoder. On CUDA, decode steps replay CUDA graphs per batch bucket
(graphs.py) and `step_sample` samples on the device (executors/sampling/torch_sampler.py), so a
step copies back token ids, not logits. On CPU the same code runs with the Triton kernels in
Triton's interpreter (slow: tests and tiny models only).

LoRA adapters (`enable_lora`, every projection): the slots' updates in device pools (lora.py), applied per
segment of one adapter's tokens by the SGMV kernels. A step with a LoRA chunk runs eagerly, its segments in the
step's one copy; the CUDA graphs are the base model's (graphs.py). Base-model steps are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine_format import EngineConfig, EngineLoadError
from executors.base import SequenceChunk
from executors.block_table_rows import BlockTableRows
from executors.device_sampling import PendingSample
from executors.lora import TARGETS
from executors.sampling.state import DeviceSample, SamplingState
from executors.sampling.torch_sampler import TorchSampler
from executors.torch.graphs import DecodeGraphs, default_buckets
from executors.torch.kernels import load_kernels
from executors.torch.kv_cache import TorchKVPool
from executors.torch.lora import DeviceLoraSlots, LoraHostStep
from executors.torch.model import Decoder, HostStep
from executors.torch.weights import load_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchBackend:
    name = "torch"
    lora_targets = TARGETS  # every projection

    def __init__(
        self, config: EngineConfig, num_blocks: int | None = None, device: str | None = None,
        dtype: str | None = None, cuda_graphs: bool | None = None, graph_buckets: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """device: default "cuda" where available, else "cpu" (interpreted kernels).
        dtype: compute dtype (default: the engine's), e.g. "bfloat16" over a float32 engine.
        cuda_graphs: replay decode steps from CUDA graphs (default: on CUDA). False on CUDA: eager;
        True on CPU: the graphs' buffers and bucketing run eagerly (what the CPU tests check)."""
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        name = dtype or config.dtype
        if name not in DTYPES:
            raise EngineLoadError(f"the torch backend computes in {', '.join(DTYPES)} (got {name!r})")
        self.dtype = DTYPES[name]
        self.kernels = kernels = load_kernels(self.device)
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        self.weights = load_weights(config, self.device, self.dtype)
        self.kv = TorchKVPool.allocate(config, self.num_blocks, self.dtype, self.device, kernels)
        self.pool = self.kv.data
        on_cuda = self.device.type == "cuda"
        # The split-KV heuristic's SM count; the interpreter takes the launcher's default (an H100's).
        sm_count = kernels.attention.sm_count_of(self.device)
        self.decoder = Decoder(config, self.weights, self.kv, kernels, sm_count)
        self.sampler = TorchSampler(self.device)
        self.rows = BlockTableRows(config.max_batch_size, config.max_blocks_per_seq)  # the persistent batch
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs if cuda_graphs is not None else on_cuda:
            buckets = graph_buckets or default_buckets(config.max_batch_size)
            self.graphs = DecodeGraphs(self.decoder.forward, buckets, config.max_blocks_per_seq, self.num_blocks,
                                       self.device, capture=on_cuda)  # fmt: skip
        self._staging: list[torch.Tensor | None] = [None, None]  # pinned host buffers of eager steps' inputs
        self.lora: DeviceLoraSlots | None = None
        self._turn = 0
        log.info("torch backend on %s (%s, kernels %s): KV pool %d blocks (%s), %.1f MiB", self.device, name,
                 "interpreted" if kernels.interpreted else "compiled", self.num_blocks, config.kv_cache_dtype,
                 self.kv.nbytes / 2**20)  # fmt: skip

    def enable_lora(self, num_slots: int, max_rank: int) -> DeviceLoraSlots:
        """Serve adapters from now on (FlatStepBackend.enable_lora's contract): `num_slots` resident at once, filled
        by the engine, of ranks up to `max_rank` (the server's max_lora_rank: it sizes the device pools)."""
        self.lora = DeviceLoraSlots(self.config.model, num_slots, self.name, max_rank, self.device, self.dtype)
        return self.lora

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        return self._logits(chunks).cpu().numpy()

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        if len(rows) != len(chunks):
            raise ValueError(f"{len(rows)} sampling rows for {len(chunks)} chunks")
        if any(c.num_logits != 1 for c in chunks):  # speculative verify steps: `step`, rejection-sampled on the host
            raise ValueError("step_sample samples one row per chunk; verify drafts through step()")
        return self.sampler.sample_rows(self._logits(chunks), rows)

    def launch(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None], sources: np.ndarray,
               previous: PendingSample | None) -> PendingSample:  # fmt: skip
        """step_sample, queued on the device: the host returns as soon as the kernels are launched (see
        executors/device_sampling.py). Placeholder tokens are copied from `previous`'s sampled tokens on the
        device, after the step's inputs arrive and before its kernels read them."""
        if len(rows) != len(chunks) or len(sources) != len(chunks):
            raise ValueError(f"{len(rows)} rows and {len(sources)} sources for {len(chunks)} chunks")
        filled = sources >= 0
        if filled.any() and not isinstance(previous, _Launched):
            raise ValueError("placeholder tokens need the previous launch of this backend")
        with torch.inference_mode():
            step = HostStep.pack(chunks, self.config, self.num_blocks, placeholders=filled, rows=self.rows)
            first_rows = np.flatnonzero(filled)  # a chunk's first token is its sequence's first row...
            starts = step.packed[4 * step.tokens : 4 * step.tokens + step.batch]  # ...query_start[i]
            where = torch.from_numpy(starts[first_rows]).to(self.device, non_blocking=True)
            src = torch.from_numpy(sources[first_rows]).to(self.device, non_blocking=True)

            def fill(input_ids: torch.Tensor) -> None:
                if first_rows.size:
                    assert isinstance(previous, _Launched)
                    input_ids[where] = previous.tokens[src]

            logits = self._run(step, chunks, fill)
            return _Launched(self.sampler.sample_on_device(logits, rows))

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, interpreted: bool = False) -> float:
        """On CUDA, before serving: run every step of `warm_up_steps`, so that no request waits for Triton to
        compile a kernel or for a decode graph to be captured; returns the seconds it took. Off CUDA the
        interpreter compiles nothing, so it is skipped (0.0) unless `interpreted` (tests: which kernel
        variants it launches, tests/test_warm_up_coverage.py). The steps write K/V into the pool's first
        blocks, which hold nothing yet: a request writes a row before any step reads it."""
        if self.device.type != "cuda" and not interpreted:
            return 0.0
        import time

        start = time.perf_counter()
        for chunks in self.warm_up_steps(max_num_seqs, max_num_batched_tokens):
            self._logits(chunks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def warm_up_steps(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[list[SequenceChunk]]:
        """A step of every kernel variant the engine can launch. Decodes: every graph bucket up to
        `max_num_seqs` (captured there). Prefills: one chunk of each power-of-two length up to the step
        budget and the pool (the tile sizes follow the row count). The kernels do not specialize on the
        step's varying sizes or its index arrays' alignment (their `do_not_specialize` lists), so these
        stand for every step of their class."""
        bs, width = self.config.block_size, self.config.max_blocks_per_seq
        table = list(range(min(width, self.num_blocks)))
        buckets = self.graphs.buckets if self.graphs is not None else (1,)
        steps = [
            [SequenceChunk([0], bs, table[:2]) for _ in range(batch)] for batch in buckets if batch <= max_num_seqs
        ]
        length, longest = 1, min(max_num_batched_tokens, self.config.max_seq_len - 1, len(table) * bs)
        while length <= longest:  # a chunk longer than the pool holds is never sent
            steps.append([SequenceChunk([0] * length, 0, table[: -(-length // bs)])])
            length *= 2
        # Uncaptured steps of a few rows (a decode beside a short chunk) take the decode kernel, split or not
        # by the context: one near the start of a sequence, one at the longest the pool holds.
        end = min(self.config.max_seq_len, len(table) * bs)
        steps += [[SequenceChunk([0, 0], past, table[: -(-(past + 2) // bs)])] for past in (0, max(end - 2, 0))]
        return steps

    def close(self) -> None:
        """Drop the graphs, pool and weights; return the cached device memory to CUDA."""
        self.graphs = None
        if self.lora is not None:
            self.lora.pools.clear()
        del self.decoder, self.kv, self.pool, self.weights
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _logits(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        return self._run(HostStep.pack(chunks, self.config, self.num_blocks, rows=self.rows), chunks)

    def _run(self, step: HostStep, chunks: Sequence[SequenceChunk], fill: Fill | None = None) -> torch.Tensor:
        """The step's logits rows. `fill`: writes the placeholder tokens into the input ids on the device.
        Graphs are keyed on whether a LoRA is present: they hold base steps only, so a step with a LoRA chunk
        never replays one (it runs eagerly, the adapters' kernels launched per step)."""
        lora = None if self.lora is None else LoraHostStep.pack(chunks, self.lora)
        bucket = self.graphs.bucket(chunks) if self.graphs is not None and lora is None else None
        if self.graphs is not None and bucket is not None:
            return self.graphs.run(step, bucket, fill)
        if lora is None:
            inputs, adapters = step.views(self._upload(step.packed)), None
        else:  # the segments travel in the step's one copy
            assert self.lora is not None
            device = self._upload(np.concatenate([step.packed, lora.packed]))
            inputs = step.views(device[: step.packed.size])
            adapters = lora.on_device(device[step.packed.size :], self.lora, self.kernels.lora)
        if fill is not None:
            fill(inputs.input_ids)
        return self.decoder.forward(inputs, adapters)

    def _upload(self, packed: np.ndarray) -> torch.Tensor:
        """One host -> device copy, through pinned buffers on CUDA, two taken in turn: an overlapped step's copy
        may still read one while the next step is packed into the other (a step's results are read back
        before the step after next is packed)."""
        host = torch.from_numpy(packed)
        if self.device.type != "cuda":
            return host  # each step packs a new array
        self._turn ^= 1
        staging = self._staging[self._turn]
        if staging is None or staging.numel() < host.numel():
            staging = self._staging[self._turn] = torch.empty(max(host.numel(), 1 << 16), dtype=torch.int64,
                                                              pin_memory=True)  # fmt: skip
        staged = staging[: host.numel()]
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)


Fill = Callable[[torch.Tensor], None]


class _Launched:
    """A launched step's sampled tokens (PendingSample): on the device, where the next launch's placeholders
    read them, and copied into pinned host memory right behind this step's kernels. Reading them then waits
    for this step only: a plain `.cpu()` later would queue its copy behind everything launched since (the
    next step), and the host could not prepare a step while the device ran the one before it."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens, self._host = tokens, tokens
        self._copied: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> DeviceSample:
        if self._copied is not None:
            self._copied.synchronize()  # this step's copy done; later launches may still run
        ids = self._host.numpy().copy()  # the pinned block goes back to torch's cache with this object
        return DeviceSample(ids, [None] * len(ids))
