"""Greedy output equivalence, token by token: trtserve vs HF eager on the benchmark prompts.

trtserve runs the prompts together (in-flight batching, as served) and, when a server is up,
the served text over Triton's /generate is compared too. At a divergence the HF top-2 logit
margin at that position is reported: fp32 rounding can flip a near-tie, nothing else should.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.client import Endpoint
from benchmarks.datasets import BenchRequest
from benchmarks.hf_baseline import greedy_ids
from runtime import LLM, SamplingParams


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(model, ids: Sequence[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def served_text(endpoint: Endpoint, req: BenchRequest, max_tokens: int) -> str:
    body = {"text_input": req.prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(f"{endpoint.url}/v2/models/{endpoint.model}/generate",
                                     data=json.dumps(body).encode(), method="POST")  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["text_output"]


def check(
    engine_dir: Path, hf_model, tokenizer, requests: Sequence[BenchRequest], max_tokens: int,
    endpoint: Endpoint | None = None,
) -> dict:  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = LLM(engine_dir).generate([list(r.prompt_ids) for r in requests], params)
    rows = []
    for req, out in zip(requests, ours, strict=True):
        ref = greedy_ids(hf_model, req.prompt_ids, max_tokens)
        at = first_divergence(out.token_ids, ref)
        row = {"prompt_tokens": len(req.prompt_ids), "tokens": max_tokens, "identical": at is None}
        if at is not None:
            row["first_divergence"] = at
            row["hf_top2_margin_there"] = round(top2_margin(hf_model, [*req.prompt_ids, *ref[:at]]), 5)
        if endpoint is not None:
            row["served_text_identical"] = served_text(endpoint, req, max_tokens) == tokenizer.decode(ref)
        rows.append(row)
    return {
        "prompts": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "served_identical": sum(r.get("served_text_identical", False) for r in rows) if endpoint else None,
        "rows": rows,
    }
