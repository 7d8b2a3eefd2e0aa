"""`python -m benchmarks.gpu --out DIR`: the project's check on a CUDA machine, in one command.

Parts, each in its own process (a CUDA fault poisons the process that hit it; and importing
tests/test_kv_quant_triton.py switches Triton to its interpreter for the whole process), each writing its
JSON into DIR as soon as it ends, so a run cut short keeps what it measured:
- `kernels`: `python -m plugins_cuda.check --no-bench` (every kernel against its float64 reference,
  fp32/fp16/bf16);
- `graphs`: `python -m plugins_cuda.graph_check` (the attention launchers captured in CUDA graphs and
  replayed, every decode bucket and a prefill, against the same launches run plainly);
- `bench`: `python -m plugins_cuda.bench` (the kernels before/after, plain launches and graph replays);
- `tests`: the GPU-capable test files, one pytest process each;
- `engine`: LLMEngine over the torch backend (bf16, CUDA graphs, device sampling, overlapped scheduling)
  against HF eager `generate` (static batch 64) on the same GPU, same random prompts, EOS ignored: output
  tok/s, TTFT and TPOT p50, and a single stream's TTFT / TPOT; on random-weight models of SmolLM2-135M's
  and Llama-3.2-1B's shapes (the weights do not change the speed; real ones cannot travel to a lent GPU).
  The engine loop is timed as served: its step returns token ids, text is made on another thread.
- `kv_tiers`: `python -m benchmarks.kv_tier_copy` (whole KV blocks gathered from the device's pool into host
  payloads and scattered back, GB/s at 1/16/128 blocks: the host tier's copy bandwidth over the bus).
- `lora`: `python -m benchmarks.lora_kernel` (the multi-LoRA SGMV kernels, shrink + expand over 8 adapter
  slots, against the bf16 qkv projection they ride on, SmolLM2-135M's and Llama-3.2-1B's shapes, ranks 16 and 64,
  decode 64/256 rows and a 4 x 512 prefill: median µs of each and their ratio, plain launches and graph replays;
  under a minute).
Sized for about 8 minutes on one H100/H200; `--parts` picks some. `--dry-run` runs the same code on the
CPU at toy sizes (Triton interpreted), which is how this file is tested where there is no GPU; without
CUDA and without `--dry-run` the command runs nothing and exits 2 at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

# The order the parts run in: the most wanted first.
PARTS = ("kernels", "graphs", "engine", "kv_tiers", "lora", "bench", "tests")
GPU_TESTS = (
    "tests/test_torch_backend.py",
    "tests/test_torch_sampler.py",
    "tests/test_torch_kv_quant.py",
    "tests/test_kv_quant_triton.py",
    "tests/test_triton_kernels.py",
)
SHAPES = {  # random-weight models: (layers, hidden, intermediate, heads, kv heads, head_dim, vocab, tied)
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152, True),
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 64, 49152, True),
}


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--parts", default=",".join(PARTS), show_default=True)
@click.option("--dry-run", is_flag=True, help="Toy sizes on the CPU (the plumbing, not the speed).")
@click.option("--part-timeout-s", default=300, show_default=True, type=click.IntRange(10))
def main(out: Path, parts: str, dry_run: bool, part_timeout_s: int) -> None:
    if not dry_run and not _cuda_available():  # before DIR or any part: on a CPU the engine part ran 10+ minutes
        raise click.UsageError(NO_CUDA)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in parts.split(",") if p]
    unknown = set(chosen) - set(PARTS)
    if unknown:
        raise click.UsageError(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    _write(out / "environment.json", environment())
    for part in chosen:
        commands = _commands(part, out, dry_run)
        for name, command in commands:
            start = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=part_timeout_s)
                result = {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-6000:]}
            except subprocess.TimeoutExpired as exc:
                result = {"returncode": "timeout", "tail": str(exc.stdout or "")[-6000:]}
            result["seconds"] = round(time.perf_counter() - start, 1)
            _write(out / f"{name}.run.json", {"command": command, **result})  # the part's own figures: {name}.json
            click.echo(f"{name}: {result['returncode']} in {result['seconds']} s")


NO_CUDA = (
    "benchmarks.gpu needs a GPU (CUDA), and none is visible here (no NVIDIA device, CUDA_VISIBLE_DEVICES empty, "
    "or torch without CUDA); nothing was run. To rehearse it on a CPU at toy sizes, add --dry-run."
)


def _cuda_available() -> bool:
    """An NVIDIA device visible to a CUDA build of torch: the cheap look first (no torch import, so a CPU
    machine refuses in well under a second), torch itself only where a device is there."""
    from executors.factory import cuda_present

    if not cuda_present():
        return False
    import torch

    return torch.cuda.is_available()


def _commands(part: str, out: Path, dry_run: bool) -> list[tuple[str, list[str]]]:
    python = sys.executable
    if part == "kernels":
        check = [python, "-m", "plugins_cuda.check", "--no-bench", "--out", str(out / "kernels")]
        return [("kernels", check + (["--interpret"] if dry_run else []))]
    if part == "graphs":
        graphs = [python, "-m", "plugins_cuda.graph_check", "--out", str(out / "graphs")]
        return [("graphs", graphs + (["--dry-run"] if dry_run else []))]
    if part == "bench":  # no CPU form: its cases run interpreted at toy sizes in tests/test_kernel_bench.py
        return [] if dry_run else [("bench", [python, "-m", "plugins_cuda.bench", "--out", str(out)])]
    if part == "kv_tiers":
        copy = [python, "-m", "benchmarks.kv_tier_copy", "--out", str(out / "kv_tier_copy.json")]
        return [("kv_tiers", copy + (["--device", "cpu", "--repeats", "2"] if dry_run else []))]
    if part == "lora":
        lora = [python, "-m", "benchmarks.lora_kernel", "--out", str(out / "lora_kernel.json")]
        return [("lora", lora + (["--device", "cpu", "--repeats", "2"] if dry_run else []))]
    if part == "tests":
        files = GPU_TESTS[:1] if dry_run else GPU_TESTS
        return [
            (f"tests-{Path(f).stem}", [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f]) for f in files
        ]
    shapes = ["tiny"] if dry_run else list(SHAPES)
    return [
        (
            f"engine-{s}",
            [
                python,
                "-m",
                "benchmarks.gpu_engine",
                "--shape",
                s,
                "--out",
                str(out / f"engine-{s}.json"),
                *(["--dry-run"] if dry_run else []),
            ],
        )
        for s in shapes
    ]


def environment() -> dict:
    import platform

    info: dict = {"python": platform.python_version(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch
        import triton

        info.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(
                gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count
            )
    except ImportError as exc:
        info["missing"] = str(exc)
    return info


def _write(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


if __name__ == "__main__":
    main()
