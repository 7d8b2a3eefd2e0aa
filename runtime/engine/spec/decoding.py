"""What the engine loop does for speculative decoding: propose drafts for decoding requests and
verify the drafts a step carried, counting acceptance (stats.SpecDecodeCounters).

The scheduler gives a decoding request 1 + len(draft_token_ids) tokens (its last token and the
drafts, slots allocated for all); the backend returns logits for all of them (SequenceChunk.
num_logits); `verify` keeps the accepted prefix plus one token; the engine then advances the
request's computed length by the accepted tokens only and trims blocks that held nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from engine_format import EngineConfig
from runtime.engine.engine_args import EngineArgs
from runtime.engine.request import Request
from runtime.engine.sampler import TokenLogprobs
from runtime.engine.spec.proposer import Proposer, create_proposer
from runtime.engine.spec.rejection_sampler import RejectionSampler
from runtime.engine.stats import SpecDecodeCounters


def create_spec_decoder(args: EngineArgs, config: EngineConfig, max_num_seqs: int) -> SpecDecoder | None:
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
    return SpecDecoder(proposer, args.num_speculative_tokens, args.speculative_disable_batch_size, config.max_seq_len)


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_tokens: int, disable_batch_size: int, max_seq_len: int) -> None:
        """num_tokens: drafts per request per step; disable_batch_size: no drafts while more requests run."""
        self.proposer, self.num_tokens = proposer, num_tokens
        self.disable_batch_size, self.max_seq_len = disable_batch_size, max_seq_len
        self.sampler = RejectionSampler()
        self.counters = SpecDecodeCounters()

    def propose(self, requests: Iterable[Request], running: Sequence[Request]) -> None:
        """Set draft_token_ids of `requests` (live, decoding) for the next step; with more than
        disable_batch_size requests running, clear every running request's drafts instead."""
        if len(running) > self.disable_batch_size:
            for request in running:
                request.draft_token_ids.clear()
            return
        live = [r for r in requests if not r.is_finished and r.num_tokens_to_compute == 1]
        if not live:
            return
        # Room: the drafts plus the token the target adds must fit max_tokens and max_seq_len.
        room = [
            min(self.num_tokens, r.params.max_tokens - r.num_output_tokens - 1, self.max_seq_len - r.num_tokens)
            for r in live
        ]
        drafts = self.proposer.propose(
            [r.all_token_ids for r in live], [max(k, 0) for k in room], [r.request_id for r in live],
            [r.params.max_tokens - r.num_output_tokens for r in live],
        )  # fmt: skip
        for request, tokens in zip(live, drafts, strict=True):
            request.draft_token_ids = list(tokens)

    def release(self, request: Request) -> None:
        """The request finished (or was aborted): the proposer drops its state."""
        self.proposer.release(request.request_id)

    def verify(
        self, logits: np.ndarray, to_verify: Sequence[tuple[Request, int, list[int]]]
    ) -> list[tuple[Request, list[int], list[TokenLogprobs] | None]]:
        """to_verify: (request, its first logit row in `logits`, its drafts). Rejection-samples every
        request's drafts and advances its computed length past the accepted ones (their K/V, and
        the last real token's, are valid; the rejected rows are stale); returns the tokens to append."""
        rows = np.concatenate([np.arange(first, first + len(d) + 1) for _, first, d in to_verify])
        requests, drafts = [r for r, _, _ in to_verify], [d for _, _, d in to_verify]
        result = self.sampler.verify(logits[rows], drafts, [r.sampling for r in requests])
        for request, d, accepted in zip(requests, drafts, result.num_accepted.tolist(), strict=True):
            self.counters.record(len(d), accepted)
            request.num_computed_tokens = request.num_tokens + accepted  # tokens so far hold K/V, plus accepted
        return list(zip(requests, result.token_ids, result.logprobs, strict=True))
