"""TensorRT engine backend (GPU only): `step(chunks)` on a compiled `model.plan`.

A checked runner. The plan has two optimization profiles (0: decodes, step 1; 1: prefill
chunks), and each gets its own execution context for its lifetime, so a step never switches
profiles; both share one activation buffer (they never run at once). Device memory is torch's:
the KV pool [layers, 2, num_blocks, block_size, kv_width] (each layer's K and V bound once as
`key_cache.{l}`/`value_cache.{l}`; the PagedKVWrite plugins write it in place), one int64
input buffer, one logits buffer per context ([max_logit_rows, vocab]: the rows `logit_rows` asks
for, several per sequence when speculative drafts are verified). Per step the host packs every input of both calls
(engine_format/INTERFACE.md, block tables covering the step) into one pinned buffer, which
reaches the device in one copy; the calls run on one stream and their logits stay on the
device, where `step_sample` samples them (executors/sampling/torch_sampler.py, shared with the
torch backend) so that only token ids come back. Every TensorRT call's result is checked, and
a shape the plan cannot take is refused first with the profile's limits (engine_format's
TensorRTLimits, from the manifest); the engine's own limits are checked against EngineArgs at
start-up (`check_limits`).

UNVERIFIED: written against TensorRT 10.x (>= 10.1 for set_device_memory/device_memory_size_v2);
never run (no GPU here). Without TensorRT or a GPU, construction raises EngineLoadError; the
limit checks and error messages are tested on CPU with stand-ins (tests/test_tensorrt.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_format import EngineConfig, EngineLoadError, TensorRTLimits
from engine_format.files import PLAN_FILE
from executors.base import SequenceChunk, StepTensors, num_logit_rows
from executors.device_sampling import check_chunks
from executors.sampling.state import DeviceSample, SamplingState

if TYPE_CHECKING:  # imported when a backend is made: this module loads without torch or TensorRT
    import torch

STEP_INPUTS = ("input_ids", "positions", "seq_lens", "past_lens", "block_tables", "logit_rows")
ALIGN = 32  # int64 elements: every input address 256-byte aligned
DECODE, PREFILL = 0, 1  # the plan's optimization profiles


def _load_tensorrt() -> Any:
    """The tensorrt module (untyped), or EngineLoadError naming what is missing."""
    try:
        import tensorrt as trt
        import torch
    except ImportError as exc:
        raise EngineLoadError(
            f"engine built for backend 'tensorrt' needs TensorRT and torch on an NVIDIA GPU ({exc.name} is not "
            "installed); run it with --backend torch on a GPU, or rebuild with --backend onnxruntime-cpu"
        ) from None
    if not torch.cuda.is_available():
        raise EngineLoadError("engine built for backend 'tensorrt' needs an NVIDIA GPU; no CUDA device is visible")
    return trt


def refuse_quantized_kv(config: EngineConfig) -> None:
    """An int8/fp8 KV cache is refused here (and by build-engine for --target tensorrt): the quantized
    ops' Triton kernels exist (plugins_cuda/kv_write_quant.py, paged_attention_quant.py; the torch backend
    runs them) but no TensorRT plugin registers them, so a plan cannot take the pool's codes, scale pools
    or kv_scales yet."""
    if config.kv_quantized:
        raise EngineLoadError(
            f"the TensorRT backend does not read a {config.kv_cache_dtype} KV cache: plugins_cuda/trt_plugins.py "
            "registers only the float-pool PagedKVWrite/PagedAttention plugins; use backend 'cpu', 'graph' or 'plugin'"
        )


def check_limits(config: EngineConfig, num_blocks: int | None, max_num_batched_tokens: int | None) -> TensorRTLimits:
    """The run's sizes (None: the default) against the shapes the plan's profiles accept."""
    limits = config.tensorrt
    if limits is None:
        raise EngineLoadError(
            f"{config.engine_dir}: the manifest has no TensorRT limits; rebuild with --target tensorrt"
        )
    chunk = min(max_num_batched_tokens or 0, config.max_seq_len)  # the longest prefill chunk a step may carry
    problems = [
        (num_blocks is not None and num_blocks > limits.max_num_blocks,
         f"{num_blocks} KV blocks exceed the {limits.max_num_blocks} the plan was built for "
         f"(tensorrt.limits.max_num_blocks); ask for num_kv_blocks <= {limits.max_num_blocks}"),
        (config.max_batch_size > limits.max_batch,
         f"max_batch_size {config.max_batch_size} exceeds the plan's max_batch {limits.max_batch}"),
        (config.max_blocks_per_seq > limits.max_table_blocks,
         f"a {config.max_seq_len}-token sequence needs {config.max_blocks_per_seq} table blocks; "
         f"the plan takes {limits.max_table_blocks} (tensorrt.limits.max_table_blocks)"),
        (chunk > limits.max_step,
         f"max_num_batched_tokens {max_num_batched_tokens} allows {chunk}-token prefill chunks; the plan's "
         f"prefill profile takes at most {limits.max_step} (tensorrt.limits.max_step): set "
         f"max_num_batched_tokens <= {limits.max_step} or rebuild with a larger max_step"),
    ]  # fmt: skip
    for failed, message in problems:
        if failed:
            raise EngineLoadError(message)
    return limits


@dataclass(frozen=True)
class Call:
    """One execute: the chunks of one profile, their indices in the step, and where their logit
    rows go in the step's output."""

    profile: int
    rows: list[int]
    tensors: StepTensors
    out_rows: list[int]


