"""Issue 17's mixed-traffic workload (seeded, shared system prompts, varied turns and answers) and
its target check (ratios to vLLM per rate, TPOT no worse), on synthetic rows."""

from __future__ import annotations

import json
from dataclasses import replace

import click
import pytest

from benchmarks.mixed import NGRAM_TOKENS, TrtserveRun, VllmRun, targets
from benchmarks.servers import ServingSettings, vllm_command
from benchmarks.slo_report import poisson_mode, vllm_system


def test_mixed_workload_is_seeded_shares_three_system_prompts_and_varies_turns(llama_engine):
    from benchmarks.datasets import mixed
    from runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_engine)
    a = mixed(tok, 30, seed=1, system_len=40, turn_mean=20, answer_range=(4, 9))
    assert a == mixed(tok, 30, seed=1, system_len=40, turn_mean=20, answer_range=(4, 9))
    b = mixed(tok, 30, seed=2, system_len=40, turn_mean=20, answer_range=(4, 9))
    heads = {r.prompt.split("Reply to this note:")[0] for r in a}
    assert len(heads) == 3 and heads == {r.prompt.split("Reply to this note:")[0] for r in b}
    assert {r.prompt for r in a}.isdisjoint({r.prompt for r in b})  # new turns per seed, same system prompts
    assert all(4 <= r.max_tokens <= 9 and r.ignore_eos for r in a) and len({r.max_tokens for r in a}) > 1
    assert len({len(r.prompt_ids) for r in a}) > 5  # turn lengths vary


TRTSERVE = "trtserve via Triton (float32 weights, auto KV: e)"


def test_runs_name_engine_and_backend(llama_engine):
    run = TrtserveRun.parse(f"{llama_engine}@cpu-bf16")
    assert run == TrtserveRun(llama_engine, "cpu-bf16") and TrtserveRun.parse(str(llama_engine)).backend is None
    assert run.system == f"trtserve via Triton (float32 weights, auto KV, backend cpu-bf16: {llama_engine.name})"
    assert run.params == {"backend": "cpu-bf16"}


def test_ngram_runs_speculate_at_every_load_with_the_same_drafts_as_vllm(llama_engine, tmp_path):
    run = TrtserveRun.parse(f"{llama_engine}@cpu-bf16+ngram")
    assert run == TrtserveRun(llama_engine, "cpu-bf16", ngram=True)
    assert run.params == {"backend": "cpu-bf16", "speculative": "ngram", "num_speculative_tokens": str(NGRAM_TOKENS),
                          "speculative_disable_batch_size": "4096"}  # fmt: skip
    assert run.system.endswith(f"n-gram speculation k={NGRAM_TOKENS}: {llama_engine.name})")
    vllm = VllmRun.parse("bfloat16+ngram")
    assert vllm == VllmRun("bfloat16", ngram=True) and VllmRun.parse("bfloat16") == VllmRun("bfloat16")
    assert vllm.system == vllm_system("bfloat16") + f", n-gram speculation k={NGRAM_TOKENS}"
    settings = replace(ServingSettings(), vllm_dtype="bfloat16", vllm_ngram_tokens=NGRAM_TOKENS)
    hf_config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    command, _ = vllm_command(tmp_path, settings, 8000)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1}  # fmt: skip
    assert "--speculative-config" not in vllm_command(tmp_path, ServingSettings(), 8000)[0]
    with pytest.raises(click.BadParameter, match="ngram"):
        VllmRun.parse("bfloat16+eagle")
    with pytest.raises(click.BadParameter, match=r"a run takes only \+ngram$"):
        VllmRun.parse("bfloat16+thread")  # (trtserve's engine core only)


def test_a_thread_run_keeps_the_engine_core_in_the_stub(llama_engine):
    run = TrtserveRun.parse(f"{llama_engine}+thread+ngram")
    assert run == TrtserveRun(llama_engine, ngram=True, core_thread=True)
    assert run.params["engine_process"] == "false" and run.system.endswith(
        f"on the stub's thread: {llama_engine.name})"
    )
    assert run.log_name == f"{llama_engine.name}-ngram-thread"


def _row(system: str, rate: float, tok_s: float, goodput: float, tpot: float) -> dict:
    median = {"output_tok_s": tok_s, "goodput_req_s": goodput, "tpot_ms_p50": tpot}
    return {"system": system, "mode": poisson_mode(rate), "median": median}


def test_mixed_targets_need_every_ratio_and_no_worse_tpot():
    vllm = vllm_system("float32")
    rows = [_row(TRTSERVE, 1.0, 130, 1.5, 40), _row(vllm, 1.0, 100, 1.0, 50),  # all met
            _row(TRTSERVE, 2.0, 140, 1.5, 60), _row(vllm, 2.0, 100, 1.0, 50),  # TPOT worse
            _row(TRTSERVE, 3.0, 120, 2.0, 40), _row(vllm, 3.0, 100, 1.0, 50)]  # tok/s short  # fmt: skip
    offered = {1.0: 150.0, 2.0: 300.0, 3.0: 450.0, 4.0: 600.0}
    got = {t["rate"]: t for t in targets(rows, offered, TRTSERVE, vllm)}
    assert got[1.0]["met"] and got[1.0]["tok_s_ratio"] == 1.3 and got[1.0]["goodput_ratio"] == 1.5
    assert got[1.0]["offered_tok_s"] == 150.0 and got[1.0]["tok_s_ratio_bound"] == 1.5
    assert not got[2.0]["met"] and not got[3.0]["met"]
    assert got[4.0] == {"rate": 4.0, "status": "not measured"}


def test_offered_load_is_the_answers_tokens_over_the_window_median_of_repetitions():
    from benchmarks.datasets import BenchRequest
    from benchmarks.mixed import offered_tok_s

    def answers(*lengths: int) -> list[BenchRequest]:
        return [BenchRequest("p", (1,), n, True) for n in lengths]

    work = {(1.0, 0): answers(10, 30), (1.0, 1): answers(50), (1.0, 2): answers(100, 100),
            (2.0, 0): answers(5)}  # fmt: skip
    assert offered_tok_s(work, 10.0) == {1.0: 5.0, 2.0: 0.5}


def test_write_report_renders_the_payload_as_written(tmp_path, monkeypatch):
    from benchmarks import report

    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    md, full = report.write_report("x", {"rows": [1, 2]}, lambda p: f"rows {p['rows']} on {p['machine']['cores']}\n")
    assert full["rows"] == [1, 2] and "versions" in full and (tmp_path / "x.json").is_file()
    assert md == tmp_path / "x.md" and md.read_text() == f"rows [1, 2] on {full['machine']['cores']}\n"
