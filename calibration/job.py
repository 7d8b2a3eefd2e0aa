"""A standalone gate run for an existing quantized engine (`trtserve calibrate`).

Re-exports the unquantized reference from the source the engine's manifest records, rebuilds
the held-out set with the recorded seed and sizes (their hashes must match the manifest, so
the re-run scores the same text), runs the gate, and updates the engine's gate report.
Use it when the gate's thresholds change (a new gate config version) or to audit an engine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from calibration.data import DataConfig, load_text_sets
from calibration.gate import GateReport, run_gate


class CalibrationJobError(Exception):
    """The engine cannot be re-gated (not quantized, source gone, data changed)."""


def regate_engine(engine_dir: Path, gate_config: Path | None = None) -> GateReport:
    from builder.build import BuildOptions, engine_config
    from builder.export import ExportOptions, export_onnx
    from builder.sources import load_checkpoint, resolve_model
    from runtime.engine_config import MANIFEST, EngineConfig

    candidate = EngineConfig.load(engine_dir)
    manifest = json.loads((engine_dir / MANIFEST).read_text())
    record = manifest.get("quantization")
    if not record:
        raise CalibrationJobError(f"{engine_dir} is not a quantized engine (its manifest has no 'quantization')")
    data_record = record["calibration_data"]
    data = DataConfig(
        calibration_samples=data_record["calibration_sequences"],
        heldout_samples=data_record["heldout_sequences"],
        seq_len=data_record["seq_len"],
        seed=data_record["seed"],
    )
    model, tokenizer = load_checkpoint(resolve_model(manifest["source"]["model"]))
    texts = load_text_sets(tokenizer, data)
    if texts.record["heldout_sha256"] != data_record["heldout_sha256"]:
        raise CalibrationJobError("the held-out text differs from the one this engine was gated on (package changed)")
    options = BuildOptions(
        model=manifest["source"]["model"], output=engine_dir, max_batch_size=candidate.max_batch_size,
        max_seq_len=candidate.max_seq_len, block_size=candidate.block_size,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        files = export_onnx(
            model, candidate.model, ExportOptions(options.block_size, options.max_seq_len), Path(scratch)
        )
        reference = engine_config(Path(scratch), options, candidate.model, len(files) - 1)
        report = run_gate(reference, candidate, texts, tokenizer, gate_config)
    (engine_dir / "gate_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (engine_dir / "gate_report.md").write_text(report.table() + "\n")
    return report
