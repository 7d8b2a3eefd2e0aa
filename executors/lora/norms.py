"""Each layer's RMSNorm weights as the model has them: the adapters' inputs on the CPU backends, whose layers keep
hidden states rather than their normalized (fused, quantized or smoothed) projection inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig
from executors.engine_weights import WeightReader


@dataclass(frozen=True)
class NormWeights:
    """Each layer's RMSNorm weights as the model has them (float32 [hidden]): the adapters' inputs."""

    input_norms: list[np.ndarray]
    post_norms: list[np.ndarray]
    eps: float

    @classmethod
    def read(cls, config: EngineConfig) -> NormWeights:
        reader, layers = WeightReader(config), range(config.model.num_layers)

        def norms(name: str) -> list[np.ndarray]:
            return [reader.array(f"layer{i}.{name}.weight").astype(np.float32) for i in layers]

        return cls(norms("input_norm"), norms("post_norm"), config.model.rms_norm_eps)
