"""The eager PyTorch baseline: HF `generate`, sequential or static batches, timed per token."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from benchmarks.metrics import RequestRecord


class StepClock(LogitsProcessor):
    """Records a timestamp each time `generate` produces a token (for the whole batch)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate_timed(model, group: Sequence[Sequence[int]], output_len: int) -> tuple[float, list[float], float]:
    """One greedy `generate` over `group` (left-padded with id 0), exactly output_len new tokens
    (EOS ignored). Returns (start, time of each generated token, end)."""
    width = max(len(p) for p in group)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in group])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
    clock = StepClock()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))  # fmt: skip
    return start, clock.times, time.perf_counter()


def run(model, prompts: Sequence[Sequence[int]], output_len: int, batch: int) -> tuple[list[RequestRecord], float]:
    """HF generate over `prompts` in batches of `batch`, one batch after another. Each request's
    timings count from its own batch's start. Returns (records, wall time)."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        start, times, end = generate_timed(model, group, output_len)
        for p in group:
            records.append(RequestRecord(start, list(times), [1] * len(times), end, len(p)))
    return records, time.perf_counter() - t0


def greedy_ids(model, prompt: Sequence[int], output_len: int) -> list[int]:
    """Greedy continuation token ids (EOS ignored), for the output-equivalence check."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
