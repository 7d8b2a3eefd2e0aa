"""Triton Python-backend model `llm`: the trtserve async engine behind Triton.

Decoupled: each request gets its responses through its response sender, streamed (one
response per delta) or whole, the last one flagged FINAL. An asyncio loop runs on its own
thread; the engine loop runs on another (inside AsyncLLM). A request whose client cancels
(`is_cancelled()`, asked every `cancel_poll_s` seconds) is aborted and its KV blocks freed.
On unload, in-flight requests are drained (up to a timeout) before the engine stops.
`trtserve serve` probes its health, reads its heartbeat and drains it through files (runtime.serve.lifecycle).

config.pbtxt parameters: `engine_dir` (required); the EngineArgs `max_num_seqs`,
`max_num_batched_tokens`, `num_kv_blocks`, `max_waiting`, `min_prefill_tokens` (empty: the
engine's default), `itl_target_ms` (empty: the engine's DEFAULT_ITL_TARGET_MS, 200; "0": no
target, the fixed token budget), `stream_interval` (tokens per streamed response; empty: 1) and
`enable_prefix_caching` ("true"/"false"); `cancel_poll_s`,
the seconds between a request's `is_cancelled()` checks (empty: CANCEL_POLL_S = 0.5; "0": before
every response is sent, one IPC round trip per token, which tests use so that a cancel is seen by
the next token).
`max_prompt_chars`, `max_messages`, `max_stop_strings`, `max_stop_chars`: bounds on one request
(runtime/serve/request_inputs.py, Limits; empty: its defaults, and for max_prompt_chars the most
characters a prompt fitting the context can have), checked before the prompt is tokenized.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import json
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime import AsyncLLM, CompletionOutput, EngineArgs, InvalidRequest, Overloaded
from runtime.serve import lifecycle
from runtime.serve.metrics import TritonMetrics
from runtime.serve.request_inputs import INPUTS, Limits, parse_request, prompt_char_limit, resolve_max_tokens

CANCEL_POLL_S = 0.5  # default of the `cancel_poll_s` parameter
METRICS_INTERVAL_S = 0.5
OUTPUTS = frozenset({"text_output", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs"})
LIMIT_ARGS = ("max_prompt_chars", "max_messages", "max_stop_strings", "max_stop_chars")  # request_inputs.Limits
INT_ARGS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_waiting", "min_prefill_tokens",
            "num_speculative_tokens", "speculative_disable_batch_size", "draft_prompt_lookup_min",
            "stream_interval")  # fmt: skip
STR_ARGS = ("backend", "speculative")  # EngineArgs strings (empty: the engine's default)


class TritonPythonModel:
    def initialize(self, args):
        # A fatal signal in the stub prints every thread's Python stack into the server's log.
        faulthandler.enable(file=sys.stderr, all_threads=True)
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if not params.get("engine_dir"):
            raise pb_utils.TritonModelException("config parameter 'engine_dir' is empty: point it at an engine")
        engine_args = {k: int(params[k]) for k in INT_ARGS if params.get(k)}
        engine_args["enable_prefix_caching"] = params.get("enable_prefix_caching", "true").lower() == "true"
        engine_args["speculative_adaptive"] = params.get("speculative_adaptive", "true").lower() == "true"
        engine_args.update({k: params[k].strip() for k in STR_ARGS if params.get(k, "").strip()})
        if params.get("draft_engine"):  # a path: taken as it is, like engine_dir
            engine_args["draft_engine"] = params["draft_engine"]
        if params.get("itl_target_ms", "").strip():
            engine_args["itl_target_ms"] = _itl_target_ms(params["itl_target_ms"])
        self.cancel_poll_s = _cancel_poll_s(params.get("cancel_poll_s", ""))
        limits = {k: int(_non_negative(k, params[k], "a count")) for k in LIMIT_ARGS if params.get(k, "").strip()}
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = TritonMetrics(pb_utils, labels, speculative="speculative" in engine_args)
        try:
            self.engine = AsyncLLM(
                params["engine_dir"], EngineArgs(**engine_args), on_finished=self.metrics.observe_finished
            )
        except Exception as exc:  # reported by Triton as the model's load failure
            raise pb_utils.TritonModelException(f"trtserve engine failed to start: {exc}") from None
        engine = self.engine.engine
        self.context_tokens = min(engine.config.max_seq_len, engine.kv.capacity_tokens)
        if "max_prompt_chars" not in limits:  # the longest prompt that could fit the context
            limits["max_prompt_chars"] = prompt_char_limit(engine.tokenizer, self.context_tokens)
        self.limits = Limits(**limits)
        self.in_flight: set[concurrent.futures.Future] = set()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="trtserve-asyncio", daemon=True)
        self.loop_thread.start()
        # `trtserve serve` drains through files in this model's directory (runtime.serve.lifecycle).
        self.lifecycle = lifecycle.ModelLifecycle(
            Path(args["model_repository"]), self.loop, self.in_flight, self.engine.progress
        )
        self.stopping = threading.Event()
        self.metrics_thread = threading.Thread(target=self._publish_metrics, name="trtserve-metrics", daemon=True)
        self.metrics_thread.start()

    def execute(self, requests):
        for request in requests:
            if self.lifecycle.requested.is_set():
                _send_error(request.get_response_sender(), lifecycle.REFUSED_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
                continue
            serve = self._health if lifecycle.is_health_probe(request) else self._serve
            future = asyncio.run_coroutine_threadsafe(serve(request), self.loop)
            self.in_flight.add(future)
            future.add_done_callback(self.in_flight.discard)
        return None

    async def _serve(self, request) -> None:
        responder = _Responder(request)
        sender = responder.sender
        try:
            inputs = {}
            for spec in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                if tensor is not None:
                    inputs[spec.name] = tensor.as_numpy()
            parsed = parse_request(inputs, json.loads(request.parameters() or "{}"), self.limits)
            # Tokenized off this loop: a long prompt must not stall the other requests' streams.
            prompt_ids = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.engine.admission.tokenize, parsed.prompt
            )
            params = resolve_max_tokens(parsed, len(prompt_ids), self.context_tokens)
            stream = self.engine.generate(prompt_ids, params, request.request_id() or None)
            texts = _TokenTexts(self.engine.engine.tokenizer, prompt_ids)
            whole = CompletionOutput(request.request_id(), [])
            finished = False
            async with contextlib.aclosing(_until_cancelled(stream, request, self.cancel_poll_s)) as deltas:
                async for delta in deltas:
                    finished = delta.finished
                    if delta.error is not None:
                        _send_error(sender, f"engine error: {delta.error}", pb_utils.TritonError.INTERNAL)
                        return
                    if parsed.stream:
                        responder.send(delta.text, delta, texts=texts, final=delta.finished)
                    else:
                        whole.add(delta)
                        if delta.finished:
                            responder.send(whole.text, delta, whole.logprobs or [], texts, final=True)
            if not finished:  # cancelled by the client: close the stream without data
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except InvalidRequest as exc:
            _send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
        except Overloaded as exc:
            _send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
        except asyncio.CancelledError:  # cut by the drain deadline: the client gets a final error
            self.lifecycle.count_cut()
            _send_error(sender, lifecycle.CUT_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
        except Exception as exc:  # never leave a client hanging
            _send_error(sender, f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)

    async def _health(self, request) -> None:
        """Answer `trtserve serve`'s health probe from the loop, without the engine's queue."""
        sender = request.get_response_sender()
        problem = self.engine.progress().problem
        if problem is not None:
            _send_error(sender, problem, pb_utils.TritonError.INTERNAL)
            return
        ok = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", np.array([b"ok"], np.object_))])
        sender.send(ok, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _publish_metrics(self) -> None:
        while not self.stopping.wait(METRICS_INTERVAL_S):
            self._update_metrics()

    def _update_metrics(self) -> None:
        engine = self.engine.engine
        self.metrics.update(engine.stats(), engine.take_step_records())

    def finalize(self):
        """Every thread of ours ends here, joined: the stub tears down the backend's objects (response
        senders, metrics) after this returns, and a thread still using one would crash it at exit."""
        self.engine.shutdown(drain_timeout_s=30.0)
        concurrent.futures.wait(list(self.in_flight), timeout=5)  # let final responses go out
        self.stopping.set()
        self.metrics_thread.join()
        self.lifecycle.stop()
        self._update_metrics()
        self.metrics.close()
        executor = asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            executor.result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=5)


def _cancel_poll_s(value: str) -> float:
    return _non_negative("cancel_poll_s", value, "seconds") if value.strip() else CANCEL_POLL_S


def _itl_target_ms(value: str) -> float | None:
    return _non_negative("itl_target_ms", value, "ms") or None  # 0: no target


def _non_negative(name: str, value: str, unit: str) -> float:
    """A finite number >= 0 from config parameter `name`; a bad one stops the model loading."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 <= number < float("inf"):
        raise pb_utils.TritonModelException(f"config parameter '{name}' must be {unit} >= 0 (got {value!r})")
    return number


