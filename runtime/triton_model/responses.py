"""What the `llm` model answers, as numpy arrays per output (the contract's OUTPUTS), built only for the
outputs a request asked for: unrequested ones are never computed, and never handed to the Python backend
(which drops them after releasing the GIL; freeing their arrays there corrupted the stub's heap)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

import numpy as np

from engine_format.requests import OUTPUT_NAMES
from runtime.engine.outputs import RequestOutput, TokenLogprobs


def output_arrays(wanted: Collection[str], text: str, delta: RequestOutput,
                  logprobs: list[TokenLogprobs] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The outputs in `wanted` (empty: all) for a response carrying `text`, with `delta`'s finish reason and
    counts; `logprobs`: the response's (default: the delta's)."""
    build: dict[str, Callable[[], np.ndarray]] = {
        "text_output": lambda: np.array([text.encode("utf-8")], dtype=np.object_),
        "finish_reason": lambda: np.array([(delta.finish_reason or "").encode()], dtype=np.object_),
        "prompt_tokens": lambda: np.array([delta.num_prompt_tokens], dtype=np.int32),
        "completion_tokens": lambda: np.array([delta.num_output_tokens], dtype=np.int32),
        "logprobs": lambda: np.array(
            [logprobs_json(logprobs if logprobs is not None else delta.logprobs).encode()], dtype=np.object_
        ),
        "kv_handle": lambda: np.array([(delta.kv_handle or "").encode()], dtype=np.object_),
    }
    assert tuple(build) == OUTPUT_NAMES, "every output of the contract, in its order"
    return {name: make() for name, make in build.items() if not wanted or name in wanted}


def logprobs_json(logprobs: list[TokenLogprobs] | None) -> str:
    """Each token's text, log-probability and alternatives (texts rendered by the engine)."""
    return json.dumps([
        {"token_id": lp.token_id, "token": lp.texts.get(lp.token_id, ""), "logprob": lp.logprob,
         "top": [[t, v, lp.texts.get(t, "")] for t, v in lp.top]}
        for lp in logprobs or []
    ])  # fmt: skip
