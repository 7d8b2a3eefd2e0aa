"""Static FP8 KV-cache scales: one (k_scale, v_scale) per layer, measured on the calibration text.

The engine runs each calibration sequence with a model-dtype (float32) pool on the CPU backend;
the K/V rows it wrote are then read back from the pool and each layer's absmax of K and of V,
over every sequence, becomes scale = absmax * HEADROOM / 448 (E4M3's largest value). Serving
text may exceed what calibration saw: E4M3's error is relative, so headroom costs precision only
near zero (subnormals), while a value past the scale's range would saturate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from engine_format import EngineConfig, ceil_div
from engine_format.kv_cache import FP8_E4M3_MAX
from executors.base import SequenceChunk

HEADROOM = 1.25


def measure_kv_scales(config: EngineConfig, sequences: Sequence[Sequence[int]]) -> tuple[tuple[float, float], ...]:
    """Per layer (k_scale, v_scale) for an fp8 KV cache of the engine `config` describes."""
    from executors import create_backend

    float_kv = dataclasses.replace(config, kv_cache_dtype="auto", kv_scales=None)
    longest = max(len(s) for s in sequences)
    backend = create_backend(float_kv, num_blocks=ceil_div(longest, config.block_size), kind="cpu")
    pool = backend.pool  # [layers, 2, num_blocks, block_size, kv_width] float32
    absmax = np.zeros(pool.shape[:2], np.float64)
    for tokens in sequences:
        table = list(range(ceil_div(len(tokens), config.block_size)))
        backend.prompt_logits(SequenceChunk(list(tokens), 0, table))
        rows = pool.reshape(*pool.shape[:2], -1, pool.shape[-1])[:, :, : len(tokens)]  # slots 0.. in order
        absmax = np.maximum(absmax, np.abs(rows).max(axis=(2, 3)))
    absmax = np.maximum(absmax, np.finfo(np.float32).tiny)  # a layer of zeros still gets a valid scale
    return tuple((float(k), float(v)) for k, v in absmax * HEADROOM / FP8_E4M3_MAX)
