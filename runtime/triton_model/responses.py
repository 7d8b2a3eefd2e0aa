"""What the `llm` model answers, as numpy arrays per output (the contract's OUTPUTS), built only for the
outputs a request asked for: unrequested ones are never computed, and never handed to the Python backend
(which drops them after releasing the GIL; freeing their arrays there corrupted the stub's heap)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence

import numpy as np

from engine_format.requests import OUTPUT_NAMES
from runtime.engine.outputs import RequestOutput, TokenLogprobs


def output_arrays(wanted: Collection[str], text: str, delta: RequestOutput,
                  logprobs: list[TokenLogprobs] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The outputs in `wanted` (empty: all) for a response carrying `text`, with `delta`'s finish reason and
    counts; `logprobs`: the response's (default: the delta's). Every streamed delta of every request comes
    through here on the model's event loop: the builders are module functions, not made per call."""
    return {name: build(text, delta, logprobs) for name, build in _BUILDERS if not wanted or name in wanted}


def _object(value: bytes) -> np.ndarray:
    out = np.empty(1, dtype=np.object_)
    out[0] = value
    return out


Build = Callable[[str, RequestOutput, "list[TokenLogprobs] | None"], np.ndarray]
_BUILDERS: tuple[tuple[str, Build], ...] = (
    ("text_output", lambda text, delta, lp: _object(text.encode("utf-8"))),
    ("finish_reason", lambda text, delta, lp: _object((delta.finish_reason or "").encode())),
    ("prompt_tokens", lambda text, delta, lp: np.array([delta.num_prompt_tokens], dtype=np.int32)),
    ("completion_tokens", lambda text, delta, lp: np.array([delta.num_output_tokens], dtype=np.int32)),
    ("logprobs", lambda text, delta, lp: _object(logprobs_json(lp if lp is not None else delta.logprobs).encode())),
    ("prompt_logprobs", lambda text, delta, lp: _object(logprobs_json(delta.prompt_logprobs).encode())),
    ("kv_handle", lambda text, delta, lp: _object((delta.kv_handle or "").encode())),
    ("token_ids", lambda text, delta, lp: np.array(delta.token_ids, dtype=np.int32)),
)
assert tuple(name for name, _ in _BUILDERS) == OUTPUT_NAMES, "every output of the contract, in its order"


def logprobs_json(logprobs: Sequence[TokenLogprobs | None] | None) -> str:
    """Each token's text, log-probability and alternatives (texts rendered by the engine); null for a token
    without (a prompt's first)."""
    return json.dumps([
        None if lp is None else
        {"token_id": lp.token_id, "token": lp.texts.get(lp.token_id, ""), "logprob": lp.logprob,
         "top": [[t, v, lp.texts.get(t, "")] for t, v in lp.top]}
        for lp in logprobs or []
    ])  # fmt: skip
