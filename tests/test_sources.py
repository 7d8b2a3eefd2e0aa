"""Model sources: bad checkpoints fail with one clear message, through the API and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from builder.cli import main as build_engine_cli
from builder.errors import ModelSourceError
from builder.sources import load_checkpoint, resolve_model


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A copy of the tiny-llama checkpoint that a test may break."""
    src = resolve_model("tiny-llama").checkpoint_dir
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def expect_error(spec: str | Path, match: str) -> None:
    with pytest.raises(ModelSourceError, match=match):
        load_checkpoint(resolve_model(str(spec)))


def test_valid_checkpoint_dir_resolves(checkpoint):
    source = resolve_model(str(checkpoint))
    assert source.origin["kind"] == "checkpoint_dir"
    assert len(source.origin["weights_sha256"]["model.safetensors"]) == 64
    model, tokenizer = load_checkpoint(source)
    assert model.config.model_type == "llama" and tokenizer.chat_template


def test_unknown_name_lists_named_models():
    expect_error("no-such-model", "no such directory, and not a named model.*smollm2-135m")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    expect_error(checkpoint, "has no config.json")


def test_unknown_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    expect_error(checkpoint, r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM")


def test_config_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    expect_error(checkpoint, "is not valid JSON")


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    expect_error(checkpoint, "holds no weight files")


def test_missing_tokenizer(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    expect_error(checkpoint, "holds no tokenizer")


def test_truncated_weights(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    expect_error(checkpoint, "could not load weights from")


def test_weights_with_missing_tensors(checkpoint):
    """transformers would silently random-init missing tensors; we refuse."""
    from safetensors.numpy import load_file, save_file

    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    expect_error(checkpoint, "incomplete: 1 tensors missing.*layers.1.mlp.down_proj")


def test_unsupported_rope_type(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (checkpoint / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(build_engine_cli, ["--model", str(checkpoint), "--output", str(tmp_path / "e")])
    assert result.exit_code == 1
    assert "rope_type='dynamic' is not supported" in result.output


def test_cli_reports_source_error_without_traceback(checkpoint, tmp_path):
    (checkpoint / "model.safetensors").unlink()
    result = CliRunner().invoke(build_engine_cli, ["--model", str(checkpoint), "--output", str(tmp_path / "e")])
    assert result.exit_code == 1
    assert "build-engine: error:" in result.output and "holds no weight files" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "e").exists()
