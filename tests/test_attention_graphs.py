"""Graph capture and replay of the attention launches at several shapes in one process.

On CPU (Triton's interpreter): plugins_cuda.graph_record.FakeGraph captures `launch_ragged` at
a sweep of decode shapes (split and unsplit, as the benchmark's decode sweep does) and a
prefill, after an eager warm-up each (as triton.testing.do_bench_cudagraph does), then
replays every graph after all were captured, on inputs changed in place, against the
float64 reference. A workspace cached across launches and regrown for a bigger shape (the
pattern that turns graph replays into illegal memory accesses) is caught, as is a host
synchronization during capture. On a GPU (`gpu`): plugins_cuda.graph_check does the same
with torch.cuda.CUDAGraph, in its own process (this module runs the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
from plugins_cuda.interpreter import interpreter_problem  # noqa: E402

interpreted = pytest.mark.skipif(bool(interpreter_problem()), reason=str(interpreter_problem()))

from executors.cpu_attention import AttentionShape  # noqa: E402
from plugins_cuda import decode_attention  # noqa: E402
from plugins_cuda.attention_launch import (  # noqa: E402
    launch_ragged,
    paged_attention,
    paged_attention_padded,
    ragged_layout,
)
from plugins_cuda.decode_attention import plan_splits  # noqa: E402
from plugins_cuda.graph_record import FakeGraph, GraphHazard  # noqa: E402
from tests.test_paged_attention import make_case, reference  # noqa: E402

SHAPE = AttentionShape(8, 2, 32, 16)
SMS = 4  # a small GPU: 16 programs wanted, so small batches split
SWEEP = [(1, 40), (3, 1100), (2, 600), (8, 70), (1, 2000)]  # (batch, context): decodes
PREFILL = [(0, 50), (30, 20)]


class Step:
    """One shape's static buffers (what a graph reads), filled in place between replays."""

    def __init__(self, seqs, seed: int) -> None:
        self.seqs, self.rng = seqs, np.random.default_rng(seed)
        q, k, v, tables, seq_of_token, pos = make_case(self.rng, SHAPE, seqs, num_blocks=512)
        self.seq_of_token = seq_of_token
        self.query_start, self.max_rows = ragged_layout(torch.from_numpy(seq_of_token))
        self.q, self.k, self.v, self.tables, self.pos = (torch.from_numpy(x) for x in (q, k, v, tables, pos))

    def launch(self) -> torch.Tensor:
        return launch_ragged(self.q, self.k, self.v, self.tables, self.pos, self.query_start, self.max_rows,
                             SHAPE.num_kv_heads, sm_count=SMS)  # fmt: skip

    def launch_plugin_pair(self) -> torch.Tensor:
        """The TensorRT plugin pair's launches (padded layout; decodes only: one row a sequence)."""
        batch = self.tables.shape[0]
        q, pos = self.q.view(batch, 1, -1), self.pos.view(batch, 1)
        out = paged_attention_padded(q, self.k, self.v, self.tables, pos, SHAPE.num_kv_heads, SHAPE.head_dim**-0.5,
                                     sm_count=SMS)  # fmt: skip
        return out.view(batch, -1)

    def refill(self) -> None:
        for t in (self.q, self.k, self.v):
            t.copy_(torch.from_numpy(self.rng.standard_normal(t.shape, dtype=np.float32)))

    def want(self) -> np.ndarray:
        args = (self.q, self.k, self.v, self.tables, self.seq_of_token, self.pos)
        return reference(*(a.numpy() if isinstance(a, torch.Tensor) else a for a in args), SHAPE)


def capture(step: Step, plugin: bool = False) -> tuple[FakeGraph, torch.Tensor]:
    launch = step.launch_plugin_pair if plugin else step.launch
    launch()  # eager warm-up first, as do_bench_cudagraph and the backend's graphs do
    graph = FakeGraph()
    with graph.capture():
        out = launch()
    return graph, out


@interpreted
def test_decode_sweep_and_prefill_replay_after_every_capture():
    steps = [Step([(ctx - 1, 1)] * batch, seed) for seed, (batch, ctx) in enumerate(SWEEP)]
    steps.append(Step(PREFILL, 99))
    splits = [plan_splits(b, s.tables.shape[1] * 16, 2, SMS) for (b, _), s in zip(SWEEP, steps, strict=False)]
    assert 1 in splits and max(splits) > 1  # both the one-launch and the split + merge paths
    graphs = [capture(step) for step in steps]
    assert [len(g.launches) for g, _ in graphs[:-1]] == [1 + (n > 1) for n in splits]
    for step, (graph, out) in reversed(list(zip(steps, graphs, strict=True))):
        step.refill()
        graph.replay()
        np.testing.assert_allclose(out.numpy(), step.want(), atol=2e-5)


@interpreted
def test_the_plugin_pair_replays_after_every_capture():
    steps = [Step([(ctx - 1, 1)] * batch, seed) for seed, (batch, ctx) in enumerate(SWEEP[:3])]
    graphs = [capture(step, plugin=True) for step in steps]
    for step, (graph, out) in reversed(list(zip(steps, graphs, strict=True))):
        step.refill()
        graph.replay()
        np.testing.assert_allclose(out.numpy(), step.want(), atol=2e-5)


@interpreted
def test_a_cached_workspace_regrown_for_a_bigger_shape_is_caught(monkeypatch):
    """The broken pattern: one workspace kept across launches, reallocated when a bigger
    shape needs more. The graph captured at the small shape keeps the old pointer."""
    cache: dict[str, torch.Tensor] = {}

    def cached(parts: int, width: int, device):
        if "ws" not in cache or cache["ws"].shape[0] < parts:
            cache["ws"] = torch.empty((parts, width), dtype=torch.float32, device=device)
        return cache["ws"][:parts]

    monkeypatch.setattr(decode_attention, "split_workspace", cached)
    small, big = Step([(1100, 1)], 1), Step([(1100, 1)] * 3, 2)
    graph, _ = capture(small)
    graph.replay()  # fine while the cache still holds the captured buffer
    capture(big)  # the warm-up regrows the cache: the small graph's buffer is freed
    with pytest.raises(GraphHazard, match="partials_ptr was freed after capture"):
        graph.replay()


@interpreted
def test_a_workspace_resized_in_place_is_caught(monkeypatch):
    kept: list[torch.Tensor] = []

    def resized(parts: int, width: int, device):
        if not kept:
            kept.append(torch.empty((parts, width), dtype=torch.float32, device=device))
        elif kept[0].shape[0] < parts:
            kept[0].resize_(parts, width)
        return kept[0][:parts]

    monkeypatch.setattr(decode_attention, "split_workspace", resized)
    small, big = Step([(1100, 1)], 3), Step([(1100, 1)] * 3, 4)  # the inputs stay alive, as a graph needs
    graph, _ = capture(small)
    capture(big)
    with pytest.raises(GraphHazard, match="partials_ptr moved or was resized"):
        graph.replay()


@interpreted
def test_a_host_synchronization_during_capture_is_refused():
    step = Step([(40, 1), (9, 1)], 5)
    with pytest.raises(GraphHazard, match="host synchronization"), FakeGraph().capture():
        paged_attention(step.q, step.k, step.v, step.tables, torch.from_numpy(step.seq_of_token), step.pos, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_graphs_capture_and_replay_the_decode_sweep(tmp_path):
    """torch.cuda.CUDAGraph at the benchmark's decode shapes, replayed after all captures, in a
    fresh process without TRITON_INTERPRET (this module set it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "plugins_cuda.graph_check", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
