"""The multi-LoRA Triton kernels (plugins_cuda/lora.py: SGMV shrink + expand over a slot pool) on CPU under
Triton's interpreter, against the float64 per-token reference: ragged batches mixing prefill segments,
decode rows and base-model rows, ranks 8-64 with a zero-padded lower-rank slot, fp32 and fp16, an
update written into one slice of a fused QKV output, and a swapped slot that the comparison catches.
bfloat16 only compiles here (AOT for sm_80/89/90): the interpreter's tl.dot reads bfloat16 operands as raw
bits (Triton 3.9; plugins_cuda/check.py), so its results can only be checked on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
import torch

from plugins_cuda.interpreter import interpreter_problem

PROBLEM = interpreter_problem()
if PROBLEM:
    pytest.skip(PROBLEM, allow_module_level=True)

from plugins_cuda.lora import LoraTiles, lora_apply, lora_reference, segments_of  # noqa: E402

NUM_SLOTS = 4
LOW_RANK_SLOT = 2  # trained at half the pool's rank, zero-padded
# Per-token slots: a 9-token prefill chunk, base rows, decode rows of three adapters, a 20-token prefill
# chunk, a trailing decode row and base row: 38 tokens in 10 runs.
SLOTS = [0] * 9 + [-1, 1, 3, 1, -1, -1] + [2] * 20 + [0, 3, -1]
SM_SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block
AOT_SCRIPT = """
import json
from plugins_cuda import lora
from plugins_cuda.aot import compile_kernel
segments = {"segment_starts_ptr": "*i32", "segment_slots_ptr": "*i32"}
found = {}
for dtype, ptr in (("bf16", "*bf16"), ("fp32", "*fp32")):
    t = lora.tiles_for(64, 64, 4 if dtype == "fp32" else 2)  # prefill tiles, rank 64: the largest
    shrink = ({"x_ptr": ptr, "a_ptr": ptr, "tmp_ptr": "*fp32", **segments, "x_stride": "i32"},
              {"H_IN": 4096, "RANK": 64, "BLOCK_T": t.block_t, "BLOCK_R": t.shrink_r, "BLOCK_K": t.block_k})
    expand = ({"tmp_ptr": "*fp32", "b_ptr": ptr, "scaling_ptr": "*fp32", "y_ptr": ptr, **segments,
               "y_stride": "i32", "col_offset": "i32"},
              {"H_OUT": 6144, "RANK": 64, "BLOCK_T": t.block_t, "BLOCK_R": t.block_r, "BLOCK_N": t.block_n})
    for kernel, (signature, constexprs) in ((lora.lora_shrink_kernel, shrink), (lora.lora_expand_kernel, expand)):
        for arch in (80, 89, 90):
            c = compile_kernel(kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs, arch)
            found[f"{c.metadata.name}.{dtype}.{arch}"] = [c.metadata.shared, c.metadata.global_scratch_size]
