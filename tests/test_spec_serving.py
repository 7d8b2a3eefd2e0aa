"""Speculative decoding at the serving edge: `trtserve serve`'s options (checked before any server
starts, written into the model config with paths absolute and escaped), its metrics through a fake
pb_utils, and a live tritonserver whose streamed greedy output equals the engine's without
speculation while /metrics counts the drafts."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from benchmarks import prometheus
from engine_format.serving import MODEL_NAME
from runtime import LLM, SamplingParams
from runtime.cli import main as trtserve_cli
from runtime.engine.stats import SpecDecodeStats
from runtime.serve import launcher
from runtime.serve.launcher import ServerConfig, ServerError, TritonServer, prepare
from runtime.triton_model.metrics import TritonMetrics
from tests.test_slo_serving import FakePbUtils, stats
from tests.triton_helpers import running_server, sse_events, wait_for

METRICS_INTERVAL_S = 0.5  # model_repository/llm/1/model.py
# The tiny tokenizer splits these words into the same tokens each time: the n-gram proposer finds the
# repeated run, so the server must verify drafts from the first decode on.
REPETITIVE = "alpha beta gamma delta epsilon " * 4 + "alpha beta"
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


@pytest.fixture()
def no_server(monkeypatch):
    """Fails the test if `trtserve serve` gets as far as starting tritonserver."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("tritonserver was started")

    monkeypatch.setattr(launcher, "TritonServer", refuse)


