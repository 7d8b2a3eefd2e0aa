"""Runs inside benchmarks/.venvs/ortgenai: onnxruntime-genai, greedy, static batches.

    python ortgenai_runner.py SPEC.json OUT.json

SPEC: {"model_dir": path, "prompts": [[ids]], "max_tokens": n, "batch": b, "warmup": 1}.
Prompts run in batches of `batch`, left-padded with the pad id (setup.sh sets it to 0, not
<|im_end|>); min_length = max_length forces exactly max_tokens new tokens (EOS ignored).
Each batch step yields one token per sequence. Standalone: no project imports.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


def timed_batch(model: og.Model, group: list[list[int]], max_tokens: int, pad: int) -> tuple[float, list[float], float]:
    width = max(len(p) for p in group)
    ids = np.array([[pad] * (width - len(p)) + p for p in group], dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=len(group), max_length=width + max_tokens,
                              min_length=width + max_tokens)  # fmt: skip
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    times = []
    while len(times) < max_tokens and not generator.is_done():
        generator.generate_next_token()
        times.append(time.perf_counter())
    return start, times, time.perf_counter()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    config = json.loads((Path(spec["model_dir"]) / "genai_config.json").read_text())
    pad = int(config["model"]["pad_token_id"])
    model = og.Model(spec["model_dir"])
    batch, prompts = spec["batch"], spec["prompts"]
    timed_batch(model, prompts[:batch], 4, pad)  # warm-up
    records = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        start, times, end = timed_batch(model, group, spec["max_tokens"], pad)
        records += [{"start": start, "chunk_times": times, "end": end, "prompt_tokens": len(p)} for p in group]
    info = {"onnxruntime_genai": og.__version__, "pad_token_id": pad}
    Path(sys.argv[2]).write_text(json.dumps({"records": records, "info": info}))


if __name__ == "__main__":
    main()
