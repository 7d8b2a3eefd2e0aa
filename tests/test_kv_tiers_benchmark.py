"""benchmarks/kv_tiers.py's pure parts, without a server: the seeded documents, Zipf picks and workload, the tiers'
sizes and serve flags, vLLM's command line and pool, medians and targets (vLLM's too), and the report and plot from a
synthetic result (benchmarks/kv_tiers_report.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections import Counter
from pathlib import Path

from click.testing import CliRunner

from benchmarks import kv_tiers, prometheus, servers
from benchmarks.datasets import BenchRequest
from benchmarks.kv_tiers import (
    MODES,
    SMOKE,
    Config,
    documents,
    serve_args,
    tier_sizes,
    vllm_args,
    vllm_blocks,
    vllm_plan,
    workload,
    zipf_picks,
)
from benchmarks.kv_tiers_report import medians, render, targets, vs_vllm, write_plot
from engine_format import EngineConfig
from engine_format.model_spec import ModelSpec


class CharTokenizer:
    """One token per character: sizes are exact and decode(encode(text)) == text."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


TOK = CharTokenizer()
SMOLLM2 = ModelSpec(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    qkv_bias=False,
    rope_type="default",
    max_position_embeddings=8192,
    sliding_windows=(None,) * 30,
    bos_token_id=1,
    eos_token_ids=(2,),
)
ENGINE = EngineConfig(
    engine_dir=Path("."),
    target="onnxruntime-cpu",
    dtype="float32",
    block_size=64,
    max_batch_size=16,
    max_seq_len=2048,
    model=SMOLLM2,
)


def test_documents_are_seeded_sized_and_differ_from_their_first_tokens():
    docs = documents(TOK, 5, 300, seed=1)
    assert docs == documents(TOK, 5, 300, seed=1) and docs != documents(TOK, 5, 300, seed=2)
    assert all(295 <= len(TOK.encode(d)) <= 300 for d in docs)  # cut to 300 tokens, a trailing space stripped
    assert [d.split(":")[0] for d in docs] == [f"Document {i}" for i in range(5)] and re.search(
        "[a-z]\\. [A-Z][a-z]+ ", docs[0]
    )
    assert len({d[:12] for d in docs}) == 5


def test_zipf_picks_are_seeded_and_follow_the_power_law():
    picks = zipf_picks(4000, 48, 1.1, seed=3)
    assert picks == zipf_picks(4000, 48, 1.1, seed=3) and picks != zipf_picks(4000, 48, 1.1, seed=4)
    counts = Counter(picks)
    assert set(counts) <= set(range(48)) and counts[0] > counts[1] > counts[5] > counts[30]
    top = 1 / sum(1 / i**1.1 for i in range(1, 49))  # P(document 0)
    assert abs(counts[0] / 4000 - top) < 0.03


def test_workload_puts_each_picked_document_before_a_numbered_question():
    cfg = Config(Path("e"), documents=5, doc_tokens=200, requests=30, restart_docs=3, max_tokens=7)
    work = workload(TOK, cfg)
    assert work == workload(TOK, cfg)
    assert {k: len(v) for k, v in work.items()} == {
        "warmup": 2,
        "prime": 5,
        "measured": 30,
        "restart_before": 3,
        "restart_after": 3,
    }
    docs = documents(TOK, 5, 200, cfg.seed)
    picks = zipf_picks(30, 5, 1.1, cfg.seed)
    assert all(r.prompt.startswith(docs[p] + "\n\nQuestion: (") for r, p in zip(work["measured"], picks, strict=True))
    assert len({r.prompt for r in work["measured"]}) == 30
    assert all(list(r.prompt_ids) == TOK.encode(r.prompt) and r.max_tokens == 7 and r.ignore_eos for r in work["prime"])
    for before, after, doc in zip(work["restart_before"], work["restart_after"], docs, strict=False):
        assert before.prompt.startswith(doc + "\n\n") and after.prompt.startswith(doc + "\n\n")
        assert before.prompt != after.prompt


