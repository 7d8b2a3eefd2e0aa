"""The portable graph's side of the paged KV pool (engine_format/INTERFACE.md): the pool inputs,
each layer's attention keys and values (cached rows gathered from the pool through the block
table, then this step's rows), and the rows the runtime stores (`new_kv`).

With a quantized cache (int8/fp8) the pool inputs hold codes, int8 adds the scale pools and fp8
the per-layer `kv_scales`; this step's rows are quantized in the graph (`new_kv` holds codes and
`new_kv_scales` the int8 scales) and attention reads them back dequantized, exactly as the CPU
backend's kernel reads the rows it has just stored. The plugin rewrite finds a layer's float rows
as the input of the Identity nodes `layer{i}.k_quantize` / `layer{i}.v_quantize`.
"""

from __future__ import annotations

from onnx import TensorProto

from builder.kv_onnx import POOL_ELEM_TYPES, layer_scale, read_rows, write_rows
from builder.onnx_graph import GraphBuilder
from engine_format import ModelSpec


def cache_names(layer: int) -> tuple[str, str]:
    return f"key_cache.{layer}", f"value_cache.{layer}"


def scale_names(layer: int) -> tuple[str, str]:
    """int8: the layer's scale pools [num_blocks, block_size, kv_heads] float32."""
    return f"key_scales.{layer}", f"value_scales.{layer}"


KV_SCALES = "kv_scales"  # fp8: float32 [num_layers, 2], the manifest's kv_cache.scales
NEW_KV_SCALES = "new_kv_scales"


class PagedKV:
    def __init__(self, g: GraphBuilder, spec: ModelSpec, block_size: int, elem_type: int, kind: str) -> None:
        self.g, self.spec, self.kind = g, spec, kind
        self.elem_type = elem_type  # the model dtype's
        self.pool_type = POOL_ELEM_TYPES.get(kind, elem_type)
        self.block_size = block_size
        self.stored: list[str] = []  # new_kv rows, 2 per layer
        self.stored_scales: list[str] = []

    @property
    def quantized(self) -> bool:
        return self.kind in POOL_ELEM_TYPES

    def add_inputs(self) -> None:
        g, spec = self.g, self.spec
        for layer in range(spec.num_layers):
            for name in cache_names(layer):
                g.input(name, self.pool_type, ["num_blocks", self.block_size, spec.kv_width])
            if self.kind == "int8":
                for name in scale_names(layer):
                    g.input(name, TensorProto.FLOAT, ["num_blocks", self.block_size, spec.num_kv_heads])
        if self.kind == "fp8":
            g.input(KV_SCALES, TensorProto.FLOAT, [spec.num_layers, 2])

    def attention_inputs(self, layer: int, k: str, v: str, block_tables: str) -> tuple[str, str]:
        """Keys and values [batch, table_blocks*block_size + step, kv_width] of `layer`'s Attention."""
        g, out = self.g, []
        for side, (short, rows, cache) in enumerate(zip("kv", (k, v), cache_names(layer), strict=True)):
            name = f"layer{layer}.{short}"
            if self.quantized:
                cached, rows = self._quantized(layer, side, name, rows, cache, block_tables)
            else:
                cached = self._gather(cache, block_tables, name)
                self.stored.append(g.op("Unsqueeze", rows, g.const([0])))
            out.append(g.op("Concat", cached, rows, axis=1))
        return out[0], out[1]

    def add_outputs(self) -> None:
        g, spec = self.g, self.spec
        g.op("Concat", *self.stored, axis=0, name="new_kv", out="new_kv")
        g.output("new_kv", self.pool_type, [2 * spec.num_layers, "batch", "step", spec.kv_width])
        if self.stored_scales:
            g.op("Concat", *self.stored_scales, axis=0, name=NEW_KV_SCALES, out=NEW_KV_SCALES)
            g.output(NEW_KV_SCALES, TensorProto.FLOAT, [2 * spec.num_layers, "batch", "step", spec.num_kv_heads])

    def _gather(self, cache: str, block_tables: str, name: str) -> str:
        """[num_blocks, bs, kv] pool + [B, M] table -> [B, M*bs, kv] cached rows in order."""
        rows = self.g.op("Gather", cache, block_tables, axis=0, name=name + "_gather_blocks")
        return self.g.op("Reshape", rows, self.g.const([0, -1, self.spec.kv_width]), name=name + "_cached")

    def _quantized(self, layer: int, side: int, name: str, rows: str, cache: str, block_tables: str) -> tuple[str, str]:
        """(cached rows read back, this step's rows as stored then read back); records what is stored."""
        g, spec = self.g, self.spec
        heads = [spec.num_kv_heads, spec.head_dim]
        scale = layer_scale(g, KV_SCALES, g.const(layer), side) if self.kind == "fp8" else None
        rows = g.op("Identity", rows, name=f"{name}_quantize")  # the plugin rewrite's anchor
        codes, scales = write_rows(g, self.kind, self._float32(rows), g.const([0, 0, *heads]), scale)
        self.stored.append(g.op("Unsqueeze", codes, g.const([0])))
        if scales is not None:
            self.stored_scales.append(g.op("Unsqueeze", scales, g.const([0])))
        step_rows = read_rows(g, self.kind, codes, g.const([0, 0, *heads]), scales, scale)
        blocks = g.op("Gather", cache, block_tables, axis=0, name=name + "_gather_blocks")  # [B, M, bs, kv]
        block_scales = None
        if self.kind == "int8":
            block_scales = g.op("Gather", scale_names(layer)[side], block_tables, axis=0)  # [B, M, bs, H]
        cached = read_rows(g, self.kind, blocks, g.const([0, 0, 0, *heads]), block_scales, scale)
        cached = g.op("Reshape", cached, g.const([0, -1, spec.kv_width]), name=name + "_cached")
        return self._model_dtype(cached), self._model_dtype(step_rows)

    def _float32(self, x: str) -> str:
        return x if self.elem_type == TensorProto.FLOAT else self.g.op("Cast", x, to=TensorProto.FLOAT)

    def _model_dtype(self, x: str) -> str:
        return x if self.elem_type == TensorProto.FLOAT else self.g.op("Cast", x, to=self.elem_type)
