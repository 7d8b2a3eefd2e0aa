"""The supervisor's verdicts (runtime.serve.liveness) and restart budget (runtime.serve.restarts), round by
round on an explicit clock: a busy model is never condemned, a dead or stuck one is, as early as the
evidence allows."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_format.serving import HEARTBEAT_FILE, Heartbeat, read_heartbeat
from runtime.serve.liveness import Liveness, Verdict
from runtime.serve.restarts import RestartBudget
from runtime.serve.serve_loop import _supervise
from runtime.serve.supervisor import STANDBY, TRITON, Failure, stub_running

TIMEOUT = "TimeoutError: timed out"
STUB_DEAD = 'HTTP 400: {"error":"Stub process \'llm_0_0\' is not healthy."}'


def beat(now: float, steps: int, unfinished: int, loop_tick: float | None = None, problem: str | None = None):
    return Heartbeat(now, now if loop_tick is None else loop_tick, steps, unfinished, problem)


def test_answered_probes_are_alive():
    liveness = Liveness(max_failures=3, stall_s=60)
    for t in range(10):
        assert liveness.observe(None, beat(t, steps=t, unfinished=2), now=t) == Verdict(False)


def test_failed_probes_of_a_stepping_engine_are_slow_not_dead():
    liveness = Liveness(max_failures=3, stall_s=60)
    verdicts = [liveness.observe(TIMEOUT, beat(t, steps=10 * t, unfinished=40), now=t) for t in range(8)]
    assert [v.dead for v in verdicts] == [False] * 8
    assert [bool(v.reason) for v in verdicts] == [False, False, True, True, True, True, True, True]
    assert (
        verdicts[-1].reason.startswith("slow: 8 health probes failed in a row") and "40 requests" in verdicts[-1].reason
    )


def test_failed_probes_without_a_heartbeat_or_work_are_dead_after_max_failures():
    for heartbeat in (None, beat(0, steps=5, unfinished=0)):
        liveness = Liveness(max_failures=3, stall_s=60)
        assert [liveness.observe(TIMEOUT, heartbeat, now=t).dead for t in range(3)] == [False, False, True]


def test_a_probe_answer_resets_the_failure_count():
    liveness = Liveness(max_failures=3, stall_s=60)
    probes = [TIMEOUT, TIMEOUT, None, TIMEOUT, TIMEOUT, TIMEOUT]
    assert [liveness.observe(p, None, now=t).dead for t, p in enumerate(probes)] == [False] * 5 + [True]


@pytest.mark.parametrize("answer", [STUB_DEAD, "HTTP 400: engine loop stopped: RuntimeError('x')"])
def test_a_dead_stub_or_engine_loop_is_dead_at_the_first_probe(answer):
    verdict = Liveness(max_failures=3, stall_s=60).observe(answer, beat(0, steps=1, unfinished=1), now=0)
    assert verdict.dead and answer in verdict.reason


def test_a_stub_triton_calls_unhealthy_while_it_runs_is_a_failed_probe_not_a_death():
    # Triton's one-second check of the stub's health timed out on a loaded machine: the stub still steps.
    liveness = Liveness(max_failures=3, stall_s=60)
    verdicts = [
        liveness.observe(STUB_DEAD, beat(t, steps=t, unfinished=16), now=t, stub_running=True) for t in range(5)
    ]
    assert [v.dead for v in verdicts] == [False] * 5 and verdicts[-1].reason.startswith("slow: 5 health probes")
    idle = Liveness(max_failures=3, stall_s=60)  # the same answers with nothing to step: dead after max_failures
    dead = [idle.observe(STUB_DEAD, beat(t, 3, 0), now=t, stub_running=True).dead for t in range(3)]
    assert dead == [False, False, True]


def test_stub_running_tells_a_live_stub_from_a_stopped_exited_or_other_process(tmp_path: Path):
    model_dir = tmp_path / "models" / "llm"
    script = "import time; time.sleep(60)"
    stub = subprocess.Popen([sys.executable, "-c", script, f"{model_dir}/1/model.py"])
    other = subprocess.Popen([sys.executable, "-c", script, f"{model_dir}_infer/1/model.py"])
    try:
        assert stub_running(stub.pid, model_dir) and not stub_running(other.pid, model_dir)
        stub.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: not stub_running(stub.pid, model_dir))  # stopped: it cannot run
        stub.send_signal(signal.SIGCONT)
        assert wait_for(lambda: stub_running(stub.pid, model_dir))
        stub.kill()  # not reaped yet: a zombie
        assert wait_for(lambda: not stub_running(stub.pid, model_dir))
    finally:
        for process in (stub, other):
            process.kill()
            process.wait()
    assert not stub_running(stub.pid, model_dir)  # reaped: no such process


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Polls a process state the kernel changes asynchronously (a signal's delivery), bounded."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_heartbeat_reporting_a_stopped_engine_is_dead():
    verdict = Liveness().observe(None, beat(0, 1, 0, problem="engine loop stopped: MemoryError()"), now=0)
    assert verdict == Verdict(True, "the model's engine loop stopped: MemoryError()")


def test_a_stale_heartbeat_is_dead_after_stall_s_even_if_probes_pass():
    liveness = Liveness(max_failures=3, stall_s=60)
    last = beat(100, steps=5, unfinished=0)
    assert not liveness.observe(None, last, now=160).dead
    verdict = liveness.observe(None, last, now=161)
    assert verdict.dead and "heartbeat stopped 61 s ago" in verdict.reason


def test_a_stale_heartbeat_with_failing_probes_is_frozen_after_10_s():
    """A stopped stub (SIGSTOP) or one whose native call holds the GIL: its heartbeat thread and probes both fail."""
    liveness = Liveness(max_failures=30, stall_s=60)
    last = beat(100, steps=5, unfinished=3)
    assert not liveness.observe(TIMEOUT, last, now=110).dead
    verdict = liveness.observe(TIMEOUT, last, now=111)
    assert verdict.dead and verdict.reason.startswith("the model is frozen: its heartbeat stopped 11 s ago")
    assert Liveness(stall_s=5).observe(TIMEOUT, last, now=106).dead  # never later than the stall timeout
    assert not Liveness(stall_s=60).observe(None, last, now=130).dead  # it answers: only its heartbeat stopped


def test_a_wedged_event_loop_is_dead():
    liveness = Liveness(max_failures=3, stall_s=60)
    assert not liveness.observe(None, beat(160, 5, 0, loop_tick=100), now=160).dead
    assert liveness.observe(None, beat(161, 5, 0, loop_tick=100), now=161).reason == (
        "the model's event loop has run nothing for 61 s"
    )


def test_unfinished_work_with_no_step_for_stall_s_is_dead_an_idle_engine_is_not():
    stuck, idle = Liveness(stall_s=60), Liveness(stall_s=60)
    for t in range(0, 61, 10):
        assert not stuck.observe(None, beat(t, steps=7, unfinished=3), now=t).dead
        assert not idle.observe(None, beat(t, steps=7, unfinished=0), now=t).dead
    verdict = stuck.observe(None, beat(61, steps=7, unfinished=3), now=61)
    assert verdict.dead and verdict.reason == "the engine ran no step for 61 s with 3 requests unfinished"
    assert not idle.observe(None, beat(61, steps=7, unfinished=0), now=61).dead
    # a step resets the clock
    moving = Liveness(stall_s=60)
    for t in range(0, 200, 30):
        assert not moving.observe(None, beat(t, steps=t // 60, unfinished=3), now=t).dead


def test_heartbeat_file_round_trip_and_malformed_files(tmp_path: Path):
    assert read_heartbeat(tmp_path) is None
    (tmp_path / HEARTBEAT_FILE).write_text('{"time": 1.5, "loop_tick": 1.0, "steps": 3, "unfinished": 2}')
    assert read_heartbeat(tmp_path) == Heartbeat(1.5, 1.0, 3, 2, None)
    (tmp_path / HEARTBEAT_FILE).write_text('{"time": 1, "loop_tick": 1, "steps": 3, "unfinished": 2, "pid": 42}')
    assert read_heartbeat(tmp_path) == Heartbeat(1.0, 1.0, 3, 2, None, 42)
    for bad in ("{", "[]", '{"time": 1}', '{"time": "x", "loop_tick": 1, "steps": 1, "unfinished": 0}'):
        (tmp_path / HEARTBEAT_FILE).write_text(bad)
        assert read_heartbeat(tmp_path) is None, bad


def test_restart_budget_backs_off_and_caps_restarts_per_window():
    budget = RestartBudget(max_per_window=3, window_s=60, base_s=0.5, max_s=1.5)
    delays = []
    for now in (0.0, 1.0, 2.0):
        delays.append(budget.delay(now))
        budget.record(now)
    assert delays == [0.5, 1.0, 1.5]  # doubling, capped at max_s
    assert budget.delay(30.0) is None  # a fourth within the minute: give up
    assert budget.delay(60.5) == 1.5 and budget.recent == 2  # the first left the window
    assert budget.delay(62.5) == 0.5 and budget.recent == 0


def test_a_zero_budget_never_restarts():
    assert RestartBudget(max_per_window=0).delay(0.0) is None


class SpareGivenUp:
    """What serve_loop._supervise needs of its children once the budget is spent: nothing runs any more."""

    def __init__(self) -> None:
        self.servers: dict = {}
        self.dropped: list[str] = []

    def others(self) -> dict:
        return {}

    def drop_standby(self, reason: str) -> None:
        self.dropped.append(reason)


def test_past_the_budget_a_failing_spare_is_dropped_but_a_failing_server_stops_serve():
    stop = threading.Event()
    stop.set()  # the watch that follows returns at once
    children = SpareGivenUp()
    spare = Failure(STANDBY, "the standby tritonserver exited (code -9)")
    assert _supervise(children, stop, RestartBudget(max_per_window=0), (), 0.01, 60.0, spare) is None  # type: ignore[arg-type]
    assert children.dropped == [spare.reason]
    served = Failure(TRITON, "tritonserver exited (code -9)")
    assert _supervise(children, stop, RestartBudget(max_per_window=0), (), 0.01, 60.0, served) is served  # type: ignore[arg-type]
    assert children.dropped == [spare.reason]
