"""The CPU backends' LoRA kernel (executors/kernels/lora_ops.h through LoraSlots.delta) against a float64 reference:
ragged rows of several slots and base rows, ranks that are no multiple of the vector width, q|k|v blocks of
unequal widths, adapters of some projections only, float16 storage, the RMS norm on the way in, and rows read in
place from a larger activation matrix, tiles of every row count with ranks past the kernel's register block,
updates added in place; and a swapped slot caught."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_format import ModelSpec
from executors.lora import LoraAdapter, LoraModule, LoraRows, LoraSlots, Rope
from executors.lora.adapter import module_shape

SPEC = ModelSpec(
    model_type="llama",
    vocab_size=100,
    hidden_size=40,
    intermediate_size=72,
    num_layers=2,
    num_heads=5,
    num_kv_heads=1,
    head_dim=8,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    qkv_bias=False,
    rope_type="default",
    max_position_embeddings=64,
    sliding_windows=(None, None),
    bos_token_id=1,
    eos_token_ids=(2,),
)
GROUP_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def adapter(name: str, targets: dict[str, int], seed: int) -> LoraAdapter:
    """Random modules of the given ranks (target -> rank) in every layer."""
    rng = np.random.default_rng(seed)
    modules = {}
    for layer in range(SPEC.num_layers):
        for target, rank in targets.items():
            fan_in, fan_out = module_shape(SPEC, target)
            a = rng.standard_normal((rank, fan_in)).astype(np.float32)
            b = rng.standard_normal((fan_out, rank)).astype(np.float32)
            modules[layer, target] = LoraModule(a, b, float(rng.uniform(0.5, 2)))
    return LoraAdapter(name, Path(name), max(targets.values()), tuple(targets), modules, name)


def reference(ad: LoraAdapter | None, layer: int, group: str, x: np.ndarray) -> np.ndarray:
    """float64: each target's scaling * x @ A.T @ B.T at its columns of the fused output."""
    targets = GROUP_TARGETS[group]
    widths = [module_shape(SPEC, t)[1] for t in targets]
    out = np.zeros((x.shape[0], sum(widths)))
    col = 0
    for target, width in zip(targets, widths, strict=True):
        module = None if ad is None else ad.modules.get((layer, target))
        if module is not None:
            out[:, col : col + width] = module.scaling * (x.astype(np.float64) @ module.a.T @ module.b.T)
        col += width
    return out


ADAPTERS = [
    adapter("qv", {"q_proj": 5, "v_proj": 17}, 1),  # no k: its columns stay zero
    adapter("qkv", {"q_proj": 16, "k_proj": 3, "v_proj": 33}, 2),
    adapter("mlp", {"gate_proj": 7, "up_proj": 9, "down_proj": 21}, 3),
]


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("group", ["qkv", "gate_up", "down"])
def test_each_row_gets_its_own_adapters_update(half, group):
    slots = LoraSlots(SPEC, 4, "test", half=half)
    slots.threads = 2  # 64 rows or more: tiles on two threads
    for slot, ad in enumerate(ADAPTERS):  # slot 3 stays empty
        slots.load(slot, ad)
    lengths = np.array([3, 1, 53, 2, 1, 6, 1])  # prefill chunks (one past 16-row tiles) and decodes, base between
    chunk_slots = [0, None, 1, 2, 0, None, 1]
    rows = LoraRows.of(chunk_slots, lengths)
    fan_in = module_shape(SPEC, GROUP_TARGETS[group][0])[0]
    x = np.random.default_rng(7).standard_normal((int(lengths.sum()), fan_in)).astype(np.float32)
    assert slots.updates_group(rows, 1, group)
    got = slots.delta(rows, 1, group, x)
    pairs = list(zip(rows.rows, rows.slots, strict=True))
    want = np.concatenate([reference(ADAPTERS[s], 1, group, x[[r]]) for r, s in pairs])
    tolerance = 3e-3 if half else 1e-5
    np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max())
    swapped = np.concatenate([reference(ADAPTERS[(s + 1) % 3], 1, group, x[[r]]) for r, s in pairs])
    assert np.abs(got - swapped).max() > 0.1 * np.abs(want).max()  # the check catches a slot read as another


def test_the_norm_on_the_way_in_and_rows_read_in_place():
    slots = LoraSlots(SPEC, 2, "test")
    slots.load(1, ADAPTERS[1])
    rows = LoraRows(np.array([4, 0, 7]), np.array([1, 1, 1], np.int32))
    hidden = np.random.default_rng(3).standard_normal((9, SPEC.hidden_size)).astype(np.float32) * 3
    weight = np.random.default_rng(4).uniform(0.5, 1.5, SPEC.hidden_size).astype(np.float32)
    got = slots.delta(rows, 0, "qkv", hidden, weight, 1e-5)
    x = hidden[rows.rows].astype(np.float64)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * weight
    np.testing.assert_allclose(got, reference(ADAPTERS[1], 0, "qkv", normed), rtol=1e-4, atol=1e-4)
    gathered = slots.delta(rows, 0, "qkv", hidden[rows.rows], x_rows=np.arange(3))
    np.testing.assert_allclose(gathered, reference(ADAPTERS[1], 0, "qkv", x), rtol=1e-4, atol=1e-4)


