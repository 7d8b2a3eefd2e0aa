"""The kernels the TensorRT plugins embed, compiled ahead of time on CPU (no GPU needed): PTX
and cubin for sm_80/89/90 within each arch's shared memory, entries with exactly the plugins'
parameters, `trtserve kernels` writing what the plugins embed, and the plugins' aot_impls
(against a stand-in `tensorrt.plugin`) launching it with attention_launch's grid and splits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

# Compiles run in fresh processes (compile_env); in-process, plugins_cuda is imported as the
# interpreter tests need it, whichever test module is collected first.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
from click.testing import CliRunner

pytest.importorskip("triton")

from plugins_cuda.attention_launch import AttentionTiles, num_splits
from runtime.cli import main

ROOT = Path(__file__).resolve().parents[1]


# inputs + int32 extras + outputs of each plugin node (builder/plugin_graph.py), written out
# independently of plugins_cuda/plugin_kernels.py; the prologue once per tactic
PROLOGUE_PARAMS = 7 + 1 + 3
PLUGIN_PARAMS = {
    "fused_rmsnorm_qkv_rope_decode": PROLOGUE_PARAMS, "fused_rmsnorm_qkv_rope_prefill": PROLOGUE_PARAMS,
    "paged_kv_write": 7 + 2 + 2, "paged_attention": 5 + 3 + 2, "paged_attention_merge": 4 + 2 + 1,
}  # fmt: skip
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
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 3 * len(PLUGIN_PARAMS)
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
    one arch, small shapes: per kernel the stripped PTX (assembles), the cubin and launch JSON;
    the plugins' aot_impls embed the same PTX with the launch attention_launch computes."""
    trtserve = os.path.join(os.path.dirname(sys.executable), "trtserve")
    args = ["kernels", "--arch", "sm_90", "--out", str(tmp_path / "out"), *SMALL, "--window", "8"]
    result = subprocess.run([trtserve, *args], capture_output=True, text=True, env=compile_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{name}.sm_90.{ext}" for name in PLUGIN_PARAMS for ext in ("ptx", "cubin", "json")
    )
    infos = {name: json.loads((out / f"{name}.sm_90.json").read_text()) for name in PLUGIN_PARAMS}
    for name, params in PLUGIN_PARAMS.items():
        ptx_path, info = out / f"{name}.sm_90.ptx", infos[name]
        ptx = ptx_path.read_text()
        assert ptx.count(".target sm_90") == 1 and (out / f"{name}.sm_90.cubin").stat().st_size > 1000
        assert entry_params(ptx) == params == info["plugin_params"], name
        assert sum(len(v) for v in info["params"].values()) == params
        assert f".entry {info['kernel']}(" in ptx and info["global_scratch_bytes"] == 0
        assert info["block_threads"] == 32 * info["num_warps"] and info["arch"] == "sm_90"
        asm = assemble(ptx_path, tmp_path)
        assert asm.returncode == 0, f"{name}: {asm.stderr}"
    attention = infos["paged_attention"]
    assert {k: attention["shapes"][k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size", "window")} \
        == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, "window": 8}  # fmt: skip
    assert attention["params"]["int32"] == ["step", "table_width", "splits"]
    assert attention["params"]["outputs"] == ["ctx", "partials"] and attention["grid"][1:] == ["2", "batch"]
    prologue = infos["fused_rmsnorm_qkv_rope_decode"]
    assert prologue["grid"] == ["ceil(batch * step / 16)", "8", "1"] and prologue["params"]["int32"] == ["tokens"]

    # the plugins' aot_impls, run against a stand-in tensorrt.plugin on concrete shapes
    batch, table_width = 3, 40
    embedded = run_aot_impls(tmp_path, arch=90, window=8, batch=batch, step=1, table_width=table_width)
    for name, launch in embedded["kernels"].items():
        info = infos[name]
        assert launch["ptx"] == (out / f"{name}.sm_90.ptx").read_text(), name
        assert (launch["block_x"], launch["shared"]) == (info["block_threads"], info["shared_memory_bytes"]), name
    tiles = AttentionTiles(2, 32, 2)
    splits = num_splits(batch, 1, table_width, 16, 2, tiles, 132)
    assert splits == 3  # ceil(40 blocks * 16 keys / 256): the decode step splits
    assert embedded["kernels"]["paged_attention"]["grid"] == [splits, 2, batch]
    assert embedded["kernels"]["paged_attention"]["extra"] == [1, table_width, splits]
    assert embedded["kernels"]["paged_attention_merge"]["grid"] == [1, 2, batch]
    assert embedded["kernels"]["paged_attention_merge"]["extra"] == [1, splits]
    assert embedded["kernels"]["fused_rmsnorm_qkv_rope_prefill"]["grid"] == [1, 2, 1]  # 64 tokens, 64 pairs
    assert embedded["partials_shape"] == [1024, tiles.slot_width]
    prefill = run_aot_impls(tmp_path, arch=90, window=8, batch=2, step=37, table_width=table_width)
    assert prefill["kernels"]["paged_attention"]["grid"] == [2, 2, 2]  # 32-token tiles (64 rows / group 2), no split
    assert prefill["kernels"]["paged_attention"]["extra"] == [37, table_width, 1]


# A stand-in for `tensorrt.plugin`: records the decorated functions so that their register and
# aot_impl bodies run without TensorRT; shape expressions carry concrete values (dynamic or
# not). Only what trt_plugins.py touches; it checks nothing about the real API.
FAKE_TRTP = """
import builtins, operator
impls = {}
def _record(kind):
    return lambda name: lambda fn: impls.setdefault((kind, name.split("::")[1]), fn)
register, autotune, aot_impl = _record("register"), _record("autotune"), _record("aot")
TensorDesc = AutoTuneCombination = SymExprs = object
class KernelLaunchParams: pass
class SymIntExprs:
    from_tuple = staticmethod(lambda exprs: [e.value if isinstance(e, Dim) else e for e in exprs])
class Dim:
    def __init__(self, value, constant=True): self.value, self.is_constant = value, constant
    def constant_value(self): return self.value
    def _op(self, other, fn):
        other = other if isinstance(other, Dim) else Dim(other)
        return Dim(int(fn(self.value, other.value)), self.is_constant and other.is_constant)
    __add__ = lambda self, o: self._op(o, operator.add)
    __sub__ = lambda self, o: self._op(o, operator.sub)
    __mul__ = lambda self, o: self._op(o, operator.mul)
    __floordiv__ = lambda self, o: self._op(o, operator.floordiv)
    __lt__ = lambda self, o: self._op(o, operator.lt)
_dim = lambda x: x if isinstance(x, Dim) else Dim(x)
max = lambda a, b: _dim(a)._op(b, builtins.max)
min = lambda a, b: _dim(a)._op(b, builtins.min)
cdiv = lambda a, b: _dim(a)._op(b, lambda x, y: -(-x // y))
SymInt32 = lambda x: x
from_shape_expr = lambda shape, dtype: [_dim(d).value for d in shape]
"""
AOT_IMPLS = """
import json, sys
import numpy as np
import tensorrt.plugin as trtp
from plugins_cuda import trt_plugins
arch, window, B, S, W = (int(a) for a in sys.argv[1:])
trt_plugins.current_arch, trt_plugins.current_sm_count = lambda: arch, lambda: 132
trt_plugins.register_plugins()
class Desc:
    def __init__(self, *shape):
        self.shape_expr = [n if isinstance(n, trtp.Dim) else trtp.Dim(n) for n in shape]
        self.dtype = "fp16"
    def like(self): return self
b, s = trtp.Dim(B, constant=False), trtp.Dim(S, constant=False)
prologue = (Desc(b, s, 64), Desc(64), Desc(64, 256), Desc(256), Desc(512, 16), Desc(512, 16), Desc(b, s), 1e-5,
            np.array([128, 64, 64]), 4, 2)
attention = (Desc(b, s, 128), Desc(99, 16, 64), Desc(99, 16, 64), Desc(b, W), Desc(b, s), np.array([0, -1, 64]),
             4, 2, 32 ** -0.5, window)
calls = {
    "fused_rmsnorm_qkv_rope_decode": ("FusedRMSNormQKVRoPE", *prologue, 1),
    "fused_rmsnorm_qkv_rope_prefill": ("FusedRMSNormQKVRoPE", *prologue, 2),
    "paged_kv_write": ("PagedKVWrite", Desc(b, s, 64), Desc(b, s, 64), Desc(99, 16, 64), Desc(99, 16, 64),
                       Desc(b, W), Desc(b, s), Desc(b), 16, 0),
    "paged_attention": ("PagedAttention", *attention, 0),
    "paged_attention_merge": ("PagedAttentionMerge", Desc(b, s, 128), Desc(1024, 528), Desc(b, W), Desc(b, s),
                              4, 2, 32, 16, 0),
}
out = {"kernels": {}}
for name, (plugin, *args, tactic) in calls.items():
    _, ptx, launch, extra = trtp.impls[("aot", plugin)](*args, (), tactic)
    grid = [trtp._dim(g).value for g in (launch.grid_x, launch.grid_y, launch.grid_z)]
    out["kernels"][name] = dict(ptx=ptx.decode(), block_x=launch.block_x, grid=grid, shared=launch.shared_mem,
                                extra=extra)
out["partials_shape"] = trtp.impls[("register", "PagedAttention")](*attention)[1]
print(json.dumps(out))
"""


def run_aot_impls(tmp_path, arch: int, window: int, batch: int, step: int, table_width: int) -> dict:
    """trt_plugins' aot_impls on SMALL's shapes: kernel -> PTX, block_x, grid, shared, int32 extras."""
    fake = tmp_path / "fake"
    if not fake.exists():
        (fake / "tensorrt").mkdir(parents=True)
        (fake / "tensorrt" / "__init__.py").write_text('float32, float16, bfloat16 = "fp32", "fp16", "bf16"')
        (fake / "tensorrt" / "plugin.py").write_text(FAKE_TRTP)
    env = compile_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT), env.get("PYTHONPATH", "")])
    argv = [str(n) for n in (arch, window, batch, step, table_width)]
    result = subprocess.run([sys.executable, "-c", AOT_IMPLS, *argv], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--num-heads", "9", "--num-kv-heads", "2"], "--num-heads"),
        (["--num-kv-heads", "0"], "--num-kv-heads"),
        (["--head-dim", "48"], "--head-dim"),
        (["--block-size", "0"], "--block-size"),
        (["--window", "-1"], "--window"),
    ],
)
def test_trtserve_kernels_refuses_bad_shapes_before_compiling(tmp_path, args, option):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["kernels", "--arch", "sm_90", "--out", str(out), *args])
    assert result.exit_code == 2, result.output  # click's usage error, not a crash
    assert option in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()  # refused before compiling anything
