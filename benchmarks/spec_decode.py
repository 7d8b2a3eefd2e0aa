"""`python -m benchmarks.spec_decode`: issue 18's speculative decoding -> results/spec_decode.{json,md,png}.

One tritonserver per system serves the fp32 target (--engine), started side by side (an idle one costs
no CPU) and measured in turn: speculation off, `ngram` (prompt lookup), `draft` (--draft-engine, the
INT4-AWQ engine of the same model, as served: prompt lookup first, the draft model where it has nothing)
and `draft-model` (the draft model for every guess), with --num-speculative-tokens drafts and the engine's
auto-off rule (no drafts while more than --speculative-disable-batch-size requests run). Two workloads, greedy with EOS
honoured, capped at --max-tokens: copy-heavy (datasets.copy_heavy: the answer repeats or edits a passage
of the prompt) and chat (datasets.chat). A closed loop at each concurrency; every (workload, level) runs
--repetitions times with the systems interleaved in a rotating order, so drift hits them alike. Greedy
speculation changes no token, so every system generates the same text. Acceptance comes from each
server's /metrics, as deltas over the measured phase. Prefix caching is off: repetitions redo the same work.

    python -m benchmarks.spec_decode --engine /work/engines/v3/smollm2-135m-b32 \\
        --draft-engine /work/engines/v3/smollm2-135m-int4-awq
    python -m benchmarks.spec_decode ... --quick     # smoke test: c=1, one short request per workload
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click

from benchmarks import client, datasets, prometheus, servers
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from benchmarks.spec_decode_report import (
    CHAT,
    COPY,
    DRAFT,
    DRAFT_MODEL,
    DRAFT_SYSTEMS,
    NGRAM,
    OFF,
    SYSTEMS,
    WORKLOADS,
    aggregate,
    render,
    spec_deltas,
    targets,
    write_plot,
)
from benchmarks.suite import DEFAULT_SLO, flatten
from runtime.engine.engine_args import DISABLE_BATCH_SIZE_DEFAULTS

ASSUMED_TOK_S = {1: 25.0, 4: 50.0, 16: 80.0}  # output tok/s, speculation off (2 cores, SmolLM2-135M fp32)
STARTUP_S = 40.0  # per server
SETTLE_TIMEOUT_S = 5.0  # for the metrics thread (every 0.5 s) to publish a phase's last tokens
Workloads = dict[str, dict[int, list[BenchRequest]]]  # workload -> level -> requests


@dataclass(frozen=True)
class Config:
    engine: Path
    draft_engine: Path | None
    systems: tuple[str, ...] = SYSTEMS
    workloads: tuple[str, ...] = WORKLOADS
    levels: tuple[int, ...] = (1, 4, 16)
    repetitions: int = 3
    max_tokens: int = 192
    num_speculative_tokens: int = 4
    disable_batch_size: int | None = None  # None: the engine's default for the method
    requests_per_slot: int = 2
    min_requests: int = 4
    warmup: int = 2
    quiet: bool = True  # wait for other work to stop before each phase
    settings: servers.ServingSettings = field(
        default_factory=lambda: servers.ServingSettings(max_num_seqs=16, kv_tokens=16 * 1024, prefix_caching=False)
    )
    logs: Path = RESULTS_DIR / "logs" / "spec_decode"

    def requests(self, c: int) -> int:
        return max(self.min_requests, self.requests_per_slot * c)


DEFAULT_DISABLE = f"the engine's default for the method ({DISABLE_BATCH_SIZE_DEFAULTS})"


def server_params(cfg: Config, system: str) -> dict[str, str]:
    """The trtserve config parameters of a system (what `trtserve serve --speculative ...` writes)."""
    if system == OFF:
        return {}
    params = {
        "speculative": NGRAM if system == NGRAM else DRAFT,
        "num_speculative_tokens": str(cfg.num_speculative_tokens),
    }
    if cfg.disable_batch_size is not None:
        params["speculative_disable_batch_size"] = str(cfg.disable_batch_size)
    if system in DRAFT_SYSTEMS:
        if cfg.draft_engine is None:
            raise ValueError(f"the {system} system needs --draft-engine")
        params["draft_engine"] = str(cfg.draft_engine)
    if system == DRAFT_MODEL:
        params["draft_prompt_lookup_min"] = "0"
    return params


def estimate_s(cfg: Config, tokens_per_request: float) -> float:
    """Rough wall time: every phase at ASSUMED_TOK_S (as if speculation were off), plus start-ups."""
    phase = sum(cfg.requests(c) * tokens_per_request / ASSUMED_TOK_S.get(c, 60.0) + 5 for c in cfg.levels)
    return round(len(cfg.systems) * (len(cfg.workloads) * cfg.repetitions * phase + STARTUP_S))


def build_workloads(cfg: Config, tok) -> Workloads:
    """The same prompts for every system and repetition, one set per (workload, level)."""
    make = {COPY: datasets.copy_heavy, CHAT: datasets.chat}
    return {w: {c: make[w](tok, cfg.requests(c), cfg.max_tokens, seed=c) for c in cfg.levels} for w in cfg.workloads}


def measure(endpoint: client.Endpoint, reqs: list[BenchRequest], warm: list[BenchRequest], c: int) -> dict:
    """Warm-up (not measured), then the measured phase: its serving metrics and its speculation, read from
    /metrics before and after (once the server has published the phase's last tokens)."""
    assert endpoint.metrics_url is not None
    send = client.sender_for(endpoint)
    if warm:
        asyncio.run(client.run_load(send, warm, concurrency=len(warm)))
    before = _settled(endpoint.metrics_url, None)
    result = asyncio.run(client.run_load(send, reqs, concurrency=c))
    generated = sum(r.output_tokens for r in result.records if r.ok)
    after = _settled(endpoint.metrics_url, prometheus.total(before, "trtserve_generation_tokens_total") + generated)
    out = flatten(summarize(result.records, result.duration_s, DEFAULT_SLO))
    tpot = out.get("tpot_ms_p50")
    out["decode_tok_s"] = round(1000 / tpot, 2) if tpot else None
    out["client_cpu_s"] = round(result.client_cpu_s, 2)
    return out | spec_deltas(before, after)


def _settled(url: str, generated: float | None) -> dict[str, float]:
    """A scrape once the engine's generation counter reaches `generated` (None: once it stops moving)."""
    deadline, last = time.monotonic() + SETTLE_TIMEOUT_S, prometheus.fetch(url)
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = prometheus.fetch(url)
        total = prometheus.total(now, "trtserve_generation_tokens_total")
        if (generated is not None and total >= generated) or (
            generated is None and total == prometheus.total(last, "trtserve_generation_tokens_total")
        ):
            time.sleep(0.6)  # one more refresh: the counters after the generation counter are written too
            return prometheus.fetch(url)
        last = now
    return last


def run(cfg: Config, work: Workloads, warm: list[BenchRequest], endpoints: dict[str, client.Endpoint],
        log: Callable[[str], None]) -> list[dict]:  # fmt: skip
    """Every (workload, level) x repetition, the systems interleaved in a rotating order."""
    rows = {(w, s, c): {"workload": w, "system": s, "concurrency": c, "reps": []}
            for w in work for c in cfg.levels for s in cfg.systems}  # fmt: skip
    live = [s for s in cfg.systems if s in endpoints]
    for w in work:
        for c in cfg.levels:
            for rep in range(cfg.repetitions):
                first = rep % max(len(live), 1)
                for s in live[first:] + live[:first]:
                    if cfg.quiet:
                        wait_quiet(log)
                    m = measure(endpoints[s], work[w][c], warm, c)
                    rows[(w, s, c)]["reps"].append(m)
                    log(f"  {w} c={c} rep {rep} {s}: {m['output_tok_s']} tok/s, TPOT p50 {m.get('tpot_ms_p50')} ms, "
                        f"acceptance {m['acceptance_rate']}, length {m['mean_acceptance_length']}, "
                        f"failed {m['failed']} {m['errors']}")  # fmt: skip
    return list(rows.values())


@contextlib.contextmanager
def started(cfg: Config, log: Callable[[str], None]) -> Iterator[tuple[dict[str, client.Endpoint], dict[str, str]]]:
    """The systems' servers, started one after the other; a system that cannot start is reported, not run."""
    with contextlib.ExitStack() as stack:
        endpoints: dict[str, client.Endpoint] = {}
        failed: dict[str, str] = {}
        for system in cfg.systems:
            log(f"== starting tritonserver: speculation {system}")
            try:
                params = {**cfg.settings.extra_params, **server_params(cfg, system)}
                settings = replace(cfg.settings, extra_params=params)
                endpoints[system] = stack.enter_context(
                    servers.trtserve(cfg.engine, settings, cfg.logs / f"tritonserver-{system}.log")
                )
            except (RuntimeError, ValueError) as exc:
                failed[system] = f"{type(exc).__name__}: {exc}"[-600:]
                log(f"  {system}: unavailable: {failed[system][-300:]}")
        yield endpoints, failed


def controls(cfg: Config, work: Workloads) -> list[str]:
    s = cfg.settings
    sizes = ", ".join(f"c{c}: {cfg.requests(c)} requests" for c in cfg.levels)
    prompts = {w: datasets.describe([r for reqs in by_level.values() for r in reqs]) for w, by_level in work.items()}
    return [
        f"target {cfg.engine} (fp32); draft {cfg.draft_engine or '-'}; k = {cfg.num_speculative_tokens} draft tokens "
        f"per step; speculation pauses while more than {cfg.disable_batch_size or DEFAULT_DISABLE} requests run/wait",
        f"every server: max {s.max_num_seqs} sequences, KV for {s.kv_tokens} tokens, {s.max_num_batched_tokens}-token "
        "step budget, prefix caching off; tritonserver generate_stream (SSE) from benchmarks/client.py",
        f"greedy, EOS honoured, at most {cfg.max_tokens} tokens; closed loop, {sizes}; {cfg.warmup} warm-up chat "
        f"requests (16 tokens) before every phase; {cfg.repetitions} repetition(s), systems interleaved",
        "prompts: " + "; ".join(f"{w}: {d['count']} requests, prompt tokens min/mean/max "
                                f"{d['prompt_tokens_min_mean_max']}" for w, d in prompts.items()),
        "ITL per token (a chunk of k tokens counts as k gaps), so accepted drafts lower it; decode tok/s = 1000 / TPOT "
        "p50 (the targets' measure); tok/s over the phase's wall time",
    ]  # fmt: skip


WORKLOAD_NAMES = {COPY: "Copy-heavy: the answer repeats or edits a passage of the prompt",
                  CHAT: "Chat: the benchmarks' chat prompts (every third summarises a passage)"}  # fmt: skip


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32",
              show_default=True, help="The target (fp32).")  # fmt: skip
