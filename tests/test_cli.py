"""build-engine and trtserve generate as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import builder.build
from builder.cli import main as build_engine_cli
from builder.errors import BuildError
from builder.sources import sha256_file
from executors.cpus import amx_bf16, int8_simd
from runtime.cli import main as trtserve_cli

TINY_ARGS = ["--model", "tiny-qwen2", "--block-size", "8", "--max-seq-len", "128", "--max-batch-size", "4"]


def build(output: Path, *extra: str):
    return CliRunner().invoke(build_engine_cli, [*TINY_ARGS, "--output", str(output), *extra])


@pytest.fixture(scope="module")
def cli_engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "engine"
    result = build(out)
    assert result.exit_code == 0, result.output
    return out


def test_manifest_describes_the_engine(cli_engine):
    manifest = json.loads((cli_engine / "manifest.json").read_text())
    assert manifest["backend"] == "onnxruntime-cpu" and manifest["dtype"] == "float32"
    assert manifest["limits"] == {"max_batch_size": 4, "max_seq_len": 128, "block_size": 8}
    assert manifest["kv_layout"]["pool_shape"] == ["num_layers", 2, "num_blocks", 8, 64]
    assert manifest["source"] == {
        "model": "tiny-qwen2",
        "name": "tiny-qwen2",
        "kind": "tiny_random",
        "config": "tiny-qwen2",
        "seed": 0,
    }
    assert manifest["graph"]["opset"] == 23 and manifest["graph"]["ir_version"] <= 10
    assert manifest["versions"]["onnxruntime"] and manifest["versions"]["torch"].startswith("2.13")
    verification = manifest["verification"]
    # cpu-bf16 too where this CPU has AMX (it is the default there: tests/test_cpu_bf16_default.py), cpu-int8 where
    # it multiplies int8 in vector loops instead (tests/test_cpu_int8.py)
    extra = {"cpu-bf16"} if amx_bf16() else {"cpu-int8"} if int8_simd() else set()
    assert set(verification["backends"]) == {"graph", "plugin", "cpu"} | extra
    for result in verification["backends"].values():
        assert max(result["max_abs_error"].values()) < result["tolerance"]
    for name, digest in manifest["files_sha256"].items():
        assert sha256_file(cli_engine / name) == digest
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(manifest["files_sha256"])
    assert manifest["graph"]["cpu_segments"] == [f"segment.{i:02d}.onnx" for i in range(3)]


def test_failed_build_leaves_previous_engine_intact(cli_engine, tmp_path, monkeypatch):
    engine = tmp_path / "engine"
    shutil.copytree(cli_engine, engine)
    before = {p.name: p.read_bytes() for p in engine.iterdir()}

    def broken_verification(*args, **kwargs):
        raise BuildError("engine verification failed (injected)")

    monkeypatch.setattr(builder.build, "verify_engine", broken_verification)
    result = build(engine)
    assert result.exit_code == 1 and "verification failed (injected)" in result.output
    assert {p.name: p.read_bytes() for p in engine.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no staging left behind


def test_rebuild_replaces_engine_atomically(cli_engine, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(cli_engine, engine)
    result = build(engine, "--max-batch-size", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads((engine / "manifest.json").read_text())["limits"]["max_batch_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "12"], "--block-size must be a power of two (got 12)"),
        (["--max-seq-len", "4", "--block-size", "8"], "--max-seq-len (4) must be >= --block-size (8)"),
        (["--max-seq-len", "4096"], "exceeds the model's max_position_embeddings (512)"),
        (["--dtype", "int3"], "Invalid value for '--dtype'"),
        (["--dtype", "bfloat16", "--quantize", "fp8"], "--dtype bfloat16 builds unquantized engines"),
        (["--max-batch-size", "0"], "Invalid value for '--max-batch-size'"),
    ],
)
def test_bad_build_options(tmp_path, args, message):
    result = build(tmp_path / "engine", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_help_is_enough_for_a_ci_author():
    text = CliRunner().invoke(build_engine_cli, ["--help"]).output
    for needle in (
        "--model",
        "smollm2-135m",
        "--max-seq-len",
        "--block-size",
        "--dtype",
        "Exit status",
        "leaves an existing engine",
    ):
        assert needle in text


def test_generate_prints_an_answer(cli_engine):
    result = CliRunner().invoke(
        trtserve_cli,
        ["generate", "--engine", str(cli_engine), "--prompt", "Hello there", "--max-tokens", "8"],
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "/nonexistent", "--prompt", "hi"], "is not an engine directory"),
        (["--prompt", "word " * 200], "exceeds the engine's max sequence length (128 tokens"),
        (["--prompt", "   "], "--prompt: must not be empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    ],
)
def test_generate_rejects_bad_input(cli_engine, args, message):
    if "--engine" not in args:
        args = ["--engine", str(cli_engine), *args]
    result = CliRunner().invoke(trtserve_cli, ["generate", *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_serve_help_names_the_hardening_options():
    text = CliRunner().invoke(trtserve_cli, ["serve", "--help"], terminal_width=200).output
    for needle in ("--triton-host", "--admin-key", "TRTSERVE_ADMIN_KEY", "--drain-timeout", "--health-interval",
                   "exit code 3", "code 4"):  # fmt: skip
        assert needle in text, needle


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drain-timeout", "-1"], "Invalid value for '--drain-timeout'"),
        (["--health-interval", "0"], "Invalid value for '--health-interval'"),
    ],
)
def test_serve_rejects_bad_lifecycle_options(cli_engine, args, message):
    result = CliRunner().invoke(trtserve_cli, ["serve", "--engine", str(cli_engine), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_console_scripts_are_installed(cli_engine):
    bindir = Path(sys.executable).parent
    out = subprocess.run([bindir / "build-engine", "--help"], capture_output=True, text=True, check=True)
    assert "Usage: build-engine" in out.stdout
    out = subprocess.run(
        [
            bindir / "trtserve",
            "generate",
            "--engine",
            str(cli_engine),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--no-chat",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip()


def test_float16_engine_builds_and_passes_its_verification(tmp_path):
    result = build(tmp_path / "fp16", "--dtype", "float16", "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "fp16" / "manifest.json").read_text())
    assert manifest["dtype"] == "float16" and manifest["kv_layout"]["bytes_per_token"] == 2 * 2 * 64 * 2
    verification = manifest["verification"]
    assert set(verification["backends"]) == {"graph", "plugin"}  # the CPU kernel backend is float32-only
    assert max(verification["backends"]["graph"]["max_abs_error"].values()) < verification["tolerance"]


def test_engine_of_an_older_format_asks_for_a_rebuild(cli_engine, tmp_path):
    engine = tmp_path / "old"
    shutil.copytree(cli_engine, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["format_version"] = 1
    (engine / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(trtserve_cli, ["generate", "--engine", str(engine), "--prompt", "hi"])
    assert result.exit_code != 0 and "rebuild the engine" in result.output
