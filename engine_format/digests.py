"""SHA-256 of engine files, and the cache that spares a restart from hashing them again.

The cache maps a file's stamp (size, mtime_ns, inode) to the digest its bytes had when that stamp
was seen; a file whose stamp is unchanged is not read again. It stores the digest found, not a
verdict, so an altered digest in the manifest is still caught from a warm cache. It lives outside
the engine directory (engines are often on read-only mounts): one JSON file per engine, named
after the hash of the engine's resolved path, under $TRTSERVE_CACHE/verified/ (the builder's cache
root), else $XDG_CACHE_HOME/trtserve/verified/, else ~/.cache/trtserve/verified/. It is written
to a temporary file and renamed (concurrent loaders never see half a file) and anything
unreadable in it is ignored, which costs a re-hash and nothing else.

What the fast path does not catch: a file rewritten in place with the same size and its mtime
restored (`touch -r`, os.utime, a copy that preserves times onto the same inode, or a rewrite
within the filesystem's timestamp granularity) keeps its stamp, so its cached digest is trusted;
neither does it guard against someone who can write the cache itself. TRTSERVE_VERIFY=full (see
verify.py) hashes every file. ctime would catch a restored mtime but is left out of the stamp on
purpose: chmod/chown change it too, and Kubernetes re-chowns a volume with an fsGroup on every
mount, which would re-hash the whole engine at every pod start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_CHUNK = 1 << 22  # the read loop's chunk before Python 3.11 (file_digest picks its own)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file, read in chunks (engine weights are gigabytes)."""
    with open(path, "rb") as f:
        if sys.version_info >= (3, 11):
            return hashlib.file_digest(f, "sha256").hexdigest()
        digest = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        return digest.hexdigest()


def is_sha256(value: object) -> bool:
    """A lowercase hex SHA-256 digest, as hashlib's hexdigest() writes it."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def default_cache_dir() -> Path | None:
    """Where digest caches live (module docstring); None when there is no home to put them in."""
    if root := os.environ.get("TRTSERVE_CACHE"):
        return Path(root) / "verified"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "trtserve" / "verified"
    try:
        return Path.home() / ".cache" / "trtserve" / "verified"
    except RuntimeError:  # no HOME and no passwd entry (some containers)
        return None


@dataclass(frozen=True)
class FileStamp:
    """What the cache compares instead of the bytes: changed by any ordinary write or replacement."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        """The stamp of a regular file (symlinks followed); FileNotFoundError / IsADirectoryError otherwise."""
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class DigestCache:
    """The digests known for one engine directory's files (by file name), loaded and saved as one file."""

    path: Path | None  # None: no cache (every lookup misses, save does nothing)
    engine_dir: str  # resolved absolute path: the cache's key
    entries: dict[str, tuple[FileStamp, str]] = field(default_factory=dict)
    changed: bool = False

    @classmethod
    def open(cls, engine_dir: Path, cache_dir: Path | None) -> DigestCache:
        engine = str(engine_dir.resolve())
        if cache_dir is None:
            return cls(None, engine)
        path = cache_dir / f"{hashlib.sha256(engine.encode()).hexdigest()[:32]}.json"
        return cls(path, engine, _read_entries(path, engine))

    def lookup(self, name: str, stamp: FileStamp) -> str | None:
        """The digest of `name` if it was hashed with this very stamp."""
        entry = self.entries.get(name)
        return entry[1] if entry is not None and entry[0] == stamp else None

    def record(self, name: str, stamp: FileStamp, digest: str) -> None:
        if self.entries.get(name) != (stamp, digest):
            self.entries[name] = (stamp, digest)
            self.changed = True

    def save(self) -> None:
        """Write the cache if anything was hashed (temp file + rename); failing costs the next load a re-hash."""
        if self.path is None or not self.changed:
            return
        files = {name: {"size": s.size, "mtime_ns": s.mtime_ns, "inode": s.inode, "sha256": digest}
                 for name, (s, digest) in sorted(self.entries.items())}  # fmt: skip
        payload = {"version": CACHE_VERSION, "engine_dir": self.engine_dir, "files": files}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(payload, f)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("could not write the engine verification cache %s (%s); the next load hashes again",
                        self.path, exc)  # fmt: skip
            return
        self.changed = False
        _prune(self.path.parent)


def _read_entries(path: Path, engine: str) -> dict[str, tuple[FileStamp, str]]:
    """The cache's valid entries; an unreadable or foreign cache reads as empty, a malformed entry is dropped."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        log.warning("ignoring the unreadable engine verification cache %s (%s); hashing again", path, exc)
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("engine_dir") != engine \
            or not isinstance(files, dict):  # fmt: skip
        log.warning("ignoring the engine verification cache %s: not a version %d cache of %s", path, CACHE_VERSION,
                    engine)  # fmt: skip
        return {}
    entries = {}
    for name, raw in files.items():
        if (entry := _entry(raw)) is not None:
            entries[name] = entry
    return entries


def _entry(raw: Any) -> tuple[FileStamp, str] | None:
    if not isinstance(raw, dict) or not is_sha256(raw.get("sha256")):
        return None
    numbers = [raw.get(key) for key in ("size", "mtime_ns", "inode")]
    ints = [n for n in numbers if isinstance(n, int) and not isinstance(n, bool)]
    if len(ints) != len(numbers):
        return None
    return FileStamp(*ints), raw["sha256"]


def _prune(cache_dir: Path) -> None:
    """Drop the caches of engine directories that no longer exist (test runs and rebuilt temporary
    directories leave them behind). Runs only after a write, i.e. after hashing, which costs far more."""
    for path in cache_dir.glob("*.json"):
        try:
            engine = json.loads(path.read_text()).get("engine_dir")
            if isinstance(engine, str) and not Path(engine).exists():
                path.unlink()
        except (OSError, ValueError, AttributeError):
            continue
