"""What plugins_cuda/bench.py times, one case (shape) at a time, before and after (GPU only).

Llama-3-8B heads (32 query / 8 kv, head_dim 128), bfloat16, block size 16:
- decode: batch 1-256 x context 512-32k; `before` is the plugin pair as the first H200 run
  timed it (plugins_cuda/baseline: PagedAttention + PagedAttentionMerge), `before_ragged`
  the torch backend's launch_ragged then, `after` launch_ragged now; `sdpa` torch's
  scaled_dot_product_attention over a contiguous copy of the same keys (GQA);
- prefill: one 2k / 8k-token causal sequence, TFLOP/s against SDPA causal;
- prologue (RMSNorm -> QKV -> RoPE, hidden 4096): the unfused torch sequence (cuBLAS matmul)
  against the fused kernel's tactics before and the token-count choice after.
Each implementation is timed by a `timer(fn) -> µs` the caller supplies (plain launches or
CUDA-graph replays), after `mark(name)` so that a crash can be attributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK = 32, 8, 128, 4096, 16
DEVICE, DTYPE = "cuda", "bfloat16"  # a CPU test swaps these (and the sizes) to run every case once
MAX_CACHED_TOKENS = 2**21  # batch x context cap: 4 GiB of bf16 K (and V), twice with SDPA's copy
DECODE = [{"batch": b, "context": c} for c in (512, 4096, 32768) for b in (1, 8, 32, 128, 256)
          if b * c <= MAX_CACHED_TOKENS]  # fmt: skip
PREFILL = [{"tokens": 2048}, {"tokens": 8192}]
PROLOGUE = [{"tokens": t} for t in (1, 32, 64, 65, 256, 2048)]
QUICK = {"decode": [*DECODE[:2], {"batch": 8, "context": 4096}], "prefill": PREFILL[:1], "prologue": PROLOGUE[1:4]}
Timer = Callable[[Callable], float]
Mark = Callable[[str], None]


def cases(part: str, quick: bool = False) -> list[dict]:
    return QUICK[part] if quick else {"decode": DECODE, "prefill": PREFILL, "prologue": PROLOGUE}[part]


def _pool(batch: int, context: int):
    import torch

    per_seq = -(-context // BLOCK)
    tables = torch.randperm(batch * per_seq, device=DEVICE).view(batch, per_seq)
    pools = [torch.randn(batch * per_seq, BLOCK, KV_HEADS * HEAD_DIM, device=DEVICE, dtype=getattr(torch, DTYPE))
             for _ in range(2)]  # fmt: skip
    return pools, tables


def _contiguous(pool, tables, context: int):
    """[batch, kv_heads, context, head_dim]: the same keys, laid out for SDPA."""
    batch = tables.shape[0]
    rows = pool[tables].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context]
    return rows.transpose(1, 2).contiguous()


def sdpa_backend(q, k, v, causal: bool) -> str:
    """The SDPA kernel torch picks for these inputs (private API; "?" when it moves)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, None, enable_gqa=True)
        return SDPBackend(choice).name
    except Exception:  # diagnostic only: the private API moves between torch versions
        return "?"


def _versus(row: dict, times: dict[str, float], reference: str) -> dict:
    for name, us in times.items():
        row[f"{name}_us"] = round(us, 1)
    for name, us in times.items():
        if name != reference:
            row[f"{name}_vs_{reference}"] = round(times[reference] / us, 2)
    return row


