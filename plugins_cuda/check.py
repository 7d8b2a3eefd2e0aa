"""`python -m plugins_cuda.check`: every kernel against a float64 reference, then benchmarks.

On a CUDA machine with torch and triton: paged attention (flat ragged and the plugins' padded
layout, split-KV merge included), the KV write, the fused prologue (every tactic) and the decoder
tails (residual add + RMSNorm, SiLU * up), in float32/float16/bfloat16, over shapes from SmolLM2
(9/3 heads, head_dim 64) to Llama-3-8B (32/8, 128) with MQA and MHA, block sizes 16 and 64,
sliding windows, decodes long enough to split and prefill chunks straddling blocks; then the
benchmarks of plugins_cuda/bench.py.
`--interpret` runs the correctness part on the CPU under Triton's interpreter with a few
small shapes (CI), in float32 and float16: the interpreter's tl.dot reads bfloat16 operands
as raw bits (Triton 3.9), so bfloat16 is checked on a GPU only. Writes check.json and
check.md to --out. Exit status: 0 all correct, 1 a mismatch, 2 no GPU and no --interpret.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}  # max error / max |reference|


@dataclass(frozen=True)
class AttentionCase:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seqs: tuple[tuple[int, int], ...]  # (cached tokens, new tokens) per sequence
    window: int = 0


GPU_CASES = [
    AttentionCase("smollm2 mixed", 9, 3, 64, 16, ((0, 1), (37, 1), (4000, 1), (0, 300), (700, 129))),
    AttentionCase("smollm2 window", 9, 3, 64, 64, ((0, 1), (5000, 1), (0, 200), (300, 77)), window=256),
    AttentionCase("llama3-8b decode", 32, 8, 128, 16, ((8000, 1), (3000, 1), (100, 1))),
    AttentionCase("llama3-8b verify+chunk", 32, 8, 128, 64, ((2000, 4), (500, 3), (1000, 256))),
    AttentionCase("mqa", 16, 1, 128, 16, ((6000, 1), (0, 96), (64, 64))),
    AttentionCase("mha", 8, 8, 64, 64, ((3000, 1), (9, 2), (0, 150)), window=100),
]
INTERPRET_CASES = [
    AttentionCase("gqa3 split decode", 6, 2, 32, 16, ((0, 1), (600, 1), (37, 1))),
    AttentionCase("gqa3 prefill+window", 6, 2, 32, 16, ((0, 40), (19, 5)), window=7),
]
PROLOGUE_CASES = {"gpu": [(1, 576, 9, 3, 64), (300, 576, 9, 3, 64), (70, 4096, 32, 8, 128)],
                  "interpret": [(5, 64, 4, 2, 32), (33, 96, 2, 1, 32)]}  # fmt: skip
# (tokens, hidden, intermediate): SmolLM2's decode and a batch, Llama-3.2-1B's and Llama-3-8B's widths.
TAIL_CASES = {"gpu": [(1, 576, 1536), (256, 576, 1536), (300, 2048, 8192), (70, 4096, 14336)],
              "interpret": [(1, 64, 176), (37, 96, 256)]}  # fmt: skip


def reference_attention(q, k_cache, v_cache, tables, seqs, num_kv_heads: int, window: int):
    """float64, per sequence: its keys gathered through the block table, a causal/window mask."""
    import torch

    out, row = [], 0
    block_size, heads = k_cache.shape[1], q.shape[1] // (k_cache.shape[2] // num_kv_heads)
    dim = q.shape[1] // heads
    for b, (past, new) in enumerate(seqs):
        keys = torch.arange(past + new, device=q.device)
        slots = tables[b, keys // block_size] * block_size + keys % block_size
        k, v = (c.flatten(0, 1)[slots].double().view(-1, num_kv_heads, dim).repeat_interleave(heads // num_kv_heads, 1)
                for c in (k_cache, v_cache))  # fmt: skip
        qs = q[row : row + new].double().view(new, heads, dim)
        scores = torch.einsum("thd,khd->htk", qs, k) / math.sqrt(dim)
        pos = torch.arange(past, past + new, device=q.device)[:, None]
        visible = (keys[None, :] <= pos) & ((keys[None, :] > pos - window) if window else True)
        out.append(torch.einsum("htk,khd->thd", scores.masked_fill(~visible, -math.inf).softmax(-1), v))
        row += new
    return torch.cat(out).reshape(q.shape[0], -1)


def attention_errors(case: AttentionCase, dtype, device: str, seed: int = 0) -> dict[str, float]:
    """Max error / max |reference| of the ragged kernel and of KV write + the padded plugin pair."""
    import torch

    from plugins_cuda.attention_launch import paged_attention, paged_attention_padded
    from plugins_cuda.kv_write import paged_kv_write

    gen = torch.Generator().manual_seed(seed)
    kv_width, width = case.num_kv_heads * case.head_dim, case.num_heads * case.head_dim
    need = [-(-(p + n) // case.block_size) for p, n in case.seqs]
    ids = torch.randperm(sum(need) + 3, generator=gen)
    tables = torch.zeros(len(need), max(need), dtype=torch.int64)
    for b, n in enumerate(need):
        tables[b, :n] = ids[sum(need[:b]) : sum(need[: b + 1])]
    pools = [torch.randn(len(ids), case.block_size, kv_width, generator=gen).to(dtype) for _ in range(2)]
    tokens = sum(n for _, n in case.seqs)
    q = torch.randn(tokens, width, generator=gen).to(dtype)
    new_k, new_v = (torch.randn(tokens, kv_width, generator=gen).to(dtype) for _ in range(2))
    seq_of_token = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(case.seqs)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in case.seqs])
    # the reference pool: this step's rows written by hand
    ref_pools = [p.clone() for p in pools]
    slots = tables[seq_of_token, positions // case.block_size] * case.block_size + positions % case.block_size
    for pool, rows in zip(ref_pools, (new_k, new_v), strict=True):
        pool.view(-1, kv_width)[slots] = rows
    to = [t.to(device) for t in (q, *ref_pools, tables)]
    want = reference_attention(*to, case.seqs, case.num_kv_heads, case.window)
    scale = float(want.abs().max())
    ragged = paged_attention(*to, seq_of_token.to(device), positions.to(device), case.num_kv_heads, case.window)
    # padded [batch, step]: KV write into copies of the pools, then both attention plugins
    batch, step = len(case.seqs), max(n for _, n in case.seqs)
    index = torch.cat([b * step + torch.arange(n) for b, (_, n) in enumerate(case.seqs)])
    padded = [torch.zeros(batch * step, t.shape[1], dtype=dtype).index_copy(0, index, t) for t in (q, new_k, new_v)]
    pos_pad = torch.stack([torch.arange(p, p + step).clamp(max=p + n - 1) for p, n in case.seqs])
    seq_lens = torch.tensor([n for _, n in case.seqs])
    gpu_pools = [p.clone().to(device) for p in pools]
    pq, pk, pv = (t.view(batch, step, -1).to(device) for t in padded)
    paged_kv_write(pk, pv, *gpu_pools, tables.to(device), pos_pad.to(device), seq_lens.to(device))
    plugin = paged_attention_padded(pq, *gpu_pools, tables.to(device), pos_pad.to(device), case.num_kv_heads,
                                    case.head_dim**-0.5, case.window)  # fmt: skip
    plugin = plugin.reshape(batch * step, -1)[index.to(device)]
    pool_error = max(float((g.double() - w.double()).abs().max()) for g, w in zip(gpu_pools, to[1:3], strict=True))
    return {"ragged": float((ragged.double() - want).abs().max()) / scale,
            "plugin": float((plugin.double() - want).abs().max()) / scale, "kv_write": pool_error}  # fmt: skip


def prologue_error(tokens: int, hidden: int, num_q: int, num_kv: int, head_dim: int, dtype, device: str,
                   tactic: str) -> float:  # fmt: skip
    import torch

    from plugins_cuda.fused_qkv import fused_rmsnorm_qkv_rope

    gen = torch.Generator().manual_seed(tokens)
    width, half = (num_q + 2 * num_kv) * head_dim, head_dim // 2
    x = torch.randn(tokens, hidden, generator=gen)
    norm, bias = torch.rand(hidden, generator=gen) + 0.5, torch.randn(width, generator=gen) * 0.1
    w = torch.randn(hidden, width, generator=gen) / hidden**0.5
    angles = torch.arange(4096)[:, None] / 10000 ** (torch.arange(half) / half)
    cos, sin, positions = angles.cos(), angles.sin(), torch.randint(0, 4096, (tokens,), generator=gen)
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.double()
    y = (xn @ w.double() + bias.double()).view(tokens, -1, head_dim)
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    lo, hi = y[..., :half], y[..., half:]
    rot = num_q + num_kv
    y[:, :rot] = torch.cat([lo * c - hi * s, hi * c + lo * s], -1)[:, :rot]
    args = [t.to(dtype).to(device) for t in (x, norm, w, bias)] + [t.to(device) for t in (cos, sin, positions)]
    got = torch.cat(fused_rmsnorm_qkv_rope(*args, num_q, num_kv, 1e-5, tactic=tactic), 1).double().cpu()
    return float((got - y.reshape(tokens, -1)).abs().max() / y.abs().max())


def tails_reference(hidden, delta, norm, gate_up, eps: float):
    """float64 (hidden + delta, RMSNorm(hidden + delta) * norm, SiLU(gate) * up) of the given tensors."""
    import torch

    total = hidden.double() + delta.double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    gate, up = gate_up.double().chunk(2, dim=-1)
    return total, normed, gate * torch.sigmoid(gate) * up


def tails_errors(tokens: int, hidden: int, inter: int, dtype, device: str) -> dict[str, float]:
    """Max error / max |reference| of the decoder tails (decoder_tails.py) on random rows of `dtype`."""
    import torch

    from plugins_cuda.decoder_tails import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(tokens)
    h, d = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    norm = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=gen)).to(dtype)
    want = tails_reference(h, d, norm, gate_up, 1e-5)
    got = (*add_rms_norm(h.to(device), d.to(device), norm.to(device), 1e-5), silu_mul(gate_up.to(device)))
    errors = [float((g.double().cpu() - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True)]
    return dict(zip(("sum", "normed", "silu_mul"), errors, strict=True))


def correctness(interpret: bool, device: str) -> list[dict]:
    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if interpret:
        del dtypes["bfloat16"]
    cases = INTERPRET_CASES if interpret else GPU_CASES
    rows = []
    for name, dtype in dtypes.items():
        for case in cases:
            errors = attention_errors(case, dtype, device)
            ok = errors["ragged"] <= TOLERANCE[name] and errors["plugin"] <= TOLERANCE[name] and not errors["kv_write"]
            rows.append({"kernel": "paged_attention", "case": case.name, "dtype": name, **errors, "ok": ok,
                         "shape": asdict(case)})  # fmt: skip
        for shape in PROLOGUE_CASES["interpret" if interpret else "gpu"]:
            for tactic in ("decode", "prefill", "gemm"):
                error = prologue_error(*shape, dtypes[name], device, tactic)
                rows.append({"kernel": f"fused_rmsnorm_qkv_rope/{tactic}", "case": "x".join(map(str, shape)),
                             "dtype": name, "error": error, "ok": error <= TOLERANCE[name]})  # fmt: skip
        for shape in TAIL_CASES["interpret" if interpret else "gpu"]:
            tails = tails_errors(*shape, dtypes[name], device)
            error = max(tails.values())
            rows.append({"kernel": "add_rms_norm + silu_mul", "case": "x".join(map(str, shape)), "dtype": name,
                         "error": error, **tails, "ok": error <= TOLERANCE[name]})  # fmt: skip
    return rows


def markdown(rows: list[dict], bench: list[dict]) -> str:
    lines = ["| kernel | case | dtype | max error / max ref | ok |", "|---|---|---|---|---|"]
    for r in rows:
        error = r.get("error", max(r.get("ragged", 0.0), r.get("plugin", 0.0)))
        lines.append(f"| {r['kernel']} | {r['case']} | {r['dtype']} | {error:.2e} | {'yes' if r['ok'] else 'NO'} |")
    for kind in dict.fromkeys((b["bench"], b.get("mode")) for b in bench):
        group = [b for b in bench if (b["bench"], b.get("mode")) == kind]
        keys = list(dict.fromkeys(k for b in group for k in b))
        lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(b.get(k, "")) for k in keys) + " |" for b in group]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins_cuda.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true", help="correctness only, on CPU, small shapes")
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmarks")
    parser.add_argument("--out", type=Path, default=Path("kernel-check"), help="directory for check.json/.md")
    args = parser.parse_args(argv)
    if args.interpret:
        from plugins_cuda.interpreter import interpreter_problem

        if problem := interpreter_problem():
            print(problem, file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("plugins_cuda.check needs a CUDA GPU (torch.cuda.is_available() is False); "
              "run with --interpret for the CPU correctness check", file=sys.stderr)  # fmt: skip
        return 2
    device = "cpu" if args.interpret else "cuda"
    rows = correctness(args.interpret, device)
    bench = []
    if not args.interpret and not args.no_bench:
        from plugins_cuda import bench as benchmarks

        bench = benchmarks.run_all()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check.json").write_text(json.dumps({"device": device, "correctness": rows, "bench": bench},
                                                    indent=2) + "\n")  # fmt: skip
    (args.out / "check.md").write_text(markdown(rows, bench))
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"MISMATCH {r['kernel']} {r['case']} {r['dtype']}", file=sys.stderr)
    print(f"{len(rows) - len(failed)}/{len(rows)} correct; wrote {args.out / 'check.json'} and check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