@pytest.fixture(scope="module")
def other_vocabulary(llama_engine, tmp_path_factory) -> Path:
    other = tmp_path_factory.mktemp("vocab") / "other"
    shutil.copytree(llama_engine, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model"]["vocab_size"] += 1
    (other / "manifest.json").write_text(json.dumps(manifest))
    return other


def serve(engine: Path, *args: str):
    return CliRunner().invoke(trtserve_cli, ["serve", "--engine", str(engine), "--no-openai", *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative", "draft"], "--speculative draft needs --draft-engine (the draft model's engine)"),
        (["--draft-engine", "."], "--draft-engine is only used with --speculative draft"),
        (["--speculative", "ngram", "--draft-engine", "."], "--draft-engine is only used with --speculative draft"),
        (
            ["--speculative", "ngram", "--draft-prompt-lookup-min", "2"],
            "--draft-prompt-lookup-min is only used with --speculative draft",
        ),
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens is only used with --speculative"),
        (["--speculative-disable-batch-size", "3"], "--speculative-disable-batch-size is only used with --speculative"),
        (["--speculative", "ngram", "--num-speculative-tokens", "17"], "Invalid value for '--num-speculative-tokens'"),
        (["--speculative", "medusa"], "Invalid value for '--speculative'"),
    ],
)
def test_bad_speculative_options_stop_serve_before_any_server(llama_engine, no_server, args, message):
    result = serve(llama_engine, *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_draft_of_another_vocabulary_stops_serve_before_any_server(llama_engine, other_vocabulary, no_server):
    result = serve(llama_engine, "--speculative", "draft", "--draft-engine", str(other_vocabulary))
    assert result.exit_code == 1 and "has another vocabulary than the target" in result.output, result.output
    assert "Traceback" not in result.output


def test_serve_writes_the_options_into_the_model_config(llama_engine, tmp_path, monkeypatch):
    draft = tmp_path / 'dr"aft\\engine'  # a quote and a backslash must survive the config's string literal
    shutil.copytree(llama_engine, draft)
    configs: list[ServerConfig] = []

    def capture(config: ServerConfig) -> None:
        configs.append(config)
        raise ServerError("captured")

    monkeypatch.setattr(launcher, "TritonServer", capture)
    monkeypatch.chdir(draft.parent)
    result = serve(llama_engine, "--speculative", "draft", "--draft-engine", draft.name,
                   "--num-speculative-tokens", "3", "--speculative-disable-batch-size", "2",
                   "--draft-prompt-lookup-min", "0")  # fmt: skip
    assert result.exit_code == 1 and "captured" in result.output, result.output
    prepare(configs[0], tmp_path / "repo")
    text = (tmp_path / "repo" / "models" / MODEL_NAME / "config.pbtxt").read_text()
    params = text_format.Parse(text, model_config_pb2.ModelConfig()).parameters
    assert params["speculative"].string_value == "draft"
    assert params["draft_engine"].string_value == str(draft.resolve())  # absolute: tritonserver runs elsewhere
    assert params["num_speculative_tokens"].string_value == "3"
    assert params["speculative_disable_batch_size"].string_value == "2"
    assert params["draft_prompt_lookup_min"].string_value == "0"


def test_help_of_generate_and_serve_names_the_same_options():
    for command in ("generate", "serve"):
        text = CliRunner().invoke(trtserve_cli, [command, "--help"], terminal_width=200).output
        for needle in ("--speculative [ngram|draft]", "--draft-engine", "--num-speculative-tokens",
                       "--speculative-disable-batch-size", "--draft-prompt-lookup-min"):  # fmt: skip
            assert needle in text, (command, needle)


def test_spec_metrics_count_deltas_per_position_and_only_when_on():
    labels = {"model": "llm", "version": "1"}
    metrics = TritonMetrics(FakePbUtils, labels, speculative=True)
    metrics.update(stats(spec_decode=SpecDecodeStats(4, 12, 6, (3, 2, 1))))
    metrics.update(stats(spec_decode=SpecDecodeStats(6, 18, 11, (5, 3, 2, 1))))
    for ours, vllm, value in (("drafts", "num_drafts", 6), ("draft_tokens", "num_draft_tokens", 18),
                              ("accepted_tokens", "num_accepted_tokens", 11)):  # fmt: skip
        assert metrics.counters[f"trtserve_spec_decode_{ours}_total"].value == value
        assert metrics.counters[f"vllm:spec_decode_{vllm}_total"].value == value
    for name in ("trtserve_spec_decode_accepted_tokens_per_position_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):  # fmt: skip
        per_position = metrics.labelled[name]
        assert {p: m.value for p, m in per_position.items()} == {"0": 5, "1": 3, "2": 2, "3": 1}
        assert per_position["3"].labels == {**labels, "position": "3"}  # the position appeared in the second update
    assert metrics.gauges["trtserve_spec_decode_acceptance_rate"].value == pytest.approx(11 / 18)
    assert metrics.gauges["trtserve_spec_decode_mean_acceptance_length"].value == pytest.approx(1 + 11 / 6)
    off = TritonMetrics(FakePbUtils, labels)
    off.update(stats())
    assert not [n for n in [*off.counters, *off.gauges, *off.labelled] if "spec_decode" in n]


@pytest.mark.serving
def test_served_ngram_speculation_streams_the_greedy_tokens_and_counts_drafts(llama_engine):
    params = {"speculative": "ngram", "num_speculative_tokens": "4"}
    plain = LLM(llama_engine).generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    with running_server(llama_engine, params) as server:
        url = f"http://{server.config.host}:{server.config.metrics_port}/metrics"
        events = sse_events(server, {"text_input": REPETITIVE, "max_tokens": 32, "stream": True, "ignore_eos": True})
        assert "".join(e["text_output"] for e in events) == plain.text
        assert events[-1]["completion_tokens"] == 32 and events[-1]["finish_reason"] == "length"
        assert wait_for(lambda: prometheus.total(prometheus.fetch(url), "trtserve_spec_decode_drafts_total") > 0)
        time.sleep(2 * METRICS_INTERVAL_S)  # the refresh after the request's end has run in full
        samples = prometheus.fetch(url)
    value = {name: prometheus.total(samples, f"trtserve_spec_decode_{name}_total") for name in SPEC_COUNTERS}
    assert value["draft_tokens"] > 0 and 0 <= value["accepted_tokens"] <= value["draft_tokens"]
    assert value["draft_tokens"] <= 4 * value["drafts"]
    assert prometheus.total(samples, "vllm:spec_decode_num_draft_tokens_total") == value["draft_tokens"]
    per_position = prometheus.total(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_position == value["accepted_tokens"]
    rate = prometheus.total(samples, "trtserve_spec_decode_acceptance_rate")
    assert rate == pytest.approx(value["accepted_tokens"] / value["draft_tokens"], abs=1e-6)


@pytest.mark.serving
def test_a_draft_of_another_vocabulary_fails_the_model_load_clearly(llama_engine, other_vocabulary):
    """Deployed without the CLI (config parameters set by hand), the engine's refusal is the load failure."""
    params = {"speculative": "draft", "draft_engine": str(other_vocabulary)}
    server = TritonServer(ServerConfig.on_free_ports(llama_engine, engine_params=params))
    try:
        with pytest.raises(ServerError, match="another vocabulary than the target"):
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
