"""trtserve's LoRA machinery offline (runtime.LLM's engine, no server), for benchmarks/lora.py: what reading an
adapter costs, what a slot-pool miss costs a step, and what a resident adapter holds in memory.

- load: the engine's LoraManager counters after it started with every adapter (`--lora`: each read from disk and
  checked), and `LLMEngine.add_lora` timed for each adapter directory again under a new name (then removed);
- slot-pool miss: `max_loras` 1 and the first two adapters, one request at a time (the same prompt, prefix caching
  off, greedy, `PROBE_TOKENS` tokens, EOS ignored) in cycles of base, a0, a0, a1, a1: each adapter's first request
  of a cycle finds the other in the slot (a miss: paged in during its first step), its second finds it resident
  (warm). The first step (the prefill, with the slot load on a miss) and the decode steps are timed per kind; the
  slot fill itself is the LoraManager's load_seconds over the miss step (no disk read: host memory holds them all);
- memory: LoraAdapter.nbytes (its float32 A and B, in host memory) and the fused GroupUpdates its slot holds
  (executors/lora/slots.py: A_cat and each module's B block per fused projection and layer, float16 on cpu-int8
  and cpu-bf16).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROBE_TOKENS = 4
KINDS = ("base", "warm", "miss")


def _median_ms(values: Sequence[float]) -> float | None:
    return round(1000 * statistics.median(values), 2) if values else None


def slot_nbytes(slots: Any, slot: int) -> int | None:
    """Bytes of the fused updates a slot of a LoraSlots holds (read from its private table; None where a backend
    keeps its slots another way)."""
    updates = getattr(slots, "_updates", None)
    if not isinstance(updates, list) or slot >= len(updates):
        return None
    return sum(u.a.nbytes + sum(block.nbytes for block, _ in u.blocks) for u in updates[slot].values())


def probe_order(first: str, second: str, cycles: int) -> list[tuple[str | None, str]]:
    """(adapter, kind) per probe request: `cycles` of base, first (a miss), first (warm), second (a miss), second
    (warm). `first`'s request of the first cycle finds an empty slot (still a slot load)."""
    return [(None, "base"), (first, "miss"), (first, "warm"), (second, "miss"), (second, "warm")] * cycles


def _probe(engine: Any, prompt_ids: list[int], adapter: str | None) -> dict:
    """One request alone: its first step's and decode steps' seconds, and the slot loads and load seconds the
    LoraManager counted during the first step."""
    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=PROBE_TOKENS, ignore_eos=True, lora=adapter)
    counters = engine.loras.counters
    loads, seconds = counters.slot_loads, counters.load_seconds
    request_id = engine.add_request(list(prompt_ids), params)
    times: list[float] = []
    first: dict = {}
    while not first or request_id in engine.requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        first = first or {"slot_loads": counters.slot_loads - loads, "slot_fill_s": counters.load_seconds - seconds}
    return {"first_s": times[0], "decode_s": times[1:], **first}


