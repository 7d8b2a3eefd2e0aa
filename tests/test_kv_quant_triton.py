"""The quantized-pool Triton kernels (plugins_cuda/kv_write_quant.py, paged_attention_quant.py) on
CPU under Triton's interpreter: the writes store numpy's bytes (executors/kv_quant.py), the
attention dequantizing in registers matches the float reference over explicitly dequantized pools
(decodes, prefill chunks, GQA, a window, a split decode), in the plugins' padded layout and in the
torch backend's flat ragged one (tests/test_torch_kv_quant.py runs that backend), the plugin ops'
ONNX reference bodies agree with the kernels, and a corrupted scale is caught. AOT compilation of
the plugin kernels for sm_80/89/90 runs in a subprocess (no GPU needed); running them on a GPU is
marked `gpu`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# TRTSERVE_KV_GPU=1 (test_..._on_a_gpu's subprocess): the same checks with the kernels compiled for the GPU.
DEVICE = "cuda" if os.environ.get("TRTSERVE_KV_GPU") == "1" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from builder.onnx_graph import OPSET  # noqa: E402
from builder.plugin_functions import DOMAIN, MERGE, merge_function  # noqa: E402
from builder.plugin_functions_kv import QUANTIZED_OPS, quantized_functions  # noqa: E402
from executors.cpu_attention import AttentionShape  # noqa: E402
from executors.kv_quant import decode_fp8, dequantize_int8, encode_fp8, quantize_int8  # noqa: E402
from plugins_cuda.kv_write_quant import paged_kv_write_fp8, paged_kv_write_int8  # noqa: E402
from plugins_cuda.paged_attention_quant import launch_ragged_quant, paged_attention_padded_quant  # noqa: E402
from tests.test_paged_attention import reference  # noqa: E402
from tests.test_plugin_kernels import LONG_DECODES, SEQS, padded_case, write_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KV_SCALES = np.array([[0.02, 0.03], [0.011, 0.017]], np.float32)  # fp8: 2 layers x (K, V)
LAYER = 1


def _t(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE)


def quantized_case(rng, seqs, shape: AttentionShape, kind: str, num_blocks: int = 200):
    """A padded step over a pool already holding quantized rows: (k, v, pools, scales, tables,
    positions, seq_lens); pools hold codes of random rows (int8 scales: their row scales)."""
    kv_width = shape.num_kv_heads * shape.head_dim
    k, v, floats, tables, positions, seq_lens = padded_case(rng, seqs, kv_width, shape.block_size, num_blocks)
    k[0, 0, :4] = [1.5, -2.5, 0.5, 8.0]  # exact int8 ties once scaled (absmax/127 below) and fp8 values
    if kind == "int8":
        coded = [quantize_int8(p.reshape(-1, kv_width), shape.num_kv_heads) for p in floats]
        pools = [c.reshape(floats[0].shape) for c, _ in coded]
        scales = [s.reshape(*floats[0].shape[:2], shape.num_kv_heads) for _, s in coded]
    else:
        pools = [encode_fp8(p, float(KV_SCALES[LAYER, side])) for side, p in enumerate(floats)]
        scales = [KV_SCALES]
    return k, v, pools, scales, tables, positions, seq_lens


def numpy_write(kind, k, v, pools, scales, tables, positions, seq_lens, heads):
    """The numpy twin: quantize the float rows, place them as the float write would."""
    if kind == "int8":
        rows = [quantize_int8(x.reshape(-1, x.shape[-1]), heads) for x in (k, v)]
        codes = [c.reshape(k.shape) for c, _ in rows]
        row_scales = [s.reshape(*k.shape[:2], heads) for _, s in rows]
        return (*write_reference(*codes, pools, tables, positions, seq_lens),
                *write_reference(*row_scales, scales, tables, positions, seq_lens))  # fmt: skip
    codes = [encode_fp8(x, float(KV_SCALES[LAYER, side])) for side, x in enumerate((k, v))]
    return write_reference(*codes, pools, tables, positions, seq_lens)


def kernel_write(kind, k, v, pools, scales, tables, positions, seq_lens):
    """The Triton write on copies of the pools; returns them."""
    pools = [_t(p.copy()) for p in pools]
    scales = [_t(s.copy()) for s in scales]
    step = [_t(x) for x in (k, v)] + pools + [_t(x) for x in (tables, positions, seq_lens)]
    if kind == "int8":
        paged_kv_write_int8(*step, *scales)
        return [x.cpu().numpy() for x in pools + scales]
    paged_kv_write_fp8(*step, scales[0], LAYER)
    return [x.cpu().numpy() for x in pools]


def dequantized(kind, pools, scales):
    if kind == "int8":
        return [dequantize_int8(p, s) for p, s in zip(pools, scales, strict=True)]
    return [decode_fp8(p, float(KV_SCALES[LAYER, side])) for side, p in enumerate(pools)]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_write_stores_numpy_bytes_and_skips_padding(kind):
    shape = AttentionShape(8, 3, 16, 8)  # 3 kv heads: a head count that is no power of two
    k, v, pools, scales, tables, positions, seq_lens = quantized_case(np.random.default_rng(0), SEQS, shape, kind)
    k *= np.float32(40.0)  # fp8: past 448 * scale, saturates
    got = kernel_write(kind, k, v, pools, scales, tables, positions, seq_lens)
    want = numpy_write(kind, k, v, pools, scales, tables, positions, seq_lens, shape.num_kv_heads)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(got[0], pools[0])  # something was written


def attend(kind, q, pools, scales, tables, positions, shape, window=0):
    tensors = [_t(x) for x in (q, *pools, tables, positions)]
    out = paged_attention_padded_quant(*tensors, shape.num_kv_heads, shape.head_dim**-0.5, kind,
                                       tuple(_t(s) for s in scales), layer=LAYER, window=window)  # fmt: skip
    return out.cpu().numpy()


CASES = [
    (AttentionShape(9, 3, 64, 16), 0, SEQS),  # prefill chunks after cached prefixes + decodes, GQA 3:1
    (AttentionShape(4, 4, 32, 16), 7, SEQS),  # a sliding window, no GQA
    (AttentionShape(8, 2, 32, 16), 0, LONG_DECODES),  # decodes split over programs + merge, GQA 4:1
]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("shape", "window", "seqs"), CASES)
def test_write_then_attention_matches_the_dequantized_reference(kind, shape, window, seqs):
    rng = np.random.default_rng(3)
    k, v, pools, scales, tables, positions, seq_lens = quantized_case(rng, seqs, shape, kind)
    written = kernel_write(kind, k, v, pools, scales, tables, positions, seq_lens)
    pools, scales = written[:2], written[2:] or scales
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    got = attend(kind, q, pools, scales, tables, positions, shape, window)
    real = [(b, i) for b in range(len(seqs)) for i in range(seq_lens[b])]
    flat = dict(q=np.stack([q[r] for r in real]), seq_of_token=np.array([b for b, _ in real]),
                positions=np.array([positions[r] for r in real]))  # fmt: skip
    deq_k, deq_v = dequantized(kind, pools, scales)
    want = reference(flat["q"], deq_k, deq_v, tables, flat["seq_of_token"], flat["positions"], shape, window or None)
    np.testing.assert_allclose(np.stack([got[r] for r in real]), want, atol=2e-5)
    assert not np.any([got[b, i] for b in range(len(seqs)) for i in range(seq_lens[b], positions.shape[1])])
    # The check can fail: reading the codes as if they were values is far off.
    raw = [p.astype(np.float32) for p in pools]
    wrong = reference(flat["q"], *raw, tables, flat["seq_of_token"], flat["positions"], shape, window or None)
    assert np.abs(wrong - want).max() > 1e-2


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("shape", "window", "seqs"), CASES)
def test_ragged_attention_matches_the_dequantized_reference(kind, shape, window, seqs):
    """launch_ragged_quant (the torch backend's layout: flat tokens, query_start; fp8 scales as the
    layer's two scalars) over the pools the write produced."""
    rng = np.random.default_rng(3)
    k, v, pools, scales, tables, positions, seq_lens = quantized_case(rng, seqs, shape, kind)
    written = kernel_write(kind, k, v, pools, scales, tables, positions, seq_lens)
    pools, scales = written[:2], written[2:] or scales
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    real = [(b, i) for b in range(len(seqs)) for i in range(seq_lens[b])]
    flat_q, flat_positions = np.stack([q[r] for r in real]), np.array([positions[r] for r in real])
    query_start = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    layer_scales = scales if kind == "int8" else [KV_SCALES[LAYER, 0:1], KV_SCALES[LAYER, 1:2]]
    got = launch_ragged_quant(_t(flat_q), _t(pools[0]), _t(pools[1]), _t(tables), _t(flat_positions),
                              _t(query_start), int(seq_lens.max()), shape.num_kv_heads, kind,
                              tuple(_t(s) for s in layer_scales), window=window)  # fmt: skip
    seq_of_token = np.array([b for b, _ in real])
    want = reference(flat_q, *dequantized(kind, pools, scales), tables, seq_of_token, flat_positions, shape,
                     window or None)  # fmt: skip
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=2e-5)