def test_a_cleared_slot_and_a_projection_it_does_not_update_give_zeros():
    slots = LoraSlots(SPEC, 2, "test")
    slots.load(0, ADAPTERS[0])
    slots.load(1, ADAPTERS[2])
    rows = LoraRows(np.array([0, 1]), np.array([0, 1], np.int32))
    x = np.ones((2, SPEC.hidden_size), np.float32)
    assert np.all(slots.delta(rows, 0, "qkv", x)[1] == 0)  # the MLP adapter has no q|k|v update
    slots.clear(0)
    assert not slots.updates_group(LoraRows(np.array([0]), np.array([0], np.int32)), 0, "qkv")
    with pytest.raises(ValueError, match="rows within x"):
        slots.delta(LoraRows(np.array([5]), np.array([1], np.int32)), 0, "gate_up", x)


@pytest.mark.parametrize("count", range(1, 18))
def test_every_tile_row_count_and_ranks_past_the_register_block(count):
    """The kernel compiles a tile for each row count 1-16 (registers: 4 vectors a row up to 4 rows, 2 up to 8,
    1 past), and q's rank 70 spans two blocks of 64 columns with a partial one."""
    wide = adapter("wide", {"q_proj": 70, "k_proj": 1, "v_proj": 20}, 5)
    slots = LoraSlots(SPEC, 2, "test", half=count % 2 == 0)
    slots.load(1, wide)
    rows = LoraRows(np.arange(count, dtype=np.int64), np.ones(count, np.int32))
    x = np.random.default_rng(count).standard_normal((count, SPEC.hidden_size)).astype(np.float32)
    want = reference(wide, 0, "qkv", x)
    np.testing.assert_allclose(slots.delta(rows, 0, "qkv", x), want, atol=3e-3 * np.abs(want).max())


def test_updates_added_in_place_to_their_rows_only():
    slots = LoraSlots(SPEC, 3, "test")
    slots.load(0, ADAPTERS[0])
    slots.load(2, ADAPTERS[1])
    rows = LoraRows(np.array([1, 4, 5]), np.array([2, 0, 2], np.int32))
    x = np.random.default_rng(8).standard_normal((6, SPEC.hidden_size)).astype(np.float32)
    out = np.random.default_rng(9).standard_normal((6, 56)).astype(np.float32)  # q|k|v: 40 + 8 + 8 columns
    expected = out.astype(np.float64)
    held = {0: ADAPTERS[0], 2: ADAPTERS[1]}
    for r, s in zip(rows.rows, rows.slots, strict=True):
        expected[r] += reference(held[s], 1, "qkv", x[[r]])[0]
    slots.add(rows, 1, "qkv", x, (out,))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)  # rows 0, 2, 3 unchanged
    assert slots.groups(rows) == {(layer, "qkv") for layer in range(SPEC.num_layers)}
    with pytest.raises(ValueError, match="parts as wide as the projection"):
        slots.add(rows, 1, "qkv", x, (np.zeros((6, 64), np.float32),))  # another width
    with pytest.raises(ValueError, match="out_rows within every part"):
        slots.add(rows, 1, "qkv", x, (out[:3],))  # rows 4 and 5 are past its end
    with pytest.raises(ValueError, match="C-contiguous float32"):
        slots.add(rows, 1, "qkv", x, (out.astype(np.float64),))


def rotate(x: np.ndarray, position: int, head_dim: int, heads: int) -> np.ndarray:
    """float64 RoPE (HF's rotate-half, base 10000) of the first `heads` heads of row x."""
    out = x.astype(np.float64).copy()
    half = head_dim // 2
    angle = position / 10000.0 ** (np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    for h in range(heads):
        x1, x2 = x[h * head_dim : h * head_dim + half], x[h * head_dim + half : (h + 1) * head_dim]
        out[h * head_dim : h * head_dim + half] = x1 * cos - x2 * sin
        out[h * head_dim + half : (h + 1) * head_dim] = x2 * cos + x1 * sin
    return out


def rope_tables(max_positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's rotate-half tables: [cos, cos] and [-sin, sin] per position."""
    half = head_dim // 2
    angle = np.arange(max_positions)[:, None] / 10000.0 ** (np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([cos, cos], 1).astype(np.float32), np.concatenate([-sin, sin], 1).astype(np.float32)


def test_updates_rotated_and_split_over_q_k_v():
    """The `cpu` backend's form: q and k updates rotated at each token's position, added to three arrays."""
    slots = LoraSlots(SPEC, 2, "test")
    slots.load(0, ADAPTERS[1])
    slots.load(1, ADAPTERS[0])
    rows = LoraRows(np.array([0, 2, 3]), np.array([0, 1, 0], np.int32))
    x = np.random.default_rng(10).standard_normal((4, SPEC.hidden_size)).astype(np.float32)
    positions = np.array([5, 0, 17, 30])
    cos, sin = rope_tables(SPEC.max_position_embeddings, SPEC.head_dim)
    rotated = (SPEC.num_heads + SPEC.num_kv_heads) * SPEC.head_dim
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((4, w)).astype(np.float32) for w in (40, 8, 8))
    expected = np.concatenate([q, k, v], 1).astype(np.float64)
    unrotated = expected.copy()
    held = {0: ADAPTERS[1], 1: ADAPTERS[0]}
    for r, s in zip(rows.rows, rows.slots, strict=True):
        update = reference(held[s], 1, "qkv", x[[r]])[0]
        expected[r] += rotate(update, positions[r], SPEC.head_dim, SPEC.num_heads + SPEC.num_kv_heads)
        unrotated[r] += update
    slots.add(rows, 1, "qkv", x, (q, k, v), rope=Rope(cos, sin, positions, rotated))
    got = np.concatenate([q, k, v], 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - unrotated).max() > 0.1  # the check catches an update added unrotated
    with pytest.raises(ValueError, match="a position in the tables"):
        slots.add(rows, 1, "qkv", x, (q, k, v), rope=Rope(cos, sin, np.array([5, 0, 17, 64]), rotated))
