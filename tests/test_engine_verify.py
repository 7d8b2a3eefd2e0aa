"""Serving-time verification of an engine's files against its manifest's SHA-256 digests
(engine_format/verify.py) and the digest cache that keeps a restart from hashing them again
(engine_format/digests.py). Engines here are hand-written directories (a few bytes a file),
except the last test, which loads a built tiny engine through LLMEngine."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_format import EngineConfig, EngineIntegrityError, EngineLoadError
from engine_format.digests import FileStamp, default_cache_dir, sha256_file
from engine_format.files import GATE_REPORT_JSON, GRAPH_FILE, MANIFEST, WEIGHTS_FILE
from engine_format.verify import Verification, verify_engine_files
from tests.test_engine_format import config_in

TOKENIZER = "tokenizer.json"
FILES = {GRAPH_FILE: b"graph bytes", WEIGHTS_FILE: bytes(range(256)) * 64, TOKENIZER: b'{"vocab": {}}',
         GATE_REPORT_JSON: b'{"passed": true}'}  # fmt: skip
CHECKED = sorted(set(FILES) - {GATE_REPORT_JSON})  # the gate report is rewritten by `trtserve calibrate`


@dataclass
class CountingHasher:
    """sha256_file, recording which files were actually read."""

    calls: list[str] = field(default_factory=list)

    def __call__(self, path: Path) -> str:
        self.calls.append(path.name)
        return sha256_file(path)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test gets its own digest cache and the default mode, whatever the environment says."""
    monkeypatch.setenv("TRTSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRTSERVE_VERIFY", raising=False)
    return tmp_path / "cache" / "verified"


@pytest.fixture
def engine(tmp_path) -> Path:
    directory = tmp_path / "engine"
    directory.mkdir()
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    manifest = {**config_in(directory, cpu_segments=0).manifest_fields(), "source": {"model": "tiny-llama"},
                "files_sha256": {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}}  # fmt: skip
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def edit_manifest(engine: Path, **fields) -> None:
    manifest = json.loads((engine / MANIFEST).read_text())
    (engine / MANIFEST).write_text(json.dumps({**manifest, **fields}))


def check(engine: Path, mode: str = "fast", hasher: CountingHasher | None = None) -> Verification:
    manifest = json.loads((engine / MANIFEST).read_text())
    return verify_engine_files(engine, manifest, mode=mode, hash_file=hasher or sha256_file)