def plan_calls(chunks: Sequence[SequenceChunk], block_size: int, limits: TensorRTLimits) -> list[Call]:
    """Decodes in one call (profile 0), prefill chunks in another (profile 1), as the ORT graph
    backend; a shape outside the profile is refused here with its limits, before TensorRT sees it."""
    calls = []
    first = np.cumsum([0] + [c.num_logits for c in chunks])
    for profile in (DECODE, PREFILL):
        rows = [i for i, c in enumerate(chunks) if (len(c.token_ids) == 1) == (profile == DECODE)]
        if not rows:
            continue
        t = StepTensors.pack([chunks[i] for i in rows], block_size, cover_step=True)
        (batch, step), width = t.input_ids.shape, t.block_tables.shape[1]
        kind = "decode" if profile == DECODE else "prefill"
        if batch > limits.max_batch or step > limits.max_step or width > limits.max_table_blocks:
            raise ValueError(
                f"{kind} call [batch={batch}, step={step}, table_blocks={width}] is outside optimization profile "
                f"{profile}: batch <= {limits.max_batch}, step <= {limits.max_step}, "
                f"table_blocks <= {limits.max_table_blocks}"
            )
        if t.logit_rows.size > limits.max_logit_rows:
            raise ValueError(
                f"{kind} call asks for {t.logit_rows.size} logit rows; optimization profile {profile} returns at most "
                f"{limits.max_logit_rows} (tensorrt.limits.max_logit_rows): lower num_speculative_tokens"
            )
        out_rows = [r for i in rows for r in range(first[i], first[i + 1])]
        calls.append(Call(profile, rows, t, out_rows))
    return calls


def pack_inputs(calls: Sequence[Call], names: Sequence[str]) -> tuple[np.ndarray, list[dict[str, tuple[int, tuple]]]]:
    """Every call's inputs in one int64 array (regions ALIGN-aligned); per call name -> (offset, shape)."""
    layouts, parts, offset = [], [], 0
    for call in calls:
        layout = {}
        for name in names:
            array = np.ascontiguousarray(getattr(call.tensors, name), np.int64)
            pad = -array.size % ALIGN
            layout[name] = (offset, array.shape)
            parts += [array.ravel(), np.zeros(pad, np.int64)]
            offset += array.size + pad
        layouts.append(layout)
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), layouts


def input_capacity(limits: TensorRTLimits) -> int:
    """Elements pack_inputs needs at most: both calls at the profiles' largest shapes."""
    b, s, m = limits.max_batch, limits.max_step, limits.max_table_blocks
    return 2 * (2 * b * s + 2 * b + b * m + limits.max_logit_rows + len(STEP_INPUTS) * ALIGN)


class ProfileContext:
    """One IExecutionContext pinned to one optimization profile; every call checked."""

    def __init__(self, trt: Any, engine: Any, profile: int, stream: int, memory: int, memory_size: int) -> None:
        self.engine, self.profile = engine, profile
        self.context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if self.context is None:
            raise EngineLoadError(f"TensorRT could not create an execution context for profile {profile}")
        self.context.set_device_memory(memory, memory_size)
        if not self.context.set_optimization_profile_async(profile, stream):
            raise EngineLoadError(f"TensorRT refused optimization profile {profile} "
                                  f"(the plan has {engine.num_optimization_profiles})")  # fmt: skip

    def set_shape(self, name: str, shape: tuple) -> None:
        if not self.context.set_input_shape(name, tuple(shape)):
            low, _, high = self.engine.get_tensor_profile_shape(name, self.profile)
            raise RuntimeError(f"TensorRT rejected {name} shape {tuple(shape)} in optimization profile "
                               f"{self.profile}, which accepts {tuple(low)} .. {tuple(high)}")  # fmt: skip

    def bind(self, name: str, address: int) -> None:
        if not self.context.set_tensor_address(name, address):
            raise RuntimeError(f"TensorRT refused the address of {name} in optimization profile {self.profile}")

    def execute(self, stream: int, shapes: dict[str, tuple]) -> None:
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed in optimization profile {self.profile} "
                               f"(inputs {', '.join(f'{n}{tuple(s)}' for n, s in shapes.items())})")  # fmt: skip


