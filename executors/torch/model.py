"""One decoder step over flat ragged tokens: torch matmuls, trtserve's Triton kernels for the rest.

Per step the chunks are laid out as the CPU segments lay them out (engine_format/INTERFACE.md):
every token its own row, a sequence's tokens contiguous, no padding. The host packs everything
the kernels index with into one int64 array (`HostStep`), which reaches the device in one copy.
Per layer, with the kernel count of each part: the previous MLP's residual add and the input RMSNorm (one,
plugins_cuda/decoder_tails.py), the QKV matmul, bias and RoPE (the prologue's GEMM tactic: cuBLAS, then
one kernel, plugins_cuda/prologue_gemm.py; torch ops where head_dim is not a power of two >= 32 or the
activations are FP8), `paged_kv_write` of the new K/V rows into the pool (one), `launch_ragged` paged
attention over the pool in place (split-KV decode path and query-tiled prefill path, per-layer sliding
window; an int8/fp8 pool through the quantized write and attention kernels, kv_cache.py), o_proj, the
residual add and the post-attention RMSNorm (one), the SwiGLU MLP (two matmuls, SiLU * up in one kernel).
The last residual add, the final norm and lm_head run only on the rows the step asks logits for
(`logit_rows`: each sequence's last token, plus the draft positions of a speculative verify chunk).
A step with LoRA chunks (executors/torch/lora.py) adds its adapters' updates to the outputs of the QKV (before
RoPE: the unfused prologue), o_proj, gate|up and down matmuls, with the SGMV kernels (plugins_cuda/lora.py).

`Decoder.forward` never reads device memory on the host (no sync), so a decode step can be
captured in a CUDA graph (graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine_format import EngineConfig
from executors.base import SequenceChunk, logit_rows
from executors.block_table_rows import BlockTableRows
from executors.device_sampling import ChunkArrays
from executors.torch.kernels import Kernels
from executors.torch.kv_cache import TorchKVPool
from executors.torch.lora import LoraStep
from executors.torch.weights import Layer, Weights

PROLOGUE_MIN_HEAD_DIM = 32  # the RoPE kernel's heads: a power of two (tl.arange over half a head), as fused_qkv's


@dataclass(frozen=True)
class HostStep:
    """A step packed on the host: one int64 array of regions (see `views`)."""

    packed: np.ndarray
    tokens: int
    batch: int
    table_width: int
    max_rows: int  # most tokens of one sequence
    rows: int  # logit rows (sum of the chunks' num_logits)

    @classmethod
    def pack(cls, chunks: Sequence[SequenceChunk], config: EngineConfig, num_blocks: int,
             placeholders: np.ndarray | None = None, rows: BlockTableRows | None = None) -> HostStep:  # fmt: skip
        """Validates every chunk first (check_chunks): the kernels index the pool with these numbers.
        `placeholders[i]`: chunk i's first token is filled on the device (an overlapped launch). `rows`: the
        backend's persistent batch, used where every chunk has a slot. Gathered once (ChunkArrays), checked
        and laid out by numpy calls over the whole batch."""
        slotted = rows is not None and all(c.slot is not None for c in chunks)
        step = ChunkArrays.gather(chunks, config.block_size, rows if slotted else None)
        step.check(config, num_blocks, placeholders)
        bs, batch, tokens, width = config.block_size, len(chunks), step.token_ids.size, int(step.need.max())
        tables = np.zeros((batch, width), np.int64)
        tables[np.arange(width) < step.need[:, None]] = step.tables  # each row's needed blocks, zeros after
        if tokens == batch:  # decode (one token, so one logit row, per chunk): chunk b is row b
            seq = picked = np.arange(batch)
            positions, max_rows = step.past_lens, 1
        else:
            starts = step.query_start[:-1]
            seq = np.arange(batch).repeat(step.lengths)
            positions = np.arange(tokens) + (step.past_lens - starts)[seq]
            picked, max_rows = logit_rows(step.lengths, step.num_logits, starts), int(step.lengths.max())
        blocks, offsets = np.divmod(positions, bs)
        packed = np.concatenate([step.token_ids, positions, tables[seq, blocks], offsets, step.query_start, picked,
                                 tables.ravel()])  # fmt: skip
        return cls(packed, tokens, batch, width, max_rows, picked.size)

    def views(self, device_packed: torch.Tensor) -> StepTensors:
        t, b = self.tokens, self.batch
        ids, pos, kv_block, kv_offset, rest = device_packed.split([t, t, t, t, device_packed.numel() - 4 * t])
        query_start, rows, tables = rest.split([b + 1, self.rows, b * self.table_width])
        return StepTensors(ids, pos, kv_block, kv_offset, query_start, rows,
                           tables.view(b, self.table_width), self.max_rows)  # fmt: skip


@dataclass(frozen=True)
class StepTensors:
    """A step on the device. `kv_block`/`kv_offset`: each token's pool slot, as the block and the
    row in it (paged_kv_write then reads a one-entry table per token)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    kv_block: torch.Tensor  # [T]
    kv_offset: torch.Tensor  # [T]
    query_start: torch.Tensor  # [B + 1]: sequence b owns rows query_start[b] .. query_start[b + 1] - 1
    logit_rows: torch.Tensor  # [rows]: the token rows whose logits are returned
    block_tables: torch.Tensor  # [B, M]
    max_rows: int


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads * D] with per-token cos/sin [T, D / 2], in float32."""
    t = x.view(x.shape[0], heads, -1).float()
    lo, hi = t.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([lo * c - hi * s, hi * c + lo * s], dim=-1).to(x.dtype).view(x.shape)


class Decoder:
    def __init__(self, config: EngineConfig, weights: Weights, kv: TorchKVPool, kernels: Kernels,
                 sm_count: int) -> None:  # fmt: skip
        self.spec, self.w, self.kv, self.k, self.sm_count = config.model, weights, kv, kernels, sm_count
        self.scale = float(self.spec.head_dim) ** -0.5
        dim = self.spec.head_dim
        self.rope_kernel = dim >= PROLOGUE_MIN_HEAD_DIM and dim & (dim - 1) == 0  # as fused_qkv.check_head_dim

    def forward(self, s: StepTensors, lora: LoraStep | None = None) -> torch.Tensor:
        """float32 logits [rows, vocab] of the `logit_rows` tokens; writes the step's K/V into the pool. `lora`: the
        step's adapters; None (the base model) runs exactly the base step, the only one CUDA graphs capture."""
        spec, w, tails, eps = self.spec, self.w, self.k.tails, self.spec.rms_norm_eps
        hidden = F.embedding(s.input_ids, w.embed)
        mlp: torch.Tensor | None = None  # the last MLP's output: the next norm adds it to the residual stream
        for index, layer in enumerate(w.layers):
            hidden, normed = tails.add_rms_norm(hidden, mlp, layer.input_norm, eps)
            q, k, v = self._qkv_rope(layer, normed, s.positions, lora, index)
            self.kv.write(index, k, v, s.kv_block, s.kv_offset)
            ctx = self.kv.attend(index, q, s.block_tables, s.positions, s.query_start, s.max_rows, spec.num_kv_heads,
                                 layer.window, self.scale, self.sm_count)  # fmt: skip
            if lora is None:
                hidden, normed = tails.add_rms_norm(hidden, layer.o_proj(ctx), layer.post_norm, eps)
                mlp = layer.down(tails.silu_mul(layer.gate_up(normed)))
            else:
                hidden, mlp = self._lora_tail(layer, index, hidden, ctx, lora)
        assert mlp is not None, "a decoder has layers"
        rows = s.logit_rows
        _, last = tails.add_rms_norm(hidden.index_select(0, rows), mlp.index_select(0, rows), w.final_norm, eps)
        return F.linear(last, w.lm_head).float()

    def _qkv_rope(
        self, layer: Layer, normed: torch.Tensor, positions: torch.Tensor, lora: LoraStep | None, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prologue after its norm: QKV projection, bias, RoPE on q and k. Where the step's adapters update
        this layer's q, k or v, the unfused path: their update goes into the QKV output before RoPE."""
        spec, w = self.spec, self.w
        updated = lora is not None and lora.updates(index, "qkv")
        if self.rope_kernel and layer.qkv.input_scale is None and not updated:
            q, k, v = self.k.prologue.gemm_rope(normed, layer.qkv.weight, layer.qkv.bias, w.cos, w.sin, positions,
                                                spec.num_heads, spec.num_kv_heads)  # fmt: skip
            return q, k, v
        qkv = layer.qkv(normed)
        if lora is not None:
            lora.apply(index, "qkv", normed, qkv)  # PEFT's input: the activation before an FP8 engine's Q/DQ
        q, k, v = qkv.split([spec.num_heads * spec.head_dim, spec.kv_width, spec.kv_width], dim=-1)
        cos, sin = w.cos[positions], w.sin[positions]
        return rope(q, cos, sin, spec.num_heads), rope(k, cos, sin, spec.num_kv_heads), v.contiguous()

    def _lora_tail(
        self, layer: Layer, index: int, hidden: torch.Tensor, ctx: torch.Tensor, lora: LoraStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj and the MLP of a LoRA step, each projection's output with the adapters' update added: the new
        residual stream and the MLP's output (the next norm adds it)."""
        tails, eps = self.k.tails, self.spec.rms_norm_eps
        attn = layer.o_proj(ctx)
        lora.apply(index, "o_proj", ctx, attn)
        hidden, normed = tails.add_rms_norm(hidden, attn, layer.post_norm, eps)
        gate_up = layer.gate_up(normed)
        lora.apply(index, "gate_up", normed, gate_up)  # before SiLU * up
        act = tails.silu_mul(gate_up)
        mlp = layer.down(act)
        lora.apply(index, "down", act, mlp)
        return hidden, mlp
