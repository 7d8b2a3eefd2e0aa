"""The disk tier: block payloads as files, shared by the replicas on a host and kept across restarts.

Layout: DIR/<engine key>/<hash[:2]>/<hash>.kvb, where the engine key is a digest of the engine's KV identity
(its weights, model shape, dtypes, fp8 scales: engine_format/kv_identity.py), the pool's layout and the bytes
per block, so engines whose KV differs never share a directory. A file is a header (magic, engine key, block
hash, payload length, CRC-32 of the payload) and the payload; it is written to a temporary name and renamed,
so a reader (another replica, a restarted server) sees a whole file or none. A file whose header or checksum
does not match what its name and directory promise (corrupt, truncated, foreign) is counted, deleted and never
loaded.

Bounds: the tier keeps at most `capacity_bytes` of the files it knows (those found at start, those it wrote,
those another replica wrote that it read), evicting the least recently written or read first. Replicas
sharing a directory each bound what they know. A write that fails (a full disk, a read-only directory) is
counted and logged; the tier stays usable for reads, and the engine serves on without it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TRTKVB1\n"
HEADER = struct.Struct("<8s16s16sQI")  # magic, engine key, block hash, payload bytes, CRC-32
SUFFIX = ".kvb"
WARN_INTERVAL_S = 60.0


def engine_key(identity: dict[str, object]) -> bytes:
    """16 bytes naming the engine and layout whose blocks a directory holds."""
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).digest()


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, identity: dict[str, object], block_bytes: int):
        self.key = engine_key(identity)
        self.root = Path(directory) / self.key.hex()
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.usage_bytes = 0
        self.rejected = 0  # corrupt, truncated or foreign files refused
        self.write_errors = 0
        self._last_warning = -WARN_INTERVAL_S
        self._files: OrderedDict[bytes, None] = OrderedDict()  # known files, least recently used first
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)  # OSError: the caller serves without this tier
        probe = self.root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")  # an unwritable directory fails here, at start, not on the first eviction
        probe.unlink()
        self._scan()

    def _scan(self) -> None:
        """Know the files already there (a restart, other replicas), oldest first."""
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX) and len(entry.name) == 32 + len(SUFFIX):
                    try:
                        found.append((entry.stat().st_mtime_ns, bytes.fromhex(entry.name[:32])))
                    except (OSError, ValueError):
                        continue
        for _, block_hash in sorted(found):
            self._files[block_hash] = None
        self.usage_bytes = len(self._files) * self.file_bytes
        self._evict()
        if found:
            log.info("KV disk tier %s: %d blocks from earlier runs", self.root, len(self._files))

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._files:
                return True
        if self.path(block_hash).is_file():  # written by another replica: known from now on
            with self._lock:
                self._adopt(block_hash)
            return True
        return False

    def __len__(self) -> int:
        return len(self._files)

    def knows(self, block_hash: bytes) -> bool:
        """Whether a file this tier knows holds the block (no file system call: the engine thread asks)."""
        with self._lock:
            return block_hash in self._files

    def _adopt(self, block_hash: bytes) -> None:
        if block_hash not in self._files:
            self._files[block_hash] = None
            self.usage_bytes += self.file_bytes
        self._files.move_to_end(block_hash)

    def read(self, block_hash: bytes) -> np.ndarray | None:
        """The block's payload, or None: no such file, or one refused (counted, deleted)."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        problem = self._check(data, block_hash)
        if problem is not None:
            self.rejected += 1
            log.warning("KV disk tier: refused %s (%s); deleted", path, problem)
            with contextlib.suppress(OSError):
                path.unlink()
            self._forget(block_hash)
            return None
        with self._lock:
            self._adopt(block_hash)
        return np.frombuffer(data, np.uint8, offset=HEADER.size)

    def _check(self, data: bytes, block_hash: bytes) -> str | None:
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, not {self.file_bytes}"
        magic, key, stored_hash, length, crc = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a trtserve KV block file"
        if key != self.key or stored_hash != block_hash or length != self.block_bytes:
            return "written by another engine or for another block"
        if zlib.crc32(memoryview(data)[HEADER.size :]) != crc:
            return "checksum mismatch"
        return None

    def write(self, block_hash: bytes, payload: np.ndarray) -> bool:
        """Write the block's file (callers first ask whether it is there); False if that failed (counted, logged)."""
        path = self.path(block_hash)
        body = np.ascontiguousarray(payload, np.uint8).data  # a flat byte view, no copy
        header = HEADER.pack(MAGIC, self.key, block_hash, len(body), zlib.crc32(body))
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as f:
                f.write(header)
                f.write(body)
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            self._write_failed(exc)
            return False
        with self._lock:
            self._adopt(block_hash)
            self._evict()
        return True

    def _write_failed(self, exc: OSError) -> None:
        self.write_errors += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL_S:
            self._last_warning = now
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            what = "the disk is full" if full else "an error"
            log.warning(
                "KV disk tier %s: %s writing a block (%s); blocks go unsaved until writes succeed", self.root, what, exc
            )
            if full:  # make room among what this tier knows
                with self._lock:
                    self._evict(target=self.usage_bytes // 2)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            if self._files.pop(block_hash, False) is None:
                self.usage_bytes -= self.file_bytes

    def _evict(self, target: int | None = None) -> None:
        """Delete the least recently used files until usage is within `target` (default: the capacity);
        the caller holds the lock."""
        limit = self.capacity_bytes if target is None else target
        while self._files and self.usage_bytes > limit:
            block_hash, _ = self._files.popitem(last=False)
            self.usage_bytes -= self.file_bytes
            with contextlib.suppress(OSError):  # gone already (another replica evicted it), or not ours to delete
                self.path(block_hash).unlink()