async def _until_cancelled(stream, request, poll_s: float = CANCEL_POLL_S):
    """Yield the stream's deltas; stop (aborting the request) once the client cancels.

    `is_cancelled()` is an IPC round trip to the Triton process, so a timer asks it every `poll_s`
    per request, whether deltas are flowing or not, and cancels the serving task when it says yes;
    the request is aborted as the cancellation unwinds AsyncLLM.generate. Asking on every delta
    woke Triton hundreds of times a second under load, and each wake-up stalls one of the kernel's
    two threads on a 2-core machine (c32: 67-68 -> 72 tok/s without them). Watching with a timer,
    not a task and an `asyncio.wait` per delta, keeps a delta's cost to the queue hand-off: this
    thread's per-token Python holds the GIL that the engine thread needs between its ops.
    With `poll_s` 0 it is asked before each delta is passed on (and every CANCEL_POLL_S while
    none comes, e.g. while the request waits to be scheduled).
    It must not be asked once the final response is sent (Triton frees the response factory
    then): the caller closes this generator (`contextlib.aclosing`) before it returns, and the
    timer stops with it."""
    watch = _CancelWatch(request, poll_s or CANCEL_POLL_S)
    try:
        async for delta in stream:
            if poll_s == 0 and request.is_cancelled():
                break  # leaving the stream unfinished: closing it aborts the request
            yield delta
            if delta.finished:
                return
    except asyncio.CancelledError:
        if not watch.cancelled:
            raise  # not the client's: e.g. the drain deadline
        asyncio.current_task().uncancel()  # handled: the request was aborted as the error unwound
    finally:
        watch.stop()
        await stream.aclose()  # a no-op once finished; otherwise aborts the request, its KV blocks freed now


