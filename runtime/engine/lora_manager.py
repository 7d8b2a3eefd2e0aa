"""The LoRA adapters an engine serves, at three levels (S-LoRA's): registered by name (a PEFT directory, checked
when added), loaded in host memory (at most `max_cpu_loras`, least recently used dropped first and read again
from disk when asked for), and resident in one of the backend's `max_loras` slots, where a step applies them.

A request pins its adapter in host memory from its arrival to its end, and holds its adapter's slot while it
runs: the scheduler admits a request only when its adapter is resident or a slot can be taken from adapters
no running request uses (least recently used first), so a step never holds more adapters than there are
slots, and a slot is never rewritten under a request that reads it. An adapter removed while requests use it
refuses new requests at once and leaves when the last one finishes.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import MANIFEST
from engine_format.requests import InvalidRequest
from executors.lora import AdapterError, LoraAdapter, LoraSlots, load_adapter
from runtime.engine.engine_args import EngineArgs
from runtime.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class LoraCounters:
    """Since start: adapters read from disk, slot loads (an adapter paged into a slot) and slot evictions,
    the seconds they took, and per adapter the requests admitted and tokens generated."""

    disk_loads: int = 0
    slot_loads: int = 0
    slot_evictions: int = 0
    load_seconds: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class LoraStats:
    registered: tuple[str, ...]
    loaded: tuple[str, ...]  # in host memory
    resident: tuple[str, ...]  # in a slot
    disk_loads: int
    slot_loads: int
    slot_evictions: int
    load_seconds: float
    requests: dict[str, int]
    tokens: dict[str, int]


class LoraManager:
    def __init__(self, slots: LoraSlots, max_rank: int, max_cpu_loras: int, base_model: str | None = None) -> None:
        self.slots = slots
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.base_model = base_model
        self.paths: dict[str, Path] = {}
        self.digests: dict[str, str] = {}  # name -> the adapter's content digest (its prefix-cache identity)
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # host memory, least recently used first
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.users: Counter[str] = Counter()  # running requests per adapter (their slot's)
        self.live: Counter[str] = Counter()  # requests per adapter, waiting or running (pinned in host memory)
        self.removing: set[str] = set()  # removed while in use: gone when the last user finishes
        self.counters = LoraCounters()

    # ---- registry (under the engine's lock, except `read`) ---------------------------------------

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """An adapter read from disk and checked for this engine and backend (AdapterError naming the problem).
        Touches nothing shared: the engine calls it without its lock, so steps go on while files are read."""
        if not name or len(name) > 128 or any(c.isspace() for c in name):
            raise AdapterError(name, "name", "must be 1-128 characters without whitespace")
        adapter = load_adapter(name, path, self.slots.spec, self.max_rank, self.base_model)
        self.slots.check(adapter)
        return adapter

    def add(self, adapter: LoraAdapter, read_seconds: float = 0.0) -> None:
        """Register an adapter `read` returned (in `read_seconds`). Adding a name again replaces its adapter, if no
        request uses it."""
        name = adapter.name
        if self.live[name]:
            raise AdapterError(name, "name", "is in use by requests: remove it first, or use another name")
        self.counters.disk_loads += 1
        self.counters.load_seconds += read_seconds
        self._drop(name)
        self.paths[name], self.digests[name] = adapter.path, adapter.digest
        self._keep_loaded(adapter)
        log.info(
            "LoRA adapter %r: rank %d, targets %s (%s)", name, adapter.rank, ",".join(adapter.targets), adapter.path
        )

    def remove(self, name: str) -> bool:
        """Unregister an adapter: new requests for it are refused now; True if it left at once, False if it
        leaves when its running requests finish. InvalidRequest if it is not registered."""
        if name not in self.paths or name in self.removing:
            raise InvalidRequest("lora", f"adapter {name!r} is not loaded")
        if self.live[name]:
            self.removing.add(name)
            return False
        self._drop(name)
        return True

    def register_request(self, request: Request) -> None:
        """A new request for an adapter (params.lora): refused (InvalidRequest) if the name is not served;
        the adapter is read back into host memory if it had left, and stays there until the request ends."""
        name = request.params.lora
        if name is None:
            return
        digest = self.digest(name)
        if name not in self.loaded:
            try:
                adapter = self._read(name, self.paths[name])
            except AdapterError as exc:
                raise InvalidRequest("lora", f"adapter {name!r} could not be read again: {exc}") from None
            if adapter.digest != digest:
                raise InvalidRequest("lora", f"adapter {name!r} changed on disk since it was loaded: load it again")
            self._keep_loaded(adapter)
        self.loaded.move_to_end(name)
        self.live[name] += 1
        request.lora_id = digest

    def digest(self, name: str) -> str:
        """The served adapter's content digest: its identity in the prefix cache and in KV handed between
        workers. InvalidRequest naming `lora` if no adapter of that name is served."""
        if name not in self.paths or name in self.removing:
            known = ", ".join(sorted(set(self.paths) - self.removing)) or "none"
            raise InvalidRequest("lora", f"adapter {name!r} is not loaded (loaded: {known})")
        return self.digests[name]

    def unregister_request(self, request: Request) -> None:
        """A request ended (after release): its adapter may leave host memory, or leave altogether if removed."""
        name = request.params.lora
        if name is None or request.lora_id is None:
            return
        request.lora_id = None
        self.counters.tokens[name] += request.num_output_tokens
        self.live[name] -= 1
        if not self.live[name]:
            del self.live[name]
            if name in self.removing:
                self._drop(name)

    # ---- slots (the scheduler's) -------------------------------------------------------------

    def can_acquire(self, request: Request) -> bool:
        """Whether the request's adapter is resident or a slot can be freed for it."""
        name = request.params.lora
        return name is None or name in self.resident or self._free_slot() is not None

    def acquire(self, request: Request) -> None:
        """Give an admitted request its adapter's slot (can_acquire said yes), loading it if needed."""
        name = request.params.lora
        if name is None:
            return
        slot = self.resident.get(name)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "can_acquire first"
            self._load_slot(name, slot)
        self.resident.move_to_end(name)
        self.users[name] += 1
        self.counters.requests[name] += 1
        request.lora_slot = slot

    def release(self, request: Request) -> None:
        """A request stopped running (finished or preempted): its slot may be reused once no other uses it."""
        name = request.params.lora
        if name is None or request.lora_slot is None:
            return
        request.lora_slot = None
        self.users[name] -= 1
        if not self.users[name]:
            del self.users[name]

    def stats(self) -> LoraStats:
        c = self.counters
        return LoraStats(
            registered=tuple(sorted(set(self.paths) - self.removing)),
            loaded=tuple(self.loaded),
            resident=tuple(self.resident),
            disk_loads=c.disk_loads,
            slot_loads=c.slot_loads,
            slot_evictions=c.slot_evictions,
            load_seconds=c.load_seconds,
            requests=dict(c.requests),
            tokens=dict(c.tokens),
        )

    # ---- internals -------------------------------------------------------------------------

    def _read(self, name: str, path: Path) -> LoraAdapter:
        """`read`, counted: an adapter read back into host memory."""
        start = time.perf_counter()
        adapter = self.read(name, path)
        self.counters.disk_loads += 1
        self.counters.load_seconds += time.perf_counter() - start
        return adapter

    def _keep_loaded(self, adapter: LoraAdapter) -> None:
        """In host memory, dropping the least recently used adapters past max_cpu_loras that no request pins."""
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        spare = [name for name in self.loaded if not self.live[name] and name != adapter.name]
        for name in spare[: max(0, len(self.loaded) - self.max_cpu_loras)]:
            del self.loaded[name]

    def _free_slot(self) -> int | None:
        """A slot no adapter holds, else the least recently used adapter's that no running request uses."""
        taken = set(self.resident.values())
        for slot in range(self.slots.num_slots):
            if slot not in taken:
                return slot
        return next((slot for name, slot in self.resident.items() if not self.users[name]), None)

    def _load_slot(self, name: str, slot: int) -> None:
        start = time.perf_counter()
        evicted = self.slots.names[slot]
        if evicted is not None:
            del self.resident[evicted]
            self.counters.slot_evictions += 1
        adapter = self.loaded[name]  # pinned there by the request (register_request)
        self.slots.load(slot, adapter)
        self.resident[name] = slot
        self.counters.slot_loads += 1
        self.counters.load_seconds += time.perf_counter() - start

    def _drop(self, name: str) -> None:
        self.removing.discard(name)
        self.paths.pop(name, None)
        self.digests.pop(name, None)
        self.loaded.pop(name, None)
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)


