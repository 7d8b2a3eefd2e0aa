"""EngineArgs: how an engine is sized and scheduled (validated at construction), each setting declared once:
the Python API takes the dataclass, `trtserve serve`/`generate` derive their options from its fields
(runtime/cli_options.py), and the Triton model reads them from config.pbtxt parameters of the same names
(to_parameters / from_parameters)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from executors import BACKENDS

# Inter-token latency target (ms): the longest gap a decoding stream should see; a step that carries
# decodes takes only the prefill its learned cost keeps within it. 200 = the goodput TPOT objective,
# so a stream whose gaps are on target meets it by construction, with 50 ms left under the ITL p99
# <= 250 ms objective for prediction error and the server. SmolLM2-135M on the 2-core Xeon
# (benchmarks/results/slo.md): ITL p99 206 / 211 / 245 ms at 8 / 16 / 32 streams, c=32 throughput 105%
# of the fixed budget's. 150 left prefill under half of a step from 16 streams (c=32: 86%).
DEFAULT_ITL_TARGET_MS = 200.0
# Prefill a step carries however busy decoding is, so prompts progress. In tokens, so its time
# scales with the machine: 96 gained ~1.5% throughput at c=32 on the Xeon, but on a 2x slower CPU
# it alone made steps ~250 ms; 64 stays.
DEFAULT_MIN_PREFILL_TOKENS = 64
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DRAFT_MIN_CONFIDENCE = 0.0  # measured in benchmarks/results/spec_decode.md
# Shortest prompt-lookup match the `draft` method takes instead of its draft model's guess (runtime/engine/
# spec/lookup_first.py): 3 measured best on chat (2 and 4 both lost ~0.1x of decode speed-up).
DEFAULT_DRAFT_PROMPT_LOOKUP_MIN = 3
# Measured through tritonserver at concurrency 4 (benchmarks/results/spec_decode_*_c4.md): n-gram drafts
# still pay (copy-heavy 1.6x, chat 1.05x); an INT4 draft engine of the same model costs 13-17% (its steps
# for several requests and its catch-up on each new prompt outweigh the tokens it saves), so it drafts
# for a lone request only.
DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE = {"ngram": 4, "draft": 1}
SPECULATIVE_METHODS = ("ngram", "draft")
# Structured output: the longest a grammar may take to compile before its request is refused. The 20 test schemas
# compile in 2 ms median, 6 ms at most, on SmolLM2's vocabulary (benchmarks/results/grammar_engines.md).
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# Prefill/decode disaggregation (runtime/engine/disagg.py): what a worker does with KV handles.
ROLES = ("both", "prefill", "decode")
# How long a prefill worker keeps a handed-off request's blocks pinned for its decode worker: a read normally
# ends in milliseconds; the pin outlives a gateway's pick and a decode worker's wait for free blocks.
DEFAULT_KV_PIN_TIMEOUT_S = 30.0
# The KV cache's disk tier, when a directory is given: bounded, so a shared cache directory cannot fill a disk.
DEFAULT_KV_DISK_CACHE_GB = 16.0
# LoRA: adapters one step mixes (slots), and the highest rank (vLLM's default too).
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
DISABLE_BATCH_SIZE_DEFAULTS = ", ".join(f"{n} with {m}" for m, n in DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE.items())


def setting(
    default: Any,
    help: str,
    flag: str | None = None,
    choices: tuple[str, ...] = (),
    lo: float | None = None,
    hi: float | None = None,
    served: bool = True,
    only_with: str | None = None,
    repeat: bool = False,
) -> Any:
    """An EngineArgs field, declared once with what its users need: `help` (the CLI's and config.pbtxt's), the
    command-line `flag` (default: --the-field-name; a bool: --flag/--no-flag), `choices` for strings, the
    bounds `lo` and `hi` for numbers, whether `trtserve serve` passes it to its model (`served`), and `only_with`:
    the setting it means nothing without ("speculative", or "speculative=draft"), so that giving it alone
    is a usage error rather than silently ignored. `repeat`: a text setting the command line takes several
    times, joined with commas."""
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "lo": lo,
        "hi": hi,
        "served": served,
        "only_with": only_with,
        "repeat": repeat,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineArgs:
    """How an engine is sized and scheduled. Each field is a setting of the Python API, of `trtserve serve`
    and `generate` (click options derived from these fields), and of the Triton model (a config.pbtxt
    parameter of the same name): add one here and every door has it."""

    num_kv_blocks: int | None = setting(None, "KV cache size in blocks (default: max_batch_size sequences of "
                                        "max_seq_len).", lo=1)  # fmt: skip
    max_num_seqs: int | None = setting(None, "Most requests batched at once (default and cap: the engine's "
                                       "max_batch_size).", lo=1)  # fmt: skip
    max_num_batched_tokens: int = setting(512, "Per-step token budget (decodes + prefill chunks).", lo=1)
    enable_prefix_caching: bool = setting(True, "Reuse the KV blocks of shared prompt prefixes.",
                                          flag="--prefix-caching/--no-prefix-caching")  # fmt: skip
    max_waiting: int = setting(1024, "Waiting-queue bound; beyond it requests are refused as overloaded.", lo=1)
    threads: int | None = setting(None, "Backend compute threads (default: every usable core).", lo=1, served=False)
    backend: str | None = setting(None, "Executor (default: TensorRT for TensorRT engines where installed, else torch "
                                  "on a GPU, else cpu-bf16 on CPUs with AMX for engines verified on it, else "
                                  "cpu). cpu-bf16: the CPU kernel backend with bfloat16 dense layers (oneDNN, AMX): "
                                  "faster, HF-bf16 numerics; cpu: float32.", choices=BACKENDS)  # fmt: skip
    dtype: str | None = setting(None, "The torch backend's compute dtype (default: the engine's), e.g. bfloat16 "
                                "over a float32 engine's weights.",
                                choices=("float32", "float16", "bfloat16"))  # fmt: skip
    itl_target_ms: float | None = setting(DEFAULT_ITL_TARGET_MS, "Inter-token latency target (ms): while requests "
                                          "decode, a step carries only the prefill its learned cost keeps within it; "
                                          "0: none (the fixed token budget).", lo=0)  # fmt: skip
    min_prefill_tokens: int = setting(DEFAULT_MIN_PREFILL_TOKENS, "Prompt tokens every step may carry however busy "
                                      "decoding is.", lo=1)  # fmt: skip
    speculative: str | None = setting(None, "Speculative decoding: 'ngram' proposes the tokens that followed the "
                                      "latest earlier occurrence of the text's last words (prompt lookup); 'draft' "
                                      "lets --draft-engine (same tokenizer) propose. Greedy output is unchanged; "
                                      "sampled output keeps the model's distribution.",
                                      choices=SPECULATIVE_METHODS)  # fmt: skip
    draft_engine: str | None = setting(None, "Engine directory of the draft model, e.g. an INT4 build of the same "
                                       "model.", only_with="speculative=draft")  # fmt: skip
    draft_backend: str | None = setting(None, "The draft engine's executor (default: as for the target).",
                                        choices=BACKENDS, only_with="speculative=draft")  # fmt: skip
    num_speculative_tokens: int = setting(4, "Draft tokens verified per step.", lo=1, hi=MAX_SPECULATIVE_TOKENS,
                                          only_with="speculative")  # fmt: skip
    draft_min_confidence: float = setting(DEFAULT_DRAFT_MIN_CONFIDENCE, "A draft engine stops proposing for a "
                                          "request at its first guess below this probability.", lo=0,
                                          only_with="speculative=draft")  # fmt: skip
    draft_prompt_lookup_min: int = setting(DEFAULT_DRAFT_PROMPT_LOOKUP_MIN, "A request whose text ends in this many or "
                                           "more tokens seen earlier in it takes the prompt-lookup guess, free, "
                                           "instead of the draft model's; 0: the draft model always.", lo=0,
                                           only_with="speculative=draft")  # fmt: skip
    ngram_prompt_lookup_min: int = setting(1, "Shortest suffix the n-gram proposer matches.", lo=1,
                                           only_with="speculative=ngram")  # fmt: skip
    ngram_prompt_lookup_max: int = setting(4, "Longest suffix the n-gram proposer matches (tried first).", lo=1,
                                           only_with="speculative=ngram")  # fmt: skip
    speculative_disable_batch_size: int | None = setting(None, "Speculation pauses while more requests than this run "
                                                         f"or wait (default: {DISABLE_BATCH_SIZE_DEFAULTS}, as "
                                                         "measured).", lo=1, only_with="speculative")  # fmt: skip
    speculative_adaptive: bool = setting(True, "Speculate only where measured steps with drafts cost less per emitted "
                                         "token than steps without (per batch size); off: always.",
                                         flag="--speculative-adaptive/--no-speculative-adaptive",
                                         only_with="speculative")  # fmt: skip
    overlap_scheduling: bool = setting(True, "Schedule and pack the next step while the device computes this one "
                                       "(backends that sample on their device; steps run one by one while a "
                                       "request uses penalties, logprobs or speculation).",
                                       flag="--overlap-scheduling/--no-overlap-scheduling")  # fmt: skip
    engine_process: bool = setting(
        True,
        "AsyncLLM and the served model: run the engine core (scheduler, KV cache, backend, KV transfers) in a "
        "process of its own, so that its steps never wait for the text and the streams of the serving one.",
        flag="--engine-process/--no-engine-process",
    )
    role: str = setting("both", "Prefill/decode disaggregation: 'prefill' runs prompts and hands their KV on (pinned "
                        "until read), 'decode' reads KV from prefill workers (NIXL) and decodes; 'both' does "
                        "whole requests.", choices=ROLES)  # fmt: skip
    kv_pin_timeout_s: float = setting(DEFAULT_KV_PIN_TIMEOUT_S, "Seconds a prefill worker keeps a handed-off "
                                      "request's KV blocks pinned unless a decode worker reads them first.",
                                      flag="--kv-pin-timeout", lo=0.001)  # fmt: skip
    kv_host_cache_gb: float = setting(
        0.0,
        "Host-memory tier behind the prefix cache, in GiB (fractions allowed): "
        "full blocks computed are kept there too and read back on a later miss "
        "instead of recomputed. 0 (default): none; a CPU backend's pool is host "
        "memory already, so there a larger --num-kv-blocks serves better.",
        lo=0,
    )
    kv_disk_cache: str | None = setting(
        None,
        "Directory of a disk tier below the host tier (or below the pool "
        "without one): blocks kept across restarts and shared by the replicas "
        "using the same directory (default: none).",
    )
    kv_disk_cache_gb: float = setting(
        DEFAULT_KV_DISK_CACHE_GB,
        "Most GiB of blocks the disk tier keeps (oldest deleted first).",
        lo=0.001,
        only_with="kv_disk_cache",
    )
    enable_lora: bool = setting(
        False,
        "Serve LoRA adapters on the base model (implied by --lora): requests pick one "
        "by name, and adapters may be loaded and removed at run time.",
        flag="--enable-lora/--no-enable-lora",
    )
    lora_modules: str | None = setting(
        None,
        "LoRA adapters to serve: NAME=DIR, DIR a PEFT adapter "
        "(adapter_config.json, adapter_model.safetensors); repeat the flag, or separate "
        "them with commas.",
        flag="--lora",
        repeat=True,
    )
    max_loras: int = setting(
        DEFAULT_MAX_LORAS, "LoRA adapters one step may mix (slots; the least recently used idle one is replaced).", lo=1
    )
    max_lora_rank: int = setting(
        DEFAULT_MAX_LORA_RANK, "Highest LoRA rank served; adapters above it are refused.", lo=1
    )
    max_cpu_loras: int | None = setting(
        None,
        "LoRA adapters kept in host memory (default: as many as --max-loras or "
        "--lora gives, the larger); the others are read again when asked for.",
        lo=1,
    )
    stream_interval: int = setting(1, "Tokens per streamed response, the first and last at once; fewer responses cost "
                                   "the server less (a request may ask for more).", lo=1)  # fmt: skip
    grammar_compile_timeout_s: float = setting(DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, "Longest a structured-output "
                                               "grammar (guided_json, response_format, tools, ...) may take to "
                                               "compile; slower ones are refused. Compiles run off the engine "
                                               "loop, once per distinct grammar.", lo=0)  # fmt: skip

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or self.lora_modules is not None

    def lora_adapters(self) -> dict[str, str]:
        """lora_modules as {name: directory}; ValueError for a malformed or repeated entry."""
        adapters: dict[str, str] = {}
        for entry in (self.lora_modules or "").split(","):
            if not entry.strip():
                continue
            name, sep, path = (part.strip() for part in entry.partition("="))
            if not sep or not name or not path:
                raise ValueError(f"EngineArgs.lora_modules: {entry.strip()!r} must be NAME=DIR")
            if name in adapters:
                raise ValueError(f"EngineArgs.lora_modules: adapter {name!r} is given twice")
            adapters[name] = path
        return adapters

    @property
    def disable_batch_size(self) -> int:
        """speculative_disable_batch_size, or the speculative method's default."""
        if self.speculative_disable_batch_size is not None:
            return self.speculative_disable_batch_size
        return DEFAULT_SPECULATIVE_DISABLE_BATCH_SIZE[self.speculative or "ngram"]

    def __post_init__(self) -> None:
        if self.itl_target_ms == 0:  # as the settings say: no target
            object.__setattr__(self, "itl_target_ms", None)
        names = (
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
            "threads",
            "min_prefill_tokens",
            "num_speculative_tokens",
            "ngram_prompt_lookup_min",
            "ngram_prompt_lookup_max",
            "speculative_disable_batch_size",
            "stream_interval",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
        )
        for name in names:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineArgs.{name} must be a positive integer (got {value!r})")
        target = self.itl_target_ms
        if target is not None and (not isinstance(target, int | float) or not 0 < target < math.inf):
            raise ValueError(f"EngineArgs.itl_target_ms must be a positive number of ms or None (got {target!r})")
        for name in ("backend", "draft_backend"):
            if getattr(self, name) not in (None, *BACKENDS):
                choices = ", ".join(BACKENDS)
                raise ValueError(f"EngineArgs.{name} must be one of {choices} (got {getattr(self, name)!r})")
        if self.role not in ROLES:
            raise ValueError(f"EngineArgs.role must be one of {', '.join(ROLES)} (got {self.role!r})")
        if self.engine_process not in (True, False):
            raise ValueError(f"EngineArgs.engine_process must be a bool (got {self.engine_process!r})")
        pin = self.kv_pin_timeout_s
        if not isinstance(pin, int | float) or isinstance(pin, bool) or not 0 < pin < math.inf:
            raise ValueError(f"EngineArgs.kv_pin_timeout_s must be a positive number of seconds (got {pin!r})")
        for name in ("kv_host_cache_gb", "kv_disk_cache_gb"):
            size = getattr(self, name)
            if not isinstance(size, int | float) or isinstance(size, bool) or not 0 <= size < math.inf:
                raise ValueError(f"EngineArgs.{name} must be a number of GiB >= 0 (got {size!r})")
        if self.kv_disk_cache_gb == 0:
            raise ValueError("EngineArgs.kv_disk_cache_gb must be > 0 (leave kv_disk_cache unset for no disk tier)")
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"EngineArgs.speculative must be 'ngram', 'draft' or None (got {self.speculative!r})")
        if self.speculative == "draft" and self.draft_engine is None:
            raise ValueError("EngineArgs.speculative draft needs EngineArgs.draft_engine (the draft model's engine)")
        if self.speculative != "draft" and self.draft_engine is not None:
            raise ValueError("EngineArgs.draft_engine is only used with EngineArgs.speculative draft")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"EngineArgs.speculative_adaptive must be a bool (got {self.speculative_adaptive!r})")
        if not isinstance(self.draft_min_confidence, int | float) or not 0 <= self.draft_min_confidence < 1:
            raise ValueError(f"EngineArgs.draft_min_confidence must be in [0, 1) (got {self.draft_min_confidence!r})")
        lookup = self.draft_prompt_lookup_min
        if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 0:
            raise ValueError(f"EngineArgs.draft_prompt_lookup_min must be an integer >= 0 (got {lookup!r})")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"EngineArgs.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        timeout = self.grammar_compile_timeout_s
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
            raise ValueError(f"EngineArgs.grammar_compile_timeout_s must be a positive number (got {timeout!r})")
        self.lora_adapters()  # NAME=DIR pairs well formed
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("EngineArgs.ngram_prompt_lookup_min must be <= ngram_prompt_lookup_max")


