"""A prefill worker in a process of its own, for tests that kill it: runs one prompt prefill-only, prints the KV
handle on one line, then waits (its pinned blocks readable) until it is killed or its stdin closes.

    python -m tests.disagg_peer ENGINE_DIR TOKEN_IDS_JSON
"""

from __future__ import annotations

import json
import sys

from runtime import EngineArgs, LLMEngine, SamplingParams


def main() -> None:
    engine = LLMEngine(sys.argv[1], EngineArgs(max_num_batched_tokens=32, role="prefill"))
    engine.disagg.export("peer")
    engine.add_request(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), "peer")
    while "peer" in engine.requests:
        for out in engine.step():
            if out.kv_handle is not None:
                print("HANDLE", out.kv_handle, flush=True)  # NIXL logs to stdout too
    sys.stdin.read()  # until the test closes it (or kills this process)


if __name__ == "__main__":
    main()
