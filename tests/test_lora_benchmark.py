"""benchmarks/lora.py's pure parts, without a server: the adapters' assignment to requests and the workloads, each
request's model on the wire, both servers' LoRA flags, trtserve's LoRA counters, the offline probe's summary, and the
targets, report and plot from a synthetic result (benchmarks/lora_report.py), a failed request failing them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest

from benchmarks import client, lora_workload
from benchmarks.decode_chat import medians as chat_medians
from benchmarks.lora import Config, lora_flags, workloads
from benchmarks.lora_offline import probe_order, probe_summary
from benchmarks.lora_report import RUNS, lora_counters, medians, problems, render, targets, write_plot
from benchmarks.lora_workload import adapter_names, assign, sender

ENGINE = Path("engines/smollm2-135m-b32")


class ChatTokenizer:
    """A chat template of tags, one token per character."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_assignment_round_robin_or_seeded_random() -> None:
    names = adapter_names(8)
    assert names == [f"a{i}" for i in range(8)]
    picks = assign(64, names, "round-robin", 0)
    assert picks[:9] == [*names, "a0"] and Counter(picks) == {n: 8 for n in names}
    drawn = assign(64, names, "random", 3)
    assert drawn == assign(64, names, "random", 3) != assign(64, names, "random", 4)
    assert set(drawn) <= set(names) and drawn != picks
    with pytest.raises(ValueError, match="round-robin or random"):
        assign(4, names, "by size", 0)


def test_workloads_send_the_same_prompts_base_and_adapters() -> None:
    cfg = Config(ENGINE, prompts=20, warmup=8, adapters=4)
    work = workloads(ChatTokenizer(), cfg)
    base, adapters = work["base"], work["lora"]
    assert [r.model for r in base["chat"]] == [None] * 20 and [r.model for r in base["warmup"]] == [None] * 8
    assert [r.model for r in adapters["chat"]] == [f"a{i % 4}" for i in range(20)]
    assert {r.model for r in adapters["warmup"]} == {"a0", "a1", "a2", "a3"}  # every adapter warmed up
    for kind in ("warmup", "chat"):
        strip = [dataclasses.replace(r, model=None) for r in adapters[kind]]
        assert strip == base[kind]
    assert {(r.temperature, r.seed, r.max_tokens, r.ignore_eos) for r in base["chat"]} == {(0.7, None, 160, False)}
    assert len({r.messages for r in base["chat"]}) == 20


def test_each_request_names_its_model_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []

    async def fake_send(session: object, endpoint: client.Endpoint, req: object) -> str:
        seen.append((endpoint.kind, endpoint.model))
        return "sent"

    monkeypatch.setattr(client, "send_chat", fake_send)
    work = workloads(ChatTokenizer(), Config(ENGINE, prompts=3, warmup=0, adapters=2))
    send = sender(client.Endpoint("gateway-chat", "http://x", "smollm2-135m-b32"))

    async def send_all() -> list[object]:
        return [await send(cast(Any, None), r) for r in work["base"]["chat"] + work["lora"]["chat"]]

    assert asyncio.run(send_all()) == ["sent"] * 6
    assert [m for _, m in seen] == ["smollm2-135m-b32"] * 3 + ["a0", "a1", "a0"]


def test_lora_flags_of_both_servers(tmp_path: Path) -> None:
    adapters = {"a0": tmp_path / "a0", "a1": tmp_path / "a1"}
    cfg = Config(ENGINE, rank=12, max_loras=8)
    assert lora_flags(adapters, cfg, vllm=False) == [
        "--lora",
        f"a0={tmp_path}/a0",
        "--lora",
        f"a1={tmp_path}/a1",
        "--max-loras",
        "8",
        "--max-lora-rank",
        "12",
    ]
    assert lora_flags(adapters, cfg, vllm=True) == [
        "--enable-lora",
        "--lora-modules",
        f"a0={tmp_path}/a0",
        f"a1={tmp_path}/a1",
        "--max-loras",
        "8",
        "--max-lora-rank",
        "16",  # vLLM takes 1, 8, 16, 32, ... only
    ]
    assert Config(ENGINE).runs == RUNS and Config(ENGINE, vllm=False).runs == ("trtserve-base", "trtserve-lora")
    assert Config(ENGINE, only=("vllm-base", "trtserve-lora", "vllm-lora")).runs == (
        "trtserve-lora",
        "vllm-lora",
        "vllm-base",
    )


