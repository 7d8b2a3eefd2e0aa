"""The CPU backend with int8 dense layers (backend kind "cpu-int8"): W8A8 matmuls in our kernel
(executors/int8_ops.py), our kernel for paged attention, numpy between them; no ONNX Runtime, no torch.

Why: a decode step streams every weight once, and at 16-32 rows the float32 matmuls are also bound by the
FMA units. int8 weights move a quarter of the bytes, and AVX512-VNNI multiplies four times the pairs per
instruction: the dense layers of a 16-row SmolLM2 step take 14 ms on a VNNI Xeon against 48 ms in ONNX
Runtime float32 (benchmarks/results/decode_profile.md). With AVX2 only (16-bit multiply-adds, twice FMA's
pairs a cycle) they take 26-33 against 42-45 ms on a Zen 3 EPYC (decode_profile-amd-avx2-int8.md).
Weights are quantized symmetrically per output channel when the engine loads, activations per token
(asymmetric, over [min(x, 0), max(x, 0)]): per-token scales keep SmolLM2's perplexity within 0.2% of float32
where one scale per tensor lost 40%. It changes the arithmetic, so it is a default only where the build
verified it and ran the quality gate on it (executors/factory.py). The build also measures each matmul
input's range per channel on calibration text (activation_ranges.npz): SmoothQuant's factors move half of
each outlier channel's range into the weights (Int8Layer), which halves the KL divergence from float32 again.

A step has the `cpu` backend's layout (`FlatStep`): per layer RMSNorm -> quantize -> QKV -> RoPE, the new
K/V rows into the pool, attention over each sequence's blocks in place, quantize -> o_proj added into the
residual stream, RMSNorm -> quantize -> gate|up, SiLU-gating -> quantize -> down added into the stream.
The LM head is int8 too. Embedding lookups, norms and RoPE stay float32. LoRA adapters (every projection)
add float32 updates from the projections' real inputs to the rows of their slots (executors/lora/int8.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import ACTIVATION_RANGES_FILE
from executors.cpus import spin_openmp_workers, usable_cpus

spin_openmp_workers("cpu-int8")  # before the kernel module loads libgomp

# isort: off
from executors.cpu_attention import AttentionShape, paged_attention  # noqa: E402 - loads libgomp
from executors.engine_weights import WeightReader  # noqa: E402
from executors.flat_step import FlatStep, FlatStepBackend  # noqa: E402
from executors.int8_ops import (  # noqa: E402
    PackedLinear,
    linear,
    quantize_rows,
    rms_norm_quantize,
    rope_split,
    silu_mul_quantize,
    simd_isa,
    smoothing,
)
from executors.kv_pool import KVPool  # noqa: E402
from executors.lora import TARGETS, LoraSlots  # noqa: E402
from executors.lora.int8 import NormWeights, StepLora  # noqa: E402
# isort: on


@dataclass(frozen=True)
class Int8Layer:
    """One decoder layer as this backend runs it. Smoothing (SmoothQuant) is folded in where it is exact: the
    norms' weights divide qkv's and gate_up's inputs, the up projection divides down's, and the matmuls' rows
    carry the factors; only o_proj's input (attention output, mixed across heads) is divided as it is quantized."""

    input_norm: np.ndarray  # float32 [hidden]
    qkv: PackedLinear
    o_proj: PackedLinear
    o_proj_multiplier: np.ndarray | None  # 1 / o_proj's smoothing, applied as its input is quantized
    post_norm: np.ndarray
    gate_up: PackedLinear  # gate | up
    down: PackedLinear
    s_down: np.ndarray  # down's smoothing factors, which up's columns are divided by (LoRA needs the real up)
    window: int | None  # sliding window in tokens; None = full attention


def _activation_ranges(config: EngineConfig) -> dict[str, np.ndarray] | None:
    """max |input| per channel of each MatMul, measured by the build (None: an engine built without them runs
    unsmoothed)."""
    path = config.engine_dir / ACTIVATION_RANGES_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path) as ranges:
            return {name: ranges[name].astype(np.float32) for name in ranges.files}
    except (OSError, ValueError) as exc:
        raise EngineLoadError(f"{path} could not be read ({exc}); rebuild the engine") from None


def _smoothing(ranges: dict[str, np.ndarray] | None, name: str, weight: np.ndarray) -> np.ndarray:
    """The SmoothQuant factors s [in] of a weight [in, out] (ones without measured ranges): its rows are
    multiplied by s, its input divided by it."""
    if ranges is None or name not in ranges:
        return np.ones(weight.shape[0], np.float32)
    return smoothing(ranges[name], weight)