@click.option("--draft-engine", type=click.Path(exists=True, path_type=Path), default=None,
              help="The draft engine (INT4-AWQ of the same model); without it, no draft system.")  # fmt: skip
@click.option("--systems", default=",".join(SYSTEMS), show_default=True)
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True)
@click.option("--concurrency", default="1,4,16", show_default=True)
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=192, show_default=True, type=click.IntRange(min=2))
@click.option("--num-speculative-tokens", default=4, show_default=True, type=click.IntRange(1, 16))
@click.option("--speculative-disable-batch-size", default=None, type=click.IntRange(min=1), help=DEFAULT_DISABLE)
@click.option("--quick", is_flag=True, help="Smoke test: c=1, one 32-token request per workload, one repetition.")
@click.option("--name", default="spec_decode", show_default=True)
def main(engine: Path, draft_engine: Path | None, systems: str, workloads: str, concurrency: str, repetitions: int,
         max_tokens: int, num_speculative_tokens: int, speculative_disable_batch_size: int | None, quick: bool,
         name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    picked = tuple(s for s in systems.split(",") if s and (s not in DRAFT_SYSTEMS or draft_engine is not None))
    cfg = Config(engine, draft_engine, picked, tuple(w for w in workloads.split(",") if w),
                 tuple(int(c) for c in concurrency.split(",") if c), repetitions, max_tokens, num_speculative_tokens,
                 speculative_disable_batch_size, logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    if quick:
        cfg = replace(cfg, levels=(1,), repetitions=1, max_tokens=32, min_requests=1, requests_per_slot=1, warmup=1,
                      quiet=False)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    estimate = estimate_s(cfg, min(cfg.max_tokens, 150))
    log(f"estimated run time: ~{estimate / 60:.0f} min")
    busy, start = cpu_busy_fraction(), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    tok = load_tokenizer(engine)
    work, warm = build_workloads(cfg, tok), datasets.chat(tok, cfg.warmup, 16, seed=99)
    with started(cfg, log) as (endpoints, failed):
        rows = run(cfg, work, warm, endpoints, log)
    for row in rows:
        row["unavailable"] = failed.get(row["system"])
    if draft_engine is None:
        missing = [s for s in DRAFT_SYSTEMS if s in systems.split(",")]
        rows += [{"workload": w, "system": s, "concurrency": c, "reps": [], "unavailable": "no --draft-engine"}
                 for s in missing for w in cfg.workloads for c in cfg.levels]  # fmt: skip
    aggregated = aggregate(rows)
    payload = {"command": "python -m benchmarks.spec_decode " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
               "config": {**asdict(cfg), "engine": str(engine), "draft_engine": str(draft_engine),
                          "logs": str(cfg.logs)},
               "estimate_s": estimate, "wall_s": round(time.time() - start, 1), "workload_names": WORKLOAD_NAMES,
               "controls": controls(cfg, work), "rows": aggregated,
               "targets": targets(aggregated, max(cfg.levels))}  # fmt: skip
    md, full = write_report(name, payload, render)
    write_plot(full, RESULTS_DIR / f"{name}.png")
    click.echo(md.read_text())


if __name__ == "__main__":
    main()