class _CancelWatch:
    """Asks `request.is_cancelled()` every `poll_s` seconds on the running loop; when it says yes,
    cancels the task that created the watch."""

    def __init__(self, request, poll_s: float) -> None:
        self.request, self.poll_s, self.cancelled = request, poll_s, False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(poll_s, self._check)

    def _check(self) -> None:
        if self.request.is_cancelled():
            self.cancelled = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_later(self.poll_s, self._check)

    def stop(self) -> None:
        self._timer.cancel()


class _TokenTexts:
    """Each sampled token's text (and its alternatives'), decoded after the few tokens before it:
    alone, a SentencePiece token would lose its leading space. Multi-byte characters split across
    tokens show as U+FFFD, as in vLLM; the answer's text is decoded as a whole elsewhere."""

    CONTEXT = 4

    def __init__(self, tokenizer, prompt_ids) -> None:
        self.tokenizer, self.context = tokenizer, list(prompt_ids[-self.CONTEXT :])

    def entry(self, lp) -> dict:
        before = self._decode(self.context)
        texts = {lp.token_id: "", **{t: "" for t, _ in lp.top}}
        for token_id in texts:
            full = self._decode([*self.context, token_id])
            texts[token_id] = full[len(before) :] if full.startswith(before) else self._decode([token_id])
        self.context = [*self.context[1 - self.CONTEXT :], lp.token_id]
        top = [[t, v, texts[t]] for t, v in lp.top]
        return {"token_id": lp.token_id, "token": texts[lp.token_id], "logprob": lp.logprob, "top": top}

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _logprobs_json(logprobs, texts) -> str:
    return json.dumps([texts.entry(lp) for lp in logprobs or []])


class _Responder:
    """Sends a request's responses with only the outputs its client asked for.

    The Python backend (2.51, and upstream still) drops unrequested output tensors inside
    `ResponseSender.send` after releasing the GIL; a dropped tensor that nothing else holds is freed
    there, its numpy arrays decref'd without the GIL, which corrupted the stub's heap under load
    (the gateway asks for four outputs, not `logprobs`). So a response carries only requested
    outputs (unrequested ones are not even computed), and the tensors are held here until `send`
    returns, so that no Python object is ever released by the backend's GIL-free code."""

    def __init__(self, request) -> None:
        self.sender = request.get_response_sender()
        self.outputs = frozenset(request.requested_output_names()) or OUTPUTS

    def send(self, text: str, delta, logprobs=None, texts=None, final: bool = False) -> None:
        values = {
            "text_output": lambda: np.array([text.encode("utf-8")], dtype=np.object_),
            "finish_reason": lambda: np.array([(delta.finish_reason or "").encode()], dtype=np.object_),
            "prompt_tokens": lambda: np.array([delta.num_prompt_tokens], dtype=np.int32),
            "completion_tokens": lambda: np.array([delta.num_output_tokens], dtype=np.int32),
            "logprobs": lambda: np.array(
                [_logprobs_json(logprobs if logprobs is not None else delta.logprobs, texts).encode()],
                dtype=np.object_,
            ),
        }
        tensors = [pb_utils.Tensor(name, value()) for name, value in values.items() if name in self.outputs]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        del tensors  # released here, holding the GIL (see the class docstring)


def _send_error(sender, message: str, code) -> None:
    sender.send(
        pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