class TrtBackend:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None) -> None:  # fmt: skip
        refuse_quantized_kv(config)
        trt = _load_tensorrt()
        import torch

        from executors.sampling.torch_sampler import TorchSampler

        plan = config.engine_dir / PLAN_FILE
        if not plan.is_file():
            raise EngineLoadError(f"{config.engine_dir}: {PLAN_FILE} is missing; rebuild with --target tensorrt")
        self.config, spec = config, config.model
        self.limits = limits = check_limits(config, num_blocks, max_num_batched_tokens)
        self.num_blocks = num_blocks or limits.max_num_blocks
        self.device = torch.device("cuda")
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise EngineLoadError(f"TensorRT could not deserialize {plan} (built for another TensorRT or GPU?)")
        self.stream = torch.cuda.Stream(self.device)
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.dtype]
        shape = (spec.num_layers, 2, self.num_blocks, config.block_size, spec.kv_width)
        self.pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.workspace = torch.empty(max(1, self.engine.device_memory_size_v2), dtype=torch.uint8, device=self.device)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in STEP_INPUTS if n in names]
        capacity = input_capacity(limits)
        self.host_inputs = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.device_inputs = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.contexts: list[ProfileContext] = []
        self.logits: list[torch.Tensor] = []
        for profile in (DECODE, PREFILL):
            context = ProfileContext(trt, self.engine, profile, self.stream.cuda_stream, self.workspace.data_ptr(),
                                     self.workspace.numel())  # fmt: skip
            for layer in range(spec.num_layers):
                for kind, name in ((0, "key_cache"), (1, "value_cache")):
                    context.set_shape(f"{name}.{layer}", tuple(self.pool.shape[2:]))
                    context.bind(f"{name}.{layer}", self.pool[layer, kind].data_ptr())
            logits = torch.empty((limits.max_logit_rows, spec.vocab_size), dtype=torch.float32, device=self.device)
            context.bind("logits", logits.data_ptr())
            self.contexts.append(context)
            self.logits.append(logits)
        self.sampler = TorchSampler(self.device)

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        import torch

        with torch.cuda.stream(self.stream):
            return self._run(chunks).cpu().numpy()

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        """One logits row per chunk only (speculative verify steps go through `step`: the engine's
        rejection sampler runs on the host)."""
        import torch

        if any(c.num_logits != 1 for c in chunks):
            raise ValueError("step_sample samples one row per chunk; verify drafts through step()")

        with torch.cuda.stream(self.stream):
            return self.sampler.sample_rows(self._run(chunks), rows)

    def close(self) -> None:
        """Release the contexts, the engine and every device buffer (torch returns them to CUDA)."""
        import torch

        self.stream.synchronize()
        del self.contexts, self.logits, self.engine, self.runtime
        del self.pool, self.workspace, self.device_inputs, self.host_inputs
        torch.cuda.empty_cache()

    def _run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """float32 logits [sum of num_logits, vocab] on the device, enqueued on self.stream (current)."""
        import torch

        check_chunks(chunks, self.config, self.num_blocks)  # the plugins index the pool unchecked
        calls = plan_calls(chunks, self.config.block_size, self.limits)
        packed, layouts = pack_inputs(calls, self.inputs)
        self.host_inputs[: packed.size].numpy()[:] = packed  # free: the previous step synchronized
        self.device_inputs[: packed.size].copy_(self.host_inputs[: packed.size], non_blocking=True)
        base = self.device_inputs.data_ptr()
        out = torch.empty((num_logit_rows(chunks), self.config.model.vocab_size), dtype=torch.float32,
                          device=self.device)  # fmt: skip
        for call, layout in zip(calls, layouts, strict=True):
            context = self.contexts[call.profile]
            for name, (offset, shape) in layout.items():
                context.set_shape(name, shape)
                context.bind(name, base + 8 * offset)
            context.execute(self.stream.cuda_stream, {n: s for n, (_, s) in layout.items()})
            rows = torch.tensor(call.out_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            out.index_copy_(0, rows, self.logits[call.profile][: len(call.out_rows)])
        return out
