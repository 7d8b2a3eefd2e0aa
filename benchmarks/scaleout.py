"""`python -m benchmarks.scaleout`: issue 19's replica routing -> results/scaleout.{json,md,png}.

Two tritonservers, each pinned to one core (started inside benchmarks/cpu.py's `pinned`, as under
`taskset -c`), behind one gateway (`trtserve gateway
--config`, a `replicas:` list with each replica's metrics URL, `--routing` per run). The gateway and
the load generator are not pinned: they share both cores with the replicas. Workload: 8 system
prompts of ~400 tokens x many users (uniform pick, seeded), short numbered questions, Poisson
arrivals, exactly `output_len` tokens each, through the gateway's /v1/completions (SSE). Runs:
prefix-aware, round-robin, least-loaded, and one replica on both cores (twice the KV) for reference.
Every run starts fresh servers (empty prefix caches) and sends the same requests at the same times.
Engine threads: the CPU backends size their ORT and OpenMP pools from the process's CPU mask
(executors/cpus.py), so a pinned replica runs one thread per core it was given.

KV per pinned replica (`--kv-tokens`, default 2,560) holds ~6 of the 8 system prompts, fewer while
running requests hold their own blocks: the regime where replica choice matters. With room for every
prompt on every replica, round-robin would hit as often as prefix routing after the first 16 requests.

    python -m benchmarks.scaleout --engine /work/engines/smollm2-135m-b32
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import yaml

from benchmarks import client, datasets, plots, prometheus, servers
from benchmarks.client import Endpoint
from benchmarks.cpu import pinned, session_affinity, wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from benchmarks.suite import DEFAULT_SLO, flatten

POLICIES = ("prefix", "round_robin", "least_loaded")
SINGLE = "one replica on both cores"
TTFT_GAIN_TARGET = 2.0  # issue 19: prefix-aware TTFT p50 at least 2x better than round-robin
MODEL = "smollm2"
STARTUP_S = 40.0  # two tritonservers and the gateway, per run (for the estimate)


@dataclass(frozen=True)
class Config:
    engine: Path
    cores: tuple[int, ...] = (0, 1)  # one pinned replica per core
    system_prompts: int = 8
    system_len: int = 400
    output_len: int = 32
    rate: float = 1.0  # Poisson arrivals, req/s, across the gateway
    arrival_s: float = 90.0
    kv_tokens: int = 2560  # per pinned replica; the single reference replica gets the sum
    max_num_seqs: int = 16
    seed: int = 0
    logs: Path = RESULTS_DIR / "logs" / "scaleout"

    @property
    def requests(self) -> int:
        return max(4, round(self.rate * self.arrival_s))


def estimate_s(cfg: Config, runs: int) -> float:
    """Arrivals, a drain of ~20 s and start-ups per run."""
    return round(runs * (cfg.arrival_s + 20.0 + STARTUP_S))


def replica_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """One replica over the measured phase: prefix-cache hit rate (prompt tokens), requests served
    (its TTFT histogram's count), prompt tokens computed, tokens generated."""
    delta = lambda name: prometheus.total(after, name) - prometheus.total(before, name)  # noqa: E731
    return {**prometheus.hit_rate(before, after), "requests": delta("trtserve_time_to_first_token_seconds_count"),
            "prompt_tokens_computed": delta("trtserve_prompt_tokens_total"),
            "generated_tokens": delta("trtserve_generation_tokens_total")}  # fmt: skip


def picks(before: dict[str, float], after: dict[str, float], replicas: list[str]) -> list[dict[str, float]]:
    """The gateway's picks per replica (by gRPC address, in `replicas` order) and reason, over the phase."""
    out = []
    for url in replicas:
        name, label = "trtserve_gateway_replica_picks_total", f'replica="{url}"'
        keys = {k for k in after if k.split("{")[0] == name and label in k}
        reasons = {k.split('reason="', 1)[1].split('"', 1)[0]: after[k] - before.get(k, 0.0) for k in keys}
        out.append({r: n for r, n in sorted(reasons.items()) if n})
    return out


def gain(runs: dict[str, dict]) -> dict:
    """Round-robin's TTFT p50 over prefix-aware's (> 1: prefix routing is faster), against the target."""
    prefix, rr = runs.get("prefix", {}).get("ttft_ms_p50"), runs.get("round_robin", {}).get("ttft_ms_p50")
    if not prefix or not rr:
        return {"ratio": None, "status": "not measured"}
    ratio = round(rr / prefix, 2)
    return {"ratio": ratio, "status": "met" if ratio >= TTFT_GAIN_TARGET else "missed"}


def gateway_config(replicas: list[tuple[int, int]], policy: str) -> dict:
    """The gateway's YAML: one backend listing (gRPC port, metrics port) replicas on loopback."""
    entries = [{"url": f"127.0.0.1:{g}", "metrics_url": f"http://127.0.0.1:{m}/metrics"} for g, m in replicas]
    return {"routing": {"policy": policy, "metrics_interval_s": 0.5}, "backends": {MODEL: {"replicas": entries}}}


@contextlib.contextmanager
def deployment(cfg: Config, policy: str, placement: list[set[int] | None], kv_tokens: int, tag: str
               ) -> Iterator[tuple[str, list[str], list[dict]]]:  # fmt: skip
    """Replicas (each started on its cores) and a gateway routing by `policy`: (gateway URL, replica
    metrics URLs, each replica's gRPC address and placement: its threads' CPU masks)."""
    from runtime.gateway.process import GatewayProcess
    from runtime.serve.launcher import ServerConfig, TritonServer, free_port

    settings = servers.ServingSettings(max_num_seqs=cfg.max_num_seqs, kv_tokens=kv_tokens, max_model_len=1024)
    params = servers.trtserve_params(cfg.engine, settings)
    with contextlib.ExitStack() as stack:
        started = []
        for i, cores in enumerate(placement):
            config = ServerConfig.on_free_ports(cfg.engine, engine_params=params)
            with pinned(cores):
                started.append((config, stack.enter_context(TritonServer(config, cfg.logs / f"{tag}-triton{i}.log"))))
        for _, server in started:
            server.wait_ready()
        path = cfg.logs / f"{tag}-gateway.yaml"
        path.write_text(yaml.safe_dump(gateway_config([(c.grpc_port, c.metrics_port) for c, _ in started], policy)))
        gw = stack.enter_context(GatewayProcess(["--config", str(path), "--routing", policy], "127.0.0.1",
                                                free_port(), log_path=cfg.logs / f"{tag}-gateway.log"))  # fmt: skip
        gw.wait_ready()
        masks = [{"url": f"127.0.0.1:{config.grpc_port}", "cores": sorted(c) if c else "all",
                  "threads_by_mask": session_affinity(s.process.pid)}
                 for c, (config, s) in zip(placement, started, strict=True)]  # fmt: skip
        yield gw.url, [f"http://127.0.0.1:{c.metrics_port}/metrics" for c, _ in started], masks


def measure(cfg: Config, policy: str, placement: list[set[int] | None], kv_tokens: int, tag: str,
            reqs: list[BenchRequest], warm: list[BenchRequest], log: Callable[[str], None]) -> dict:  # fmt: skip
    with deployment(cfg, policy, placement, kv_tokens, tag) as (url, metrics, masks):
        send = client.sender_for(Endpoint("gateway", url, MODEL))
        asyncio.run(client.run_load(send, warm, concurrency=len(warm)))
        wait = wait_quiet(log)
        time.sleep(1.2)  # the engines refresh their counters every 0.5 s
        before, gw_before = [prometheus.fetch(m) for m in metrics], prometheus.fetch(f"{url}/metrics")
        result = asyncio.run(client.run_load(send, reqs, rate=cfg.rate, seed=cfg.seed))
        time.sleep(1.2)
        after, gw_after = [prometheus.fetch(m) for m in metrics], prometheus.fetch(f"{url}/metrics")
    out = flatten(summarize(result.records, result.duration_s, DEFAULT_SLO))
    out |= {"client_cpu_s": round(result.client_cpu_s, 2), "quiet_wait_s": wait, "placement": masks,
            "replicas": [replica_stats(b, a) for b, a in zip(before, after, strict=True)]}  # fmt: skip
    for replica, chosen in zip(out["replicas"], picks(gw_before, gw_after, [m["url"] for m in masks]), strict=True):
        replica["gateway_picks"] = chosen
    queries = sum(r["queries"] for r in out["replicas"])
    out["hit_rate"] = round(sum(r["hits"] for r in out["replicas"]) / queries, 4) if queries else None
    hits = [r["hit_rate"] for r in out["replicas"]]
    log(f"  {tag}: TTFT p50 {out.get('ttft_ms_p50')} ms, p99 {out.get('ttft_ms_p99')} ms, {out['output_tok_s']} "
        f"tok/s, hit rates {hits}, failed {out['failed']} {out['errors']}")  # fmt: skip
    return out


def render(p: dict) -> str:
    m = p["machine"]
    fmt = lambda v, d=0: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["# Scale-out: replica routing behind the gateway (issue 19)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall (estimated "
             f"{p['estimate_s']:.0f} s). Command: `{p['command']}`. CPU busy before: {p['cpu_busy_before']}.", "",
             "Controls: " + "; ".join(p["controls"]), "",
             f"Target: prefix-aware TTFT p50 ≥ {TTFT_GAIN_TARGET:g}x better than round-robin: round-robin / prefix = "
             f"{fmt(p['gain']['ratio'], 2)}x, **{p['gain']['status']}**.", "",
             "| routing | TTFT p50 / p99 ms | TPOT p50 ms | output tok/s | goodput req/s | prefix-cache hit rate "
             "(all) | per replica: hit rate, requests, prompt tokens computed, gateway picks by reason | failed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in p["runs"].items():
        per = "; ".join(f"{fmt(x['hit_rate'], 3)}, {x['requests']:.0f} req, {x['prompt_tokens_computed']:.0f} tok, "
                        f"picks {x.get('gateway_picks')}" for x in r["replicas"])  # fmt: skip
        lines.append(f"| {name} | {fmt(r.get('ttft_ms_p50'))} / {fmt(r.get('ttft_ms_p99'))} | "
                     f"{fmt(r.get('tpot_ms_p50'), 1)} | {r['output_tok_s']:.1f} | {r['goodput_req_s']:.3f} | "
                     f"{fmt(r['hit_rate'], 3)} | {per} | {r['failed']} |")  # fmt: skip
    lines += ["", "Placement (threads of each replica's tritonserver session by CPU mask, read after start): "
              + "; ".join(f"{name}: {[x['threads_by_mask'] for x in r['placement']]}" for name, r in p["runs"].items()),
              "", f"Workload: {json.dumps(p['dataset'])}", "",
              "## Versions", "", ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v), ""]  # fmt: skip
    return "\n".join(lines)


def controls(cfg: Config, prompt_tokens: float) -> list[str]:
    return [
        f"{len(cfg.cores)} tritonservers pinned one per core ({', '.join(f'core {c}' for c in cfg.cores)}), each max "
        f"{cfg.max_num_seqs} sequences, KV for {cfg.kv_tokens} tokens (~{cfg.kv_tokens / prompt_tokens:.1f} of the "
        f"{cfg.system_prompts} system prompts), 512-token step budget, prefix caching on, SLO step budget (default)",
        "engine threads per replica: one per core of its CPU mask (the CPU backends read the mask)",
        "gateway (`trtserve gateway --config`, replicas with their metrics URLs, scraped every 0.5 s) and the load "
        "generator unpinned, sharing both cores",
        f"{SINGLE}: one unpinned tritonserver with KV for {cfg.kv_tokens * len(cfg.cores)} tokens behind the same "
        "gateway (the same total memory)",
        f"workload: {cfg.system_prompts} system prompts of {cfg.system_len} corpus tokens (+ a one-line role), a "
        f"numbered question from data/chat_prompts.txt per request, chat template, exactly {cfg.output_len} output "
        f"tokens (EOS ignored), greedy; {cfg.requests} requests, Poisson arrivals at {cfg.rate:g} req/s (seed "
        f"{cfg.seed}), identical in every run; /v1/completions through the gateway (SSE)",
        "each run on fresh servers and a fresh gateway (empty caches and prefix index), 2 warm-up requests of "
        "unrelated text first; hit rate = prefix-cache hits / queries (prompt tokens) from each replica's "
        "trtserve_prefix_cache_{hits,queries}_total over the measured phase",
    ]


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--rate", default=1.0, show_default=True, help="Poisson arrivals, req/s.")
@click.option("--arrival-s", default=90.0, show_default=True, help="Seconds of arrivals per run.")
@click.option("--kv-tokens", default=2560, show_default=True, help="KV budget per pinned replica, tokens.")
@click.option("--system-prompts", default=8, show_default=True)
@click.option("--system-len", default=400, show_default=True)
@click.option("--output-len", default=32, show_default=True)
@click.option("--cores", default="0,1", show_default=True, help="One pinned replica per listed core.")
@click.option("--policies", default=",".join(POLICIES) + ",single", show_default=True)
@click.option("--name", default="scaleout", show_default=True)
def main(engine: Path, rate: float, arrival_s: float, kv_tokens: int, system_prompts: int, system_len: int,
         output_len: int, cores: str, policies: str, name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    cfg = Config(engine, tuple(int(c) for c in cores.split(",")), system_prompts, system_len, output_len, rate,
                 arrival_s, kv_tokens, logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    chosen = [p for p in policies.split(",") if p]
    if unknown := set(chosen) - {*POLICIES, "single"}:
        raise click.BadParameter(f"unknown policies {sorted(unknown)}")
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    estimate = estimate_s(cfg, len(chosen))
    log(f"estimated run time: ~{estimate / 60:.0f} min")
    tok = load_tokenizer(engine)
    reqs = datasets.many_system_prompts(tok, cfg.requests, output_len, system_prompts, system_len, cfg.seed)
    warm = datasets.fixed(tok, 2, 32, 8, seed=99)
    described = datasets.describe(reqs)
    busy, started = cpu_busy_fraction(), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    runs: dict[str, dict] = {}
    for policy in chosen:
        log(f"== {policy}")
        if policy == "single":
            runs[SINGLE] = measure(cfg, "prefix", [None], kv_tokens * len(cfg.cores), "single", reqs, warm, log)
        else:
            runs[policy] = measure(cfg, policy, [{c} for c in cfg.cores], kv_tokens, policy, reqs, warm, log)
    prompt_tokens = described["prompt_tokens_min_mean_max"][1]
    payload = {"command": "python -m benchmarks.scaleout " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs)}, "estimate_s": estimate,
               "wall_s": round(time.time() - started, 1), "controls": controls(cfg, prompt_tokens),
               "dataset": described, "runs": runs, "gain": gain(runs)}  # fmt: skip
    md, full = write_report(name, payload, render)
    plots.scaleout(full["runs"], RESULTS_DIR / f"{name}.png")
    click.echo(md.read_text())


if __name__ == "__main__":
    main()