def create_lora_manager(args: EngineArgs, backend: object, config: EngineConfig) -> LoraManager:
    """The engine's adapters: the backend's slots and the adapters `args` names, each checked (EngineLoadError
    naming the adapter and what is wrong: a server does not start with an adapter it cannot run)."""
    enable = getattr(backend, "enable_lora", None)
    if enable is None:
        raise EngineLoadError(f"{type(backend).__name__} does not apply LoRA adapters: use --backend cpu-bf16")
    adapters = args.lora_adapters()
    manager = LoraManager(
        enable(args.max_loras, args.max_lora_rank),
        args.max_lora_rank,
        args.max_cpu_loras or max(args.max_loras, len(adapters)),
        base_model=_source_name(config),
    )
    for name, path in adapters.items():
        try:
            start = time.perf_counter()
            manager.add(manager.read(name, path), time.perf_counter() - start)
        except AdapterError as exc:
            raise EngineLoadError(str(exc)) from None
    return manager


def _source_name(config: EngineConfig) -> str | None:
    """The model the engine was built from, as its manifest names it."""
    try:
        source = json.loads((config.engine_dir / MANIFEST).read_text()).get("source") or {}
    except (OSError, ValueError):
        return None
    name = source.get("name") if isinstance(source, dict) else None
    return name if isinstance(name, str) else None
