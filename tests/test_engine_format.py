"""The engine format: what the builder writes is what every reader loads back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine_format import FORMAT_VERSION, EngineConfig, EngineLoadError, ModelSpec, TensorRTLimits, ceil_div
from engine_format.files import GRAPH_FILE, MANIFEST, segment_file

SPEC = ModelSpec(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True, qkv_bias=False, rope_type="default",
    max_position_embeddings=512, sliding_windows=(None, 24), bos_token_id=1, eos_token_ids=(2,),
)  # fmt: skip


def write_engine(directory: Path, config: EngineConfig, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GRAPH_FILE).write_bytes(b"")
    (directory / MANIFEST).write_text(json.dumps({**config.manifest_fields(), **overrides}))
    return directory


def config_in(directory: Path, **changes) -> EngineConfig:
    base = EngineConfig(directory, "onnxruntime-cpu", "float32", 16, 4, 256, SPEC, cpu_segments=3)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"quantization": "int4-awq", "cpu_segments": 0, "dtype": "float16"},
        {"target": "tensorrt", "tensorrt": TensorRTLimits.from_build(4, 256, 16)},
    ],
)
def test_manifest_fields_load_back_unchanged(tmp_path, changes):
    config = config_in(tmp_path, **changes)
    write_engine(tmp_path, config)
    assert EngineConfig.load(tmp_path) == config


def test_tensorrt_limits_follow_the_build_limits():
    limits = TensorRTLimits.from_build(max_batch_size=8, max_seq_len=1000, block_size=64, max_step=512)
    assert limits == TensorRTLimits(
        max_batch=8, max_step=512, max_table_blocks=16, max_num_blocks=128, max_logit_rows=64
    )
    assert TensorRTLimits.from_build(2, 100, 64).max_step == 100  # a chunk never exceeds the sequence


def test_segment_files_are_named_in_the_manifest(tmp_path):
    fields = config_in(tmp_path).manifest_fields()
    assert fields["graph"]["cpu_segments"] == ["segment.00.onnx", "segment.01.onnx", "segment.02.onnx"]
    assert segment_file(12) == "segment.12.onnx"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"format_version": FORMAT_VERSION - 1}, "rebuild the engine with build-engine"),
        ({"format": "something-else"}, "rebuild"),
        ({"backend": "openvino"}, "target 'openvino'"),
        ({"limits": {"block_size": 16}}, "malformed"),
    ],
)
def test_incompatible_manifests_are_refused_with_a_rebuild_hint(tmp_path, overrides, message):
    write_engine(tmp_path, config_in(tmp_path), **overrides)
    with pytest.raises(EngineLoadError, match=message):
        EngineConfig.load(tmp_path)


def test_a_missing_graph_or_manifest_is_named(tmp_path):
    with pytest.raises(EngineLoadError, match="not an engine directory"):
        EngineConfig.load(tmp_path)
    write_engine(tmp_path, config_in(tmp_path))
    (tmp_path / GRAPH_FILE).unlink()
    with pytest.raises(EngineLoadError, match=f"graph file {GRAPH_FILE} is missing"):
        EngineConfig.load(tmp_path)


def test_ceil_div():
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
