"""The tiers behind the prefix cache: full blocks copied to host memory and disk, and read back on a later miss.

Stores are write-through: each step, the blocks the prefix cache indexed are copied to every tier that lacks
them (so the disk tier holds what the host tier evicts, and a model that dies has lost nothing of it). A block
waiting for its copy holds a pool reference, so it cannot be evicted and rewritten before it is read. Loads: a waiting
request whose next blocks miss the pool but hit a tier gets new pool blocks (held here, in no request's
table), one copy thread reads them back, and once every read is done the engine indexes them in the prefix
cache; the request is admitted from then on, as with any prefix hit, and the hold ends. Copies run on the
copy thread, never on the step path; the engine thread only queues them and collects what finished (`poll`).

When the server stops, copies still queued are finished and blocks in the pool or the host tier that the disk
tier lacks (a write that failed) are written to it (`close`), so a restart finds them.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from executors.kv_blocks import BlockCopier
from runtime.engine.block_pool import BlockPool, KVBlock
from runtime.engine.kv_tiers.disk import DiskTier
from runtime.engine.kv_tiers.host import HostTier

log = logging.getLogger(__name__)

FLUSH_BATCH = 64  # blocks gathered at once when the pool is written to disk at shutdown


@dataclass(frozen=True)
class TierStats:
    """Per tier ("host", "disk"): blocks kept and bytes used of the capacity, blocks read back (hits) and
    written, bytes moved; the copy thread's time on loads and stores; files refused and failed writes."""

    blocks: dict[str, int]
    usage_bytes: dict[str, int]
    capacity_bytes: dict[str, int]
    hits: dict[str, int]
    stored: dict[str, int]
    read_bytes: dict[str, int]
    written_bytes: dict[str, int]
    load_seconds: float
    loads: int
    store_seconds: float
    stores: int
    rejected_files: int
    write_errors: int


@dataclass(eq=False)
class Load:
    """Blocks being read back for a waiting request: pool block i receives hashes[i]."""

    blocks: list[KVBlock]
    hashes: list[bytes]
    done: bool = False
    num_loaded: int = 0  # set by the copy thread: a leading run of blocks (a later read may fail)
    abandoned: bool = False  # its request left while the copy thread read


@dataclass
class _Counters:
    hits: Counter[str] = field(default_factory=Counter)
    stored: Counter[str] = field(default_factory=Counter)
    read_bytes: Counter[str] = field(default_factory=Counter)
    written_bytes: Counter[str] = field(default_factory=Counter)
    load_seconds: float = 0.0
    loads: int = 0
    store_seconds: float = 0.0
    stores: int = 0


