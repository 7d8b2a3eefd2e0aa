"""`python -m benchmarks.gpu_engine --shape llama-3.2-1b --out F.json`: one part of `benchmarks.gpu` (its own
process). A random-weight model of the shape is written, built into an engine, then timed:

- trtserve: LLMEngine over the torch backend in bfloat16 (CUDA graphs, device sampling, overlapped
  scheduling, warmed up at start), 256 requests of 256 random prompt tokens -> 128 tokens each, EOS ignored,
  all arriving at once; the loop is `step_tokens()`, as served (text is made on another thread);
- HF eager `generate` in bfloat16, static batches of 64, the same prompts;
- a single stream: one 256-token prompt -> 128 tokens on a just-started engine, TTFT and TPOT;
- both again under torch.profiler (other prompts): the GPU's busy share of the wall time and its kernel
  time per step, against the step's wall time.
Each figure is one timed run after the warm-up (`start_s`: the engine's start, warm-up included).
`--dry-run`: a two-layer toy on the CPU, a few requests.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from benchmarks.gpu import SHAPES


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint(shape: str, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from builder.tiny import make_tokenizer

    layers, hidden, inter, heads, kv, head_dim, vocab, tied = SHAPES.get(shape, (2, 64, 128, 4, 2, 16, 512, True))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


def start_engine(engine_dir: Path, max_num_seqs: int, max_len: int, device: str):
    """LLMEngine over the torch backend as served; returns it and its start time (warm-up included)."""
    from runtime.engine.engine_args import EngineArgs
    from runtime.engine.heap import freeze_startup_heap
    from runtime.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine(
        engine_dir,
        EngineArgs(
            backend="torch",
            dtype="bfloat16" if device == "cuda" else "float32",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            num_kv_blocks=max_num_seqs * (math.ceil(max_len / 16) + 1),
        ),
    )
    freeze_startup_heap("benchmarks.gpu_engine")  # as the served process does after its start (a Triton stub's)
    return engine, round(time.perf_counter() - started, 1)


def trtserve(engine, prompts: list[list[int]], out_len: int, device: str, profile: bool = False) -> dict:
    """One timed run of `prompts` (all arriving at once, greedy, EOS ignored). `profile`: the same under
    torch.profiler, for the GPU's busy share and its kernel time per step."""
    from executors.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    if not profile:
        return _timed_run(engine, prompts, params, out_len)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        result = _timed_run(engine, prompts, params, out_len)
    return {**result, **_device_share(prof, result)}


def _timed_run(engine, prompts: list[list[int]], params, out_len: int) -> dict:
    _sync()
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step_tokens()
        steps += 1
        now = time.perf_counter() - start
        for o in outs:
            if o.finish_reason == "error":
                raise RuntimeError(f"the engine failed a request: {o.error}")
            first.setdefault(o.request_id, now)
            tokens += len(o.token_ids)
            if o.finish_reason is not None:
                done[o.request_id] = now
    _sync()
    wall = time.perf_counter() - start
    ttft = [first[r] for r in done]
    tpot = [(done[r] - first[r]) / max(out_len - 1, 1) for r in done]
    return {
        "out_tok_s": round(tokens / wall, 1),
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "steps": steps,
        "ttft_p50_ms": round(1e3 * float(np.median(ttft)), 2),
        "tpot_p50_ms": round(1e3 * float(np.median(tpot)), 3),
    }


def _device_share(prof, result: dict) -> dict:
    """The GPU's kernel and copy time (CUDA-graph replays' kernels included, as CUPTI reports them) over the
    run's wall time, summed as torch's profiler table sums its "Self CUDA" column. Mostly one stream, so the
    sum is about the time the GPU was busy."""
    from torch.autograd import DeviceType

    device_us = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )
    wall_us, steps = result["wall_s"] * 1e6, max(result["steps"], 1)
    return {
        "gpu_busy_share": round(device_us / wall_us, 3),
        "device_ms_per_step": round(device_us / 1e3 / steps, 3),
        "wall_ms_per_step": round(wall_us / 1e3 / steps, 3),
    }


