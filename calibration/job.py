"""The calibration job behind `trtserve calibrate`: re-run the quality gate of a built engine.

The held-out set is rebuilt with the seed and sizes the manifest records (its hash must match,
so the re-run scores the same text) and the gate report in the engine is rewritten. Use it
when the gate's thresholds change (a new gate config version) or to audit an engine. The
unquantized reference engine is the caller's to export (the builder does: builder/regate.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from calibration.data import DataConfig, load_text_sets
from calibration.gate import GateReport, run_gate
from engine_format import EngineConfig
from engine_format.files import GATE_REPORT_JSON, GATE_REPORT_MD, MANIFEST


class CalibrationJobError(Exception):
    """The engine cannot be re-gated (not quantized, source gone, data changed)."""


def quantization_record(engine_dir: Path) -> dict[str, Any]:
    """The manifest's quantization record; CalibrationJobError for an unquantized engine."""
    manifest = json.loads((engine_dir / MANIFEST).read_text())
    record = manifest.get("quantization")
    if not record:
        raise CalibrationJobError(f"{engine_dir} is not a quantized engine (its manifest has no 'quantization')")
    return record


def regate(candidate: EngineConfig, reference: EngineConfig, tokenizer, gate_config: Path | None = None) -> GateReport:
    """Score `candidate` against its unquantized `reference` on the recorded held-out text."""
    data_record = quantization_record(candidate.engine_dir)["calibration_data"]
    data = DataConfig(
        calibration_samples=data_record["calibration_sequences"],
        heldout_samples=data_record["heldout_sequences"],
        seq_len=data_record["seq_len"],
        seed=data_record["seed"],
    )
    texts = load_text_sets(tokenizer, data)
    if texts.record["heldout_sha256"] != data_record["heldout_sha256"]:
        raise CalibrationJobError("the held-out text differs from the one this engine was gated on (package changed)")
    report = run_gate(reference, candidate, texts, tokenizer, gate_config)
    write_gate_report(candidate.engine_dir, report)
    return report


def write_gate_report(engine_dir: Path, report: GateReport) -> None:
    (engine_dir / GATE_REPORT_JSON).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (engine_dir / GATE_REPORT_MD).write_text(report.table() + "\n")