def flip_byte_in_place(path: Path, offset: int = 100) -> None:
    """Change one byte without changing the size or the inode."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def set_mtime_ns(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_good_engine_loads_and_its_cache_lives_outside_it(engine, cache_dir):
    before = sorted(p.name for p in engine.iterdir())
    config = EngineConfig.load(engine, verify=True)
    assert config == config_in(engine, cpu_segments=0)
    assert sorted(p.name for p in engine.iterdir()) == before  # nothing written into the engine
    assert len(list(cache_dir.glob("*.json"))) == 1


@pytest.mark.parametrize("warm", [False, True])
def test_an_altered_digest_in_the_manifest_is_refused_naming_the_file(engine, warm):
    if warm:  # the cache holds the digest found, not a verdict: a warm start still compares
        EngineConfig.load(engine, verify=True)
    real = hashlib.sha256(FILES[WEIGHTS_FILE]).hexdigest()
    forged = "0" * 64
    edit_manifest(engine, files_sha256={**json.loads((engine / MANIFEST).read_text())["files_sha256"],
                                        WEIGHTS_FILE: forged})  # fmt: skip
    with pytest.raises(EngineIntegrityError) as refused:
        EngineConfig.load(engine, verify=True)
    message = str(refused.value)
    assert f"{WEIGHTS_FILE}: expected sha256 {forged} (manifest), found {real}" in message
    assert f"rebuild it with: build-engine --model tiny-llama --output {engine}" in message
    assert isinstance(refused.value, EngineLoadError)  # callers that report load failures report this one


def test_an_altered_byte_is_refused(engine):
    flip_byte_in_place(engine / WEIGHTS_FILE)
    found = sha256_file(engine / WEIGHTS_FILE)
    pattern = rf"{re.escape(WEIGHTS_FILE)}: expected sha256 [0-9a-f]{{64}} .*found {found}"
    with pytest.raises(EngineIntegrityError, match=pattern):
        check(engine)


def test_a_missing_file_is_refused(engine):
    (engine / TOKENIZER).unlink()
    with pytest.raises(EngineIntegrityError, match=rf"{re.escape(TOKENIZER)}: listed in files_sha256 .* but missing"):
        check(engine)


def test_every_problem_is_listed_at_once(engine):
    (engine / TOKENIZER).unlink()
    flip_byte_in_place(engine / GRAPH_FILE, offset=0)
    with pytest.raises(EngineIntegrityError) as refused:
        check(engine)
    assert f"{TOKENIZER}: listed" in str(refused.value) and f"{GRAPH_FILE}: expected" in str(refused.value)


@pytest.mark.parametrize(
    ("listed", "message"),
    [
        (None, "files_sha256 is missing"),
        ([], "files_sha256 is a list, not a mapping"),
        ({"../model.onnx": "0" * 64}, "lists '../model.onnx', not a file of the engine directory"),
        ({MANIFEST: "0" * 64}, "lists 'manifest.json', not a file"),
        ({WEIGHTS_FILE: "abc"}, r"files_sha256\['model.onnx.data'\] is 'abc', not a SHA-256 hex digest"),
        ({WEIGHTS_FILE: 7}, "is 7, not a SHA-256 hex digest"),
    ],
)
def test_malformed_entries_are_refused(engine, listed, message):
    edit_manifest(engine, files_sha256=listed)
    with pytest.raises(EngineIntegrityError, match=message):
        EngineConfig.load(engine, verify=True)


def test_unlisted_graphs_are_refused_other_unlisted_files_ignored(engine):
    (engine / "notes.txt").write_text("not part of the engine")
    check(engine)
    (engine / "model.v2.onnx").write_bytes(b"a graph the build did not write")
    edit_manifest(engine, graph={**json.loads((engine / MANIFEST).read_text())["graph"], "file": "model.v2.onnx"})
    with pytest.raises(EngineIntegrityError, match=re.escape("model.v2.onnx: not listed in files_sha256")):
        EngineConfig.load(engine, verify=True)


def test_gate_reports_rewritten_by_calibrate_are_not_checked(engine):
    (engine / GATE_REPORT_JSON).write_text('{"passed": false, "rewritten": "by trtserve calibrate"}')
    assert check(engine).checked == len(CHECKED)


def test_a_restart_does_not_hash_unchanged_files(engine):
    first, second = CountingHasher(), CountingHasher()
    assert check(engine, hasher=first).hashed == len(CHECKED)
    result = check(engine, hasher=second)
    assert sorted(first.calls) == CHECKED and second.calls == []
    assert (result.checked, result.hashed, result.hashed_bytes) == (len(CHECKED), 0, 0)


def test_a_file_changed_after_it_was_cached_is_hashed_again_and_refused(engine):
    check(engine)
    weights = engine / WEIGHTS_FILE
    stamp = FileStamp.of(weights)
    flip_byte_in_place(weights)
    set_mtime_ns(weights, stamp.mtime_ns + 10**9)  # explicit: no reliance on the clock ticking between writes
    hasher = CountingHasher()
    with pytest.raises(EngineIntegrityError, match=re.escape(WEIGHTS_FILE)):
        check(engine, hasher=hasher)
    assert hasher.calls == [WEIGHTS_FILE]
    # The digest found was cached: refused again without reading the file.
    with pytest.raises(EngineIntegrityError, match=re.escape(WEIGHTS_FILE)):
        check(engine, hasher=hasher)
    assert hasher.calls == [WEIGHTS_FILE]


def test_a_rewrite_that_restores_size_and_mtime_needs_full(engine, monkeypatch):
    """The documented limit of the fast path, and the way around it."""
    check(engine)
    weights = engine / WEIGHTS_FILE
    stamp = FileStamp.of(weights)
    flip_byte_in_place(weights)
    set_mtime_ns(weights, stamp.mtime_ns)
    assert FileStamp.of(weights) == stamp
    check(engine)  # not caught: the stamp is the cached one
    with pytest.raises(EngineIntegrityError, match=re.escape(WEIGHTS_FILE)):
        check(engine, mode="full")
    monkeypatch.setenv("TRTSERVE_VERIFY", "full")
    with pytest.raises(EngineIntegrityError, match=re.escape(WEIGHTS_FILE)):
        EngineConfig.load(engine, verify=True)


def _valid_cache_text(cache_dir: Path) -> tuple[Path, str]:
    (path,) = cache_dir.glob("*.json")
    return path, path.read_text()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda text: "\x00 not json",
        lambda text: text[: len(text) // 2],  # a torn write
        lambda text: "[]",
        lambda text: json.dumps({**json.loads(text), "version": 99}),
        lambda text: json.dumps({**json.loads(text), "engine_dir": "/somewhere/else"}),
        lambda text: json.dumps({**json.loads(text), "files": "everything is fine"}),
    ],
)
def test_a_corrupt_cache_is_ignored(engine, cache_dir, corrupt):
    check(engine)
    path, text = _valid_cache_text(cache_dir)
    path.write_text(corrupt(text))
    hasher = CountingHasher()
    check(engine, hasher=hasher)
    assert sorted(hasher.calls) == CHECKED
    assert json.loads(path.read_text()) == json.loads(text)  # rewritten whole: the same stamps and digests
    rehash = CountingHasher()
    check(engine, hasher=rehash)
    assert rehash.calls == []


@pytest.mark.parametrize("bad_entry", [{"sha256": "xyz"}, "not an entry", {"size": True, "sha256": "0" * 64}])
def test_a_malformed_cache_entry_costs_only_its_file(engine, cache_dir, bad_entry):
    check(engine)
    path, text = _valid_cache_text(cache_dir)
    cache = json.loads(text)
    cache["files"][TOKENIZER] = bad_entry
    path.write_text(json.dumps(cache))
    hasher = CountingHasher()
    check(engine, hasher=hasher)
    assert hasher.calls == [TOKENIZER]


def test_an_unwritable_cache_only_costs_the_next_load(engine, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    manifest = json.loads((engine / MANIFEST).read_text())
    with caplog.at_level(logging.WARNING):
        verify_engine_files(engine, manifest, mode="fast", cache_dir=blocked / "verified")
    assert "could not write the engine verification cache" in caplog.text


def test_caches_of_deleted_engines_are_pruned(engine, tmp_path, cache_dir):
    other = tmp_path / "other"
    shutil.copytree(engine, other)
    check(other)
    shutil.rmtree(other)
    check(engine)
    (path,) = cache_dir.glob("*.json")
    assert json.loads(path.read_text())["engine_dir"] == str(engine.resolve())


def test_off_skips_the_check_with_a_warning(engine, monkeypatch, caplog):
    flip_byte_in_place(engine / WEIGHTS_FILE)
    monkeypatch.setenv("TRTSERVE_VERIFY", "off")
    with caplog.at_level(logging.WARNING):
        EngineConfig.load(engine, verify=True)
    assert "TRTSERVE_VERIFY=off" in caplog.text and "NOT checked" in caplog.text


def test_an_unknown_mode_is_refused(engine, monkeypatch):
    monkeypatch.setenv("TRTSERVE_VERIFY", "fsat")
    with pytest.raises(EngineIntegrityError, match="TRTSERVE_VERIFY='fsat' is not one of fast, full, off"):
        EngineConfig.load(engine, verify=True)


def test_load_without_verify_reads_a_damaged_engine(engine):
    """Readers that inspect an engine (or damage a copy on purpose, as the gate's tests do) opt out."""
    flip_byte_in_place(engine / WEIGHTS_FILE)
    assert EngineConfig.load(engine) == config_in(engine, cpu_segments=0)


def test_the_cache_follows_xdg_without_trtserve_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRTSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "trtserve" / "verified"


def test_llm_engine_verifies_what_it_serves(llama_engine, tmp_path):
    from runtime.engine.llm_engine import LLMEngine

    copy = tmp_path / "served"
    shutil.copytree(llama_engine, copy)
    assert LLMEngine(copy).config.engine_dir == copy
    flip_byte_in_place(copy / WEIGHTS_FILE)
    set_mtime_ns(copy / WEIGHTS_FILE, FileStamp.of(copy / WEIGHTS_FILE).mtime_ns + 10**9)
    with pytest.raises(EngineIntegrityError, match=re.escape(f"{WEIGHTS_FILE}: expected sha256")):
        LLMEngine(copy)
