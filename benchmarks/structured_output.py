"""`python -m benchmarks.structured_output --engine DIR`: what structured output costs the engine, in one run.

The engine as the Triton model runs it (AsyncLLM, default EngineArgs), closed loop at concurrency 1 and 16.
Every request is a chat prompt from tests/data/structured_schemas.json (the schema shown in a system message,
a question after it), greedy, up to 256 tokens; a fraction of them (0%, 50%, 100%) is constrained to its
schema (guided_json, what response_format json_schema sends), the rest runs free. All 20 grammars are
compiled in a warm-up first, so these phases measure masking (the per-token cost), not compiling. Reported per
phase: output tok/s, and TPOT (time per output token after the first) and TTFT of constrained and free
requests separately. Free requests may write longer answers than the JSON ones (up to max_tokens), so
the fair per-token comparison is TPOT at the same concurrency.

Then first-token latency of a constrained request whose schema is new (each a schema of the set with a
distinct "title": a new hash, a new compile) against the same schemas again (cached), and free requests, at
concurrency 1.

    python -m benchmarks.structured_output --engine /tmp/eng/smollm2 [--requests 8,32] [--output structured_output]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import click

from benchmarks.report import cpu_busy_fraction, write_report

SCHEMAS = json.loads((Path(__file__).parent.parent / "tests" / "data" / "structured_schemas.json").read_text())
MAX_TOKENS = 256
CONCURRENCY = (1, 16)
FRACTIONS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class Record:
    constrained: bool
    ttft_s: float
    tpot_s: float | None
    tokens: int


def messages(entry: dict) -> list[dict[str, str]]:
    system = "Reply with a JSON object that matches this JSON schema: " + json.dumps(entry["schema"])
    return [{"role": "system", "content": system}, {"role": "user", "content": entry["prompt"]}]


async def one(engine, entry: dict, constrained: bool, schema: dict | None = None) -> Record:
    from executors.sampling import SamplingParams

    guided = {"guided_json": json.dumps(schema or entry["schema"])} if constrained else {}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **guided)
    start, first, last, tokens = time.perf_counter(), None, None, 0
    async for delta in engine.generate(messages(entry), params, uuid.uuid4().hex):
        if delta.token_ids:
            now = time.perf_counter()
            first, last, tokens = first or now, now, tokens + len(delta.token_ids)
    assert first is not None and last is not None
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Record(constrained, first - start, tpot, tokens)


async def closed_loop(engine, concurrency: int, fraction: float, count: int) -> tuple[list[Record], float]:
    """`count` requests, `concurrency` in flight; request i constrained when it falls in the fraction."""
    queue = list(range(count))
    records: list[Record] = []

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            constrained = int((i + 1) * fraction) > int(i * fraction)  # evenly spread: 50% alternates
            records.append(await one(engine, SCHEMAS[i % len(SCHEMAS)], constrained))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"median": round(statistics.median(values) * 1e3, 1), "p90": round(ordered[int(0.9 * (len(ordered) - 1))]
            * 1e3, 1), "n": len(values)}  # fmt: skip


def phase_row(concurrency: int, fraction: float, records: list[Record], seconds: float) -> dict:
    row: dict = {
        "concurrency": concurrency,
        "constrained_fraction": fraction,
        "requests": len(records),
        "seconds": round(seconds, 2),
        "output_tok_s": round(sum(r.tokens for r in records) / seconds, 1),
    }
    for label, picked in (("constrained", True), ("free", False)):
        chosen = [r for r in records if r.constrained == picked]
        row[f"tpot_ms_{label}"] = ms([r.tpot_s for r in chosen if r.tpot_s is not None])
        row[f"ttft_ms_{label}"] = ms([r.ttft_s for r in chosen])
        row[f"tokens_mean_{label}"] = round(statistics.mean(r.tokens for r in chosen), 1) if chosen else None
    return row


async def run(engine_dir: Path, counts: dict[int, int]) -> dict:
    from runtime import AsyncLLM

    engine = AsyncLLM(engine_dir)
    try:
        await asyncio.gather(*(one(engine, e, True) for e in SCHEMAS))  # warm-up: every grammar compiled once
        rows = []
        for concurrency in CONCURRENCY:
            for fraction in FRACTIONS:
                records, seconds = await closed_loop(engine, concurrency, fraction, counts[concurrency])
                rows.append(phase_row(concurrency, fraction, records, seconds))
                click.echo(json.dumps(rows[-1]))
        entries = SCHEMAS[:8]
        variants = [{**e["schema"], "title": f"variant {uuid.uuid4().hex}"} for e in entries]
        new = [await one(engine, e, True, v) for e, v in zip(entries, variants, strict=True)]
        cached = [await one(engine, e, True, v) for e, v in zip(entries, variants, strict=True)]
        free = [await one(engine, e, False) for e in entries]
        ttft = {"new_schema": ms([r.ttft_s for r in new]), "cached_schema": ms([r.ttft_s for r in cached]),
                "free": ms([r.ttft_s for r in free])}  # fmt: skip
        click.echo(json.dumps(ttft))
        grammar = engine.stats().grammar
        return {"rows": rows, "ttft_new_vs_cached": ttft, "grammar": vars(grammar)}
    finally:
        engine.shutdown()


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="An engine with max batch size >= 16 (build-engine's default).")  # fmt: skip
@click.option("--requests", "requests", default="8,32", show_default=True, help="Requests per phase at c=1,16.")
@click.option("--output", default="structured_output", show_default=True, help="Report name under results/.")
def main(engine_dir: Path, requests: str, output: str) -> None:
    counts = dict(zip(CONCURRENCY, (int(n) for n in requests.split(",")), strict=True))
    busy = cpu_busy_fraction()
    results = asyncio.run(run(engine_dir, counts))
    command = f"python -m benchmarks.structured_output --engine {engine_dir} --requests {requests}"
    write_report(output, {"command": command, "cpu_busy_before": busy, "max_tokens": MAX_TOKENS, **results}, render)


def render(payload: dict) -> str:
    def cell(value: dict | None) -> str:
        return "-" if value is None else f"{value['median']} / {value['p90']}"

    lines = [
        "# Structured output: cost in the engine", "",
        f"Machine: {payload['machine']}; CPU busy before the run: {payload['cpu_busy_before']}", "",
        f"Command: `{payload['command']}`. Greedy, up to {payload['max_tokens']} tokens; constrained requests use "
        "guided_json (what response_format json_schema sends) with their prompt's schema, compiled in a warm-up.", "",
        "| c | constrained | requests | output tok/s | TPOT ms constrained (median / p90) | TPOT ms free | "
        "TTFT ms constrained | TTFT ms free | mean tokens constrained / free |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in payload["rows"]:
        lines.append(f"| {r['concurrency']} | {int(r['constrained_fraction'] * 100)}% | {r['requests']} | "
                     f"{r['output_tok_s']} | {cell(r['tpot_ms_constrained'])} | {cell(r['tpot_ms_free'])} | "
                     f"{cell(r['ttft_ms_constrained'])} | {cell(r['ttft_ms_free'])} | "
                     f"{r['tokens_mean_constrained'] or '-'} / {r['tokens_mean_free'] or '-'} |")  # fmt: skip
    ttft = payload["ttft_new_vs_cached"]
    lines += ["", "First-token latency at c=1 (median / p90 ms): new schema (compiled on arrival) "
              f"{cell(ttft['new_schema'])}, the same schemas cached {cell(ttft['cached_schema'])}, free "
              f"{cell(ttft['free'])}.", "", f"Engine grammar counters after the run: {payload['grammar']}"]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
