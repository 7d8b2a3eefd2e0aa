"""The wire between a front end and an engine core in a process of its own (core_process.py, core_client.py).

Messages are pickled tuples, framed by a multiprocessing Connection over a socket pair. Front end -> core:

    ("start", engine_dir, args, backend_factory)       first, once
    ("add", call_id, request_id, prompt, prompt_ids, params, resume_token_ids)
    ("abort", request_id, reason)                       its final output comes back as a step's would
    ("call", call_id, name, args)                       one of CALLS
    ("shutdown", drain_timeout_s)
    ("ack",)                                            an "out" message was turned into text: one more may come

Core -> front end:

    ("ready", EngineInfo) or ("failed", error)          after "start"
    ("out", steps, unfinished, packed outputs)          every step's and abort's outputs (merged while the
                                                        front end has CREDITS messages unanswered)
    ("reply", call_id, error or None, value)            a call's answer (a KV read's once it has ended: core_pulls.py)
    ("died", message)                                   the step loop failed; the core exits
    ("closed", final)                                   after "shutdown": drained, KV tiers written; `final`:
                                                        FINAL_CALLS' answers then (a model's last metrics)

A decode step's outputs are one token each for up to hundreds of requests (a few each when the core merged
steps for a front end behind it: core_outbox.py): they travel as columns (`pack_outputs`), ~10x cheaper to
pickle than the dataclasses; anything else (a finish, logprobs, an error) travels whole.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from runtime.engine.outputs import TokenOutput

# What a front end may call in the core by name ("call"): the engine's methods, or its parts' (dotted).
CALLS = frozenset(
    {
        "stats",
        "take_step_records",
        "grammars.take_compile_seconds",
        "add_lora",
        "remove_lora",
        "list_loras",
        "disagg.export",
        "disagg.expect",
        "disagg.pull",
        "disagg.forget",
        "disagg.stats",
        "disagg.take_pull_records",
        "check_invariants",
    }
)

# What a front end may still ask once its core has closed: the core answers them as it closes.
FINAL_CALLS = (
    "stats",
    "take_step_records",
    "grammars.take_compile_seconds",
    "list_loras",
    "disagg.stats",
    "disagg.take_pull_records",
)


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs of a core it cannot read: sizes for admission and limits."""

    context_tokens: int  # the most tokens one sequence holds
    capacity_tokens: int  # the KV pool's tokens
    pid: int


Packed = tuple[list[str], list[int], list[int], list[int], list[int], list[TokenOutput]]


def pack_outputs(outputs: list[TokenOutput]) -> Packed:
    """One message's outputs: the plain ones (tokens and counts, nothing else) as columns, the rest whole."""
    ids: list[str] = []
    tokens: list[int] = []  # every plain output's tokens, one after another
    lengths: list[int] = []  # how many of them each has (one, unless steps were merged: core_outbox.py)
    prompts: list[int] = []
    counts: list[int] = []
    whole: list[TokenOutput] = []
    for out in outputs:
        plain = (
            out.finish_reason is None
            and out.logprobs is None
            and out.prompt_logprobs is None
            and out.kv_handle is None
            and out.token_ids
        )
        if plain:
            ids.append(out.request_id)
            tokens += out.token_ids
            lengths.append(len(out.token_ids))
            prompts.append(out.num_prompt_tokens)
            counts.append(out.num_output_tokens)
        else:
            whole.append(out)
    return ids, tokens, lengths, prompts, counts, whole


def unpack_outputs(packed: Packed) -> list[TokenOutput]:
    """`pack_outputs` undone: the plain outputs first, then the whole ones (a request's finish after its token)."""
    ids, tokens, lengths, prompts, counts, whole = packed
    if len(tokens) != sum(lengths):
        raise ValueError(f"{len(tokens)} tokens for outputs of {sum(lengths)}")
    if len(tokens) == len(ids):  # one token each: a step's decodes
        plain = [
            TokenOutput(request_id, [token], None, prompt, count)
            for request_id, token, prompt, count in zip(ids, tokens, prompts, counts, strict=True)
        ]
    else:
        plain, start = [], 0
        for request_id, length, prompt, count in zip(ids, lengths, prompts, counts, strict=True):
            plain.append(TokenOutput(request_id, tokens[start : start + length], None, prompt, count))
            start += length
    return plain + whole if whole else plain


def error_state(exc: BaseException) -> tuple[str, str, str, dict[str, Any]]:
    """An exception as data: the request errors take their own constructor arguments, which pickle cannot
    replay, so they travel as their class, message and attributes."""
    return type(exc).__module__, type(exc).__qualname__, str(exc), dict(getattr(exc, "__dict__", {}))


def rebuild_error(state: tuple[str, str, str, dict[str, Any]]) -> BaseException:
    """`error_state` undone: the same class with the same message and attributes (RuntimeError naming it
    when the class cannot be found here)."""
    module, name, message, attributes = state
    try:
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(name)
    except (ImportError, AttributeError, TypeError):
        return RuntimeError(f"{module}.{name}: {message}")
    exc = cls.__new__(cls)
    BaseException.__init__(exc, message)
    exc.__dict__.update(attributes)
    return exc
