"""What the engine loop does for speculative decoding: propose drafts for decoding requests and
verify the drafts a step carried, counting acceptance (stats.SpecDecodeCounters).

The scheduler gives a decoding request 1 + len(draft_token_ids) tokens (its last token and the
drafts, slots allocated for all); the backend returns logits for all of them (SequenceChunk.
num_logits); `verify` keeps the accepted prefix plus one token; the engine then advances the
request's computed length by the accepted tokens only and trims blocks that held nothing else.

When to speculate: never while more than `disable_batch_size` requests run or wait (a verify pass
costs k + 1 tokens per sequence, which a large batch pays in compute; a queue means the batch is about
to grow, and a draft engine would prefill the first prompts of a burst for nothing); below that, where
the governor (governor.py) has measured that steps with drafts cost less per emitted token than steps
without.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig
from executors.sampling import TokenLogprobs
from runtime.engine.engine_args import EngineArgs
from runtime.engine.request import Request
from runtime.engine.spec.factory import create_proposer
from runtime.engine.spec.governor import SpeculationGovernor
from runtime.engine.spec.proposer import Proposer
from runtime.engine.spec.rejection_sampler import RejectionSampler
from runtime.engine.stats import SpecDecodeCounters


def create_spec_decoder(
    args: EngineArgs, config: EngineConfig, max_num_seqs: int, clock: Callable[[], float] = time.monotonic
) -> SpecDecoder | None:
    """The engine's speculative decoding (None: EngineArgs.speculative is off). A TensorRT plan
    returns at most tensorrt.limits.max_logit_rows logits per call: more drafts are refused here."""
    proposer = create_proposer(args, config)
    if proposer is None:
        return None
    rows = (1 + args.num_speculative_tokens) * max_num_seqs
    if config.tensorrt is not None and rows > config.tensorrt.max_logit_rows:
        raise ValueError(
            f"num_speculative_tokens {args.num_speculative_tokens} x max_num_seqs {max_num_seqs} needs {rows} logit "
            f"rows per step; the TensorRT plan returns at most {config.tensorrt.max_logit_rows}"
        )
    governor = SpeculationGovernor() if args.speculative_adaptive else None
    return SpecDecoder(proposer, args.num_speculative_tokens, args.disable_batch_size, config.max_seq_len,
                       governor, clock)  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """What propose() decided for the next step."""

    batch_size: int | None  # requests running then; None: more than disable_batch_size ran or waited (no measurement)
    speculate: bool
    propose_s: float = 0.0  # the proposer's time for its drafts
    one_off: bool = False  # proposing caught a request up on more than a steady step's tokens


class SpecDecoder:
    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        disable_batch_size: int,
        max_seq_len: int,
        governor: SpeculationGovernor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """num_tokens: drafts per request per step; disable_batch_size: no drafts while more requests run;
        governor: None speculates at every batch size up to disable_batch_size; clock: the engine's (the
        governor compares step times read from it)."""
        self.proposer, self.num_tokens = proposer, num_tokens
        self.disable_batch_size, self.max_seq_len, self.clock = disable_batch_size, max_seq_len, clock
        self.sampler = RejectionSampler()
        self.governor = governor
        self.counters = SpecDecodeCounters()
        self._planned = _Plan(None, False)  # for the step about to run
        self._ran: _Plan | None = None  # for the step that ran last

    def propose(self, requests: Iterable[Request], running: Sequence[Request], waiting: int = 0) -> None:
        """Set draft_token_ids of `requests` (live, decoding) for the next step; where speculation
        does not run (too many requests running and `waiting`, or not paying at this batch size), clear
        every running request's drafts instead."""
        self._ran, batch = self._planned, len(running)
        loaded = batch + waiting > self.disable_batch_size
        if loaded or (self.governor is not None and not self.governor.speculate(batch)):
            for request in running:
                request.draft_token_ids.clear()
            self._planned = _Plan(None if loaded else batch, False)
            return
        start = self.clock()
        caught_up = self._propose([r for r in requests if not r.is_finished and r.num_tokens_to_compute == 1])
        self._planned = _Plan(batch, True, self.clock() - start, one_off=caught_up > self.num_tokens + 1)

    def observe_step(self, seconds: float, tokens: int, decode_batch: int | None) -> float:
        """The step that ran last took `seconds` (its tail proposing for the next step included), emitted
        `tokens`, and was `decode_batch` decodes (None: it computed prompt tokens too). Feeds the governor,
        except a step whose drafts needed a one-off catch-up (a draft engine prefilling a new prompt, or the
        tokens decoded while plain): that is the price of switching, not of speculating, and judging modes
        by it turned a draft that pays (1.23x single-stream) off. Returns the target's own share of the
        seconds (the proposer's time taken out)."""
        target_s = seconds - self._planned.propose_s
        ran = self._ran
        if self.governor and ran and ran.batch_size is not None and not ran.one_off and decode_batch == ran.batch_size:
            self.governor.observe(ran.batch_size, ran.speculate, target_s + ran.propose_s, tokens)
        return target_s

    def _propose(self, live: list[Request]) -> int:
        """Sets the drafts of `live`; returns the proposer's catch-up (Proposer.caught_up)."""
        if not live:
            return 0
        # Room: the drafts plus the token the target adds must fit max_tokens and max_seq_len.
        room = [
            min(self.num_tokens, r.max_tokens - r.num_output_tokens - 1, self.max_seq_len - r.num_tokens) for r in live
        ]
        drafts = self.proposer.propose(
            [r.all_token_ids for r in live], [max(k, 0) for k in room], [r.request_id for r in live],
            [r.max_tokens - r.num_output_tokens for r in live],
        )  # fmt: skip
        for request, tokens in zip(live, drafts, strict=True):
            grammar = request.sampling.grammar  # structured output: drafts its grammar refuses are never verified
            request.draft_token_ids = list(tokens if grammar is None else tokens[: grammar.valid_prefix(tokens)])
        return self.proposer.caught_up

    def release(self, request: Request) -> None:
        """The request finished (or was aborted): the proposer drops its state."""
        self.proposer.release(request.request_id)

    def verify(
        self, logits: np.ndarray, to_verify: Sequence[tuple[Request, int, list[int]]]
    ) -> list[tuple[Request, list[int], list[TokenLogprobs] | None, int]]:
        """to_verify: (request, its first logit row in `logits`, its drafts). Rejection-samples every
        request's drafts; returns the tokens to append and how many drafts were accepted (their K/V, and the
        last real token's, are valid; the rejected rows are stale)."""
        rows = np.concatenate([np.arange(first, first + len(d) + 1) for _, first, d in to_verify])
        requests, drafts = [r for r, _, _ in to_verify], [d for _, _, d in to_verify]
        result = self.sampler.verify(logits, drafts, [r.sampling for r in requests], rows=rows)
        accepted = result.num_accepted.tolist()
        for d, n in zip(drafts, accepted, strict=True):
            self.counters.record(len(d), n)
        return list(zip(requests, result.token_ids, result.logprobs, accepted, strict=True))
