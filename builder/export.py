"""Export a Llama-family decoder to an ONNX graph with a paged-KV interface.

The graph is written node by node from the checkpoint's weights (see INTERFACE.md for the
contract). Ops are ONNX opset-23 natives that both ONNX Runtime and TensorRT (10.15+)
accept: RMSNormalization, RotaryEmbedding, Attention, MatMul, Gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from builder.model_spec import ModelSpec
from builder.onnx_graph import GraphBuilder

WEIGHTS_FILE = "model.onnx.data"
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}


@dataclass(frozen=True)
class ExportOptions:
    block_size: int
    max_seq_len: int
    dtype: str = "float32"


def export_onnx(model, spec: ModelSpec, options: ExportOptions, out_dir: Path) -> Path:
    """Write out_dir/model.onnx (+ external weights file); returns the model path."""
    graph = _DecoderGraph(model, spec, options).build()
    path = out_dir / "model.onnx"
    onnx.save_model(
        graph,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEIGHTS_FILE,
        size_threshold=1024,
    )
    onnx.checker.check_model(str(path))  # path form: checks the external-data graph too
    return path


def rope_tables(model, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_seq_len, head_dim/2] computed exactly as the HF rotary module does."""
    import torch

    rotary = model.model.rotary_emb
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
    scale = float(rotary.attention_scaling)
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


