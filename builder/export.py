"""Export a Llama-family decoder to ONNX graphs with a paged-KV interface.

Two artifacts, written node by node from the checkpoint's weights (see INTERFACE.md):
- `model.onnx`: the whole decoder as one graph over a padded [batch, step] batch, attention
  through Gather(pool, block_tables) + native `Attention`. Portable (ONNX Runtime, the
  TensorRT parser) and the reference the plugin rewrite starts from.
- `segment.NN.onnx` (float32 engines): the same decoder cut at attention, over a flat
  ragged token batch, for the CPU backend, which runs its own paged-attention kernel
  between segments. Segments reference the weights in `model.onnx.data` (no second copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto

from builder.kv_graph import PagedKV
from builder.onnx_graph import GraphBuilder
from engine_format import ModelSpec
from engine_format.files import GRAPH_FILE, WEIGHTS_FILE, segment_file

if TYPE_CHECKING:
    from calibration.quantize import QuantizedLinear

DTYPES = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
    "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
}


@dataclass(frozen=True)
class ExportOptions:
    block_size: int
    max_seq_len: int
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # engine_format/kv_cache.py; int8/fp8 pools are read and written in the graph


def export_onnx(
    model, spec: ModelSpec, options: ExportOptions, out_dir: Path, quantized: dict[str, QuantizedLinear] | None = None
) -> list[str]:
    """Write model.onnx + weights, and the CPU segments for float32; returns the graph files.
    `quantized`: calibrated weights per MatMul name (calibration.quantize), emitted as Q/DQ."""
    parts = _DecoderParts(model, spec, options, quantized or {})
    path = out_dir / GRAPH_FILE
    onnx.save_model(
        parts.paged_graph(), path, save_as_external_data=True, all_tensors_to_one_file=True,
        location=WEIGHTS_FILE, size_threshold=1024,
    )  # fmt: skip
    onnx.checker.check_model(str(path))  # path form: checks the external-data graph too
    files = [path.name]
    if options.dtype == "float32":
        saved = {t.name: t for t in onnx.load(path, load_external_data=False).graph.initializer}
        for index in range(spec.num_layers + 1):
            segment = parts.segment(index, saved)
            onnx.save_model(segment, out_dir / segment_file(index))
            files.append(segment_file(index))
    return files


def rope_tables(model, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_seq_len, head_dim/2] computed exactly as the HF rotary module does."""
    import torch

    rotary = model.model.rotary_emb
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
    scale = float(rotary.attention_scaling)
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