def served_settings() -> list[dataclasses.Field[Any]]:
    """The EngineArgs fields a served model takes as config.pbtxt parameters."""
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("served", True)]


def to_parameters(args: EngineArgs) -> dict[str, str]:
    """The settings that differ from their defaults, as the Triton model's config parameters (strings)."""
    params = {}
    for f in served_settings():
        value = getattr(args, f.name)
        if value != f.default:
            params[f.name] = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return params


def from_parameters(params: Mapping[str, str]) -> EngineArgs:
    """EngineArgs from the model's config parameters (strings; empty or absent: the default, "none": None where
    a setting may be unset); ValueError naming the parameter and what it must be."""
    values: dict[str, Any] = {}
    for f in served_settings():
        text = params.get(f.name, "").strip()
        if text:
            values[f.name] = _parse(f, text)
    try:
        return EngineArgs(**values)
    except ValueError as exc:
        raise ValueError(f"config parameter: {exc}") from None


def _parse(setting: dataclasses.Field[Any], text: str) -> Any:
    kind = str(setting.type)
    if text.lower() == "none" and "None" in kind:
        return None
    try:
        if kind.startswith("bool"):
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise ValueError(f"config parameter '{setting.name}' must be {kind.split(' ')[0]} (got {text!r})") from None
    return text
