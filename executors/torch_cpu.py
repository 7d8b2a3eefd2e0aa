"""The CPU backend with bfloat16 dense layers (backend kind "cpu-bf16"): torch (oneDNN) for the
matmuls, our kernel for paged attention.

Why: a CPU step is bound by the bytes it moves (README, "Where a step's time goes"): the fp32 dense
layers stream all of their weights through once per step. In bfloat16 they move half as much, and
oneDNN runs them on AMX tiles where the CPU has them (large chunks: 512 rows through SmolLM2-135M's
30 layers take 65 ms against ONNX Runtime's 338 in fp32). bfloat16 is the model's training dtype;
the residual stream and the norms follow HF's bfloat16 forward (`rms_norm`), RoPE and attention run
in float32 over a float32 (or int8/fp8) pool, so the reference is HF eager in bfloat16.

A step has the `cpu` backend's layout (`FlatStep`) with torch in place of ONNX Runtime between the
kernel calls: per layer RMSNorm -> QKV -> RoPE, the new K/V rows into the pool, the kernel over each
sequence's blocks in place, then o_proj and the MLP, whose SiLU, gating product and residual adds
are oneDNN post-ops of the matmuls. RMSNorm and RoPE (with the split of the fused QKV rows) are C
(executors/layer_ops.py): in torch they were ~18 small ops per layer, 10-16% of a step.
Weights are the engine's (executors/torch/weights.py; INT4 engines dequantized), reordered once
into oneDNN's blocked layout.

OpenMP: torch's elementwise ops over more than 32K elements and the kernel share one libgomp pool,
used hundreds of times a step, microseconds apart, so its workers spin before sleeping
(executors/cpus.py `spin_openmp_workers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig, EngineLoadError, ceil_div
from executors.cpus import bf16_matmul, spin_openmp_workers, usable_cpus
from executors.flat_step import FlatStep, FlatStepBackend
from executors.kv_pool import KVPool
from executors.lora import TARGETS, LoraRows, LoraSlots

spin_openmp_workers("cpu-bf16")

# isort: off
from executors.cpu_attention import AttentionShape, paged_attention  # noqa: E402 - loads libgomp
import torch  # noqa: E402 - after the kernel: one libgomp, with the policy above
import torch.nn.functional as F  # noqa: E402
from executors.layer_ops import rms_norm, rope_split  # noqa: E402
from executors.torch.weights import Layer, Linear, load_weights  # noqa: E402
# isort: on

DTYPE = torch.bfloat16
# Matmuls of more than 16 rows run on a multiple of 16 (AMX tiles hold 16 rows; oneDNN's tail path for the
# rest was ~12% slower over prefill chunks of random lengths here, and every new row count costs it a
# kernel JIT of ~1-3 ms); fewer rows run as they are (padding a decode of 1-8 rows cost 10-25%).
ROW_BUCKET = 16
_linear = torch.ops.mkldnn._linear_pointwise  # oneDNN matmul on a prepacked weight, with a fused post-op


def _packed(linear: Linear | torch.Tensor, rows_hint: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight reordered once into oneDNN's blocked layout (as torch.compile's CPU freezing does;
    10-20% faster than a plain matmul at 1-32 rows here) and its bias. Takes a [in, out] Linear
    or a [out, in] tensor."""
    if isinstance(linear, torch.Tensor):
        return torch.ops.mkldnn._reorder_linear_weight(linear, rows_hint), None
    if linear.input_scale is not None:
        raise EngineLoadError("the cpu-bf16 backend does not run FP8 engines: use --backend cpu")
    return torch.ops.mkldnn._reorder_linear_weight(linear.weight.T.contiguous(), rows_hint), linear.bias


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer's weights as oneDNN runs them. gate and up are apart so that SiLU and the
    product fuse into their matmuls (post-ops), and the residual adds into o_proj's and down's."""

    input_norm: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    o_proj: tuple[torch.Tensor, torch.Tensor | None]
    post_norm: torch.Tensor
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]

    @classmethod
    def pack(cls, layer: Layer, rows_hint: int) -> PackedLayer:
        gate_up = layer.gate_up.weight  # [hidden, 2 * intermediate]: gate | up
        half = gate_up.shape[1] // 2
        gate, up = (Linear(part.contiguous()) for part in (gate_up[:, :half], gate_up[:, half:]))
        return cls(layer.input_norm, _packed(layer.qkv, rows_hint), _packed(layer.o_proj, rows_hint),
                   layer.post_norm, _packed(gate, rows_hint), _packed(up, rows_hint),
                   _packed(layer.down, rows_hint))  # fmt: skip


class TorchCpuBackend(FlatStepBackend):
    name = "cpu-bf16"
    lora_targets = TARGETS
    lora_half = True  # float16 adapters are finer than its bfloat16 arithmetic, and half the bytes a step reads

    def __init__(self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None) -> None:
        if config.dtype not in ("float32", "bfloat16"):
            raise EngineLoadError(
                f"the cpu-bf16 backend reads a float32 or bfloat16 engine's weights (got {config.dtype})"
            )
        if not torch.backends.mkldnn.is_available():
            raise EngineLoadError("the cpu-bf16 backend needs torch built with oneDNN (mkldnn)")
        if not bf16_matmul():
            raise EngineLoadError(
                "the cpu-bf16 backend needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's bfloat16 "
                "matmul; this one has neither: use --backend cpu"
            )
        spec = config.model
        self.config = config
        self.threads = threads or usable_cpus()
        torch.set_num_threads(self.threads)
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        self.shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, config.block_size)
        weights = load_weights(config, torch.device("cpu"), DTYPE)
        hint = config.max_batch_size  # oneDNN picks its blocking for this many rows; any count runs
        self.embed, self.final_norm = weights.embed, weights.final_norm
        self.lm_head = _packed(weights.lm_head, hint)
        # RoPE as x * [cos, cos] + [x2, x1] * [-sin, sin] over x = [x1, x2], in float32 (as the tables are)
        self.cos = torch.cat([weights.cos, weights.cos], dim=-1)
        self.sin = torch.cat([-weights.sin, weights.sin], dim=-1)
        self.layers = [PackedLayer.pack(layer, hint) for layer in weights.layers]
        self.kv = KVPool.allocate(config, self.num_blocks, float_pool="float32")  # attention runs in float32
        self.pool = self.kv.data

    @torch.inference_mode()
    def _run(self, flat: FlatStep, logit_rows: np.ndarray) -> np.ndarray:
        spec = self.config.model
        eps, tokens, positions = spec.rms_norm_eps, len(flat.slots), flat.positions[:, 0]
        rows = tokens if tokens <= ROW_BUCKET else ceil_div(tokens, ROW_BUCKET) * ROW_BUCKET  # padding: token 0
        ids = torch.zeros(rows, dtype=torch.int64)
        ids[:tokens] = torch.from_numpy(flat.input_ids[:, 0])
        hidden = F.embedding(ids, self.embed)
        attn_rows = torch.zeros(rows, spec.num_heads * spec.head_dim, dtype=DTYPE)  # padding rows stay 0
        lora = self.lora if flat.loras else None
        for index, layer in enumerate(self.layers):
            normed = rms_norm(hidden, layer.input_norm, eps)
            qkv = _linear(normed, *layer.qkv, "none", [], "")[:tokens]
            if lora is not None:
                _add_deltas(qkv, lora, flat.loras, index, "qkv", normed)
            q, k, v = rope_split(qkv, spec.num_heads, spec.num_kv_heads, self.cos, self.sin, positions)
            self.kv.write(index, flat.slots, k, v)
            attn = paged_attention(
                q, self.pool[index, 0], self.pool[index, 1], flat.block_tables, flat.seq_of_token,
                positions, self.shape, window=spec.sliding_windows[index], threads=self.threads,
                quant=self.kv.quant(index),
            )  # fmt: skip
            attn_rows[:tokens] = torch.from_numpy(attn)
            hidden = _linear.binary(attn_rows, hidden, *layer.o_proj, "add")
            if lora is not None:
                _add_deltas(hidden, lora, flat.loras, index, "o_proj", attn_rows)
            normed = rms_norm(hidden, layer.post_norm, eps)
            if lora is not None and lora.updates_group(flat.loras, index, "gate_up"):
                gated = _lora_mlp_input(layer, normed, lora, flat.loras, index)
            else:
                gated = _linear.binary(normed, _linear(normed, *layer.gate, "swish", [], ""), *layer.up, "mul")
            hidden = _linear.binary(gated, hidden, *layer.down, "add")
            if lora is not None:
                _add_deltas(hidden, lora, flat.loras, index, "down", gated)
        last = rms_norm(hidden[torch.from_numpy(logit_rows)], self.final_norm, eps)
        return _linear(last, *self.lm_head, "none", [], "").float().numpy()


def _add_deltas(out: torch.Tensor, lora: LoraSlots, rows: LoraRows, layer: int, group: str, x: torch.Tensor) -> None:
    """Add the adapters' update of a projection to their rows of `out` (bfloat16), in float32 then rounded, as
    PEFT adds its float32 update to a bfloat16 layer's output."""
    if not lora.updates_group(rows, layer, group):
        return
    index = torch.from_numpy(rows.rows)
    delta = lora.delta(rows, layer, group, x.float().numpy())
    out[index] = (out[index].float() + torch.from_numpy(delta)).to(out.dtype)


def _lora_mlp_input(
    layer: PackedLayer, normed: torch.Tensor, lora: LoraSlots, rows: LoraRows, index: int
) -> torch.Tensor:
    """silu(gate) * up with the adapters' updates of gate and up added first: the fused post-ops cannot take
    them, so gate and up run as plain matmuls in such a step."""
    gate_up = torch.cat([_linear(normed, *layer.gate, "none", [], ""), _linear(normed, *layer.up, "none", [], "")], 1)
    _add_deltas(gate_up, lora, rows, index, "gate_up", normed)
    gate, up = gate_up.chunk(2, dim=1)
    return F.silu(gate) * up