print(json.dumps(found))
"""
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}  # |error| / max |y|; measured 2e-7 and 4e-4


def make_case(
    rank: int, dtype: torch.dtype, hidden_in: int = 96, hidden_out: int = 80, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """x, y, a, b, scaling in `dtype` (scaling float32) with values of order 1 in x, y and the update."""
    gen = torch.Generator().manual_seed(seed)
    tokens = len(SLOTS)
    x = torch.randn(tokens, hidden_in, generator=gen)
    y = torch.randn(tokens, hidden_out, generator=gen)
    a = torch.randn(NUM_SLOTS, rank, hidden_in, generator=gen) / hidden_in**0.5
    b = torch.randn(NUM_SLOTS, hidden_out, rank, generator=gen) / rank**0.5
    a[LOW_RANK_SLOT, rank // 2 :] = 0
    b[LOW_RANK_SLOT, :, rank // 2 :] = 0
    scaling = torch.tensor([2.0, 0.5, 4.0, 1.0])  # slot 2: alpha / r with its lower true rank
    return x.to(dtype), y.to(dtype), a.to(dtype), b.to(dtype), scaling


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def test_segments_group_runs_and_skip_base_rows() -> None:
    starts, slots = segments_of(torch.tensor(SLOTS, dtype=torch.int32))
    assert starts.tolist() == [0, 9, 10, 11, 12, 13, 15, 35, 36, 37]  # ends at the last adapter row
    assert slots.tolist() == [0, -1, 1, 3, 1, -1, 2, 0, 3]  # interior base runs only separate segments
    assert starts.dtype == slots.dtype == torch.int32
    starts, slots = segments_of(torch.tensor([-1, -1, 5, 5, -1]))
    assert starts.tolist() == [2, 4] and slots.tolist() == [5]
    for empty in ([-1, -1], []):
        starts, slots = segments_of(torch.tensor(empty, dtype=torch.int32))
        assert starts.tolist() == [0] and slots.tolist() == []


@pytest.mark.parametrize(
    ("rank", "dtype"),
    [
        (8, torch.float32),
        (16, torch.float32),
        (32, torch.float32),
        (64, torch.float32),
        (8, torch.float16),
        (64, torch.float16),
    ],
)
def test_ragged_batch_matches_reference(rank: int, dtype: torch.dtype) -> None:
    x, y, a, b, scaling = make_case(rank, dtype)
    slot_of_token = torch.tensor(SLOTS, dtype=torch.int32)
    want = lora_reference(x, y, a, b, scaling, slot_of_token)
    got = y.clone()
    lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token))
    assert error(got, want) < TOLERANCE[dtype]
    base = slot_of_token < 0
    assert torch.equal(got[base], y[base])  # base-model rows untouched, bit for bit
    update = (want - y.double()).abs().amax(dim=1)
    assert bool((update[~base] > 0.1).all())  # every adapter row, the low-rank slot's too, really moves


def test_small_tiles_cover_every_loop_and_mask() -> None:
    """Tiles smaller than the case: the 20-token chunk spans two token tiles, rank 64 four shrink rank tiles,
    H_in 100 four K steps (the last one partial), H_out 72 three column tiles (the last one partial)."""
    x, y, a, b, scaling = make_case(64, torch.float32, hidden_in=100, hidden_out=72, seed=2)
    slot_of_token = torch.tensor(SLOTS, dtype=torch.int32)
    got = y.clone()
    tiles = LoraTiles(block_t=16, block_r=64, shrink_r=16, block_k=32, block_n=32)
    lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token), tiles=tiles)
    assert error(got, lora_reference(x, y, a, b, scaling, slot_of_token)) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="whole rank"):
        lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token), tiles=LoraTiles(16, 32, 16, 32))


def test_writes_only_its_slice_of_a_fused_output() -> None:
    """k's slice [64, 128) of a q|k|v output 192 wide, from rows of a wider x (row stride 160)."""
    x, _, a, b, scaling = make_case(16, torch.float32, hidden_in=128, hidden_out=64, seed=1)
    wide_x = torch.randn(len(SLOTS), 160)
    wide_x[:, :128] = x
    x = wide_x[:, :128]
    qkv = torch.randn(len(SLOTS), 192)
    slot_of_token = torch.tensor(SLOTS, dtype=torch.int32)
    want = lora_reference(x, qkv, a, b, scaling, slot_of_token, col_offset=64)
    got = qkv.clone()
    lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token), col_offset=64)
    assert error(got, want) < TOLERANCE[torch.float32]
    assert torch.equal(got[:, :64], qkv[:, :64]) and torch.equal(got[:, 128:], qkv[:, 128:])
    with pytest.raises(ValueError, match="no columns"):
        lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token), col_offset=160)


def test_a_swapped_slot_fails_the_comparison() -> None:
    """The check has teeth: the kernel's output against a reference whose slots 0 and 1 trade weights."""
    x, y, a, b, scaling = make_case(16, torch.float32)
    slot_of_token = torch.tensor(SLOTS, dtype=torch.int32)
    got = y.clone()
    lora_apply(x, got, a, b, scaling, *segments_of(slot_of_token))
    assert error(got, lora_reference(x, y, a, b, scaling, slot_of_token)) < TOLERANCE[torch.float32]
    swap = torch.tensor([1, 0, 2, 3])
    swapped = lora_reference(x, y, a[swap], b[swap], scaling, slot_of_token)
    assert error(got, swapped) > 100 * TOLERANCE[torch.float32]


def test_aot_compiles_for_sm80_sm89_sm90() -> None:
    """Both kernels in bfloat16 and float32 compile (in a fresh process, not interpreted) within each arch's
    shared memory and without global scratch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 2 * 2 * 3
    for key, (shared, scratch) in compiled.items():
        assert shared <= SM_SHARED_LIMIT[int(key.rsplit(".", 1)[1])] and scratch == 0, key
