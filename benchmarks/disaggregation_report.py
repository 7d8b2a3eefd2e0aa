"""Markdown for results/disaggregation.json (benchmarks/disaggregation.py): the two systems side by side, the KV
transfers against a plain memory copy, the GPU figures on paper, and what this machine can and cannot show."""

from __future__ import annotations


def _p(stats: dict, key: str, q: str) -> str:
    value = stats.get(key, {}).get(q)
    return "-" if value is None else f"{value:.0f}"


def render(p: dict) -> str:
    cfg, machine = p["config"], p["machine"]
    lines = [
        "# Prefill/decode disaggregation on 2 CPU cores",
        "",
        f"{p['date_utc']}, {machine['cpu']} ({machine['cores']} cores), engine `{cfg['engine']}`. Command: "
        f"`{p['command']}`.",
        "",
        f"Traffic for {cfg['duration_s']:g} s: {cfg['streams']} steady streams ({cfg['stream_prompt_tokens']}-token "
        f"prompts, {cfg['stream_output_tokens']} tokens out, back to back) and {cfg['long_tokens']}-token prompts "
        f"({cfg['long_output_tokens']} tokens out) arriving at {cfg['long_rate']:g}/s (Poisson). `both`: one worker "
        "on both cores; `disaggregated`: a prefill worker on core 0 and a decode worker on core 1, KV moved by NIXL "
        "(`-thread`: each worker's engine core on a thread of its model's process, not a process of its own). "
        "The gateway and the client float over both cores in both. Goodput: requests/s with TTFT <= 5 s and "
        "TPOT <= 200 ms.",
        "",
        "| system | streams ITL p50 ms | ITL p99 ms | p99/p50 | streams TPOT p50 ms | long TTFT p50 ms | TTFT p99 ms "
        "| goodput req/s | output tok/s | failed | busy before |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in p["runs"]:
        s, long, all_ = run["streams"], run["long"], run["all"]
        lines.append(
            f"| {run['system']} | {_p(s, 'itl_ms', 'p50')} | {_p(s, 'itl_ms', 'p99')} | {s.get('itl_p99_over_p50')} "
            f"| {_p(s, 'tpot_ms', 'p50')} | {_p(long, 'ttft_ms', 'p50')} | {_p(long, 'ttft_ms', 'p99')} "
            f"| {all_['goodput_req_s']:.3f} | {all_['output_tok_s']:.1f} | {all_['failed']} "
            f"| {run.get('busy_before')} |"
        )
    disagg = next((r for r in p["runs"] if "transfer" in r), None)
    copy = p["memory_copy"]
    lines += ["", "## KV transfers", ""]
    if disagg is not None:
        t = disagg["transfer"]
        lines += [
            f"The decode worker's counters over the measured phase: {t['reads']} reads ({t['failures']} failed), "
            f"{t['mean_mb']} MB each on average (prefix-cache hits on the decode side are not read), "
            f"{t['mean_ms']} ms each: {t['gb_s']} GB/s.",
            "",
        ]
    lines += [
        f"A plain memory copy of one {cfg['long_tokens']}-token request's KV ({copy['bytes'] / 1e6:.1f} MB, "
        f"{copy['blocks']} blocks x every layer, K and V) in one process: {copy['gather_ms']} ms block by block "
        f"({copy['gather_gb_s']} GB/s, numpy's gather between two pools laid out as the engine's), "
        f"{copy['contiguous_ms']} ms as one contiguous copy ({copy['contiguous_gb_s']} GB/s).",
        "",
        "## On a GPU, on paper",
        "",
    ]
    paper = p["on_paper"]
    lines += [
        f"Llama-3-8B, 4,096-token prompt, bf16 KV: {paper['kv_mib']} MiB of KV; its prefill is "
        f"~{paper['prefill_tflop']} TFLOP, ~{paper['prefill_ms']} ms on an H100 at half its dense bf16 peak. NIXL "
        "moves VRAM to VRAM (the same connector registers a CUDA pool: executors/kv_transfer/memory.py), so the KV "
        "costs:",
        "",
        "| link | transfer ms | of the prefill time |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {v['ms']} | {v['of_prefill']:.1%} |" for name, v in paper["links"].items()]
    lines += ["", "None of these GPU figures was measured here: this machine has no GPU.", "", WHAT_IT_SHOWS, ""]
    return "\n".join(lines)


WHAT_IT_SHOWS = """## What 2 cores can and cannot show

- **Can:** the mechanism end to end (two processes, the real NIXL agents over UCX, the gateway's two-stage
  route, the handshake, pins and their release), that decodes on a worker of their own never share a step
  with a prefill chunk (the steady streams' ITL p99 / p50 ratio), what a prefill costs the streams when it
  does share their steps, and the transfer's cost next to a memory copy on the same machine.
- **Cannot:** a fair throughput comparison. Disaggregated, each worker has one core: the prefill worker
  is idle between long prompts while the decode worker is saturated, where the `both` worker spreads every
  step over both cores; on GPUs each pool is sized for its load and the idle share is what autoscaling
  (docker/k8s/disaggregated.yaml) removes. The KV here is fp32 host memory moved over shared memory by UCX
  on the same host: neither NVLink, RDMA nor GPU memory is exercised, and the gateway and the client take
  CPU from the workers they measure.
- **On GPUs:** a prefill is compute-bound and a decode step memory-bound; on one GPU each disturbs the
  other (the stall measured here, at GPU scale). Separate pools take the stall away and let each pool be
  scaled on its own signal, at the price of one KV read per request: for an 8B model at 4k tokens a few
  percent of the prefill's own time over RDMA, under 1 % over NVLink (the table above)."""
