"""The plugin-layout Triton kernels (padded [batch, step], as the TensorRT plugin nodes see
them) on CPU under Triton's interpreter: PagedKVWrite against a per-row numpy loop, and
KV write + padded PagedAttention against the numpy attention reference; plus the AOT
compilation of the three kernels the plugins embed for sm_80/89/90 and `trtserve kernels`
(no GPU needed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from engine_format import ceil_div  # noqa: E402
from plugins_cuda.kv_write import paged_kv_write  # noqa: E402
from plugins_cuda.paged_attention import paged_attention_padded  # noqa: E402
from runtime.backends.cpu_attention import AttentionShape  # noqa: E402
from runtime.cli import main  # noqa: E402
from tests.test_paged_attention import reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def padded_case(rng, seqs: list[tuple[int, int]], kv_width: int, block_size: int, num_blocks: int = 48):
    """(past_len, new_tokens) per sequence -> padded step inputs, block tables covering the step."""
    batch, step = len(seqs), max(n for _, n in seqs)
    need = [ceil_div(past + n, block_size) for past, n in seqs]
    ids = rng.permutation(num_blocks)[: sum(need)]
    tables = np.zeros((batch, max(need)), np.int64)
    positions = np.zeros((batch, step), np.int64)
    for b, (past, n) in enumerate(seqs):
        tables[b, : need[b]] = ids[sum(need[:b]) : sum(need[: b + 1])]
        positions[b, :n] = np.arange(past, past + n)
        positions[b, n:] = past + n - 1  # padding repeats the last position
    k = rng.standard_normal((batch, step, kv_width), dtype=np.float32)
    v = rng.standard_normal((batch, step, kv_width), dtype=np.float32)
    pools = [rng.standard_normal((num_blocks, block_size, kv_width), dtype=np.float32) for _ in range(2)]
    seq_lens = np.array([n for _, n in seqs], np.int64)
    return k, v, pools, tables, positions, seq_lens


def write_reference(k, v, pools, tables, positions, seq_lens):
    """Row by row: only real rows move, each to its block-table slot."""
    k_pool, v_pool = (p.copy() for p in pools)
    block_size = k_pool.shape[1]
    for b in range(k.shape[0]):
        for i in range(seq_lens[b]):
            p = positions[b, i]
            block = tables[b, p // block_size]
            k_pool[block, p % block_size] = k[b, i]
            v_pool[block, p % block_size] = v[b, i]
    return k_pool, v_pool


def run_write(k, v, pools, tables, positions, seq_lens):
    k_pool, v_pool = (torch.from_numpy(p.copy()) for p in pools)
    args = [torch.from_numpy(x) for x in (k, v)] + [k_pool, v_pool]
    paged_kv_write(*args, *(torch.from_numpy(x) for x in (tables, positions, seq_lens)))
    return k_pool.numpy(), v_pool.numpy()


SEQS = [(0, 1), (13, 1), (0, 9), (19, 5), (40, 2)]  # decodes, a prefill, chunks after a cached prefix


@pytest.mark.parametrize(("kv_width", "block_size"), [(48, 16), (64, 8), (128, 32)])
def test_kv_write_matches_reference_and_skips_padding(kv_width, block_size):
    case = padded_case(np.random.default_rng(0), SEQS, kv_width, block_size)
    got, want = run_write(*case), write_reference(*case)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(want[0], case[2][0])  # something was written


def test_kv_write_catches_a_wrong_seq_len():
    k, v, pools, tables, positions, seq_lens = padded_case(np.random.default_rng(1), SEQS, 48, 16)
    want = write_reference(k, v, pools, tables, positions, seq_lens)
    broken = seq_lens.copy()
    broken[0] = 3  # padding rows of sequence 0 would overwrite its real row's slot
    assert not np.array_equal(run_write(k, v, pools, tables, positions, broken)[0], want[0])


@pytest.mark.parametrize(
    ("shape", "window"),
    [(AttentionShape(9, 3, 64, 16), 0), (AttentionShape(8, 2, 16, 32), 0), (AttentionShape(4, 4, 32, 16), 7)],
)
def test_write_then_padded_attention_matches_reference(shape, window):
    rng = np.random.default_rng(2)
    kv_width = shape.num_kv_heads * shape.head_dim
    k, v, pools, tables, positions, seq_lens = padded_case(rng, SEQS, kv_width, shape.block_size)
    k_pool, v_pool = run_write(k, v, pools, tables, positions, seq_lens)
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    got = paged_attention_padded(
        torch.from_numpy(q), torch.from_numpy(k_pool), torch.from_numpy(v_pool), torch.from_numpy(tables),
        torch.from_numpy(positions), shape.num_kv_heads, shape.head_dim**-0.5, window,
    ).numpy()  # fmt: skip
    real = [(b, i) for b in range(len(SEQS)) for i in range(seq_lens[b])]
    flat_q = np.stack([q[b, i] for b, i in real])
    seq_of_token = np.array([b for b, _ in real])
    flat_pos = np.array([positions[b, i] for b, i in real])
    want = reference(flat_q, k_pool, v_pool, tables, seq_of_token, flat_pos, shape, window=window or None)
    np.testing.assert_allclose(np.stack([got[b, i] for b, i in real]), want, atol=2e-5)
    # the check can fail: attention over the pool before this step's rows were written differs
    stale = reference(flat_q, *pools, tables, seq_of_token, flat_pos, shape, window=window or None)
    assert np.abs(stale - want).max() > 1e-2


# inputs + int32 extras + outputs of each plugin node (builder/plugin_graph.py), written out
# independently of plugins_cuda/plugin_kernels.py
PLUGIN_PARAMS = {"fused_rmsnorm_qkv_rope": 7 + 1 + 3, "paged_kv_write": 7 + 2 + 2, "paged_attention": 5 + 2 + 1}
SM_SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block


def compile_env() -> dict[str, str]:
    """A fresh process compiles: this module's interpreter mode must not leak into it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return env


