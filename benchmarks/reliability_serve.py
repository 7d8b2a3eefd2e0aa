"""`trtserve serve` as a user starts it, watched from outside: its output, its processes, their memory, crashes.

The benchmark learns everything the way an operator would: serve's printed lines (ready, "restarted: serving
again N s after the failure was seen", errors), /proc (serve's children: tritonserver, whose session holds the
Python-backend stubs, and the gateway; their RSS; the log file each writes to, its stdout), the Triton and
gateway logs ("Fatal Python error": the stub's faulthandler on a fatal signal), and the kernel log (segfaults
and general protection faults of our processes, told apart from other users' of this machine by pid).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.cpu import session_cpu_s, session_pids
from runtime.serve.launcher import free_port
from runtime.serve.serve_loop import CRASH_MARKER

TRTSERVE = Path(sys.executable).parent / "trtserve"
SERVE_ARGS = ("--max-num-seqs", "32", "--num-kv-blocks", "1024")
RESTARTED = re.compile(r"^(?P<child>.+) restarted: serving again (?P<seconds>[\d.]+) s after the failure was seen")
KERNEL_LINE = re.compile(r"^\[\s*(?P<t>\d+\.\d+)\]\s*(?P<text>.*)$")
KERNEL_PID = re.compile(r"(?P<comm>[\w.-]+)\[(?P<pid>\d+)\]")
STUB = "triton_python_backend_stub"
MODEL_STUB = "/models/llm/1/model.py"  # the served model's stub (llm_infer's adapters have their own)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def stdout_path(pid: int) -> Path | None:
    """The file a process writes its stdout to (tritonserver's and the gateway's logs)."""
    with contextlib.suppress(OSError):
        return Path(os.readlink(f"/proc/{pid}/fd/1"))
    return None


class Serve:
    """`trtserve serve --engine DIR --max-num-seqs 32 --num-kv-blocks 1024 [--backend B]` on free ports (`args`
    in place of the sizing options: benchmarks.decode_chat's `--max-num-seqs 32 --max-num-batched-tokens 512`)."""

    def __init__(self, engine: Path, backend: str | None, log_path: Path, extra: Sequence[str] = (),
                 args: Sequence[str] = SERVE_ARGS) -> None:  # fmt: skip
        self.ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
        self.command = [str(TRTSERVE), "serve", "--engine", str(engine), *args,
                        *(["--backend", backend] if backend else []), *extra,
                        *(f"--{name}-port={port}" for name, port in self.ports.items())]  # fmt: skip
        self.lines: list[tuple[float, str]] = []  # (time.monotonic(), line)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by the reader thread
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._log.write(line)
            self._log.flush()
        self._log.close()

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['openai']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds until serve printed its OpenAI endpoint; raises with its output if it exits or times out."""
        start = time.monotonic()
        while not any(line.lstrip().startswith("OpenAI ") for _, line in self.lines):
            if self.process.poll() is not None or time.monotonic() - start > timeout_s:
                time.sleep(0.5)
                raise RuntimeError("trtserve serve did not become ready:\n" + "\n".join(line for _, line in self.lines))
            time.sleep(0.2)
        return round(time.monotonic() - start, 1)

    def children(self, name: str) -> list[int]:
        """The pids of serve's `name` children now ("tritonserver", with a warm spare's; or "gateway")."""
        marker = "runtime.gateway" if name == "gateway" else "/tritonserver "
        return [pid for pid in _children(self.process.pid) if marker in _cmdline(pid)]

    def child(self, name: str) -> int | None:
        """The pid of serve's `name` child now: "gateway", or "tritonserver": the one serving, which with a warm
        spare (--standby) is the one whose processes used the most CPU over the last second (the gateway keeps
        one of the two busy, and the other idle)."""
        pids = self.children(name)
        if len(pids) < 2:
            return pids[0] if pids else None
        before = {pid: session_cpu_s(pid) for pid in pids}
        time.sleep(1.0)
        return max(pids, key=lambda pid: session_cpu_s(pid) - before[pid])

    def model_stub(self) -> int | None:
        """The `llm` stub of the tritonserver serving now."""
        triton = self.child("tritonserver")
        if triton is None:
            return None
        return next((pid for pid in _children(triton) if MODEL_STUB in _cmdline(pid)), None)

    def restarts(self) -> list[tuple[float, str, float]]:
        """(when printed, child, serve's "serving again" seconds) of every restart line."""
        return [(t, m["child"], float(m["seconds"])) for t, line in self.lines if (m := RESTARTED.match(line))]

    def logged_paths(self) -> list[Path]:
        """Log paths serve printed (its first tritonserver's and gateway's, and any crash report's)."""
        paths = re.findall(r"(/\S+?\.log)\b", "\n".join(line for _, line in self.lines))
        return [Path(p) for p in dict.fromkeys(paths)]

    def terminate(self, timeout_s: float = 120.0) -> tuple[int | None, float]:
        """SIGTERM, as an orchestrator stops it: (exit code, seconds to exit); None if it had to be killed."""
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            self.kill_all()
        return code, round(time.monotonic() - start, 1)

    def kill_all(self) -> None:
        """Last resort after a failure of ours: serve, and the children it started, by pid."""
        for pid in [*self.children("tritonserver"), *self.children("gateway")]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each child leads its own session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@dataclass
class Watch:
    """Samples serve's processes every `interval_s` in a thread: RSS (peak of the sum and per part), CPU time, the
    pids and log files seen (a restarted tritonserver or gateway writes a new log that serve does not print)."""

    serve: Serve
    interval_s: float = 1.0
    peaks: dict[str, int] = field(default_factory=lambda: {"tritonserver": 0, "stubs": 0, "gateway": 0, "total": 0})
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, tritonserver, stubs, gateway)
    pids: set[int] = field(default_factory=set)
    logs: set[Path] = field(default_factory=set)
    ticks: dict[int, int] = field(default_factory=dict)  # pid -> its CPU ticks when last seen
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, t0: float) -> Watch:
        self.t0 = t0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        parts = {"tritonserver": 0, "stubs": 0, "gateway": 0}
        supervisor = self.serve.process.pid
        self.ticks[supervisor] = max(self.ticks.get(supervisor, 0), cpu_ticks(supervisor))
        for name, pid in [(child, pid) for child in ("tritonserver", "gateway") for pid in self.serve.children(child)]:
            if (log := stdout_path(pid)) is not None:
                self.logs.add(log)
            for member in session_pids(pid) if name == "tritonserver" else [pid]:
                self.pids.add(member)
                self.ticks[member] = max(self.ticks.get(member, 0), cpu_ticks(member))
                part = "stubs" if STUB in _cmdline(member) else name
                parts[part] += rss_bytes(member)
        total = sum(parts.values())
        for part, value in {**parts, "total": total}.items():
            self.peaks[part] = max(self.peaks[part], value)
        self.timeline.append((round(time.monotonic() - self.t0, 1), parts["tritonserver"], parts["stubs"],
                              parts["gateway"]))  # fmt: skip

    @property
    def cpu_s(self) -> float:
        """CPU seconds of serve and every child of it seen (up to its last sample: a killed one's last second is
        missed)."""
        return sum(self.ticks.values()) / os.sysconf("SC_CLK_TCK")


def fatal_errors(logs: Iterable[Path]) -> dict[str, int]:
    """Log path -> lines with "Fatal Python error" (unreadable logs are skipped)."""
    out = {}
    for log in logs:
        with contextlib.suppress(OSError):
            out[str(log)] = sum(CRASH_MARKER in line for line in log.read_text(errors="replace").splitlines())
    return out


def uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def kernel_crashes(dmesg: str, since_uptime_s: float, pids: set[int]) -> tuple[list[str], list[str]]:
    """Kernel-log lines after `since_uptime_s` reporting a segfault or general protection fault of a triton or
    python process: (ours, by pid; other processes')."""
    ours, others = [], []
    for line in dmesg.splitlines():
        m = KERNEL_LINE.match(line)
        if not m or float(m["t"]) < since_uptime_s:
            continue
        text = m["text"]
        if not re.search(r"segfault|general protection", text) or not re.search(r"triton|python", text, re.I):
            continue
        who = KERNEL_PID.search(text)
        (ours if who and int(who["pid"]) in pids else others).append(line.strip())
    return ours, others


def read_dmesg() -> str | None:
    """The kernel log, or None where it cannot be read here."""
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None
