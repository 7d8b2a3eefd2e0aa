"""The speculative-decoding benchmark's logic on synthetic scrapes and repetitions (hand-computed values),
its workload, and one quick pass through real tritonservers serving the tiny engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import prometheus
from benchmarks.spec_decode import Config, server_params
from benchmarks.spec_decode_report import (
    CHAT,
    COPY,
    DRAFT,
    DRAFT_MODEL,
    NGRAM,
    OFF,
    aggregate,
    render,
    spec_deltas,
    targets,
)


def scrape(generated: int, drafts: int = 0, drafted: int = 0, accepted: int = 0, per_position=()) -> dict:
    labels = 'model="llm",version="1"'
    lines = [f"trtserve_generation_tokens_total{{{labels}}} {generated}"]
    if drafts:
        lines += [f"trtserve_spec_decode_drafts_total{{{labels}}} {drafts}",
                  f"trtserve_spec_decode_draft_tokens_total{{{labels}}} {drafted}",
                  f"trtserve_spec_decode_accepted_tokens_total{{{labels}}} {accepted}",
                  f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}"]  # fmt: skip
        lines += [f'trtserve_spec_decode_accepted_tokens_per_position_total{{{labels},position="{i}"}} {n}'
                  for i, n in enumerate(per_position)]  # fmt: skip
    return prometheus.parse("\n".join(lines))


def test_spec_deltas_between_two_scrapes():
    before = scrape(100, drafts=10, drafted=40, accepted=20, per_position=(8, 6, 4, 2))
    after = scrape(160, drafts=22, drafted=88, accepted=56, per_position=(18, 15, 13, 10))
    d = spec_deltas(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (12, 48, 36)
    assert d["accepted_per_position"] == [10, 9, 9, 8]
    assert d["acceptance_rate"] == 0.75 and d["mean_acceptance_length"] == 4.0  # 1 + 36 / 12
    assert d["spec_token_share"] == 0.8  # 12 passes emitted 12 + 36 = 48 of the 60 tokens
    off = spec_deltas(scrape(0), scrape(50))  # speculation off (or paused): no families, no rates
    assert off["acceptance_rate"] is None and off["mean_acceptance_length"] is None and off["spec_token_share"] == 0
    assert off["accepted_per_position"] == []


def rep(tok_s: float, tpot_ms: float, drafts: int = 0, accepted_per_position=(), **extra) -> dict:
    return {"output_tok_s": tok_s, "tpot_ms_p50": tpot_ms, "decode_tok_s": 1000 / tpot_ms, "drafts": drafts,
            "accepted_per_position": list(accepted_per_position), "failed": 0, **extra}  # fmt: skip


def row(workload: str, system: str, c: int, reps: list[dict]) -> dict:
    return {"workload": workload, "system": system, "concurrency": c, "reps": reps, "unavailable": None}


RAW = [
    row(COPY, OFF, 1, [rep(10, 100), rep(12, 80), rep(11, 90)]),
    row(COPY, NGRAM, 1, [rep(25, 40, 10, (9, 8)), rep(24, 40, 10, (7, 6)), rep(33, 30, 20, (18, 10))]),
    row(CHAT, OFF, 1, [rep(10, 100)]),
    row(CHAT, DRAFT, 1, [rep(12, 80, 5, (3,))]),
    row(COPY, OFF, 16, [rep(100, 150), rep(90, 160), rep(110, 140)]),
    row(COPY, NGRAM, 16, [rep(96, 150), rep(89, 160), rep(100, 150)]),
    row(COPY, DRAFT, 16, [rep(70, 200), rep(75, 190), rep(72, 200)]),
]


def test_aggregate_pairs_speedups_by_repetition_and_pools_positions():
    rows = {(r["workload"], r["system"], r["concurrency"]): r for r in aggregate(RAW)}
    ngram = rows[(COPY, NGRAM, 1)]
    # Paired output tok/s ratios 2.5, 2.0, 3.0: the median of the pairs, not the ratio of the medians (25 / 11).
    assert ngram["speedup"] == [2.5, 2.0, 3.0]
    assert ngram["decode_speedup"] == [2.5, 2.0, 3.0]  # TPOT 100/40, 80/40, 90/30
    assert ngram["median"]["output_tok_s"] == 25 and ngram["spread"]["output_tok_s"] == [24, 33]
    assert ngram["position_acceptance"] == [round(34 / 40, 3), 0.6]  # (9+7+18) / 40 verify passes, (8+6+10) / 40
    assert "speedup" not in rows[(COPY, OFF, 1)] and rows[(COPY, OFF, 1)]["position_acceptance"] == []


def test_targets_from_the_aggregated_rows():
    status = {t["target"]: t["status"] for t in targets(aggregate(RAW), 16)}
    assert status["ngram ≥ 2x single-stream decode tok/s, copy-heavy"] == "met"  # 2.5x
    assert status["draft ≥ 1.3x single-stream decode tok/s, chat"] == "missed"  # 1.25x
    # The off rows at c=16 spread 90-110 around 100: ±20% is the noise band.
    assert status["no regression beyond noise at c=16, ngram, copy-heavy"] == "met"  # 0.96x
    assert status["no regression beyond noise at c=16, draft, copy-heavy"] == "missed"  # 0.7x
    assert status["no regression beyond noise at c=16, ngram, chat"] == "not measured"
    quick = {t["target"]: t["status"] for t in targets(aggregate(RAW[:4]), 1)}
    assert quick["no regression beyond noise at c=1, ngram, copy-heavy"] == "not measured"


def test_report_names_targets_rows_and_unavailable_systems():
    rows = aggregate([*RAW, {**row(CHAT, NGRAM, 1, []), "unavailable": "RuntimeError: boom"}])
    payload = {"machine": {"cpu": "cpu", "cores": 2, "platform": "linux"}, "date_utc": "now", "wall_s": 1.0,
               "estimate_s": 2.0, "command": "python -m benchmarks.spec_decode", "cpu_busy_before": 0.0,
               "controls": ["c"], "targets": targets(rows, 16), "rows": rows, "versions": {"trtserve": "0"},
               "workload_names": {COPY: "Copy-heavy", CHAT: "Chat"}}  # fmt: skip
    text = render(payload)
    assert "| ngram ≥ 2x single-stream decode tok/s, copy-heavy | 2.50x (2.00–3.00 over the" in text
    assert "| ngram | 1 | 25.0 (24.0–33.0) | 2.50x (2.00–3.00) |" in text
    assert "| ngram | 1 | not run: RuntimeError: boom |" in text
    assert text.index("## Copy-heavy") < text.index("## Chat")


def test_server_params_per_system():
    cfg = Config(Path("target"), Path("draft"), num_speculative_tokens=3, disable_batch_size=2)
    assert server_params(cfg, OFF) == {}
    assert server_params(cfg, NGRAM) == {"speculative": "ngram", "num_speculative_tokens": "3",
                                         "speculative_disable_batch_size": "2"}  # fmt: skip
    assert server_params(cfg, DRAFT)["draft_engine"] == "draft"
    assert "draft_prompt_lookup_min" not in server_params(cfg, DRAFT)  # as served: the engine's default
    assert server_params(cfg, DRAFT_MODEL) == {**server_params(cfg, DRAFT), "draft_prompt_lookup_min": "0"}
    assert "speculative_disable_batch_size" not in server_params(Config(Path("t"), None), NGRAM)  # the engine's
    with pytest.raises(ValueError, match="--draft-engine"):
        server_params(Config(Path("target"), None), DRAFT)


def test_copy_heavy_workload_cycles_seeded_prompts_in_the_chat_template(llama_engine):
    from benchmarks import datasets
    from runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_engine)
    reqs = datasets.copy_heavy(tok, 20, 64, seed=3)
    assert len(reqs) == 20 and len({r.prompt for r in reqs}) == 16  # all 16 prompts, then the cycle again
    assert reqs[16].prompt == reqs[0].prompt and not any(r.ignore_eos for r in reqs)
    assert [r.prompt for r in datasets.copy_heavy(tok, 4, 64, seed=3)] == [r.prompt for r in reqs[:4]]
    assert [r.prompt for r in datasets.copy_heavy(tok, 16, 64, seed=4)] != [r.prompt for r in reqs[:16]]
    assert "Rewrite this paragraph with one change" in "".join(r.prompt for r in reqs)


@pytest.mark.serving
def test_quick_run_through_tritonservers(llama_engine, tmp_path):
    """A server per system of the tiny engine (it drafts for itself), one quick pass: every system streams the same
    greedy tokens, speculation shows in the metrics deltas, and the report's rows aggregate."""
    from benchmarks import servers
    from benchmarks.datasets import BenchRequest
    from benchmarks.spec_decode import run, started
    from runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_engine)
    texts = ["one two three four five six " * 3 + "one two", "red green blue red green blue red"]
    reqs = [BenchRequest(t, tuple(tok.encode(t, add_special_tokens=False)), 24, True) for t in texts]
    # Not adaptive: on the tiny engine the governor may well find drafting not worth it, and this checks mechanics.
    settings = servers.ServingSettings(
        max_num_seqs=4,
        kv_tokens=8 * 256,
        max_num_batched_tokens=64,
        prefix_caching=False,
        extra_params={"speculative_adaptive": "false"},
    )
    cfg = Config(llama_engine, llama_engine, levels=(1,), repetitions=1, quiet=False, settings=settings, logs=tmp_path)
    with started(cfg, print) as (endpoints, failed):
        assert not failed and set(endpoints) == {OFF, NGRAM, DRAFT, DRAFT_MODEL}
        rows = aggregate(run(cfg, {COPY: {1: reqs}}, reqs[:1], endpoints, print))
    by_system = {r["system"]: r for r in rows}
    for r in rows:
        assert [x["output_tokens"] for x in r["reps"]] == [48] and r["median"]["failed"] == 0
    assert by_system[OFF]["reps"][0]["drafts"] == 0 and by_system[OFF]["median"].get("acceptance_rate") is None
    for system in (DRAFT, DRAFT_MODEL):
        assert by_system[system]["median"]["acceptance_rate"] > 0.9  # the target drafting for itself
    assert by_system[NGRAM]["reps"][0]["draft_tokens"] > 0
    assert len(by_system[NGRAM]["speedup"]) == 3 and by_system[DRAFT]["position_acceptance"]
