"""The KV pool memory shared by the CPU backends.

One C-contiguous allocation [layers, 2 (K, V), num_blocks, block_size, kv_width]: each
layer's K and V are contiguous views, which both ONNX Runtime (bound zero-copy) and the
paged-attention kernel read in place.
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from engine_format import EngineConfig

log = logging.getLogger(__name__)


def allocate_pool(config: EngineConfig, num_blocks: int, dtype: npt.DTypeLike) -> np.ndarray:
    spec = config.model
    pool = np.zeros((spec.num_layers, 2, num_blocks, config.block_size, spec.kv_width), dtype)
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB",
        num_blocks, config.block_size, num_blocks * config.block_size, pool.nbytes / 2**20,
    )  # fmt: skip
    return pool


def pool_rows(pool: np.ndarray) -> np.ndarray:
    """View [2*layers, num_blocks*block_size, kv_width]: row `slot` of each layer's K or V."""
    layers, _, blocks, block_size, width = pool.shape
    return pool.reshape(2 * layers, blocks * block_size, width)
