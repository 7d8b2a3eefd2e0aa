"""A disaggregated backend's generation: the prompt on a prefill worker, the decode on a decode worker.

1. Prefill: the request goes to a prefill worker (`prefill_only`), picked like any replica (prefix-aware by
   default: a worker that has the prompt's prefix cached computes only the rest), and is retried on another
   while nothing has come back, as every generation is (exchange.py). The answer is the first token and the
   KV handle (finish reason "handoff"); a request that ended on its first token (a stop, max_tokens 1) is
   answered from there.
2. The first token goes to the client at once: streaming starts with the prefill's token.
3. Decode: the least-loaded decode worker gets the request with the handle; it reads the KV and continues.
   A decode worker that refuses as overloaded (it read nothing) is replaced by another. Any other failure
   before the decode's first delta may have come after its read, once the prefill worker unpinned the blocks:
   the handle is never sent to a second decode worker. Instead the request is recomputed (the handle marked
   `recompute`: the prompt computed again, continuing after the first token the client already has) on the
   backend's `both` replicas if it has any, else on another decode worker. With neither, the client gets an
   error saying so.

The KV blocks are released on both sides whatever happens: the prefill worker's pins end when read, when
the decode worker gives up, or at their timeout; a decode worker frees what it staged when its request ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from engine_format.kv_handle import HANDOFF, KVHandleError, with_recompute
from runtime.gateway.errors import GatewayError
from runtime.gateway.replicas import ReplicaPool
from runtime.gateway.wire import Delta, GenerateRequest

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 502, 503})


@dataclass(frozen=True)
class DisaggPools:
    backend: str
    prefill: ReplicaPool
    decode: ReplicaPool
    both: ReplicaPool | None  # the backend's own replicas: `both` workers, the fallback that recomputes

    def role_pools(self) -> dict[str, ReplicaPool]:
        """The pools by the name the monitor and the metrics know them by."""
        pools = {self.prefill.name: self.prefill, self.decode.name: self.decode}
        return pools | ({self.both.name: self.both} if self.both is not None else {})


class NotDecoded(Exception):
    """The decode did not start: why, and the decode worker that failed (None: none could be picked)."""

    def __init__(self, error: GatewayError, replica: str | None) -> None:
        super().__init__(error.message)
        self.error, self.replica = error, replica


async def disaggregated(pools: DisaggPools, request: GenerateRequest, stream: bool,
                        prefill_deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:  # fmt: skip
    """The generation's deltas; `prefill_deltas`: the prefill-only request's, from the exchange's retried
    generation on the prefill pool. Raises GatewayError."""
    counter = pools.prefill.metrics.disagg
    first = None
    async for delta in prefill_deltas:
        first = delta
    if first is None or first.finish_reason != HANDOFF:  # ended on its first token: nothing to decode
        if first is not None:
            counter.labels(pools.backend, "prefill_finished").inc()
            yield first
        return
    if not first.kv_handle:
        counter.labels(pools.backend, "failed").inc()
        raise GatewayError(502, f"a prefill worker of {pools.backend!r} handed off without a KV handle", "server_error")
    yield replace(first, finish_reason=None, kv_handle=None)
    try:
        async for delta in attempts(pools.decode, replace(request, kv_handle=first.kv_handle), stream, frozenset(),
                                    retry_on=frozenset({429})):  # fmt: skip
            yield delta
        counter.labels(pools.backend, "decoded").inc()
        return
    except NotDecoded as failed:
        not_decoded = failed
    fallback = pools.both if pools.both is not None and pools.both.replicas else pools.decode
    exclude = frozenset() if fallback is pools.both or not_decoded.replica is None else frozenset({not_decoded.replica})
    log.warning("decode of a %s request failed before its first token (%s); recomputing on %s", pools.backend,
                not_decoded.error.message, fallback.name)  # fmt: skip
    try:
        handle = with_recompute(first.kv_handle)
    except KVHandleError as exc:
        counter.labels(pools.backend, "failed").inc()
        raise GatewayError(
            502, f"a prefill worker of {pools.backend!r} sent a bad KV handle: {exc}", "server_error"
        ) from None
    try:
        async for delta in attempts(fallback, replace(request, kv_handle=handle), stream, exclude, RETRYABLE):
            yield delta
    except NotDecoded as again:
        counter.labels(pools.backend, "failed").inc()
        raise GatewayError.unavailable(
            f"the decode of this {pools.backend!r} request failed ({not_decoded.error.message}) and recomputing it "
            f"on {fallback.name!r} failed too ({again.error.message}); the first token was sent",
            code="decode_failed",
        ) from None
    counter.labels(pools.backend, "recomputed").inc()


async def attempts(pool: ReplicaPool, request: GenerateRequest, stream: bool, exclude: frozenset[str],
                   retry_on: frozenset[int]) -> AsyncIterator[Delta]:  # fmt: skip
    """Deltas from one replica of `pool` (least loaded unless the pool says otherwise), another tried after a
    failure in `retry_on` while nothing was yielded (up to the routing's max_attempts); NotDecoded when no
    replica produced anything, GatewayError for a failure after that."""
    tried = set(exclude)
    while True:
        try:
            pick = pool.pick([], frozenset(tried), request.lora)  # a worker with the adapter in a slot, if any
        except GatewayError as none_left:
            raise NotDecoded(none_left, None) from None
        tried.add(pick.replica.url)
        started = False
        try:
            with pool.lease(pick, []) as upstream:
                async for delta in upstream.generate(request, stream):
                    started = True
                    yield delta
            return
        except GatewayError as exc:
            if started:
                raise
            if exc.status not in retry_on or len(tried) - len(exclude) >= pool.settings.max_attempts:
                raise NotDecoded(exc, pick.replica.url) from None
            pool.metrics.replica_retries.labels(pool.name, pick.replica.url).inc()
