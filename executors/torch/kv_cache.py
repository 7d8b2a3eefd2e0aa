"""The torch backend's paged KV pool in the engine's KV dtype, and the kernels that write and read it.

A float pool: plugins_cuda/kv_write.py writes rows as they are, attention_launch.launch_ragged reads
them. An int8 or fp8 pool (engines built with --kv-cache-dtype int8|fp8; formats: engine_format/
kv_cache.py): plugins_cuda/kv_write_quant.py quantizes each row as it is written (the bytes the CPU
backends write, executors/kv_quant.py) and paged_attention_quant.launch_ragged_quant dequantizes the
K/V tiles in registers as it reads them, so the torch backend runs the engines the CPU backend runs.

Layout: [layers, 2 (K, V), num_blocks + 1, block_size, kv_width]; the extra block is the CUDA graphs'
scratch (graphs.py), never handed out. int8 keeps a row scale per (slot, kv head), float32 [layers, 2,
num_blocks + 1, block_size, kv_heads]; fp8 reads the manifest's static per-layer scales [layers, 2].
Both kernels take the padded [batch, step] layout; a step's tokens go as one-token rows, each with a
one-entry block table (its slot's block) and its row in that block as its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_format import EngineConfig
from executors.torch.kernels import Kernels

POOL_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}  # fp8: E4M3 (fn) bit patterns, as the kernels code them


@dataclass(frozen=True)
class TorchKVPool:
    data: torch.Tensor  # [layers, 2, num_blocks + 1, block_size, kv_width]
    kind: str  # the engine's kv_cache_dtype: "auto" (the compute dtype), "int8" or "fp8"
    scales: torch.Tensor | None  # int8: row scales; fp8: kv_scales [layers, 2]; None: a float pool
    kernels: Kernels

    @classmethod
    def allocate(cls, config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels) -> TorchKVPool:  # fmt: skip
        """`dtype`: the compute dtype, a float pool's."""
        spec, kind = config.model, config.kv_cache_dtype
        shape = (spec.num_layers, 2, num_blocks + 1, config.block_size, spec.kv_width)
        data = torch.zeros(shape, dtype=POOL_DTYPES.get(kind, dtype), device=device)
        scales = None
        if kind == "int8":
            scales = torch.ones((*shape[:-1], spec.num_kv_heads), dtype=torch.float32, device=device)
        elif kind == "fp8":
            assert config.kv_scales is not None  # EngineConfig.load requires them for fp8
            scales = torch.tensor(config.kv_scales, dtype=torch.float32, device=device)
        return cls(data, kind, scales, kernels)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv_block: torch.Tensor,
              kv_offset: torch.Tensor) -> None:  # fmt: skip
        """A step's K/V rows [T, kv_width] into layer `layer`, row t at block kv_block[t], row kv_offset[t]."""
        k_cache, v_cache = self.data[layer, 0], self.data[layer, 1]
        rows = (k[:, None], v[:, None], k_cache, v_cache, kv_block[:, None], kv_offset[:, None],
                torch.ones_like(kv_block))  # fmt: skip
        if self.kind == "int8":
            assert self.scales is not None
            self.kernels.kv_write_quant.paged_kv_write_int8(*rows, self.scales[layer, 0], self.scales[layer, 1])
        elif self.kind == "fp8":
            assert self.scales is not None  # the layer's row as layer 0: one compiled kernel serves every layer
            self.kernels.kv_write_quant.paged_kv_write_fp8(*rows, self.scales[layer : layer + 1], 0)
        else:
            self.kernels.kv_write.paged_kv_write(*rows)

    def attend(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
               query_start: torch.Tensor, max_rows: int, num_kv_heads: int, window: int, scale: float,
               sm_count: int) -> torch.Tensor:  # fmt: skip
        """Paged attention of flat ragged queries q [T, Hq*D] over layer `layer` (launch_ragged's contract)."""
        k_cache, v_cache = self.data[layer, 0], self.data[layer, 1]
        common = (q, k_cache, v_cache, block_tables, positions, query_start, max_rows, num_kv_heads)
        if self.kind == "auto":
            return self.kernels.attention.launch_ragged(*common, window=window, scale=scale, sm_count=sm_count)
        assert self.scales is not None
        if self.kind == "int8":
            scales = (self.scales[layer, 0], self.scales[layer, 1])
        else:
            scales = (self.scales[layer, 0:1], self.scales[layer, 1:2])
        return self.kernels.attention_quant.launch_ragged_quant(*common, self.kind, scales, window=window,
                                                                scale=scale, sm_count=sm_count)  # fmt: skip
