"""An engine's weights as numpy arrays, read from the engine directory (no hub): what the backends that do
not run the ONNX graphs build their layers from (executors/torch/weights.py for torch, executors/cpu_int8.py).

The exporter (builder/export.py) names every initializer of `model.onnx`; large ones live in
`model.onnx.data` and onnx's external-data loader reads them one tensor at a time (no second
copy of the whole file). Layouts are the graph's: MatMul weights [in, out] with q|k|v and
gate|up fused along `out`, RMSNorm scales [hidden], the embedding and an untied `lm_head`
[vocab, hidden], RoPE tables [max_seq_len, head_dim / 2] (from the HF rotary module, so rope
scaling is already in them). Calibrated engines hold Q/DQ weights (`.qweight`, `.scale`):
they are dequantized here exactly as DequantizeLinear does; FP8 engines also carry the per-tensor
activation scale of their Quantize/Dequantize pair.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import GRAPH_FILE


class WeightReader:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.path = config.engine_dir / GRAPH_FILE
        try:
            graph = onnx.load(str(self.path), load_external_data=False).graph
        except Exception as exc:  # protobuf raises its own types for a damaged file
            raise EngineLoadError(f"{self.path} could not be read ({exc}); rebuild the engine") from None
        self.found = {t.name: t for t in graph.initializer}

    def has(self, name: str) -> bool:
        return name in self.found

    def array(self, name: str) -> np.ndarray:
        tensor = self.found.get(name)
        if tensor is None:
            raise EngineLoadError(f"{self.path.name} has no weight {name!r}: not a trtserve engine of this format")
        try:
            return numpy_helper.to_array(tensor, base_dir=str(self.config.engine_dir))
        except (OSError, ValueError) as exc:  # missing or truncated model.onnx.data
            raise EngineLoadError(f"{self.config.engine_dir}: weight {name!r} could not be read ({exc})") from None

    def linear(self, name: str) -> tuple[np.ndarray, float | None]:
        """A MatMul weight [in, out] (Q/DQ weights dequantized to float32) and, for FP8 engines, the
        activation's per-tensor Q/DQ scale."""
        if name in self.found:
            return self.array(name), None
        q, scale = self.array(name + ".qweight").astype(np.float32), self.array(name + ".scale").astype(np.float32)
        if scale.ndim == 1:  # FP8: scale [out]
            return q * scale[None, :], float(self.array(name + ".input_scale"))
        block = -(-q.shape[0] // scale.shape[0])  # INT4: blocks along `in`, zero point 0
        return q * np.repeat(scale, block, axis=0)[: q.shape[0]], None

    def untied_lm_head(self) -> np.ndarray | None:
        """[vocab, hidden]: an INT4 head (--quantize-lm-head) dequantized, or an untied head; None when the
        head is the embedding itself."""
        if "lm_head.qweight" in self.found:
            return self.linear("lm_head")[0].T.copy()
        return None if self.config.model.tie_word_embeddings else self.array("lm_head")

    def check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The manifest's model against the shapes of the weights as loaded (a mismatched or hand-edited engine):
        `shapes` names embed_tokens, lm_head, rope_cos, layer0.qkv_proj and layer0.gate_up_proj."""
        spec = self.config.model
        width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        expected = {
            "embed_tokens": (spec.vocab_size, spec.hidden_size),
            "lm_head": (spec.vocab_size, spec.hidden_size),
            "layer0.qkv_proj": (spec.hidden_size, width),
            "layer0.gate_up_proj": (spec.hidden_size, 2 * spec.intermediate_size),
        }
        for name, want in expected.items():
            if tuple(shapes[name]) != want:
                raise EngineLoadError(
                    f"{self.path.name}: {name} is {tuple(shapes[name])}, the manifest's model needs {want}; rebuild"
                )
        cos = shapes["rope_cos"]
        if cos[1:] != (spec.head_dim // 2,) or cos[0] < self.config.max_seq_len:
            raise EngineLoadError(
                f"{self.path.name}: RoPE tables {tuple(cos)} do not cover max_seq_len x head_dim / 2; rebuild"
            )