def entry_params(ptx: str) -> int:
    entry = ptx[ptx.index(".entry") :]
    return entry[: entry.index(")")].count(".param")


def test_aot_compiles_plugin_kernels_for_sm80_sm89_sm90():
    """The kernels the plugins embed (plugins_cuda/plugin_kernels.py, SmolLM2-135M in bfloat16):
    PTX/cubin per arch, no scratch, and the PTX entry takes exactly the plugin's arguments plus
    Triton's two hidden scratch pointers, which plugin_ptx drops."""
    script = (
        "import json\n"
        "from plugins_cuda.plugin_kernels import ModelShapes\n"
        "out = {}\n"
        "for arch in (80, 89, 90):\n"
        "    for name, k in ModelShapes('bfloat16', 576, 9, 3, 64, 64).kernels(arch).items():\n"
        "        m = k.compiled.metadata\n"
        "        out[f'{name}.{arch}'] = dict(ptx=k.compiled.asm['ptx'], plugin_ptx=k.ptx(), shared=m.shared,\n"
        "            cubin=len(k.compiled.asm['cubin']), scratch=m.global_scratch_size + m.profile_scratch_size,\n"
        "            plugin_params=k.plugin_params)\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=compile_env(),
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 9
    for key, info in compiled.items():
        name, arch = key.split(".")
        assert f".target sm_{arch}" in info["ptx"] and info["cubin"] > 1000 and info["scratch"] == 0, key
        assert info["shared"] <= SM_SHARED_LIMIT[int(arch)], key
        assert info["plugin_params"] == PLUGIN_PARAMS[name], key
        assert entry_params(info["ptx"]) == PLUGIN_PARAMS[name] + 2, key
        assert entry_params(info["plugin_ptx"]) == PLUGIN_PARAMS[name], key


def assemble(ptx_path, tmp_path) -> subprocess.CompletedProcess:
    """`ptxas` on a PTX file, for its `.target`: the ptxas Triton ships and picked the PTX
    `.version` for (a system CUDA toolkit may be older than that version)."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target (sm_(\d+)\w*)", ptx_path.read_text(), re.MULTILINE)
    ptxas = get_ptxas(int(target.group(2))).path
    if not os.path.exists(ptxas):
        pytest.skip(f"ptxas not found at {ptxas}")
    cmd = [ptxas, f"-arch={target.group(1)}", str(ptx_path), "-o", str(tmp_path / "check.cubin")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


SMALL = ["--hidden", "64", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "32", "--block-size", "16"]


def test_trtserve_kernels_writes_what_the_plugins_embed(tmp_path):
    """`trtserve kernels` through the installed script and the `trtserve.commands` entry point,
    one arch, small shapes: per kernel the stripped PTX (assembles), the cubin and launch JSON."""
    trtserve = os.path.join(os.path.dirname(sys.executable), "trtserve")
    args = ["kernels", "--arch", "sm_90", "--out", str(tmp_path / "out"), *SMALL, "--window", "8"]
    result = subprocess.run([trtserve, *args], capture_output=True, text=True, env=compile_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{name}.sm_90.{ext}" for name in PLUGIN_PARAMS for ext in ("ptx", "cubin", "json")
    )
    for name, params in PLUGIN_PARAMS.items():
        ptx_path = out / f"{name}.sm_90.ptx"
        ptx = ptx_path.read_text()
        info = json.loads((out / f"{name}.sm_90.json").read_text())
        assert ptx.count(".target sm_90") == 1 and (out / f"{name}.sm_90.cubin").stat().st_size > 1000
        assert entry_params(ptx) == params == info["plugin_params"], name
        assert sum(len(v) for v in info["params"].values()) == params
        assert f".entry {info['kernel']}(" in ptx and info["global_scratch_bytes"] == 0
        assert info["block_threads"] == 32 * info["num_warps"] and info["arch"] == "sm_90"
        asm = assemble(ptx_path, tmp_path)
        assert asm.returncode == 0, f"{name}: {asm.stderr}"
    attention = json.loads((out / "paged_attention.sm_90.json").read_text())
    assert attention["shapes"] == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16,
                                   "scale": 32**-0.5, "window": 8}  # fmt: skip
    assert attention["grid"] == ["batch * step", 2]
    prologue = json.loads((out / "fused_rmsnorm_qkv_rope.sm_90.json").read_text())
    assert prologue["grid"] == ["ceil(batch * step / 16)", 8] and prologue["params"]["int32"] == ["tokens"]
    # the plugins' aot_impls, run against a stand-in tensorrt.plugin, return the same PTX
    embedded = run_aot_impls(tmp_path, arch=90, window=8)
    for name, (ptx, block_x, grid_y, shared) in embedded.items():
        info = json.loads((out / f"{name}.sm_90.json").read_text())
        assert ptx == (out / f"{name}.sm_90.ptx").read_text(), name
        assert (block_x, grid_y, shared) == (info["block_threads"], info["grid"][1], info["shared_memory_bytes"])


# A stand-in for `tensorrt.plugin`: records the decorated functions so their aot_impls can run
# without TensorRT. Only what trt_plugins.py touches; it checks nothing about the real API.
FAKE_TRTP = """
impls = {}
def _record(kind):
    return lambda name: lambda fn: impls.setdefault((kind, name.split("::")[1]), fn)
register, autotune, aot_impl = _record("register"), _record("autotune"), _record("aot")
TensorDesc = AutoTuneCombination = SymExprs = object
class KernelLaunchParams: pass
class SymIntExprs:
    from_tuple = staticmethod(tuple)
SymInt32 = lambda x: x
cdiv = lambda a, b: ("cdiv", a, b)
"""
AOT_IMPLS = """
import json, sys
import numpy as np
import tensorrt.plugin as trtp
from plugins_cuda import trt_plugins
trt_plugins.current_arch = lambda: int(sys.argv[1])
trt_plugins.register_plugins()
class Dim:
    def __init__(self, value=None): self.is_constant, self.constant_value = value is not None, value
    def __mul__(self, other): return ("mul", self, other)
class Desc:
    def __init__(self, *shape): self.shape_expr, self.dtype = [Dim(n) for n in shape], "fp16"
B = S = None  # dynamic batch and step
calls = {
    "fused_rmsnorm_qkv_rope": ("FusedRMSNormQKVRoPE", Desc(B, S, 64), Desc(64), Desc(64, 256), Desc(256),
                               Desc(512, 16), Desc(512, 16), Desc(B, S), 1e-5, np.array([128, 64, 64]), 4, 2),
    "paged_kv_write": ("PagedKVWrite", Desc(B, S, 64), Desc(B, S, 64), Desc(99, 16, 64), Desc(99, 16, 64),
                       Desc(B, 8), Desc(B, S), Desc(B), 16),
    "paged_attention": ("PagedAttention", Desc(B, S, 128), Desc(99, 16, 64), Desc(99, 16, 64), Desc(B, 8),
                        Desc(B, S), np.array([-1, 16, 64]), 4, 2, 32 ** -0.5, int(sys.argv[2])),
}
out = {}
for name, (plugin, *args) in calls.items():
    _, ptx, launch, _ = trtp.impls[("aot", plugin)](*args, (), 0)
    out[name] = (ptx.decode(), launch.block_x, launch.grid_y, launch.shared_mem)
print(json.dumps(out))
"""


def run_aot_impls(tmp_path, arch: int, window: int) -> dict:
    """trt_plugins' three aot_impls on SMALL's shapes: kernel -> (PTX, block_x, grid_y, shared)."""
    (tmp_path / "fake" / "tensorrt").mkdir(parents=True)
    (tmp_path / "fake" / "tensorrt" / "__init__.py").write_text('float32, float16, bfloat16 = "fp32", "fp16", "bf16"')
    (tmp_path / "fake" / "tensorrt" / "plugin.py").write_text(FAKE_TRTP)
    env = compile_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", AOT_IMPLS, str(arch), str(window)], capture_output=True,
                            text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--num-heads", "9", "--num-kv-heads", "2"], "--num-heads"),
        (["--num-kv-heads", "0"], "--num-kv-heads"),
        (["--head-dim", "48"], "--head-dim"),
        (["--block-size", "24"], "--block-size"),
        (["--window", "-1"], "--window"),
    ],
)
def test_trtserve_kernels_refuses_bad_shapes_before_compiling(tmp_path, args, option):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["kernels", "--arch", "sm_90", "--out", str(out), *args])
    assert result.exit_code == 2, result.output  # click's usage error, not a crash
    assert option in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()  # refused before compiling anything