def test_tier_sizes_come_from_the_engines_kv_bytes_and_become_serve_flags():
    prime = [BenchRequest("x", (0,) * 100, 16, True)] * 10  # 2 blocks of 64 each
    sizes = tier_sizes(ENGINE, prime)
    assert sizes["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert sizes["all"] == 0.07 and sizes["quarter"] == 0.02  # 1,280 tokens x 46,080 B x 1.25 = 0.0687 GiB
    cfg = Config(Path("e"), pool_tokens=16384, concurrency=4)
    base = ["--num-kv-blocks", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "512"]
    assert serve_args(cfg, ENGINE, "none", sizes, Path("/d")) == base
    assert serve_args(cfg, ENGINE, "host", sizes, Path("/d")) == [*base, "--kv-host-cache-gb", "0.07"]
    disk = ["--kv-host-cache-gb", "0.02", "--kv-disk-cache", "/d", "--kv-disk-cache-gb", "0.07"]
    assert serve_args(cfg, ENGINE, "host+disk", sizes, Path("/d")) == [*base, *disk]
    assert serve_args(Config(Path("e"), concurrency=64), ENGINE, "none", sizes, None)[3] == "16"  # max_batch_size


def test_rounds_alternate_the_modes_each_on_a_fresh_disk_directory(monkeypatch):
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(kv_tiers, "run_mode", lambda cfg, args, work, name, log: seen.append((name, args)) or {})
    monkeypatch.setattr(kv_tiers, "run_vllm", lambda cfg, engine, work, name, log: seen.append((name, [])) or {})
    sizes = {"bytes_per_token": 46080, "all": 1.0, "quarter": 0.25}
    runs = kv_tiers.run_modes(Config(Path("e"), rounds=2, quiet_wait_s=0), ENGINE, {}, sizes, lambda _: None)
    assert [name for name, _ in seen] == [
        "none-round1",
        "host-round1",
        "host-disk-round1",
        "vllm-round1",
        "vllm-round2",
        "host-disk-round2",
        "host-round2",
        "none-round2",
    ]
    assert {m: len(r) for m, r in runs.items()} == {"none": 2, "host": 2, "host+disk": 2, "vllm": 2}
    disks = [args[args.index("--kv-disk-cache") + 1] for _, args in seen if "--kv-disk-cache" in args]
    assert len(disks) == 2 and disks[0] != disks[1] and not any(Path(d).exists() for d in disks)


def checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory with SmolLM2-135M's config.json (all that vLLM's flags are built from)."""
    config = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_gets_trtserves_limits_and_a_pool_of_as_many_usable_tokens(monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "vllm_dtype", lambda settings: "float32")
    cfg = Config(Path("e"), pool_tokens=16384, concurrency=4)
    command, env, info = vllm_plan(cfg, ENGINE, checkpoint(tmp_path), 8123)
    assert command[0] == str(servers.VENVS / "vllm" / "bin" / "python") and "--enable-prefix-caching" in command
    assert flag(command, "--model") == str(tmp_path) and flag(command, "--dtype") == "float32"
    assert (flag(command, "--max-num-seqs"), flag(command, "--max-num-batched-tokens")) == ("4", "512")
    assert flag(command, "--port") == "8123" and flag(command, "--max-model-len") == "2048"  # the engine's
    # the engine's 64-token blocks: 256 for the pool and the null block vLLM's block pool holds back
    assert (flag(command, "--block-size"), flag(command, "--num-gpu-blocks-override")) == ("64", "257")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # 257 x 64 x 46,080 B = 0.71 GiB, whole GiB only
    assert info == {
        "checkpoint": str(tmp_path),
        "dtype": "float32",
        "block_size": 64,
        "num_blocks": 257,
        "usable_tokens": 16384,
        "bytes_per_token": 46080,
        "pool_bytes": 257 * 64 * 46080,
        "kv_cache_space_gib": 1,
        "offloading": kv_tiers.VLLM_OFFLOADING,
    }
    assert info["bytes_per_token"] == tier_sizes(ENGINE, [])["bytes_per_token"]  # fp32 both: the same bytes too
    args = vllm_args(command, env)
    assert args[:2] == ["VLLM_CPU_KVCACHE_SPACE=1", "vllm.entrypoints.openai.api_server"] and "--block-size" in args


def test_vllm_pool_sizes_at_smoke_sizes_odd_blocks_and_bf16(monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "vllm_dtype", lambda settings: "bfloat16")
    small = vllm_plan(Config(Path("e"), pool_tokens=512, concurrency=64), ENGINE, checkpoint(tmp_path), 1)
    assert flag(small[0], "--num-gpu-blocks-override") == "9" and flag(small[0], "--max-model-len") == "512"
    assert flag(small[0], "--max-num-seqs") == "16" and small[2]["bytes_per_token"] == 23040  # max_batch_size; bf16
    odd = dataclasses.replace(ENGINE, block_size=16)
    command, _, info = vllm_plan(Config(Path("e"), pool_tokens=1000), odd, checkpoint(tmp_path), 1)
    assert (flag(command, "--block-size"), info["num_blocks"], info["usable_tokens"]) == ("128", 9, 1024)


def test_vllm_blocks_come_from_its_cache_config_info():
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="64",engine="0",num_gpu_blocks="257",'
        'num_gpu_blocks_override="257"} 1.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 4000.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 3000.0\n'
    )
    samples = prometheus.parse(text)
    assert vllm_blocks(samples) == 257 and vllm_blocks({}) is None
    assert prometheus.hit_rate({}, samples, "vllm:prefix_cache")["hit_rate"] == 0.75


def test_without_vllms_venv_the_mode_is_reported_not_started(monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "VENVS", tmp_path)
    monkeypatch.setattr(kv_tiers, "run_mode", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    out = kv_tiers.run_vllm(Config(Path("e")), ENGINE, {}, "vllm-round1", lambda _: None)
    assert out["serve_args"] == "-" and "setup.sh vllm" in out["unavailable"]
    assert kv_tiers.vllm_info(Config(Path("e")), ENGINE) == {"unavailable": out["unavailable"]}


def run(ttft: float, failed: int = 0, tier: str | None = None, **extra) -> dict:
    hits = {f'trtserve_kv_tier_hits_total{{model="llm",tier="{tier}",version="1"}}': 40.0} if tier else {}
    return {
        "serve_args": "--num-kv-blocks 256",
        "ready_s": 10.0,
        "exit_code": 0,
        "exit_s": 5.0,
        "stop_notes": [],
        "requests": 150,
        "failed": failed,
        "errors": ["HTTP 500: boom"] if failed else [],
        "ttft_ms_p50": ttft,
        "ttft_ms_p99": 2 * ttft,
        "hit_rate": 0.5,
        "output_tok_s": 10.0,
        "goodput_req_s": 1.0,
        "tier_counters": hits,
    } | extra


def first(ttfts: list[float], **extra) -> dict:
    return {
        "serve_args": "--kv-disk-cache /d",
        "ready_s": 9.0,
        "exit_code": 0,
        "exit_s": 4.0,
        "stop_notes": [],
        "ttft_ms": ttfts,
        "ttft_ms_p50": statistics.median(ttfts),
        "failed": 0,
        "errors": [],
    } | extra


VLLM_INFO = {
    "checkpoint": "/ckpt",
    "dtype": "float32",
    "block_size": 64,
    "num_blocks": 257,
    "usable_tokens": 16384,
    "bytes_per_token": 46080,
    "pool_bytes": 257 * 64 * 46080,
    "kv_cache_space_gib": 1,
    "offloading": "none: not on CPU",
    "version": "0.32.0 torch 2.9",
}


def payload(runs: dict, restart: dict | None, vllm: dict | None = None) -> dict:
    med = {m: medians(r) for m, r in runs.items()}
    return {
        "machine": {"cpu": "Test CPU", "cores": 2},
        "date_utc": "2026-01-01T00:00:00+00:00",
        "wall_s": 100.0,
        "command": "python -m benchmarks.kv_tiers --smoke",
        "cpu_busy_before": 0.05,
        "warmup_requests": 2,
        "config": {"rounds": 2, "restart_docs": 2, "pool_tokens": 16384},
        "workload": "synthetic",
        "runs": runs,
        "medians": med,
        "targets": targets(med, runs),
        "vllm": vllm,
        "vs_vllm": vs_vllm(med, runs) if vllm else None,
        "restart": restart,
    }


def test_targets_need_3x_and_no_failed_request_and_the_report_says_so(tmp_path):
    runs = {
        "none": [run(1200), run(1000)],
        "host": [run(300, tier="host"), run(320, tier="host")],
        "host+disk": [run(200, failed=1, tier="disk"), run(220, tier="disk")],
    }
    stub = "Error: the model's stub crashed"
    restart = {
        "cold": first([900, 1000]),
        "before": first([950, 1000]),
        "after": first([180, 200], exit_code=5, stop_notes=[stub]),
        "disk_bytes": 123456,
        "ratio": 5.0,
        "clean": True,
        "met": True,
    }
    p = payload(runs, restart)
    assert p["medians"]["none"]["ttft_ms_p50"] == 1100 and p["medians"]["host"]["tier_hits"] == {"host": 40.0}
    host, both = p["targets"]
    assert host == {"mode": "host", "ratio": 3.55, "clean": True, "met": True}
    assert both["ratio"] == 5.24 and not both["clean"] and not both["met"]
    md = render(p)
    assert "| TTFT p50 with the host tier ≥ 3x better than with none | 3.55x | yes |" in md
    assert "| 5.24x | **no**: see problems |" in md
    assert "than cold | 5.00x | yes |" in md and "123,456 bytes" in md
    assert "| host | 0.500 | host 40 | 310 | 620 |" in md and "1 failed: HTTP 500: boom" in md
    assert f"4.0 s, exit 5 ({stub})" in md and "| 190 | 180 / 200 |" in md
    assert "vs vLLM" not in md and "## vLLM" not in md  # not asked for
    write_plot(p, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_vllm_gets_a_row_a_comparison_and_its_pool_in_the_report(tmp_path):
    vllm_run = run(650, kv_blocks=257) | {
        "serve_args": "VLLM_CPU_KVCACHE_SPACE=1 vllm.entrypoints.openai.api_server",
        "hit_rate": 0.8,
        "exit_code": -15,
    }
    runs = {"none": [run(1200)], "host+disk": [run(300, tier="disk"), run(320, tier="disk")], "vllm": [vllm_run]}
    p = payload(runs, None, VLLM_INFO)
    assert p["vs_vllm"] == {"ratio": 2.1, "trtserve_ms": 310, "vllm_ms": 650, "faster": "trtserve", "clean": True}
    md = render(p)
    assert (
        "| trtserve host+disk TTFT p50 vs vLLM (vLLM's / trtserve's; no threshold) | 2.10x (310 vs 650 ms) | "
        "trtserve faster |" in md
    )
    assert "| vllm | 0.800 | - | 650 | 1,300 | 10.0 | 1.000 | 150 | - | 10.0 | 5.0 s, exit -15 | " in md
    assert "--num-gpu-blocks-override 257 (256 usable" in md and "16,384 tokens (trtserve's pool: 16,384)" in md
    assert "num_gpu_blocks): 257." in md and "VLLM_CPU_KVCACHE_SPACE=1 GiB" in md and "Offloading: none" in md
    write_plot(p, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0

    slower = payload({"host+disk": [run(900)], "vllm": [run(600, failed=2)]}, None, VLLM_INFO)
    assert slower["vs_vllm"]["faster"] == "vLLM" and not slower["vs_vllm"]["clean"]
    assert "| 0.67x (900 vs 600 ms) | vLLM faster: see problems |" in render(slower)
    down = {"serve_args": "-", "unavailable": "benchmarks/.venvs/vllm is missing: bash benchmarks/peers/setup.sh vllm"}
    missing = payload({"host+disk": [run(300)], "vllm": [down]}, None, {"unavailable": down["unavailable"]})
    md = render(missing)
    assert "| trtserve host+disk TTFT p50 vs vLLM (vLLM's / trtserve's; no threshold) | - | not measured |" in md
    assert "Not run: benchmarks/.venvs/vllm is missing" in md and "| vllm | - | - | - |" in md


def test_a_server_that_did_not_start_is_reported_not_measured():
    down = {
        "serve_args": "--kv-host-cache-gb 0.07",
        "unavailable": "Error: No such option: --kv-host-cache-gb",
        "exit_code": 2,
        "exit_s": 0.1,
    }
    p = payload({"none": [run(1000)], "host": [down]}, None)
    assert p["medians"]["host"]["rounds"] == 0 and p["targets"][0] == {
        "mode": "host",
        "ratio": None,
        "clean": False,
        "met": False,
    }
    md = render(p)
    assert "| host | - | - | - | - | - | - | 0 | Error: No such option: --kv-host-cache-gb |" in md
    assert "not measured" in md and "## Restart" not in md


def test_smoke_sizes_apply_unless_given(monkeypatch, tmp_path):
    seen: list[Config] = []

    def fake(cfg: Config, command: str, log) -> tuple[Path, dict]:
        seen.append(cfg)
        (tmp_path / "r.md").write_text("report\n")
        return tmp_path / "r.md", {"runs": {}, "restart": None}

    monkeypatch.setattr(kv_tiers, "benchmark", fake)
    monkeypatch.setattr(kv_tiers.signal, "signal", lambda *_: None)
    args = ["--engine", str(tmp_path), "--smoke", "--requests", "9", "--modes", "vllm,host+disk,none"]
    result = CliRunner().invoke(kv_tiers.main, args)
    assert result.exit_code == 0, result.output
    cfg = seen[0]
    assert (cfg.documents, cfg.requests, cfg.max_tokens) == (SMOKE["documents"], 9, SMOKE["max_tokens"])
    assert cfg.name == "kv_tiers_smoke" and cfg.modes == ("none", "host+disk", "vllm")
    assert CliRunner().invoke(kv_tiers.main, ["--engine", str(tmp_path), "--modes", "ssd"]).exit_code == 2
    assert CliRunner().invoke(kv_tiers.main, ["--engine", str(tmp_path)]).exit_code == 0
    assert seen[-1].modes == MODES == ("none", "host", "host+disk", "vllm")


def test_vllms_exit_code_is_reported_not_judged_trtserves_is(monkeypatch, tmp_path):
    (tmp_path / "r.md").write_text("report\n")
    monkeypatch.setattr(kv_tiers.signal, "signal", lambda *_: None)

    def exits(runs: dict) -> int:
        monkeypatch.setattr(kv_tiers, "benchmark", lambda *a: (tmp_path / "r.md", {"runs": runs, "restart": None}))
        return CliRunner().invoke(kv_tiers.main, ["--engine", str(tmp_path)]).exit_code

    assert exits({"none": [run(1000)], "vllm": [run(600, exit_code=-15)]}) == 0
    assert exits({"none": [run(1000, exit_code=5)], "vllm": [run(600)]}) == 1
    assert exits({"none": [run(1000)], "vllm": [run(600, failed=1)]}) == 1
