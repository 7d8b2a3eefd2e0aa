"""Triton Python-backend model `llm`: the trtserve async engine behind Triton.

Decoupled: each request gets its responses through its response sender, streamed (one response per
delta, or per stream interval) or whole, the last one flagged FINAL, each carrying only the outputs the
request asked for (runtime/triton_model/responses.py says why). An asyncio loop runs on its own thread;
the engine loop runs on another (inside AsyncLLM), which tokenizes prompts off the loop. A request whose
client cancels is aborted and its KV blocks freed (runtime/triton_model/cancellation.py). On unload,
in-flight requests are drained (up to a timeout) before the engine stops. `trtserve serve` probes its
health, reads its heartbeat and drains it through files (engine_format/serving.py).

Everything but this class's use of Triton's API lives in runtime/triton_model/ (tested without a server):
the inputs (the request contract, engine_format/requests.py), the config parameters (settings.py: any
EngineArgs field by name, per-request Limits, `cancel_poll_s`), responses, metrics and lifecycle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import json
import logging
import sys
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from engine_format.requests import FIELD, InvalidRequest, Limits
from engine_format.serving import CUT_MESSAGE, HEALTH_ANSWER, REFUSED_MESSAGE
from runtime import AsyncLLM, CompletionOutput, Overloaded, freeze_startup_heap
from runtime.triton_model.cancellation import until_cancelled
from runtime.triton_model.disagg_metrics import DisaggMetrics
from runtime.triton_model.inputs import door_error, parse_request
from runtime.triton_model.kv_door import KVTransferError, disaggregated, transfer_failure
from runtime.triton_model.lifecycle import ModelLifecycle, is_health_probe
from runtime.triton_model.lora_admin import STATE_FILE as LORA_STATE_FILE
from runtime.triton_model.lora_admin import LoraDoor
from runtime.triton_model.metrics import TritonMetrics
from runtime.triton_model.responses import output_arrays
from runtime.triton_model.settings import model_settings
from runtime.triton_model.tokenize import tokenizer_answer

METRICS_INTERVAL_S = 0.5
log = logging.getLogger("trtserve.model")


class TritonPythonModel:
    def initialize(self, args):
        # A fatal signal in the stub prints every thread's Python stack into the server's log.
        faulthandler.enable(file=sys.stderr, all_threads=True)
        config = json.loads(args["model_config"])
        try:
            settings = model_settings({k: v["string_value"] for k, v in config.get("parameters", {}).items()})
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        self.cancel_poll_s = settings.cancel_poll_s
        labels = {"model": args["model_name"], "version": args["model_version"]}
        engine = settings.engine
        self.metrics = TritonMetrics(
            pb_utils,
            labels,
            speculative=engine.speculative is not None,
            kv_tiers=engine.kv_host_cache_gb > 0 or engine.kv_disk_cache is not None,
            lora=engine.lora_enabled,
        )
        try:
            self.engine = AsyncLLM(settings.engine_dir, settings.engine, on_finished=self.metrics.observe_finished)
        except Exception as exc:  # reported by Triton as the model's load failure
            raise pb_utils.TritonModelException(f"trtserve engine failed to start: {exc}") from None
        self.disagg_metrics = DisaggMetrics(pb_utils, labels)
        self.loras = LoraDoor(self.engine, Path(args["model_repository"]) / LORA_STATE_FILE)
        asyncio.run(self.loras.restore())  # adapters loaded at run time before a restart
        # The longest prompt that could fit the context, unless a parameter bounds it.
        self.limits = Limits(**{"max_prompt_chars": self.engine.max_prompt_chars(), **settings.limits})
        self.in_flight: set[concurrent.futures.Future] = set()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="trtserve-asyncio", daemon=True)
        self.loop_thread.start()
        self.lifecycle = ModelLifecycle(Path(args["model_repository"]), self.loop, self.in_flight, self.engine.progress)
        self.stopping = threading.Event()
        self.metrics_thread = threading.Thread(target=self._publish_metrics, name="trtserve-metrics", daemon=True)
        self.metrics_thread.start()
        freeze_startup_heap(f"trtserve model {args['model_name']}")  # last: everything made at start stays

    def execute(self, requests):
        for request in requests:
            if self.lifecycle.requested.is_set():
                _send_error(request.get_response_sender(), REFUSED_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
                continue
            serve = self._health if is_health_probe(request) else self._serve
            future = asyncio.run_coroutine_threadsafe(serve(request), self.loop)
            self.in_flight.add(future)
            future.add_done_callback(self.in_flight.discard)
        return None

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        wanted = frozenset(request.requested_output_names())
        parsed = None
        try:
            inputs = {}
            for name in FIELD:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = parse_request(inputs, json.loads(request.parameters() or "{}"), self.limits)
            request_id = request.request_id() or uuid.uuid4().hex
            if parsed.tokenize is not None or parsed.lora_admin is not None:  # nothing is generated
                if parsed.lora_admin is not None:
                    answer = await self.loras.answer(parsed.lora_admin, request_id)
                else:
                    answer = await tokenizer_answer(self.engine, parsed, request_id)
                _send(sender, output_arrays(wanted, answer.text, answer), True)
                return
            whole = CompletionOutput(request_id, [])
            finished = False
            async with disaggregated(self.engine, parsed, request_id):  # a KV read first, or a prefill-only mark
                stream = self.engine.generate(parsed.prompt, parsed.params, request_id, parsed.resume_token_ids)
                async with contextlib.aclosing(until_cancelled(stream, request, self.cancel_poll_s)) as deltas:
                    async for delta in deltas:
                        finished = delta.finished
                        if delta.error is not None:
                            _send_error(sender, f"engine error: {delta.error}", pb_utils.TritonError.INTERNAL)
                            return
                        if parsed.stream:
                            _send(sender, output_arrays(wanted, delta.text, delta), delta.finished)
                        else:
                            whole.add(delta)
                            if delta.finished:
                                delta = replace(delta, prompt_logprobs=whole.prompt_logprobs, token_ids=whole.token_ids)
                                _send(sender, output_arrays(wanted, whole.text, delta, whole.logprobs or []), True)
            if not finished:  # cancelled by the client: close the stream without data
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except KVTransferError as exc:  # the gateway re-prefills elsewhere on these words
            _send_error(sender, transfer_failure(exc), pb_utils.TritonError.UNAVAILABLE)
        except InvalidRequest as exc:
            _send_error(sender, str(door_error(exc, parsed)), pb_utils.TritonError.INVALID_ARG)
        except Overloaded as exc:
            _send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
        except asyncio.CancelledError:  # cut by the drain deadline: the client gets a final error
            self.lifecycle.count_cut()
            _send_error(sender, CUT_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
        except Exception as exc:  # never leave a client hanging
            _send_error(sender, f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)

    async def _health(self, request) -> None:
        """Answer `trtserve serve`'s health probe from the loop, without the engine's queue."""
        sender = request.get_response_sender()
        problem = self.engine.progress().problem
        if problem is not None:
            _send_error(sender, problem, pb_utils.TritonError.INTERNAL)
            return
        _send(sender, {"text_output": np.array([HEALTH_ANSWER.encode()], dtype=np.object_)}, final=True)

    def _publish_metrics(self) -> None:
        while not self.stopping.wait(METRICS_INTERVAL_S):
            self._update_metrics()

    def _update_metrics(self) -> None:
        try:
            grammar_compiles = self.engine.take_grammar_compile_seconds()
            stats, records = self.engine.stats(), self.engine.take_step_records()
            disagg, pulls = self.engine.disagg.stats(), self.engine.disagg.take_pull_records()
        except RuntimeError as exc:  # an engine core process that died: the health probe says so, not this
            log.warning("engine metrics not updated: %s", exc)
            return
        self.metrics.update(stats, records, grammar_compiles)
        self.disagg_metrics.update(disagg, pulls)

    def finalize(self):
        """Every thread of ours ends here, joined: the stub tears down the backend's objects (response
        senders, metrics) after this returns, and a thread still using one would crash it at exit."""
        self.engine.shutdown(drain_timeout_s=30.0)
        concurrent.futures.wait(list(self.in_flight), timeout=5)  # let final responses go out
        self.stopping.set()
        self.metrics_thread.join()
        self.lifecycle.stop()
        self._update_metrics()
        self.metrics.close()  # before the stub's shared memory goes (their destructors use it)
        self.disagg_metrics.close()
        executor = asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            executor.result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=5)


def _send(sender, arrays, final: bool) -> None:
    """One response of `arrays` (output name -> numpy array). The tensors are held here until `send`
    returns, so the backend's GIL-free code never releases the last reference to a Python object."""
    tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
    del tensors  # released here, holding the GIL


def _send_error(sender, message: str, code) -> None:
    sender.send(
        pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
