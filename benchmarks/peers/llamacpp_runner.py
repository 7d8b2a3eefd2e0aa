"""Runs inside benchmarks/.venvs/llamacpp: llama.cpp in-process (llama-cpp-python), single stream.

    python llamacpp_runner.py SPEC.json OUT.json

SPEC: {"gguf": path, "prompts": [[ids]], "max_tokens": n, "threads": 2, "n_ctx": 2048,
"warmup": 1}. Greedy, EOS ignored (the token loop stops only at max_tokens). Writes one
record per prompt: perf_counter start, per-token times, end. Standalone: no project imports.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import llama_cpp


def timed(llm: llama_cpp.Llama, prompt: list[int], max_tokens: int) -> dict:
    llm.reset()  # n_tokens = 0: no prefix reuse from the previous prompt, a full prefill every time
    start = time.perf_counter()
    times = []
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens:
            break
    return {"start": start, "chunk_times": times, "end": time.perf_counter(), "prompt_tokens": len(prompt)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=spec.get("n_ctx", 2048), n_threads=spec.get("threads", 2),
                          n_threads_batch=spec.get("threads", 2), n_batch=512, verbose=False)  # fmt: skip
    for prompt in spec["prompts"][: spec.get("warmup", 1)]:
        timed(llm, prompt, 4)
    records = [timed(llm, p, spec["max_tokens"]) for p in spec["prompts"]]
    info = {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()}
    Path(sys.argv[2]).write_text(json.dumps({"records": records, "info": info}))


if __name__ == "__main__":
    main()