def hf_eager(checkpoint_dir: Path, prompts: list[list[int]], out_len: int, batch: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).to(device).eval()
    _sync()
    start, total = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        group = torch.tensor(prompts[i : i + batch], device=device)
        with torch.no_grad():
            out = model.generate(
                group,
                attention_mask=torch.ones_like(group),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=0,
            )
        total += (out.shape[1] - group.shape[1]) * len(group)
    _sync()
    wall = time.perf_counter() - start
    return {"out_tok_s": round(total / wall, 1), "wall_s": round(wall, 3), "batch": batch}


@click.command()
@click.option("--shape", required=True, type=click.Choice([*SHAPES, "tiny"]))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True)
@click.option("--dry-run", is_flag=True)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Keep the checkpoint and engine here and reuse them if built (default: a temporary directory).",
)
@click.option("--build-only", is_flag=True, help="Write the checkpoint and build the engine, time nothing.")
def main(shape: str, out: Path, dry_run: bool, workdir: Path | None, build_only: bool) -> None:
    import os

    import torch

    if dry_run or not torch.cuda.is_available():  # the kernels in Triton's interpreter, set before they load
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    n, prompt_len, out_len, batch = (4, 16, 8, 2) if dry_run else (256, 256, 128, 64)
    result: dict = {"shape": shape, "device": device, "requests": n, "prompt_tokens": prompt_len,
                    "output_tokens": out_len}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, engine = prepare(shape, workdir or Path(tmp), n, result)
        if not build_only:
            measure(shape, ckpt, engine, (n, prompt_len, out_len, batch), device, result, out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result))


def prepare(shape: str, workdir: Path, max_batch: int, result: dict) -> tuple[Path, Path]:
    """The random-weight checkpoint and its engine under `workdir`, built unless already there."""
    from builder.build import BuildOptions, build_engine

    ckpt, engine = workdir / "checkpoint", workdir / "engine"
    if not (engine / "manifest.json").exists():
        start = time.perf_counter()
        checkpoint(shape, ckpt)
        build_engine(BuildOptions(model=str(ckpt), output=engine, max_batch_size=max_batch, max_seq_len=1024,
                                  block_size=16))  # fmt: skip
        result["build_s"] = round(time.perf_counter() - start, 1)
    return ckpt, engine


def measure(shape: str, ckpt: Path, engine: Path, sizes: tuple[int, int, int, int], device: str, result: dict,
            out: Path) -> None:  # fmt: skip
    n, prompt_len, out_len, batch = sizes
    vocab = min(SHAPES.get(shape, (0,) * 6 + (512,))[6], 32000)
    rng = np.random.default_rng(0)

    def draw() -> list[list[int]]:  # each run its own random prompts: no prefix-cache hits between runs
        return [rng.integers(3, vocab, prompt_len).tolist() for _ in range(n)]

    prompts = draw()

    def save() -> None:  # after each figure: kept if what follows fails
        out.write_text(json.dumps(result, indent=2) + "\n")

    batched, result["start_s"] = start_engine(engine, n, prompt_len + out_len, device)
    result["trtserve"] = trtserve(batched, prompts, out_len, device)
    save()
    result["trtserve_second_run"] = trtserve(batched, draw(), out_len, device)  # anything compiled on first use is not
    save()
    single, result["single_start_s"] = start_engine(engine, 1, prompt_len + out_len, device)
    result["single_stream"] = trtserve(single, prompts[:1], out_len, device)  # the first request after start
    save()
    result["hf_eager"] = hf_eager(ckpt, prompts, out_len, batch, device)
    result["speedup_vs_hf"] = round(result["trtserve"]["out_tok_s"] / result["hf_eager"]["out_tok_s"], 2)
    save()
    fresh = draw()
    for name, runner, group in (("profiled_single", single, fresh[:1]), ("profiled_batch", batched, fresh)):
        try:  # the profiler is a diagnostic: a failure here keeps the figures above
            result[name] = trtserve(runner, group, out_len, device, profile=True)
        except Exception as exc:
            result[name] = {"error": repr(exc)[:500]}
        save()


if __name__ == "__main__":
    main()
