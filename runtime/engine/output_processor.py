"""Token outputs -> text deltas: the engine's per-request detokenizers and stop-string matchers.

The engine core's step ends with token ids (TokenOutput); turning them into text is per-token Python
(incremental detokenization, stop strings held back and matched across tokens, logprobs' candidate
texts) that a GPU need not wait for. So it lives here, apart from the step: `LLMEngine.step()` runs it
inline (the synchronous API, tests), `AsyncLLM` on a thread of its own while the engine thread starts the
next step (vLLM v1's OutputProcessor, in its API-server process).

A stop string is only known here. When one completes, the request's final output goes out at once and the
core is told to finish it (`stop` callback): a core running ahead may have computed a token or two past
the stop by then, which are dropped, never streamed. Outputs of a request this processor has finished,
or never saw, are dropped; but the core's final output of one finished by a stop string brings its stats
(timing) to `on_finished`, when the core could not give them at once (in a process of its own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from executors.sampling import SamplingParams, TokenLogprobs
from runtime.engine.detokenizer import LOGPROB_CONTEXT_TOKENS, DetokenizedStream, candidate_texts
from runtime.engine.fast_detokenizer import Detokenizers
from runtime.engine.outputs import RequestOutput, TokenOutput
from runtime.engine.tokenizer import decoder

# Finish a request in the core because of its text (a stop string): its final TokenOutput (stats), or None
# when that comes later (the core had finished it already, or runs in a process of its own).
StopRequest = Callable[[str], TokenOutput | None]
# Observes each finished request's final output once, with the core's stats (metrics).
OnFinished = Callable[[RequestOutput], None]


@dataclass
class _Text:
    """One live request's text state."""

    stream: DetokenizedStream
    logprob_context: list[int]  # the last few tokens: logprobs' candidates are decoded after them
    num_output_tokens: int = 0  # delivered (tokens the core computed past a stop string are not)
    prompt_ids: Sequence[int] = ()  # kept when its prompt is scored (prompt_logprobs): their candidates' context


