"""Benchmarks run by `python -m plugins_cuda.check` on a CUDA GPU (never under the interpreter).

- decode attention (both plugin kernels: PagedAttention + PagedAttentionMerge), Llama-3-8B
  heads (32/8, head_dim 128), bfloat16, block size 16, batch 1-256 x context 512-32k:
  achieved HBM bandwidth (K/V bytes read / time) against the card's peak, and the time of
  torch SDPA over a contiguous cache of the same keys;
- prefill attention of one 2k / 8k-token sequence: TFLOP/s against SDPA causal;
- the fused prologue (each tactic) against the unfused torch sequence (RMSNorm, cuBLAS
  matmul, bias, RoPE).
Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), so the launchers' Python
overhead is not counted. Numbers come from the GPU it runs on; none were measured here.
"""

from __future__ import annotations

import math

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096  # Llama-3-8B
MAX_CACHED_TOKENS = 2**21  # batch x context cap: 8 GiB of bfloat16 K/V, twice with SDPA's copy


def _time_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)


def peak_hbm_gbs() -> float:
    """DRAM bandwidth from the driver: 2 transfers per memory clock x bus width."""
    import triton

    driver = triton.runtime.driver.active
    props = driver.utils.get_device_properties(driver.get_current_device())
    return 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8 / 1e9


def _pool(batch: int, context: int, block_size: int, dtype):
    import torch

    per_seq = -(-context // block_size)
    tables = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq)
    pools = [torch.randn(batch * per_seq, block_size, KV_HEADS * HEAD_DIM, device="cuda", dtype=dtype)
             for _ in range(2)]  # fmt: skip
    return pools, tables


def _contiguous(pool, tables, context: int):
    """[batch, kv_heads, context, head_dim]: the same keys, laid out for SDPA."""
    batch = tables.shape[0]
    rows = pool[tables].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context]
    return rows.transpose(1, 2).contiguous()


def _decode_row(batch: int, context: int, block_size: int, peak: float) -> dict:
    import torch
    import torch.nn.functional as F

    from plugins_cuda.attention_launch import paged_attention_padded

    (k, v), tables = _pool(batch, context, block_size, torch.bfloat16)
    q = torch.randn(batch, 1, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    positions = torch.full((batch, 1), context - 1, device="cuda", dtype=torch.int64)
    ours = _time_us(lambda: paged_attention_padded(q, k, v, tables, positions, KV_HEADS, HEAD_DIM**-0.5))
    kc, vc = _contiguous(k, tables, context), _contiguous(v, tables, context)
    qs = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = _time_us(lambda: F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True))
    gbs = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 / ours / 1e3
    return {"bench": "decode", "batch": batch, "context": context, "us": round(ours, 1), "GB/s": round(gbs),
            "pct_of_peak": round(100 * gbs / peak, 1), "sdpa_us": round(sdpa, 1),
            "vs_sdpa": round(sdpa / ours, 2)}  # fmt: skip


def decode(batches=(1, 8, 32, 128, 256), contexts=(512, 4096, 32768), block_size: int = 16) -> list[dict]:
    peak = peak_hbm_gbs()
    return [_decode_row(batch, context, block_size, peak) for context in contexts for batch in batches
            if batch * context <= MAX_CACHED_TOKENS]  # fmt: skip


def _prefill_row(length: int, block_size: int) -> dict:
    import torch
    import torch.nn.functional as F

    from plugins_cuda.attention_launch import launch_ragged

    (k, v), tables = _pool(1, length, block_size, torch.bfloat16)
    q = torch.randn(length, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    query_start = torch.tensor([0, length], device="cuda", dtype=torch.int32)
    positions = torch.arange(length, device="cuda")
    ours = _time_us(lambda: launch_ragged(q, k, v, tables, positions, query_start, length, KV_HEADS))
    kc, vc = _contiguous(k, tables, length), _contiguous(v, tables, length)
    qs = q.view(1, length, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = _time_us(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True))
    flops = 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
    return {"bench": "prefill", "tokens": length, "us": round(ours, 1), "TFLOP/s": round(flops / ours / 1e6, 1),
            "sdpa_us": round(sdpa, 1), "sdpa_TFLOP/s": round(flops / sdpa / 1e6, 1),
            "vs_sdpa": round(sdpa / ours, 2)}  # fmt: skip


def prefill(lengths=(2048, 8192), block_size: int = 16) -> list[dict]:
    return [_prefill_row(length, block_size) for length in lengths]


def _prologue_row(tokens: int) -> dict:
    import torch

    from plugins_cuda.fused_qkv import fused_rmsnorm_qkv_rope

    dtype, half = torch.bfloat16, HEAD_DIM // 2
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = torch.randn(HIDDEN, width, device="cuda", dtype=dtype) / math.sqrt(HIDDEN)
    norm, bias = torch.ones(HIDDEN, device="cuda", dtype=dtype), torch.zeros(width, device="cuda", dtype=dtype)
    angles = torch.arange(8192, device="cuda")[:, None] / 10000 ** (torch.arange(half, device="cuda") / half)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    positions = torch.arange(tokens, device="cuda")
    rotated = HEADS + KV_HEADS

    def unfused():
        xf = x.float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * norm
        y = (xn @ w + bias).view(tokens, -1, HEAD_DIM)
        c, s = cos[positions][:, None], sin[positions][:, None]
        lo, hi = y[:, :rotated, :half], y[:, :rotated, half:]
        return torch.cat([torch.cat([lo * c - hi * s, hi * c + lo * s], -1), y[:, rotated:]], 1)

    def fused(tactic: str):
        return lambda: fused_rmsnorm_qkv_rope(x, norm, w, bias, cos, sin, positions, HEADS, KV_HEADS, 1e-5, tactic)

    base = _time_us(unfused)
    row = {"bench": "prologue", "tokens": tokens, "unfused_us": round(base, 1)}
    for tactic in ("decode", "prefill"):
        us = _time_us(fused(tactic))
        row[f"{tactic}_us"], row[f"{tactic}_vs_unfused"] = round(us, 1), round(base / us, 2)
    return row


def prologue(token_counts=(1, 32, 256, 2048)) -> list[dict]:
    return [_prologue_row(tokens) for tokens in token_counts]


def run_all() -> list[dict]:
    return decode() + prefill() + prologue()
