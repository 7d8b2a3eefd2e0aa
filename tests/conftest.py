"""Shared fixtures: engines are built once per session into a temp dir.

Checkpoints come from the on-disk cache (tiny seeded models, the converted SmolLM2 GGUF);
nothing is downloaded from a model hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Without a GPU, every in-process Triton kernel runs in the interpreter. Triton reads the
# variable when it is first imported, so it is set here, before any test module imports triton
# (tests that compile for real GPUs run in subprocesses without it).
if not Path("/proc/driver/nvidia/gpus").is_dir():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from builder.build import BuildOptions, build_engine
from builder.sources import load_checkpoint, resolve_model
from builder.tiny import TINY_MODELS
from runtime.serve.standby import STANDBY_ENV

TINY_BLOCK_SIZE = 8
TINY_MAX_SEQ_LEN = 256


@pytest.fixture(scope="session", autouse=True)
def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_warm_spare() -> None:
    """`trtserve serve` started by a test keeps no warm spare unless the test asks for one (or deletes this): on a
    2-core CI machine a second engine loading beside each served test's load slows them all."""
    os.environ.setdefault(STANDBY_ENV, "0")


@pytest.fixture(scope="session")
def engines_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session", params=sorted(TINY_MODELS))
def tiny_name(request) -> str:
    return request.param


def build_tiny(name: str, engines_dir: Path) -> Path:
    out = engines_dir / name
    if not out.exists():
        options = BuildOptions(
            model=name, output=out, max_batch_size=8, max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE
        )
        build_engine(options)
    return out


@pytest.fixture(scope="session")
def tiny_engine(tiny_name: str, engines_dir: Path) -> Path:
    return build_tiny(tiny_name, engines_dir)


@pytest.fixture(scope="session")
def llama_engine(engines_dir: Path) -> Path:
    """The tiny Llama engine, for runtime tests that need one model, not every architecture."""
    return build_tiny("tiny-llama", engines_dir)


@pytest.fixture(scope="session")
def tiny_hf(tiny_name: str):
    """(model, tokenizer) of the same seeded checkpoint the tiny engine was built from."""
    return load_checkpoint(resolve_model(tiny_name))


@pytest.fixture(scope="session")
def smollm2_engine(engines_dir: Path) -> Path:
    out = engines_dir / "smollm2-135m"
    if not out.exists():
        build_engine(BuildOptions(model="smollm2-135m", output=out, max_batch_size=8, max_seq_len=1024))
    return out


@pytest.fixture(scope="session")
def smollm2_hf():
    return load_checkpoint(resolve_model("smollm2-135m"))
