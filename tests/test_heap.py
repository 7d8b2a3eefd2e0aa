"""freeze_startup_heap (runtime/engine/heap.py): what the serving process made at start leaves the garbage
collector's passes, so a full collection walks only what was made since. Run in a child process: a freeze is
for the rest of the process's life."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, logging, sys
from runtime.engine.heap import freeze_startup_heap
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
startup = [[i] for i in range(100_000)]  # long-lived, tracked objects (the engine's, in a server)
cycle = [None]; cycle[0] = cycle; del cycle  # start-up garbage in a cycle: collected, not frozen
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap("test process")
later = [[i] for i in range(1000)]  # made while serving
print("RESULT", tracked_before, frozen, len(gc.get_objects()), gc.collect())
"""


def run_script(script: str) -> tuple[list[int], str]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    [line] = [x for x in out.splitlines() if x.startswith("RESULT")]
    return [int(v) for v in line.split()[1:]], out


def test_a_full_collection_after_the_freeze_walks_only_what_was_made_since():
    (before, frozen, after, collected), log = run_script(SCRIPT)
    assert before > 100_000 and frozen >= 100_000
    assert after < 5_000, f"{after} objects still tracked: the start-up heap was not frozen"
    assert collected == 0, "the start-up cycle was collected before the freeze"
    assert "test process:" in log and "frozen" in log


def test_the_check_sees_an_unfrozen_heap():
    (_, _, after, _), _ = run_script(SCRIPT.replace('freeze_startup_heap("test process")', "0"))
    assert after > 100_000