class _DecoderGraph:
    def __init__(self, model, spec: ModelSpec, options: ExportOptions):
        self.spec, self.options = spec, options
        self.np_dtype, self.onnx_dtype = DTYPES[options.dtype]
        self.weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        self.cos, self.sin = rope_tables(model, options.max_seq_len)
        self.g = GraphBuilder(name=f"trtserve_{spec.model_type}_paged")

    def w(self, name: str, array: np.ndarray) -> str:
        return self.g.weight(name, array.astype(self.np_dtype))

    def build(self) -> onnx.ModelProto:
        g, spec = self.g, self.spec
        kv = spec.kv_width
        input_ids = g.input("input_ids", TensorProto.INT64, ["batch", "step"])
        positions = g.input("positions", TensorProto.INT64, ["batch", "step"])
        seq_lens = g.input("seq_lens", TensorProto.INT64, ["batch"])
        past_lens = g.input("past_lens", TensorProto.INT64, ["batch"])
        block_tables = g.input("block_tables", TensorProto.INT64, ["batch", "table_blocks"])
        pool_shape = ["num_blocks", self.options.block_size, kv]
        caches = [
            (
                g.input(f"key_cache.{i}", self.onnx_dtype, pool_shape),
                g.input(f"value_cache.{i}", self.onnx_dtype, pool_shape),
            )
            for i in range(spec.num_layers)
        ]

        masks = {
            window: self.attention_mask(positions, seq_lens, past_lens, block_tables, window)
            for window in set(spec.sliding_windows)
        }
        self.rope = (self.w("rope_cos", self.cos), self.w("rope_sin", self.sin))
        embed = self.w("embed_tokens", self.weights["model.embed_tokens.weight"])
        hidden = g.op("Gather", embed, input_ids, name="embed")
        new_kv: list[str] = []
        for i, (key_cache, value_cache) in enumerate(caches):
            hidden, k, v = self.layer(
                i,
                hidden,
                positions,
                block_tables,
                key_cache,
                value_cache,
                masks[spec.sliding_windows[i]],
            )
            new_kv += [g.op("Unsqueeze", k, g.const([0])), g.op("Unsqueeze", v, g.const([0]))]
        g.op("Concat", *new_kv, axis=0, name="new_kv", out="new_kv")
        g.output("new_kv", self.onnx_dtype, [2 * spec.num_layers, "batch", "step", kv])

        last = self.last_token_rows(hidden, seq_lens)
        final = self.rms_norm(last, "model.norm.weight", "final_norm")
        lm_head = embed if spec.tie_word_embeddings else self.w("lm_head", self.weights["lm_head.weight"])
        logits = g.op("Gemm", final, lm_head, transB=1, name="lm_head")
        if self.options.dtype != "float32":
            logits = g.op("Cast", logits, to=TensorProto.FLOAT)
        g.op("Identity", logits, name="logits", out="logits")
        g.output("logits", TensorProto.FLOAT, ["batch", spec.vocab_size])
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
        cached_valid = g.op(
            "Less", g.op("Unsqueeze", cached_pos, g.const([0])), g.op("Unsqueeze", past_lens, g.const([1]))
        )
        step_idx = g.op("Range", g.const(0), step, g.const(1))
        new_valid = g.op(
            "Less", g.op("Unsqueeze", step_idx, g.const([0])), g.op("Unsqueeze", seq_lens, g.const([1]))
        )
        batch_cached = g.op(
            "Expand",
            g.op("Unsqueeze", cached_pos, g.const([0])),
            g.op(
                "Concat",
                g.op("Unsqueeze", batch, g.const([0])),
                g.op("Unsqueeze", cached_len, g.const([0])),
                axis=0,
            ),
        )
        key_pos = g.op("Concat", batch_cached, positions, axis=1)  # [B, L]
        key_valid = g.op("Concat", cached_valid, new_valid, axis=1)  # [B, L]
        query_pos = g.op("Unsqueeze", positions, g.const([2]))  # [B, S, 1]
        key_pos_b = g.op("Unsqueeze", key_pos, g.const([1]))  # [B, 1, L]
        mask = g.op(
            "And", g.op("LessOrEqual", key_pos_b, query_pos), g.op("Unsqueeze", key_valid, g.const([1]))
        )
        if window is not None:
            mask = g.op("And", mask, g.op("Greater", key_pos_b, g.op("Sub", query_pos, g.const(window))))
        return g.op("Unsqueeze", mask, g.const([1]), name=f"attn_mask_w{window or 0}")

    def rms_norm(self, x: str, weight_key: str, name: str) -> str:
        scale = self.w(name + ".weight", self.weights[weight_key])
        return self.g.op("RMSNormalization", x, scale, axis=-1, epsilon=self.spec.rms_norm_eps, name=name)

    def linear(self, x: str, name: str, keys: list[str], bias: bool = False) -> str:
        """x @ concat(weights).T (+ bias): HF [out, in] matrices fused into one MatMul."""
        weight = np.concatenate([self.weights[k + ".weight"] for k in keys], axis=0).T
        y = self.g.op("MatMul", x, self.w(name, weight), name=name)
        if bias:
            y = self.g.op(
                "Add", y, self.w(name + ".bias", np.concatenate([self.weights[k + ".bias"] for k in keys]))
            )
        return y

    def layer(self, i, hidden, positions, block_tables, key_cache, value_cache, mask):
        """One decoder layer; returns (hidden, this step's K, this step's V)."""
        p = f"model.layers.{i}."
        x = self.rms_norm(hidden, p + "input_layernorm.weight", f"layer{i}.input_norm")
        ctx, k, v = self.attention(i, x, positions, block_tables, key_cache, value_cache, mask)
        hidden = self.g.op("Add", hidden, self.linear(ctx, f"layer{i}.o_proj", [p + "self_attn.o_proj"]))
        x = self.rms_norm(hidden, p + "post_attention_layernorm.weight", f"layer{i}.post_norm")
        return self.g.op("Add", hidden, self.mlp(i, x)), k, v

    def attention(self, i, x, positions, block_tables, key_cache, value_cache, mask):
        g, spec = self.g, self.spec
        proj = [f"model.layers.{i}.self_attn.{n}_proj" for n in "qkv"]
        qkv = self.linear(x, f"layer{i}.qkv_proj", proj, bias=spec.qkv_bias)
        q_dim, kv = spec.num_heads * spec.head_dim, spec.kv_width
        q, k, v = g.op_multi("Split", qkv, g.const([q_dim, kv, kv]), axis=-1, num_outputs=3)
        cos, sin = self.rope
        q = g.op("RotaryEmbedding", q, cos, sin, positions, num_heads=spec.num_heads, name=f"layer{i}.rope_q")
        k = g.op(
            "RotaryEmbedding", k, cos, sin, positions, num_heads=spec.num_kv_heads, name=f"layer{i}.rope_k"
        )
        keys = g.op("Concat", self.gather_cached(key_cache, block_tables, f"layer{i}.k"), k, axis=1)
        values = g.op("Concat", self.gather_cached(value_cache, block_tables, f"layer{i}.v"), v, axis=1)
        ctx = g.op(
            "Attention", q, keys, values, mask,
            q_num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads,
            scale=float(spec.head_dim) ** -0.5, name=f"layer{i}.attention",
        )  # fmt: skip
        return ctx, k, v

    def mlp(self, i: int, x: str) -> str:
        g, inter, p = self.g, self.spec.intermediate_size, f"model.layers.{i}.mlp."
        gate_up = self.linear(x, f"layer{i}.gate_up_proj", [p + "gate_proj", p + "up_proj"])
        gate, up = g.op_multi("Split", gate_up, g.const([inter, inter]), axis=-1, num_outputs=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up, name=f"layer{i}.swiglu")
        return self.linear(act, f"layer{i}.down_proj", [p + "down_proj"])

    def gather_cached(self, cache: str, block_tables: str, name: str) -> str:
        """[num_blocks, bs, kv] pool + [B, M] table -> [B, M*bs, kv] cached rows in order."""
        g = self.g
        rows = g.op("Gather", cache, block_tables, axis=0, name=name + "_gather_blocks")
        return g.op("Reshape", rows, g.const([0, -1, self.spec.kv_width]), name=name + "_cached")

    def last_token_rows(self, hidden: str, seq_lens: str) -> str:
        """hidden [B, S, H] -> [B, H] at row seq_len-1 of each sequence (the sampled one)."""
        g = self.g
        shape = g.op("Shape", hidden)
        batch, step = g.op("Gather", shape, g.const(0)), g.op("Gather", shape, g.const(1))
        flat = g.op("Reshape", hidden, g.const([-1, self.spec.hidden_size]))
        starts = g.op("Mul", g.op("Range", g.const(0), batch, g.const(1)), step)
        rows = g.op("Add", starts, g.op("Sub", seq_lens, g.const(1)))
        return g.op("Gather", flat, rows, axis=0, name="last_token_rows")