def decode(case: dict, timer: Timer, mark: Mark) -> dict:
    import torch
    import torch.nn.functional as F

    from plugins_cuda import attention_launch as after
    from plugins_cuda.baseline import attention_launch as before

    batch, context = case["batch"], case["context"]
    (k, v), tables = _pool(batch, context)
    q = torch.randn(batch, HEADS * HEAD_DIM, device=DEVICE, dtype=getattr(torch, DTYPE))
    positions = torch.full((batch,), context - 1, device=DEVICE, dtype=torch.int64)
    query_start = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    impls = {
        "before": lambda: before.paged_attention_padded(q[:, None], k, v, tables, positions[:, None], KV_HEADS, scale),
        "before_ragged": lambda: before.launch_ragged(q, k, v, tables, positions, query_start, 1, KV_HEADS),
        "after": lambda: after.launch_ragged(q, k, v, tables, positions, query_start, 1, KV_HEADS),
    }
    times = {}
    for name, fn in impls.items():
        mark(name)
        times[name] = timer(fn)
    kc, vc = _contiguous(k, tables, context), _contiguous(v, tables, context)
    qs = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    mark("sdpa")
    times["sdpa"] = timer(lambda: F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True))
    gbs = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 / times["after"] / 1e3
    row = {**case, "after_GB/s": round(gbs), "sdpa_backend": sdpa_backend(qs, kc, vc, False)}
    return _versus(row, times, "sdpa")


def prefill(case: dict, timer: Timer, mark: Mark) -> dict:
    import torch
    import torch.nn.functional as F

    from plugins_cuda import attention_launch as after
    from plugins_cuda.baseline import attention_launch as before

    length = case["tokens"]
    (k, v), tables = _pool(1, length)
    q = torch.randn(length, HEADS * HEAD_DIM, device=DEVICE, dtype=getattr(torch, DTYPE))
    query_start = torch.tensor([0, length], device=DEVICE, dtype=torch.int32)
    positions = torch.arange(length, device=DEVICE)
    times = {}
    for name, module in (("before", before), ("after", after)):
        mark(name)
        times[name] = timer(lambda m=module: m.launch_ragged(q, k, v, tables, positions, query_start, length, KV_HEADS))
    kc, vc = _contiguous(k, tables, length), _contiguous(v, tables, length)
    qs = q.view(1, length, HEADS, HEAD_DIM).transpose(1, 2)
    mark("sdpa")
    times["sdpa"] = timer(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True))
    flops = 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
    row = {**case, **{f"{n}_TFLOP/s": round(flops / us / 1e6, 1) for n, us in times.items()},
           "sdpa_backend": sdpa_backend(qs, kc, vc, True)}  # fmt: skip
    return _versus(row, times, "sdpa")


def prologue(case: dict, timer: Timer, mark: Mark) -> dict:
    import torch

    from plugins_cuda import fused_qkv as after
    from plugins_cuda.baseline import fused_qkv as before

    tokens, dtype, half = case["tokens"], getattr(torch, DTYPE), HEAD_DIM // 2
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = torch.randn(HIDDEN, width, device=DEVICE, dtype=dtype) / math.sqrt(HIDDEN)
    norm, bias = torch.ones(HIDDEN, device=DEVICE, dtype=dtype), torch.zeros(width, device=DEVICE, dtype=dtype)
    angles = torch.arange(8192, device=DEVICE)[:, None] / 10000 ** (torch.arange(half, device=DEVICE) / half)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dtype)
    positions = torch.arange(tokens, device=DEVICE)
    rotated = HEADS + KV_HEADS

    def unfused():
        xf = x.float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * norm
        y = (xn @ w + bias).view(tokens, -1, HEAD_DIM)
        c, s = cos[positions][:, None], sin[positions][:, None]
        lo, hi = y[:, :rotated, :half], y[:, :rotated, half:]
        return torch.cat([torch.cat([lo * c - hi * s, hi * c + lo * s], -1), y[:, rotated:]], 1)

    def run(module, tactic):
        args = (x, norm, w, bias, cos, sin, positions, HEADS, KV_HEADS, 1e-5)
        return lambda: module.fused_rmsnorm_qkv_rope(*args, tactic)

    impls = {"unfused": unfused, "before_decode": run(before, "decode"), "before_prefill": run(before, "prefill"),
             "after": run(after, None), "after_gemm": run(after, "gemm")}  # fmt: skip
    times = {}
    for name, fn in impls.items():
        mark(name)
        times[name] = timer(fn)
    return _versus({**case, "after_tactic": after.default_tactic(tokens)}, times, "unfused")


RUN = {"decode": decode, "prefill": prefill, "prologue": prologue}
