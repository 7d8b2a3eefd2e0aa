"""The new attention tiles' cost read off their AOT build (no GPU): on sm_90 the prefill kernel
runs its dots on wgmma, neither it nor the decode kernel spills, and every kernel fits the
architecture's shared memory; on sm_80 (mma.sync) the prefill's narrower key tile does not
spill either. The full table: `python -m plugins_cuda.resources` (benchmarks/results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import json
from plugins_cuda import resources
rows = []
for arch in (80, 90):
    for name, config, build in resources.builds(arch):
        if name.startswith(("prefill", "decode")) and "d128 block16" in config:
            rows.append(resources.describe(name, config, arch, build()))
print(json.dumps(rows))
"""


def test_attention_tiles_fit_without_spills_and_use_wgmma_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["kernel"], r["arch"]): r for r in json.loads(result.stdout.strip().splitlines()[-1])}
    assert set(rows) == {(k, a) for k in ("prefill", "decode", "decode split") for a in (80, 90)}
    for key, row in rows.items():
        assert row["spill_stores"] == row["spill_loads"] == 0, key
        assert 0 < row["registers"] <= 255 and row["shared"] <= row["shared_limit"], key
        assert row["cp_async"] > 0, key  # the K/V loads are pipelined
    assert rows["prefill", 90]["wgmma"] > 0 and rows["prefill", 90]["warps"] == 8
    assert rows["prefill", 80]["wgmma"] == 0 and "128x32" in rows["prefill", 80]["config"]
