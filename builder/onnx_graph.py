"""A thin helper for writing ONNX graphs by hand with `onnx.helper`.

The exporter builds the decoder graph node by node (rather than tracing PyTorch) so that
the paged-KV interface, node names and op choices are exactly what the runtime and the
TensorRT plugin rewrite expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 23
# onnx 1.23 defaults to IR 14, which onnxruntime 1.31 rejects; IR 10 carries opset 23.
IR_VERSION = 10


@dataclass
class GraphBuilder:
    """Accumulates nodes, initializers and graph I/O; `op()` returns the output name."""

    name: str = "graph"
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    weight_names: set[str] = field(default_factory=set)
    _counter: int = 0

    def _fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def input(self, name: str, elem_type: int, shape: list[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, name: str, array: np.ndarray) -> str:
        self.weight_names.add(name)
        array = np.asarray(array)  # keeps 0-d scalars 0-d (np.ascontiguousarray would make them [1])
        self.initializers.append(numpy_helper.from_array(array if array.flags.c_contiguous else array.copy(), name))
        return name

    def const(self, value: list[int] | int, dtype: type = np.int64) -> str:
        name = self._fresh("const")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, name: str | None = None, out: str | None = None, **attrs) -> str:
        """Add one single-output node; returns its output name."""
        node_name = name or self._fresh(op_type)
        output = out or f"{node_name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=node_name, **attrs))
        return output

    def op_multi(self, op_type: str, *inputs: str, num_outputs: int, name: str | None = None, **attrs):
        node_name = name or self._fresh(op_type)
        outputs = [f"{node_name}_out{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=node_name, **attrs))
        return outputs

    def to_model(self, producer: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=producer)
        model.ir_version = IR_VERSION
        return model