def probe_summary(probes: list[tuple[str, dict]]) -> dict:
    """Per kind (base, warm, miss): median first-step and decode-step ms and the count; the miss's extra ms over a
    warm first step; the slot fill's median ms; and whether every probe's slot loads were its kind's (a miss one,
    base and warm none)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        mine = [p for k, p in probes if k == kind]
        out[kind] = {
            "first_step_ms": _median_ms([p["first_s"] for p in mine]),
            "decode_step_ms": _median_ms([d for p in mine for d in p["decode_s"]]),
            "requests": len(mine),
        }
    miss, warm = out["miss"]["first_step_ms"], out["warm"]["first_step_ms"]
    out["miss_extra_ms"] = round(miss - warm, 2) if miss is not None and warm is not None else None
    out["slot_fill_ms"] = _median_ms([p["slot_fill_s"] for k, p in probes if k == "miss"])
    out["loads_as_expected"] = all(p["slot_loads"] == (k == "miss") for k, p in probes)
    return out


def offline(
    engine_dir: Path,
    backend: str | None,
    adapters: dict[str, Path],
    rank: int,
    prompt_ids: Sequence[int],
    cycles: int,
    log: Callable[[str], None],
) -> dict:
    """measure() in a fresh `python -m benchmarks.lora_offline` process: its engine starts before torch is imported,
    as a server's does (torch loaded first leaves libgomp's threads spinning, which slows the engine's steps;
    benchmarks.lora imports torch). RuntimeError with the child's output if it fails."""
    args: dict[str, Any] = {"engine_dir": str(engine_dir), "backend": backend, "rank": rank, "cycles": cycles}
    args |= {"prompt_ids": list(prompt_ids), "adapters": {name: str(path) for name, path in adapters.items()}}
    command = [sys.executable, "-m", "benchmarks.lora_offline", json.dumps(args)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.lora_offline exited with {proc.returncode}: {proc.stderr[-1500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pr = out["probe"]
    log(
        f"  offline ({out['backend']}): first step after a slot miss {pr['miss']['first_step_ms']} ms, warm "
        f"{pr['warm']['first_step_ms']} ms, base {pr['base']['first_step_ms']} ms; slot fill {pr['slot_fill_ms']} ms"
    )
    return out


def measure(
    engine_dir: Path, backend: str | None, adapters: dict[str, Path], rank: int, prompt_ids: Sequence[int], cycles: int
) -> dict:
    """Load times, the slot-pool miss and memory per resident adapter (module docstring), on one engine."""
    from runtime import LLM

    modules = {name: str(path) for name, path in adapters.items()}
    start = time.perf_counter()
    kwargs = {"backend": backend, "lora_modules": modules, "max_loras": 1, "max_lora_rank": rank}
    with LLM(engine_dir, **kwargs, enable_prefix_caching=False, max_num_seqs=1, num_kv_blocks=64) as llm:
        engine, started_s = llm.engine, time.perf_counter() - start
        manager, stats = engine.loras, engine.stats().lora
        assert manager is not None, "LoRA is enabled"
        first, second = list(adapters)[:2]
        order = probe_order(first, second, cycles + 1)
        probes = [(kind, _probe(engine, list(prompt_ids), name)) for name, kind in order]
        summary = probe_summary(probes[len(order) // (cycles + 1) :])  # the first cycle warms the engine up
        (name, slot), *_ = manager.resident.items()  # the second adapter, the last probe's
        memory = {
            "adapter": name,
            "adapter_nbytes": manager.loaded[name].nbytes,
            "slot_nbytes": slot_nbytes(manager.slots, slot),
            "slots": manager.slots.num_slots,
        }
        add_s = []
        for i, path in enumerate(adapters.values()):
            t = time.perf_counter()
            engine.add_lora(f"probe{i}", path)
            add_s.append(time.perf_counter() - t)
            engine.remove_lora(f"probe{i}")
        backend_name = getattr(engine.backend, "name", type(engine.backend).__name__)
    return {
        "backend": backend_name,
        "engine_start_s": round(started_s, 2),
        "start_disk_loads": stats.disk_loads if stats else None,
        "start_load_ms_per_adapter": round(1000 * stats.load_seconds / stats.disk_loads, 2)
        if stats and stats.disk_loads
        else None,
        "add_lora_ms": _median_ms(add_s),
        "add_lora_ms_range": [round(1000 * min(add_s), 2), round(1000 * max(add_s), 2)],
        "probe": summary,
        "probe_tokens": PROBE_TOKENS,
        "prompt_tokens": len(prompt_ids),
        "cycles": cycles,
        "memory": memory,
    }


if __name__ == "__main__":  # benchmarks.lora's offline phase, in a process of its own (see offline())
    given = json.loads(sys.argv[1])
    given["adapters"] = {name: Path(path) for name, path in given["adapters"].items()}
    print(json.dumps(measure(**given)))