class KVTiers:
    def __init__(self, copier: BlockCopier, pool: BlockPool, host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None, "no tier to keep blocks in"
        self.copier, self.pool, self.host, self.disk = copier, pool, host, disk
        self.tiers = [t for t in (host, disk) if t is not None]
        self.counters = _Counters()
        self._loads: dict[str, Load] = {}  # by request id, until the request is admitted or leaves
        self._abandoned: list[Load] = []  # loads whose request left before the read was done
        self._storing: dict[int, list[KVBlock]] = {}  # pinned until their copy is taken, by job
        self._store_ids = itertools.count()
        self._finished: deque[Callable[[], None]] = deque()  # the copy thread's results, applied by `poll`
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()  # set whenever a job finishes: an engine with only loads to wait for
        self._thread = threading.Thread(target=self._work, name="trtserve-kv-tiers", daemon=True)
        self._thread.start()

    # ---- the engine thread (under the engine's lock) --------------------------------------------------------

    def store(self, cached: Sequence[tuple[KVBlock, bytes]]) -> None:
        """Copy newly indexed blocks to the tiers that lack them; each is pinned until copied. Asks only what
        the tiers know in memory: the copy thread looks for another replica's file before writing one."""
        # (A block evicted since it was indexed, by a disaggregated pull between steps, holds other data now.)
        new = [(b, h) for b, h in cached if b.block_hash == h and not self._kept_everywhere(h)]
        if not new:
            return
        blocks, job = [b for b, _ in new], next(self._store_ids)
        self.pool.touch(blocks)
        self._storing[job] = blocks
        ids, hashes = [b.block_id for b in blocks], [h for _, h in new]
        self._jobs.put(lambda: self._store(job, ids, hashes))

    def _kept_everywhere(self, block_hash: bytes) -> bool:
        in_host = self.host is None or block_hash in self.host
        return in_host and (self.disk is None or self.disk.knows(block_hash))

    def find(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (a prefix's next blocks, in order) a tier holds, counted from the first."""
        for i, h in enumerate(hashes):
            if not any(h in t for t in self.tiers):
                return i
        return len(hashes)

    def start_load(self, request_id: str, blocks: list[KVBlock], hashes: list[bytes]) -> None:
        load = Load(blocks, hashes)
        self._loads[request_id] = load
        self._jobs.put(lambda: self._load(load))

    def load_state(self, request_id: str) -> Load | None:
        return self._loads.get(request_id)

    def poll(self) -> None:
        """Apply what the copy thread finished: stored blocks unpinned, loaded blocks indexed."""
        while self._finished:
            self._finished.popleft()()

    def release(self, request_id: str) -> None:
        """The request was admitted (its own references hold the blocks now) or left: end the hold."""
        load = self._loads.pop(request_id, None)
        if load is not None and load.done:
            self.pool.free_blocks(reversed(load.blocks))
        elif load is not None:  # still reading: its blocks are freed once the read is done
            load.abandoned = True
            self._abandoned.append(load)

    @property
    def loading(self) -> bool:
        return any(not load.done for load in self._loads.values())

    def held(self) -> list[list[int]]:
        """Block references taken here (pending stores, loads): for the pool's invariant check."""
        return [[b.block_id for b in blocks] for blocks in self._storing.values()] + [
            [b.block_id for b in load.blocks] for load in [*self._loads.values(), *self._abandoned]
        ]

    def settle(self) -> None:
        """Wait for every queued copy and apply them (tests, and the shutdown)."""
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()
        self.poll()

    def wait(self, timeout_s: float) -> None:
        """Block (without the engine's lock) until a copy finishes or the timeout passes."""
        self._idle.wait(timeout_s)
        self._idle.clear()

    # ---- the copy thread ------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a copy that fails must not stop the others; its blocks were released by the job
                log.exception("KV tier copy failed")
            self._idle.set()

    def _store(self, job: int, block_ids: list[int], hashes: list[bytes]) -> None:
        start = time.perf_counter()
        try:
            payloads = self.copier.gather(block_ids)
        finally:
            self._finished.append(lambda: self._unpin(job))
        for h, payload in zip(hashes, payloads, strict=True):
            self._keep(h, payload)
        self.counters.store_seconds += time.perf_counter() - start
        self.counters.stores += 1

    def _keep(self, block_hash: bytes, payload: np.ndarray) -> None:
        """Into every tier: the disk tier is written through too, so a model that dies loses none of it (what the
        host tier evicts is on disk already)."""
        c = self.counters
        if self.host is not None:
            self.host.put(block_hash, payload.copy())  # a row of its own: not the whole gathered matrix alive
            c.stored["host"] += 1
            c.written_bytes["host"] += payload.nbytes
        if self.disk is not None and block_hash not in self.disk and self.disk.write(block_hash, payload):
            c.stored["disk"] += 1
            c.written_bytes["disk"] += payload.nbytes

    def _unpin(self, job: int) -> None:
        self.pool.free_blocks(reversed(self._storing.pop(job)))

    def _load(self, load: Load) -> None:
        start, payloads, c = time.perf_counter(), [], self.counters
        try:
            for h in load.hashes:
                payload, tier = self._read(h)
                if payload is None:
                    break
                payloads.append(payload)
                c.hits[tier] += 1
                c.read_bytes[tier] += payload.nbytes
            if payloads:
                self.copier.scatter([b.block_id for b in load.blocks[: len(payloads)]], np.stack(payloads))
            load.num_loaded = len(payloads)
        finally:
            self._finished.append(lambda: self._loaded(load))
        c.load_seconds += time.perf_counter() - start
        c.loads += 1

    def _read(self, block_hash: bytes) -> tuple[np.ndarray | None, str]:
        if self.host is not None and (payload := self.host.get(block_hash)) is not None:
            return payload, "host"
        if self.disk is not None and (payload := self.disk.read(block_hash)) is not None:
            if self.host is not None:  # promoted: a popular block is read from memory next time
                self.host.put(block_hash, payload)
            return payload, "disk"
        return None, ""

    def _loaded(self, load: Load) -> None:
        """Index the blocks read (the pool keeps a block already indexed under the same hash) and free those not
        read. A load whose request left meanwhile frees them all, the read ones staying in the prefix cache."""
        read = load.num_loaded
        for block, h in zip(load.blocks[:read], load.hashes[:read], strict=True):
            self.pool.cache_block(block, h)
        self.pool.free_blocks(reversed(load.blocks[read:]))
        load.blocks, load.done = load.blocks[:read], True
        if load.abandoned:
            self._abandoned.remove(load)
            self.pool.free_blocks(reversed(load.blocks))

    # ---- shutdown -------------------------------------------------------------------------------------------

    def close(self, pool_cached: Sequence[tuple[int, bytes]] = ()) -> None:
        """Stop the copy thread and write what the disk tier lacks of `pool_cached` (the pool's indexed blocks)
        and of the host tier, so a restart finds them. Called with no step running."""
        self.settle()
        self._jobs.put(None)
        self._thread.join()
        if self.disk is None:
            return
        start, written = time.perf_counter(), 0
        missing = [(i, h) for i, h in pool_cached if h not in self.disk]
        for first in range(0, len(missing), FLUSH_BATCH):
            batch = missing[first : first + FLUSH_BATCH]
            payloads = self.copier.gather([i for i, _ in batch])
            written += sum(self.disk.write(h, p) for (_, h), p in zip(batch, payloads, strict=True))
        for h, payload in self.host.items() if self.host is not None else []:
            written += h not in self.disk and self.disk.write(h, payload)
        log.info("KV disk tier: %d blocks written at shutdown in %.2f s", written, time.perf_counter() - start)

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(
            blocks={t.name: len(t) for t in self.tiers},
            usage_bytes={t.name: t.usage_bytes for t in self.tiers},
            capacity_bytes={t.name: t.capacity_bytes for t in self.tiers},
            hits=dict(c.hits),
            stored=dict(c.stored),
            read_bytes=dict(c.read_bytes),
            written_bytes=dict(c.written_bytes),
            load_seconds=c.load_seconds,
            loads=c.loads,
            store_seconds=c.store_seconds,
            stores=c.stores,
            rejected_files=0 if self.disk is None else self.disk.rejected,
            write_errors=0 if self.disk is None else self.disk.write_errors,
        )