class _DecoderParts:
    """The decoder's building blocks, emitted into whichever graph is being built."""

    def __init__(self, model, spec: ModelSpec, options: ExportOptions, quantized: dict[str, QuantizedLinear]):
        self.spec, self.options, self.quantized = spec, options, quantized
        self.np_dtype, self.onnx_dtype = DTYPES[options.dtype]
        self.weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        self.cos, self.sin = rope_tables(model, options.max_seq_len)
        self.g = GraphBuilder()
        self._saved: dict[str, TensorProto] = {}

    def w(self, name: str, make: Callable[[], np.ndarray], cast: bool = True) -> str:
        """Register a weight once per graph: from `make()` (cast to the engine dtype unless
        `cast` is False), or as a reference to the tensor already saved in model.onnx.data
        when building segments."""
        if name in self.g.weight_names:
            return name
        if name in self._saved:
            self.g.initializers.append(self._saved[name])
            self.g.weight_names.add(name)
            return name
        array = make()
        return self.g.weight(name, array.astype(self.np_dtype) if cast else array)

    # ---- shared pieces -----------------------------------------------------------------------

    def embed(self, input_ids: str) -> str:
        table = self.w("embed_tokens", lambda: self.weights["model.embed_tokens.weight"])
        return self.g.op("Gather", table, input_ids, name="embed")

    def rms_norm(self, x: str, weight_key: str, name: str) -> str:
        scale = self.w(name + ".weight", lambda: self.weights[weight_key])
        return self.g.op("RMSNormalization", x, scale, axis=-1, epsilon=self.spec.rms_norm_eps, name=name)

    def linear(self, x: str, name: str, keys: list[str], bias: bool = False) -> str:
        """x @ concat(weights).T (+ bias): HF [out, in] matrices fused into one MatMul."""
        if name in self.quantized:
            x, weight = self.dequantized_operands(x, name, self.quantized[name])
        else:
            weight = self.w(name, lambda: np.concatenate([self.weights[k + ".weight"] for k in keys], axis=0).T)
        y = self.g.op("MatMul", x, weight, name=name)
        if bias:
            b = self.w(name + ".bias", lambda: np.concatenate([self.weights[k + ".bias"] for k in keys]))
            y = self.g.op("Add", y, b)
        return y

    def dequantized_operands(self, x: str, name: str, q: QuantizedLinear) -> tuple[str, str]:
        """Q/DQ in the form a TensorRT strongly typed build consumes: INT4 weight-only
        (block-quantized DequantizeLinear, zero point 0) or FP8 E4M3 weights per output
        channel plus a per-tensor FP8 Quantize/Dequantize pair on the activation."""
        g, scale = self.g, self.w(name + ".scale", lambda: q.scale)
        weight = self.w(name + ".qweight", lambda: q.weight, cast=False)
        if q.block_size is not None:
            return x, g.op("DequantizeLinear", weight, scale, axis=0, block_size=q.block_size, name=name + ".dq_weight")
        x_scale = self.w(name + ".input_scale", lambda: np.float32(q.input_scale))
        zero = self.w(name + ".input_zero_point", lambda: np.zeros((), ml_dtypes.float8_e4m3fn), cast=False)
        x = g.op("QuantizeLinear", x, x_scale, zero, name=name + ".q_input")
        x = g.op("DequantizeLinear", x, x_scale, zero, name=name + ".dq_input")
        return x, g.op("DequantizeLinear", weight, scale, axis=1, name=name + ".dq_weight")

    def pre_attention(self, i: int, hidden: str, positions: str) -> tuple[str, str, str]:
        """RMSNorm -> fused QKV -> RoPE on Q and K. Tensors are [batch, seq, ...]."""
        g, spec = self.g, self.spec
        x = self.rms_norm(hidden, f"model.layers.{i}.input_layernorm.weight", f"layer{i}.input_norm")
        proj = [f"model.layers.{i}.self_attn.{n}_proj" for n in "qkv"]
        qkv = self.linear(x, f"layer{i}.qkv_proj", proj, bias=spec.qkv_bias)
        q_dim, kv = spec.num_heads * spec.head_dim, spec.kv_width
        q, k, v = g.op_multi("Split", qkv, g.const([q_dim, kv, kv]), axis=-1, num_outputs=3)
        cos = self.w("rope_cos", lambda: self.cos)
        sin = self.w("rope_sin", lambda: self.sin)
        q = g.op("RotaryEmbedding", q, cos, sin, positions, num_heads=spec.num_heads, name=f"layer{i}.rope_q")
        k = g.op("RotaryEmbedding", k, cos, sin, positions, num_heads=spec.num_kv_heads, name=f"layer{i}.rope_k")
        return q, k, v

    def post_attention(self, i: int, hidden: str, ctx: str) -> str:
        """o_proj + residual, then RMSNorm -> SwiGLU MLP + residual."""
        g, p = self.g, f"model.layers.{i}."
        hidden = g.op("Add", hidden, self.linear(ctx, f"layer{i}.o_proj", [p + "self_attn.o_proj"]))
        x = self.rms_norm(hidden, p + "post_attention_layernorm.weight", f"layer{i}.post_norm")
        inter = self.spec.intermediate_size
        gate_up = self.linear(x, f"layer{i}.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"])
        gate, up = g.op_multi("Split", gate_up, g.const([inter, inter]), axis=-1, num_outputs=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up, name=f"layer{i}.swiglu")
        return g.op("Add", hidden, self.linear(act, f"layer{i}.down_proj", [p + "mlp.down_proj"]))

    def logits(self, rows: str) -> str:
        """Final norm + lm_head (sharing the embedding when tied) on [rows, hidden]."""
        g = self.g
        final = self.rms_norm(rows, "model.norm.weight", "final_norm")
        if "lm_head" in self.quantized:  # --quantize-lm-head: INT4 Q/DQ [hidden, vocab], like the layers'
            logits = self.linear(final, "lm_head", [])
        else:
            if self.spec.tie_word_embeddings:
                head = self.w("embed_tokens", lambda: self.weights["model.embed_tokens.weight"])
            else:
                head = self.w("lm_head", lambda: self.weights["lm_head.weight"])
            logits = g.op("Gemm", final, head, transB=1, name="lm_head")
        if self.options.dtype != "float32":
            logits = g.op("Cast", logits, to=TensorProto.FLOAT)
        return g.op("Identity", logits, name="logits", out="logits")

    # ---- the whole decoder, padded batch -------------------------------------------------

    def paged_graph(self) -> onnx.ModelProto:
        self.g, self._saved = GraphBuilder(f"trtserve_{self.spec.model_type}_paged"), {}
        g, spec = self.g, self.spec
        input_ids = g.input("input_ids", TensorProto.INT64, ["batch", "step"])
        positions = g.input("positions", TensorProto.INT64, ["batch", "step"])
        seq_lens = g.input("seq_lens", TensorProto.INT64, ["batch"])
        past_lens = g.input("past_lens", TensorProto.INT64, ["batch"])
        block_tables = g.input("block_tables", TensorProto.INT64, ["batch", "table_blocks"])
        logit_rows = g.input("logit_rows", TensorProto.INT64, ["rows"])
        paged_kv = PagedKV(g, spec, self.options.block_size, self.onnx_dtype, self.options.kv_cache_dtype)
        paged_kv.add_inputs()
        masks = {
            window: self.attention_mask(positions, seq_lens, past_lens, block_tables, window)
            for window in set(spec.sliding_windows)
        }
        hidden = self.embed(input_ids)
        for i in range(spec.num_layers):
            q, k, v = self.pre_attention(i, hidden, positions)
            keys, values = paged_kv.attention_inputs(i, k, v, block_tables)
            ctx = g.op(
                "Attention", q, keys, values, masks[spec.sliding_windows[i]],
                q_num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads,
                scale=float(spec.head_dim) ** -0.5, name=f"layer{i}.attention",
            )  # fmt: skip
            hidden = self.post_attention(i, hidden, ctx)
        paged_kv.add_outputs()
        self.logits(self.picked_rows(hidden, logit_rows))
        g.output("logits", TensorProto.FLOAT, ["rows", spec.vocab_size])
        return g.to_model(producer="trtserve.builder")

    def attention_mask(self, positions, seq_lens, past_lens, block_tables, window) -> str:
        """Bool [batch, 1, step, table_blocks*block_size + step]: True where a query may attend.

        Keys are the cached rows (the block table laid end to end, positions 0..) followed by
        this step's rows (positions given). A key is visible if it is valid (cached row below
        past_len, or a real new row below seq_len), not in the future, and inside the window.
        """
        g, bs = self.g, self.options.block_size
        shape = g.op("Shape", block_tables)
        batch = g.op("Gather", shape, g.const(0))
        cached_len = g.op("Mul", g.op("Gather", shape, g.const(1)), g.const(bs))
        step = g.op("Gather", g.op("Shape", positions), g.const(1))
        cached_pos = g.op("Range", g.const(0), cached_len, g.const(1))  # [C]
        unsq = lambda x, axis: g.op("Unsqueeze", x, g.const([axis]))  # noqa: E731
        cached_valid = g.op("Less", unsq(cached_pos, 0), unsq(past_lens, 1))
        new_valid = g.op("Less", unsq(g.op("Range", g.const(0), step, g.const(1)), 0), unsq(seq_lens, 1))
        expand_to = g.op("Concat", unsq(batch, 0), unsq(cached_len, 0), axis=0)
        key_pos = g.op("Concat", g.op("Expand", unsq(cached_pos, 0), expand_to), positions, axis=1)  # [B, L]
        key_valid = g.op("Concat", cached_valid, new_valid, axis=1)  # [B, L]
        query_pos, key_pos_b = unsq(positions, 2), unsq(key_pos, 1)  # [B, S, 1], [B, 1, L]
        mask = g.op("And", g.op("LessOrEqual", key_pos_b, query_pos), unsq(key_valid, 1))
        if window is not None:
            mask = g.op("And", mask, g.op("Greater", key_pos_b, g.op("Sub", query_pos, g.const(window))))
        return g.op("Unsqueeze", mask, g.const([1]), name=f"attn_mask_w{window or 0}")

    def picked_rows(self, hidden: str, logit_rows: str) -> str:
        """hidden [B, S, H] -> [rows, H]: the flat rows b*S + i the runtime asks logits for (each
        sequence's last token; with speculative decoding also the draft positions it verifies),
        so the final norm and lm_head run on those rows only."""
        flat = self.g.op("Reshape", hidden, self.g.const([-1, self.spec.hidden_size]))
        return self.g.op("Gather", flat, logit_rows, axis=0, name="logit_rows_gather")

    # ---- CPU segments, flat token batch ----------------------------------------------------

    def segment(self, index: int, saved: dict[str, TensorProto]) -> onnx.ModelProto:
        """Segment `index` of num_layers+1, over tokens laid out as [tokens, 1, ...] (each token
        its own batch row, so no op sees a sequence longer than one; ORT's RotaryEmbedding
        refuses sequences longer than its cos/sin tables, and a step may hold more tokens):
        0: embed + pre-attention(0); i: post-attention(i-1) + pre-attention(i);
        last: post-attention(L-1) on the sampled rows only, final norm, lm_head."""
        self.g, self._saved = GraphBuilder(f"trtserve_segment_{index:02d}"), saved
        g, spec, f32 = self.g, self.spec, TensorProto.FLOAT
        hidden_shape, q_shape = ["tokens", 1, spec.hidden_size], ["tokens", 1, spec.num_heads * spec.head_dim]
        if index == 0:
            hidden = self.embed(g.input("input_ids", TensorProto.INT64, ["tokens", 1]))
        else:
            hidden = g.input("hidden", f32, hidden_shape)
            attn = g.input("attn", f32, q_shape)
        if index == spec.num_layers:  # only the sampled rows need the last MLP and lm_head
            rows = g.input("logit_rows", TensorProto.INT64, ["rows"])
            pick = lambda x: g.op("Gather", g.op("Squeeze", x, g.const([1])), rows, axis=0)  # noqa: E731
            self.logits(self.post_attention(index - 1, pick(hidden), pick(attn)))
            g.output("logits", f32, ["rows", spec.vocab_size])
            return g.to_model(producer="trtserve.builder")
        if index > 0:
            hidden = self.post_attention(index - 1, hidden, attn)
        positions = g.input("positions", TensorProto.INT64, ["tokens", 1])
        q, k, v = self.pre_attention(index, hidden, positions)
        for name, value, shape in (
            ("hidden_out", hidden, hidden_shape), ("q", q, q_shape),
            ("k", k, ["tokens", 1, spec.kv_width]), ("v", v, ["tokens", 1, spec.kv_width]),
        ):  # fmt: skip
            g.op("Identity", value, out=name)
            g.output(name, f32, shape)
        return g.to_model(producer="trtserve.builder")