def test_lora_counters_check_every_pick_was_served_as_its_adapter() -> None:
    def scrape(loads: float, requests: dict[str, float]) -> dict[str, float]:
        out = {'trtserve_lora_slot_loads_total{model="llm",version="1"}': loads}
        for name, n in requests.items():
            out[f'trtserve_lora_requests_total{{adapter="{name}",model="llm",version="1"}}'] = n
        return out

    before = scrape(8, {"a0": 1, "a1": 1})
    got = lora_counters(before, scrape(10, {"a0": 3, "a1": 3}), ["a0", "a1", "a0", "a1"])
    assert got["slot_loads"] == 2 and got["requests"] == {"a0": 2, "a1": 2} and got["covers_picks"]
    short = lora_counters(before, scrape(10, {"a0": 3, "a1": 2}), ["a0", "a1", "a0", "a1"])
    assert not short["covers_picks"]  # one a1 request ran on the base model (or another adapter)
    assert lora_counters(before, before, [])["covers_picks"]  # a base-model run names none


def test_probe_summary_and_a_misclassified_probe() -> None:
    assert probe_order("a0", "a1", 2)[:5] == [
        (None, "base"),
        ("a0", "miss"),
        ("a0", "warm"),
        ("a1", "miss"),
        ("a1", "warm"),
    ]

    def probe(first_ms: float, loads: int) -> dict:
        return {
            "first_s": first_ms / 1000,
            "decode_s": [0.01, 0.012],
            "slot_loads": loads,
            "slot_fill_s": 0.003 * loads,
        }

    probes = [
        ("base", probe(40, 0)),
        ("miss", probe(50, 1)),
        ("warm", probe(42, 0)),
        ("miss", probe(52, 1)),
        ("warm", probe(44, 0)),
    ]
    s = probe_summary(probes)
    assert s["miss"]["first_step_ms"] == 51 and s["warm"]["first_step_ms"] == 43 and s["miss_extra_ms"] == 8
    assert s["slot_fill_ms"] == 3 and s["loads_as_expected"] and s["base"]["decode_step_ms"] == 11
    assert not probe_summary([*probes, ("warm", probe(60, 1))])["loads_as_expected"]


def entry(rep: int, tok_s: float, tpot: float, failed: int = 0, covers: bool | None = None) -> dict:
    chat = {
        "output_tok_s": tok_s,
        "tpot_ms_p50": tpot,
        "tpot_ms_p99": 2 * tpot,
        "ttft_ms_p50": 300.0,
        "e2e_ms_p50": 9000.0,
        "mean_output_tokens": 150.0,
        "ok": 64 - failed,
        "failed": failed,
        "requests": 64,
        "errors": ["HTTP 500: boom"] if failed else [],
    }
    if covers is not None:
        chat["engine"] = {"engine_busy": 0.95, "engine_step_ms_mean": 60.0, "prefix_cache_hit_rate": 0.5}
        chat["lora"] = {
            "slot_loads": 0,
            "slot_evictions": 0,
            "disk_loads": 0,
            "load_seconds": 0.0,
            "requests": {"a0": 32, "a1": 32},
            "covers_picks": covers,
        }
    return {"repetition": rep, "position": 0, "warmup_failed": 0, "chat": chat, "server": {"command": "x"}}


def synthetic(runs: dict[str, list[dict]]) -> dict:
    med = {run: medians(e) for run, e in runs.items()}
    cfg = {**dataclasses.asdict(Config(ENGINE, repetitions=3)), "engine": str(ENGINE), "runs": list(runs)}
    offline = {
        "backend": "cpu",
        "engine_start_s": 5.0,
        "start_disk_loads": 8,
        "start_load_ms_per_adapter": 40.0,
        "add_lora_ms": 45.0,
        "add_lora_ms_range": [30.0, 60.0],
        "probe_tokens": 4,
        "prompt_tokens": 40,
        "cycles": 6,
        "memory": {"adapter": "a1", "adapter_nbytes": 7372800, "slot_nbytes": 11059200, "slots": 1},
        "probe": probe_summary([("base", {"first_s": 0.04, "decode_s": [0.01], "slot_loads": 0, "slot_fill_s": 0.0})]),
    }
    return {
        "machine": {"cpu": "test CPU", "cores": 2},
        "date_utc": "2026-11-29T00:00:00+00:00",
        "wall_s": 100.0,
        "command": "python -m benchmarks.lora --engine x",
        "cpu_busy_before": 0.05,
        "config": cfg,
        "checkpoint": "/ckpt",
        "target_modules": list(lora_workload.TARGET_MODULES),
        "picks": {"a0": 32, "a1": 32},
        "servers": {
            r: {"command": f"{r} --flags", **({"backend": "cpu", "how": "its log"} if "trt" in r else {})} for r in runs
        },
        "vllm": {"version": "0.32.0", "dtype": "float32"},
        "vllm_skipped": None,
        "runs": runs,
        "medians": med,
        "targets": targets(runs, med, 8),
        "offline": offline,
    }