class OutputProcessor:
    def __init__(self, tokenizer: Any, stop_request: StopRequest, on_finished: OnFinished | None = None) -> None:
        self.tokenizer, self.stop_request, self.on_finished = tokenizer, stop_request, on_finished
        # Finished here by a stop string: final outputs waiting for the core's stats (under the lock).
        self._stats_due: dict[str, RequestOutput] = {}
        self._decode = decoder(tokenizer)
        self.detokenizers = Detokenizers(tokenizer)
        self._texts: dict[str, _Text] = {}
        self._lock = threading.Lock()  # add (a caller's thread) and process/finish (the output thread)

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Register a request before the core can produce anything for it."""
        detokenizer = self.detokenizers(prompt_ids, params.skip_special_tokens)
        stream = DetokenizedStream(detokenizer, params.stop, params.include_stop_str_in_output)
        scored = prompt_ids if params.prompt_logprobs is not None else ()
        with self._lock:
            self._texts[request_id] = _Text(stream, list(prompt_ids[-LOGPROB_CONTEXT_TOKENS:]), prompt_ids=scored)
            # The id named another request, stopped here, whose final output (its stats) will not come now.
            unobserved = self._stats_due.pop(request_id, None)
        if unobserved is not None:
            self._finished(unobserved)

    def process(self, outputs: Sequence[TokenOutput]) -> list[RequestOutput]:
        with self._lock:
            texts = [self._texts.get(out.request_id) for out in outputs]
        done = []
        for out, text in zip(outputs, texts, strict=True):
            if text is None:  # finished here already (a stop string), or never registered
                if out.finish_reason is not None:
                    with self._lock:
                        final = self._stats_due.pop(out.request_id, None)
                    if final is not None:
                        self._finished(replace(final, stats=out.stats))
                continue
            token_ids = out.token_ids
            one_token = len(token_ids) == 1 and out.finish_reason is None and out.logprobs is None
            if one_token and out.prompt_logprobs is None:  # a decode's token
                piece, stopped = text.stream.add(token_ids[0])
                if not stopped:  # (the core's list is the delta's: made for this output, not kept)
                    text.num_output_tokens += 1
                    done.append(
                        RequestOutput(
                            out.request_id,
                            piece,
                            token_ids,
                            num_prompt_tokens=out.num_prompt_tokens,
                            num_output_tokens=text.num_output_tokens,
                        )
                    )
                else:
                    done.append(self._stopped(text, out, piece, token_ids, None, 1))
            else:
                done.append(self._one(out, text))
        return done

    def _one(self, out: TokenOutput, text: _Text) -> RequestOutput:
        logprobs = self._with_texts(text, out.token_ids, out.logprobs) if out.logprobs is not None else None
        prompt_logprobs = None if out.prompt_logprobs is None else self._prompt_texts(text, out.prompt_logprobs)
        # The core finishes with "stop" only at a stop token (stop strings are found here): its text is not output.
        spoken = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        pieces = []
        for kept, token in enumerate(spoken, start=1):
            piece, stopped = text.stream.add(token)
            pieces.append(piece)
            if stopped:
                final = self._stopped(text, out, "".join(pieces), out.token_ids[:kept], logprobs, kept)
                final.prompt_logprobs = prompt_logprobs
                return final
        text.num_output_tokens += len(out.token_ids)
        delta = RequestOutput(out.request_id, "".join(pieces), list(out.token_ids), logprobs=logprobs,
                              num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=text.num_output_tokens,
                              prompt_logprobs=prompt_logprobs)  # fmt: skip
        if out.finish_reason is not None:
            if out.kv_handle is None:  # (a handed-off request's held-back text is its decode worker's to send)
                delta.text += text.stream.finish()
                if text.stream.stopped:  # the detokenizer's last characters completed a stop string
                    out.finish_reason = "stop"
            self.forget(out.request_id)
            delta.kv_handle = out.kv_handle
            delta.finished, delta.finish_reason, delta.stats, delta.error = (
                True,
                out.finish_reason,
                out.stats,
                out.error,
            )
            self._finished(delta)
        return delta

    def _stopped(self, text: _Text, out: TokenOutput, piece: str, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None, kept: int) -> RequestOutput:  # fmt: skip
        """A stop string completed: the final output now, and the core told (unless it finished already)."""
        self.forget(out.request_id)
        final = out if out.finish_reason is not None else self.stop_request(out.request_id)
        text.num_output_tokens += kept
        delta = RequestOutput(out.request_id, piece, token_ids, finished=True, finish_reason="stop",
                              logprobs=None if logprobs is None else logprobs[:kept],
                              num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=text.num_output_tokens,
                              stats=None if final is None else final.stats)  # fmt: skip
        if final is not None:
            self._finished(delta)
        elif self.on_finished is not None:  # the core's final output brings the stats
            with self._lock:  # (a copy: the delta itself is the caller's)
                self._stats_due[out.request_id] = replace(delta)
        return delta

    def _finished(self, final: RequestOutput) -> None:
        if self.on_finished is not None:
            self.on_finished(final)

    def replay(self, request_id: str, token_id: int) -> None:
        """A token whose text went out elsewhere (a prefill worker's first token): this request's detokenizer
        takes it as context, and it counts as delivered."""
        with self._lock:
            text = self._texts[request_id]
        text.stream.add(token_id)
        text.num_output_tokens += 1

    def forget(self, request_id: str) -> None:
        """Drop a request's text state (it finished, or was refused before it ran)."""
        with self._lock:
            self._texts.pop(request_id, None)

    def _with_texts(self, text: _Text, tokens: list[int], logprobs: list[TokenLogprobs]) -> list[TokenLogprobs]:
        """Each token's candidates as text, decoded after the tokens before it."""
        out, context = [], text.logprob_context
        for token, lp in zip(tokens, logprobs, strict=True):
            texts = candidate_texts(self._decode, context, [lp.token_id, *(t for t, _ in lp.top)])
            out.append(replace(lp, texts=texts))
            context = [*context, token][-LOGPROB_CONTEXT_TOKENS:]
        text.logprob_context = context
        return out

    def _prompt_texts(self, text: _Text, scored: list[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """The prompt's scores with their candidates' texts, each decoded after the prompt tokens before it."""
        out: list[TokenLogprobs | None] = [None]
        prompt = text.prompt_ids
        for i, lp in enumerate(scored[1:], start=1):
            assert lp is not None
            context = prompt[max(0, i - LOGPROB_CONTEXT_TOKENS) : i]
            out.append(
                replace(lp, texts=candidate_texts(self._decode, context, [lp.token_id, *(t for t, _ in lp.top)]))
            )
        return out