def _layer(reader: WeightReader, ranges: dict[str, np.ndarray] | None, i: int) -> Int8Layer:
    spec = reader.config.model
    name = f"layer{i}."
    qkv, o_proj, gate_up, down = (reader.array(name + m) for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    s_qkv, s_o, s_gate_up, s_down = (
        _smoothing(ranges, name + m, w)
        for m, w in (("qkv_proj", qkv), ("o_proj", o_proj), ("gate_up_proj", gate_up), ("down_proj", down))
    )
    gate_up = gate_up * s_gate_up[:, None]
    half = gate_up.shape[1] // 2
    gate_up[:, half:] /= s_down  # up's columns: down's input is silu(gate) * up
    bias = reader.array(name + "qkv_proj.bias") if spec.qkv_bias else None
    return Int8Layer(
        input_norm=(reader.array(name + "input_norm.weight") / s_qkv).astype(np.float32),
        qkv=PackedLinear.pack(qkv * s_qkv[:, None], bias),
        o_proj=PackedLinear.pack(o_proj * s_o[:, None]),
        o_proj_multiplier=None if ranges is None else (1 / s_o).astype(np.float32),
        post_norm=(reader.array(name + "post_norm.weight") / s_gate_up).astype(np.float32),
        gate_up=PackedLinear.pack(gate_up),
        down=PackedLinear.pack(down * s_down[:, None]),
        s_down=s_down,
        window=spec.sliding_windows[i],
    )


class Int8CpuBackend(FlatStepBackend):
    name = "cpu-int8"
    lora_targets = TARGETS
    lora_half = True  # its own arithmetic is quantized: float16 adapters halve their bytes within its tolerance

    def __init__(self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None) -> None:
        if config.dtype != "float32" or config.quantization is not None:
            raise EngineLoadError(
                "the cpu-int8 backend quantizes a float32 engine's weights itself (got "
                f"{config.quantization or config.dtype}): use --backend cpu"
            )
        if not simd_isa():
            logging.getLogger(__name__).warning(
                "the kernel module was built without AVX512-VNNI or AVX2: cpu-int8 runs its portable loops (correct, "
                "slow)"
            )
        spec = config.model
        self.config = config
        self.threads = threads or usable_cpus()
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        self.shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, config.block_size)
        reader = WeightReader(config)
        ranges = _activation_ranges(config)
        self.layers = [_layer(reader, ranges, i) for i in range(spec.num_layers)]
        self.embed = reader.array("embed_tokens")
        head = (self.embed if (untied := reader.untied_lm_head()) is None else untied).T  # [hidden, vocab]
        s_head = _smoothing(ranges, "lm_head", head)  # into the final norm, not the embedding a tied head shares
        self.lm_head = PackedLinear.pack(head * s_head[:, None])
        self.final_norm = (reader.array("final_norm.weight") / s_head).astype(np.float32)
        # RoPE as x * [cos, cos] + [x2, x1] * [-sin, sin] over x = [x1, x2] (the kernel's rotate-half tables)
        cos, sin = reader.array("rope_cos"), reader.array("rope_sin")
        self.cos = np.ascontiguousarray(np.concatenate([cos, cos], axis=1), np.float32)
        self.sin = np.ascontiguousarray(np.concatenate([-sin, sin], axis=1), np.float32)
        first = self.layers[0]
        reader.check_shapes(
            {
                "embed_tokens": self.embed.shape,
                "lm_head": (self.lm_head.out_features, self.lm_head.in_features),
                "rope_cos": cos.shape,
                "layer0.qkv_proj": (first.qkv.in_features, first.qkv.out_features),
                "layer0.gate_up_proj": (first.gate_up.in_features, first.gate_up.out_features),
            }
        )
        self.kv = KVPool.allocate(config, self.num_blocks)
        self.pool = self.kv.data

    def enable_lora(self, num_slots: int, max_rank: int) -> LoraSlots:
        self._lora_norms = NormWeights.read(self.config)  # the layers' norms are smoothed: not the adapters' inputs
        return super().enable_lora(num_slots, max_rank)

    def _run(self, flat: FlatStep, logit_rows: np.ndarray) -> np.ndarray:
        spec, threads = self.config.model, self.threads
        eps, positions = spec.rms_norm_eps, flat.positions[:, 0]
        hidden = self.embed[flat.input_ids[:, 0]]  # [T, hidden] float32: the residual stream, updated in place
        lora = StepLora(self.lora, self._lora_norms, flat.loras) if flat.loras and self.lora is not None else None
        for index, layer in enumerate(self.layers):
            x = rms_norm_quantize(hidden, layer.input_norm, eps, layer.qkv.padded_in)
            qkv = linear(x, layer.qkv, threads=threads)
            if lora is not None:
                lora.add_qkv(qkv, hidden, index)
            q, k, v = rope_split(qkv, spec.num_heads, spec.num_kv_heads, self.cos, self.sin, positions)
            self.kv.write(index, flat.slots, k, v)
            attn = paged_attention(
                q,
                self.pool[index, 0],
                self.pool[index, 1],
                flat.block_tables,
                flat.seq_of_token,
                positions,
                self.shape,
                window=layer.window,
                threads=threads,
                quant=self.kv.quant(index),
            )
            o_in = quantize_rows(attn, layer.o_proj.padded_in, layer.o_proj_multiplier)
            linear(o_in, layer.o_proj, hidden, accumulate=True, threads=threads)
            if lora is not None:
                lora.add_o_proj(hidden, attn, index)
            gate_up = linear(
                rms_norm_quantize(hidden, layer.post_norm, eps, layer.gate_up.padded_in), layer.gate_up, threads=threads
            )
            if lora is not None:
                lora.add_gate_up(gate_up, hidden, index, layer.s_down)
            linear(
                silu_mul_quantize(gate_up, layer.down.padded_in), layer.down, hidden, accumulate=True, threads=threads
            )
            if lora is not None:
                lora.add_down(hidden, gate_up, index, layer.s_down)
        last = np.ascontiguousarray(hidden[logit_rows])
        return linear(
            rms_norm_quantize(last, self.final_norm, eps, self.lm_head.padded_in), self.lm_head, threads=threads
        )