def clean_runs() -> dict[str, list[dict]]:
    return {
        "trtserve-base": [entry(0, 200, 70), entry(1, 220, 65), entry(2, 210, 68)],
        "trtserve-lora": [
            entry(0, 180, 80, covers=True),
            entry(1, 190, 78, covers=True),
            entry(2, 200, 75, covers=True),
        ],
        "vllm-lora": [entry(0, 100, 140), entry(1, 110, 130), entry(2, 120, 120)],
        "vllm-base": [entry(0, 150, 100), entry(1, 160, 95), entry(2, 150, 98)],
    }


def test_targets_report_and_plot_from_a_synthetic_result(tmp_path: Path) -> None:
    p = synthetic(clean_runs())
    by_runs = {tuple(t["runs"]): t for t in p["targets"]}
    own, peer, vllm_own = (
        by_runs[k]
        for k in [("trtserve-lora", "trtserve-base"), ("trtserve-lora", "vllm-lora"), ("vllm-lora", "vllm-base")]
    )
    assert own["ratio"] == round(190 / 210, 3) and own["met"] and own["paired_ratio_range"] == [0.864, 0.952]
    assert peer["ratio"] == round(190 / 110, 3) and peer["met"] and peer["tpot_p50_ratio"] == round(78 / 130, 3)
    assert vllm_own["bound"] is None and not vllm_own["met"] and vllm_own["ratio"] == round(110 / 150, 3)
    assert problems(p) == []
    md = render(p)
    assert "# Multi-LoRA serving: 8 adapters" in md and "Machine: test CPU, 2 cores" in md
    assert "`python -m benchmarks.lora --engine x`" in md and "q_proj, k_proj, v_proj, o_proj only" in md
    row = "| trtserve: 8 adapters / base model only | 190.0 / 210.0 | 0.91 (0.86–0.95) | 1.15 | ≥ 0.85 | yes |"
    assert row in md
    assert "| vLLM: 8 adapters / base model only (no target) |" in md and "no target |" in md
    assert "| trtserve-lora | 190.0 (180.0–200.0) | 78.0 (75.0–80.0) |" in md and "a0 32, a1 32" in md
    assert "7.03 MiB in host memory" in md and "10.55 MiB in its slot" in md and "## Failures" not in md
    write_plot(p, tmp_path / "lora.png")
    assert (tmp_path / "lora.png").stat().st_size > 1000


def test_a_failed_request_or_an_unserved_adapter_fails_the_targets() -> None:
    runs = clean_runs()
    runs["trtserve-lora"][1] = entry(1, 190, 78, failed=2, covers=True)
    p = synthetic(runs)
    own, peer = p["targets"][:2]
    assert own["ratio"] > 0.85 and not own["met"] and not peer["met"]
    assert own["problems"] == ["repetition 2: 2 of 64 requests failed: HTTP 500: boom"]
    assert "**no**: see failures" in render(p) and "## Failures" in render(p) and problems(p)
    runs = clean_runs()
    runs["trtserve-lora"][0] = entry(0, 180, 80, covers=False)  # requests ran on the base model: fast, not LoRA
    assert not synthetic(runs)["targets"][0]["met"] and "fewer adapter requests" in problems(synthetic(runs))[0]
    runs = clean_runs()
    runs["vllm-lora"] = [{"repetition": 0, "position": 2, "unavailable": "server exited with code 1:\nValueError: x"}]
    p = synthetic(runs)
    assert p["targets"][1]["status"] == "not measured" and not p["targets"][1]["met"]
    assert problems(p) == ["vllm-lora repetition 1: did not run: ValueError: x"]
    assert chat_medians(runs["vllm-lora"]) == {}


def test_ratio_below_target_is_not_met() -> None:
    runs = clean_runs()
    runs["trtserve-lora"] = [entry(r, 150, 90, covers=True) for r in range(3)]
    own = synthetic(runs)["targets"][0]
    assert own["ratio"] == round(150 / 210, 3) and not own["met"] and own["problems"] == []