def test_a_corrupted_scale_is_caught():
    """One block's int8 K scales doubled after the write: the kernel reads them (the outputs of the
    sequence owning the block move away from the reference), and only that sequence's."""
    shape = AttentionShape(8, 2, 32, 16)
    rng = np.random.default_rng(4)
    k, v, pools, scales, tables, positions, seq_lens = quantized_case(rng, SEQS, shape, "int8")
    written = kernel_write("int8", k, v, pools, scales, tables, positions, seq_lens)
    pools, scales = written[:2], written[2:]
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    good = attend("int8", q, pools, scales, tables, positions, shape)
    corrupted = [scales[0].copy(), scales[1]]
    corrupted[0][tables[3, 0]] *= 2.0  # sequence 3's first block (positions 0..15 of its 19 cached)
    bad = attend("int8", q, pools, corrupted, tables, positions, shape)
    assert np.abs(bad[3, :5] - good[3, :5]).max() > 1e-2
    others = [b for b in range(len(SEQS)) if b != 3 and tables[3, 0] not in tables[b]]
    np.testing.assert_array_equal(bad[others], good[others])


def reference_graph(kind: str, shape: AttentionShape):
    """Quantized KV write -> attention -> merge wired as the plugin graph wires them (ONNX bodies)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    pool = TensorProto.INT8 if kind == "int8" else TensorProto.UINT8
    write_op, attention_op = QUANTIZED_OPS[kind]
    extra_in = ["key_scales", "value_scales"] if kind == "int8" else ["kv_scales"]
    written = ["kw", "vw"] + (["ksw", "vsw"] if kind == "int8" else [])
    attrs = {"kv_head_shape": [shape.num_kv_heads, shape.head_dim]} if kind == "int8" else {"layer": LAYER}
    common = ["block_tables", "positions"]
    nodes = [
        helper.make_node(write_op, ["k", "v", "key_cache", "value_cache", *common, "seq_lens", *extra_in], written,
                         domain=DOMAIN, block_size=shape.block_size, **attrs),
        helper.make_node(attention_op, ["q", "kw", "vw", *common, *(written[2:] or extra_in)], ["unmerged", "partials"],
                         domain=DOMAIN, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, window=0,
                         scale=shape.head_dim**-0.5, cached_shape=[0, -1, shape.num_kv_heads * shape.head_dim],
                         **attrs),
        helper.make_node(MERGE, ["unmerged", "partials", *common], ["ctx"], domain=DOMAIN, num_heads=shape.num_heads,
                         num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, block_size=shape.block_size),
    ]  # fmt: skip
    names = [("q", f), ("k", f), ("v", f), ("key_cache", pool), ("value_cache", pool), ("block_tables", i64),
             ("positions", i64), ("seq_lens", i64)] + [(n, f) for n in extra_in]  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in [("ctx", f), ("kw", pool), ("vw", pool)]]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, t, None) for n, t in names],
                              outputs)  # fmt: skip
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=[*quantized_functions(kind), merge_function()])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_onnx_reference_functions_agree_with_the_kernels(kind):
    ort = pytest.importorskip("onnxruntime")
    shape = AttentionShape(8, 2, 32, 16)
    rng = np.random.default_rng(5)
    seqs = [(700, 2), (13, 1), (1030, 2)]
    k, v, pools, scales, tables, positions, seq_lens = quantized_case(rng, seqs, shape, kind)
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    session = ort.InferenceSession(reference_graph(kind, shape).SerializeToString(), providers=["CPUExecutionProvider"])
    extra = dict(key_scales=scales[0], value_scales=scales[1]) if kind == "int8" else dict(kv_scales=KV_SCALES)
    want, k_pool, v_pool = session.run(None, dict(q=q, k=k, v=v, key_cache=pools[0], value_cache=pools[1],
                                                  block_tables=tables, positions=positions, seq_lens=seq_lens,
                                                  **extra))  # fmt: skip
    written = kernel_write(kind, k, v, pools, scales, tables, positions, seq_lens)
    np.testing.assert_array_equal(written[0], k_pool)  # the same bytes stored
    np.testing.assert_array_equal(written[1], v_pool)
    got = attend(kind, q, written[:2], written[2:] or scales, tables, positions, shape)
    real = [(b, i) for b in range(len(seqs)) for i in range(seq_lens[b])]
    np.testing.assert_allclose(np.stack([got[r] for r in real]), np.stack([want[r] for r in real]), atol=2e-5)


def test_aot_compiles_the_quantized_kernels_for_sm80_sm89_sm90():
    """Real PTX for every architecture the plugins target (a fresh process, without the interpreter)."""
    script = (
        "from plugins_cuda.kv_write_quant import compile_int8_for_arch, compile_fp8_for_arch\n"
        "from plugins_cuda.paged_attention_quant import compile_attention_quant\n"
        "for arch in (80, 89, 90):\n"
        "    for k in (compile_int8_for_arch(arch, 'bfloat16', 3, 64, 16),\n"
        "              compile_fp8_for_arch(arch, 'bfloat16', 192, 16, 1),\n"
        "              compile_attention_quant(arch, 'bfloat16', 'int8', 3, 3, 64, 16, 0.125),\n"
        "              compile_attention_quant(arch, 'bfloat16', 'fp8', 3, 3, 64, 16, 0.125, layer=1)):\n"
        "        assert '.entry' in k.asm['ptx'] and k.asm['cubin'], arch\n"
        "print('ok')\n"
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
def test_the_same_checks_pass_on_a_gpu():
    """Every interpreter check above, with the kernels compiled for the GPU (a fresh process)."""
    if not Path("/proc/driver/nvidia/gpus").is_dir() or not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: here the quantized kernels ran only under TRITON_INTERPRET=1")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRTSERVE_KV_GPU": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", __file__, "-k", "not aot and not gpu"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:]
