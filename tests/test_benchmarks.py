"""Benchmark metric math on synthetic timestamps (hand-computed values), and one small run of
the streaming client against a real tritonserver serving the tiny engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.metrics import SLO, RequestRecord, percentiles, summarize


def record(start: float, chunks: list[tuple[float, int]], end: float, prompt: int = 10) -> RequestRecord:
    return RequestRecord(start, [t for t, _ in chunks], [n for _, n in chunks], end, prompt)


def test_percentiles_linear_interpolation():
    # 1..10 s: p50 = 5.5, p90 = 9.1, p99 = 9.91 (linear between order statistics), in ms.
    p = percentiles([float(x) for x in range(1, 11)])
    assert p == {"p50": 5500.0, "p90": 9100.0, "p99": 9910.0, "mean": 5500.0}
    assert percentiles([]) == {}


def test_ttft_tpot_itl_by_hand():
    # Sent at 1.0; tokens at 1.5, 1.6, 1.8 (two tokens in that chunk), 1.9; done at 1.9.
    r = record(1.0, [(1.5, 1), (1.6, 1), (1.8, 2), (1.9, 1)], 1.9)
    assert r.output_tokens == 5
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.9)
    assert r.tpot == pytest.approx((0.9 - 0.5) / 4)  # 0.1 s
    # The 2-token chunk counts as two gaps of 0.1 s: ITL is per token and averages to TPOT.
    assert r.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert sum(r.itls()) / len(r.itls()) == pytest.approx(r.tpot)


def test_single_token_request_has_no_tpot():
    r = record(0.0, [(0.3, 1)], 0.3)
    assert r.tpot is None and r.itls() == []


def test_summary_throughput_and_goodput():
    fast = record(0.0, [(0.2, 1), (0.3, 1), (0.4, 1)], 0.4)  # TTFT 0.2, TPOT 0.1
    slow_start = record(0.0, [(1.5, 1), (1.6, 1), (1.7, 1)], 1.7)  # TTFT 1.5 breaks a 1 s TTFT SLO
    slow_decode = record(1.0, [(1.2, 1), (1.7, 1), (2.0, 1)], 2.0)  # TPOT 0.4 breaks a 0.25 s TPOT SLO
    failed = RequestRecord(0.5, [], [], 0.6, 10, error="HTTP 503")
    s = summarize([fast, slow_start, slow_decode, failed], duration_s=2.0, slo=SLO(ttft_s=1.0, tpot_s=0.25))
    assert s["requests"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["output_tokens"] == 9 and s["output_tok_s"] == 4.5
    assert s["request_s"] == 1.5
    assert s["goodput_req_s"] == 0.5  # only `fast` meets both SLOs
    assert s["slo_attainment"] == 0.25
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # TTFTs 0.2, 0.2, 1.5 s
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # TPOTs 0.1, 0.1, 0.4 s
    assert s["e2e_ms"]["p99"] == pytest.approx(1000 * (1.0 + 0.98 * 0.7))  # e2e 0.4, 1.0, 1.7 s


@pytest.mark.parametrize(
    "bad",
    [
        record(1.0, [(0.9, 1)], 1.0),  # first token before the request was sent
        record(0.0, [(0.5, 1), (0.4, 1)], 0.6),  # chunks out of order
        record(0.0, [(0.5, 1)], 0.4),  # ended before its last token
        record(0.0, [(0.5, 0)], 0.6),  # a chunk with no token
        RequestRecord(0.0, [0.5, 0.6], [1], 0.7),  # times and counts disagree
    ],
)
def test_wrong_records_are_refused(bad):
    with pytest.raises(ValueError):
        summarize([bad], duration_s=1.0, slo=SLO(1.0, 1.0))


def test_summary_needs_a_positive_duration():
    with pytest.raises(ValueError):
        summarize([record(0.0, [(0.1, 1)], 0.1)], duration_s=0.0, slo=SLO(1.0, 1.0))


def test_client_refuses_a_run_that_differs_from_the_workload():
    from benchmarks.client import _check
    from benchmarks.datasets import BenchRequest

    req = BenchRequest("x", (1, 2, 3), max_tokens=2, ignore_eos=True)
    assert _check(record(0.0, [(0.1, 1), (0.2, 1)], 0.2, prompt=3), req).error is None
    assert "prompt tokens" in _check(record(0.0, [(0.1, 1), (0.2, 1)], 0.2, prompt=4), req).error
    assert "EOS ignored" in _check(record(0.0, [(0.1, 1)], 0.2, prompt=3), req).error  # stopped early


@pytest.mark.serving
def test_client_against_tritonserver(llama_engine):
    """The load generator on the real server (tiny engine): exact prompt/output token counts,
    closed loop and Poisson arrivals, and every metric computed from what streamed back."""
    from benchmarks import client, datasets
    from benchmarks.servers import ServingSettings, trtserve
    from runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_engine)
    requests = datasets.fixed(tok, 6, input_len=24, output_len=6, seed=1)
    settings = ServingSettings(max_num_seqs=4, kv_tokens=8 * 256, max_num_batched_tokens=64, max_model_len=256)
    with trtserve(llama_engine, settings) as endpoint:
        closed = client.run(endpoint, requests[2:], requests[:2], concurrency=2)
        poisson = client.run(endpoint, requests[2:], [], rate=50.0, concurrency=4)
        whole = client.run(replace(endpoint, kind="triton-whole"), requests[2:], [], concurrency=2)
    # Not streamed: each answer is one event carrying all its tokens.
    assert [(len(r.chunk_tokens), r.output_tokens, r.error) for r in whole.records] == [(1, 6, None)] * 4
    for result in (closed, poisson):
        summary = summarize(result.records, result.duration_s, SLO(60.0, 60.0))
        assert summary["failed"] == 0, summary["errors"]
        assert summary["prompt_tokens"] == 4 * 24 and summary["output_tokens"] == 4 * 6
        assert summary["goodput_req_s"] == summary["request_s"] > 0
        assert len(summary["itl_ms"]) == 4 and summary["ttft_ms"]["p50"] > 0


def test_vllm_runs_in_the_requested_precision_with_the_same_kv_token_budget(tmp_path):
    """The KV budget is given in tokens: fp32 KV needs twice the GiB of bf16 KV for it."""
    import json

    from benchmarks.servers import ServingSettings, vllm_command, vllm_dtype

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}))  # fmt: skip
    gib = {}
    for dtype in ("float32", "bfloat16"):
        settings = ServingSettings(kv_tokens=32 * 2048, vllm_dtype=dtype)
        command, env = vllm_command(tmp_path, settings, port=1)
        assert command[command.index("--dtype") + 1] == dtype == vllm_dtype(settings)
        gib[dtype] = int(env["VLLM_CPU_KVCACHE_SPACE"])
    # 65,536 tokens x 30 layers x 2 x 3 heads x 64 dims = 2.81 GiB in fp32, 1.41 GiB in bf16 (rounded up)
    assert gib == {"float32": 3, "bfloat16": 2}
    assert vllm_dtype(ServingSettings()) in ("float32", "bfloat16")


def test_targets_table_compares_medians_and_flags_a_busy_machine():
    from benchmarks import tables

    def row(system: str, mode: str, tok_s: float, ttft_ms: float) -> dict:
        median = {"output_tok_s": tok_s, "ttft_ms_p50": ttft_ms}
        return {"workload": "fixed 500 -> 128", "system": system, "mode": mode, "median": median}

    ours = "trtserve via Triton (fp32, prefix caching on)"
    rows = [row(ours, "concurrency 8", 60.0, 900.0), row("vllm-cpu (fp32)", "concurrency 8", 50.0, 800.0),
            row(ours, "concurrency 1", 20.0, 900.0), row("vllm-cpu (fp32)", "concurrency 1", 15.0, 800.0)]  # fmt: skip
    lines = tables.targets(rows)
    assert "| c8 output tok/s vs vLLM | 60.0 vs 50.0 | 1.20x | met (goal 1x) |" in lines
    assert "| c1 TTFT p50 ms vs vLLM | 900.0 vs 800.0 | 0.89x | missed (goal 1x) |" in lines
    assert "| c16 output tok/s vs vLLM | - | - | not measured |" in lines
    assert "rerun on a quiet machine" in tables._quiet_line({"cpu_busy_before": 0.6, "load_avg_1min_before": 2})
    assert "rerun" not in tables._quiet_line({"cpu_busy_before": 0.02, "load_avg_1min_before": 1.1})


def test_cpu_busy_fraction_is_a_share():
    from benchmarks.report import cpu_busy_fraction

    assert 0.0 <= cpu_busy_fraction(0.2) <= 1.0


def test_gateway_overhead_pairs_repetitions_and_reads_aiperf():
    from benchmarks.gateway import GATEWAY, TRITON, overhead
    from benchmarks.peers.aiperf import summary as aiperf_summary

    def rep(tok_s: float, ttft: float, cpu: float = 0.0) -> dict:
        return {"output_tok_s": tok_s, "ttft_ms_p50": ttft, "ttft_ms_p99": 2 * ttft, "itl_ms_p50": 30.0,
                "gateway_cpu_s": cpu, "output_tokens": 1000}  # fmt: skip

    rows = [{"system": GATEWAY, "mode": "concurrency 32", "reps": [rep(90.0, 105.0, 1.0), rep(80.0, 112.0, 2.0)]},
            {"system": TRITON, "mode": "concurrency 32", "reps": [rep(100.0, 100.0), rep(80.0, 100.0)]}]  # fmt: skip
    (entry,) = overhead(rows)
    assert entry["mode"] == "concurrency 32"
    assert entry["throughput_ratio"] == [0.95, 0.9, 1.0]  # median, min, max of 0.9 and 1.0
    assert entry["ttft_p50_delta_ms"] == [8.5, 5.0, 12.0]
    assert entry["gateway_cpu_ms_per_token"] == [1.5, 1.0, 2.0]
    export = {"output_token_throughput": {"avg": 50.0}, "time_to_first_token": {"p50": 12.0, "p99": 20.0},
              "inter_token_latency": {"p50": 30.0}, "inter_chunk_latency": {"p50": 29.0}}  # fmt: skip
    s = aiperf_summary(export)
    assert s == {"output_tok_s": 50.0, "tpot_ms_p50": 30.0, "failed": 0.0, "ttft_ms_p50": 12.0, "ttft_ms_p99": 20.0,
                 "itl_ms_p50": 29.0}  # fmt: skip


def test_routing_cascade_curve_replays_the_gateway_rule():
    from benchmarks.routing import cascade_curve, check, correct, questions

    def q(lp: float, small_ok: bool, strong_ok: bool) -> dict:
        return {"small_mean_logprob": lp, "small_correct": small_ok, "strong_correct": strong_ok, "small_tokens": 10,
                "strong_tokens": 10}  # fmt: skip

    items = [q(-0.2, True, True), q(-0.9, False, True), q(-0.5, False, False)]
    curve = cascade_curve(items)
    assert [p["escalated"] for p in curve] == [0.0, 0.3333, 0.6667, 1.0]
    assert [p["accuracy"] for p in curve] == [0.3333, 0.6667, 0.6667, 0.6667]
    assert [p["threshold"] for p in curve] == [-0.9, -0.7, -0.35, 0.0]
    assert curve[1]["strong_token_share"] == 0.25  # 10 strong of 30 small + 10 strong tokens
    c = check(items, [[False, True, False]], threshold=-0.7)  # mean < -0.7 escalates only the second
    assert c["agree"] == 3 and c["predicted_accuracy"] == 0.6667
    assert correct("The capital is PARIS.", ["Paris"]) and not correct("Lyon", ["Paris"])
    assert {x["set"] for x in questions()} == {"qa", "held-out"}


def test_steady_state_drops_the_first_wave_and_spans_the_rest():
    from benchmarks.gateway import steady_state

    # A closed loop at concurrency 2: the first two sends start together, the next ones as slots free.
    rs = [record(0.0, [(0.5, 1)], 1.0), record(0.0, [(0.6, 1)], 1.2), record(1.0, [(1.3, 1)], 2.0),
          record(1.2, [(1.4, 1)], 2.5)]  # fmt: skip
    kept, window = steady_state(list(reversed(rs)), discard=2)  # order of completion does not matter
    assert [r.start for r in kept] == [1.0, 1.2]
    assert window == pytest.approx(1.5)  # first kept send (1.0) to last end (2.5)
    with pytest.raises(ValueError):
        steady_state(rs, discard=4)


def test_gateway_pin_takes_two_disjoint_sets_of_this_machines_cores():
    import os

    import click

    from benchmarks.gateway import parse_pin

    cores = sorted(os.sched_getaffinity(0))
    assert parse_pin(None) is None
    if len(cores) > 1:
        assert parse_pin(f"{cores[0]}/{cores[1]}") == ((cores[0],), (cores[1],))
    for bad in (f"{cores[0]}/{cores[0]}", "0/x", "0", f"{cores[0]}/{max(cores) + 1}"):
        with pytest.raises(click.BadParameter):
            parse_pin(bad)


def test_poisson_arrivals_are_seeded_exponential_gaps():
    import numpy as np

    from benchmarks.client import arrival_gaps

    a, b = arrival_gaps(4000, rate=2.0, seed=7), arrival_gaps(4000, rate=2.0, seed=7)
    assert np.array_equal(a, b) and not np.array_equal(a, arrival_gaps(4000, rate=2.0, seed=8))
    assert (a >= 0).all() and a.mean() == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate
    assert a.std() == pytest.approx(0.5, rel=0.08)  # exponential: std = mean
    assert not arrival_gaps(3, None).any()  # no rate: every request at once
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0)


def test_slo_rates_curves_and_targets():
    from benchmarks.slo import Config, estimate_s, itl_curve, poisson_rates, poisson_requests
    from benchmarks.slo_report import FIXED, SLO_BUDGET, VLLM, targets

    assert poisson_rates(0.8, (0.7, 0.9)) == (0.56, 0.72)
    assert poisson_requests(0.56, 60.0) == 34 and poisson_requests(0.01, 60.0) == 4
    with pytest.raises(ValueError):
        poisson_rates(0.0, (0.7,))
    # ITL percentiles over every token gap of the successful requests only.
    ok = record(0.0, [(0.1, 1), (0.2, 1), (0.4, 1), (0.8, 1)], 0.8)  # gaps 0.1, 0.2, 0.4 s
    failed = RequestRecord(0.0, [0.1, 5.0], [1, 1], 5.0, 10, error="cut")
    assert itl_curve([ok, failed], (0, 50, 100)) == [100.0, 200.0, 400.0]
    assert itl_curve([failed]) == []
    assert 600 < estimate_s(Config(engine=Path("e")), systems=3) < 1800  # the default run: ~30 min at most

    def row(system: str, mode: str, **median) -> dict:
        return {"system": system, "mode": mode, "median": median}

    rows = [row(SLO_BUDGET, "concurrency 8", itl_ms_p99=240.0, goodput_req_s=0.3),
            row(FIXED, "concurrency 8", itl_ms_p99=1100.0), row(SLO_BUDGET, "concurrency 16", itl_ms_p99=300.0),
            row(VLLM, "concurrency 8", goodput_req_s=0.1), row(SLO_BUDGET, "concurrency 32", output_tok_s=80.0),
            row(FIXED, "concurrency 32", output_tok_s=85.0)]  # fmt: skip
    t = {x["target"]: x for x in targets(rows)}
    assert t["ITL p99 ≤ 250 ms at c=8"]["status"] == "met"
    assert t["ITL p99 ≤ 250 ms at c=8"]["measured"] == "240 ms (fixed budget: 1100 ms)"
    assert t["ITL p99 ≤ 250 ms at c=16"]["status"] == "missed"
    assert t["goodput at c=8 ≥ 2x vLLM's (fp32)"]["status"] == "met"  # 0.3 vs 0.1
    assert t["output tok/s at c=32 ≥ 90% of the fixed budget's"]["status"] == "met"  # 94%
    rows[3]["median"]["goodput_req_s"] = 0.0
    assert "∞" in {x["target"]: x for x in targets(rows)}["goodput at c=8 ≥ 2x vLLM's (fp32)"]["measured"]
    assert all(x["status"] == "not measured" for x in targets([]))


def test_prometheus_text_and_prefix_hit_rate():
    from benchmarks import prometheus
    from benchmarks.scaleout import gain, picks, replica_stats

    def text(queries: float, hits: float, ttft_count: float) -> str:
        return (f"# HELP trtserve_prefix_cache_queries_total Prompt tokens looked up.\n"
                f'trtserve_prefix_cache_queries_total{{model="llm",version="1"}} {queries}\n'
                f'trtserve_prefix_cache_hits_total{{model="llm",version="1"}} {hits}\n'
                f'vllm:prefix_cache_hits_total{{model="llm",version="1"}} {hits}\n'
                f'trtserve_time_to_first_token_seconds_count{{model="llm",version="1"}} {ttft_count}\n'
                "garbage line\n")  # fmt: skip

    before, after = prometheus.parse(text(100, 20, 3)), prometheus.parse(text(1100, 770, 13))
    assert prometheus.total(after, "trtserve_prefix_cache_hits_total") == 770.0
    assert prometheus.total(after, "trtserve_prefix_cache_hits_total", 'model="other"') == 0.0
    assert prometheus.hit_rate(before, after) == {"queries": 1000.0, "hits": 750.0, "hit_rate": 0.75}
    assert prometheus.hit_rate(before, before)["hit_rate"] is None  # nothing looked up
    stats = replica_stats(before, after)
    assert stats["requests"] == 10.0 and stats["hit_rate"] == 0.75
    gw = 'trtserve_gateway_replica_picks_total{{backend="m",replica="{}",reason="{}"}}'
    g0 = {gw.format("a:1", "prefix_match"): 2.0}
    g1 = {gw.format("a:1", "prefix_match"): 7.0, gw.format("a:1", "no_prefix_match"): 1.0,
          gw.format("b:2", "imbalance"): 3.0}  # fmt: skip
    assert picks(g0, g1, ["a:1", "b:2"]) == [{"no_prefix_match": 1.0, "prefix_match": 5.0}, {"imbalance": 3.0}]
    assert gain({"prefix": {"ttft_ms_p50": 100.0}, "round_robin": {"ttft_ms_p50": 250.0}}) == {
        "ratio": 2.5, "status": "met"}  # fmt: skip
    assert gain({"prefix": {"ttft_ms_p50": 100.0}})["status"] == "not measured"


def test_many_system_prompts_workload_is_seeded_and_shares_prefixes(llama_engine):
    from benchmarks.datasets import many_system_prompts
    from runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_engine)
    a = many_system_prompts(tok, 12, 4, prompts=3, system_len=40, seed=1)
    assert a == many_system_prompts(tok, 12, 4, prompts=3, system_len=40, seed=1)
    heads = {r.prompt.split("User ")[0] for r in a}  # everything before the user's question
    assert len(heads) == 3 and len({r.prompt for r in a}) == 12
    assert all(r.max_tokens == 4 and r.ignore_eos for r in a)


def test_ttft_beyond_the_engine_subtracts_its_histogram_over_the_same_requests():
    from benchmarks.gateway import beyond_engine_ttft_ms

    def scrape(total_s: float, count: float) -> dict[str, float]:
        return {'trtserve_time_to_first_token_seconds_sum{model="llm",version="1"}': total_s,
                'trtserve_time_to_first_token_seconds_count{model="llm",version="1"}': count}  # fmt: skip

    rs = [record(0.0, [(0.30, 1)], 0.4), record(0.0, [(0.50, 1)], 0.6)]  # client TTFTs 0.3 and 0.5 s
    # The engine saw those two requests at 0.29 and 0.48 s: 15 ms of mean TTFT outside it.
    assert beyond_engine_ttft_ms(rs, scrape(1.0, 5), scrape(1.77, 7)) == pytest.approx(15.0)
    assert beyond_engine_ttft_ms(rs, scrape(1.0, 5), scrape(2.0, 8)) is None  # a third request: not comparable


def test_backend_steps_report_has_a_row_per_shape_and_speedups_over_the_first_backend():
    from benchmarks.backend_steps import SHAPES, render

    times = {"cpu": {label: [0.010, 0.012, 0.011] for label, *_ in SHAPES},
             "cpu-bf16": {label: [0.005, 0.006, 0.0055] for label, *_ in SHAPES}}  # fmt: skip
    payload = {"machine": {"cpu": "x", "cores": 2}, "date_utc": "d", "command": "c", "engine": "e", "repeats": 3,
               "backends": ["cpu", "cpu-bf16"], "times": times}  # fmt: skip
    lines = render(payload).splitlines()
    rows = [line for line in lines if line.startswith("| ") and "ms (" not in line and "---" not in line]
    assert rows[0] == "| step | cpu ms | cpu-bf16 ms | cpu-bf16 speedup |"
    assert f"| {SHAPES[0][0]} | 11.0 (10.0–12.0) | 5.5 (5.0–6.0) | 2.00x |" in lines
    assert len([line for line in lines if "x |" in line]) == len(SHAPES)


def test_restart_time_report():
    from benchmarks.restart_time import render

    p = {
        "machine": {"cpu": "cpu", "cores": 2},
        "date_utc": "2026-01-01",
        "command": "python -m benchmarks.restart_time",
        "serve_command": ["trtserve", "serve"],
        "ready_s": 7.8,
        "exit_code": 0,
        "serving_again_s": [6.5, None, 7.1],
    }
    md = render(p)
    assert "median (min-max) 6.8 (6.5-7.1); each kill: 6.5, None, 7.1." in md  # a kill never recovered shows as None
    assert "median (min-max) -;" in render({**p, "serving_again_s": [None]})
