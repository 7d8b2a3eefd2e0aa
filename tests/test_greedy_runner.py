"""The free-list type (executors/free_blocks.py) and the greedy runner (executors/greedy_runner.py) on a
stand-in backend whose logits name the next token: block order, all-or-nothing reservations, rewinds,
and the argmax token appended only when a sequence's every known token is computed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from executors.base import SequenceChunk
from executors.free_blocks import FreeBlockQueue, NoFreeBlocks
from executors.greedy_runner import GreedyRunner, OutOfBlocks

VOCAB = 50


def test_the_queue_hands_out_from_the_front_and_takes_back_at_either_end():
    queue = FreeBlockQueue(range(6))
    assert queue.take(2) == [0, 1] and list(queue) == [2, 3, 4, 5]
    queue.append([1])  # reused last (BlockPool's LRU order)
    queue.prepend([0, 7])  # reused first, in order (the runner's)
    assert list(queue) == [0, 7, 2, 3, 4, 5, 1] and len(queue) == 7 and 7 in queue
    queue.remove(3)  # a prefix-cache hit out of the middle
    assert queue.take(3) == [0, 7, 2] and list(queue) == [4, 5, 1]


def test_the_queue_refuses_more_than_it_holds_and_a_double_give_back():
    queue = FreeBlockQueue(range(2))
    with pytest.raises(NoFreeBlocks, match="need 3 blocks, 2 free"):
        queue.take(3)
    assert list(queue) == [0, 1]  # nothing taken
    for give_back in (queue.append, queue.prepend):
        with pytest.raises(ValueError, match="block 1 given back twice"):
            give_back([1])
    with pytest.raises(KeyError):
        queue.remove(5)


class Successor:
    """A backend whose logits put each chunk's last token + 1 (mod VOCAB) on top; it records its steps."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        self.config = SimpleNamespace(block_size=block_size, max_seq_len=64, max_batch_size=8)
        self.num_blocks = num_blocks
        self.steps: list[list[SequenceChunk]] = []

    def step(self, chunks: list[SequenceChunk]) -> np.ndarray:
        self.steps.append(list(chunks))
        logits = np.zeros((len(chunks), VOCAB), np.float32)
        for row, chunk in enumerate(chunks):
            logits[row, (chunk.token_ids[-1] + 1) % VOCAB] = 1.0
        return logits


def test_a_step_runs_the_named_tokens_and_appends_a_token_where_all_are_computed():
    backend = Successor(num_blocks=8)
    runner = GreedyRunner(backend)  # type: ignore[arg-type]
    a, b = runner.extend("a", [3, 4, 5, 6, 7]), runner.extend("b", [10, 11])
    result = runner.step([("a", 3), ("b", 2)])  # a: a prompt chunk short of its end
    assert [(list(c.token_ids), c.past_len, list(c.block_table)) for c in result.chunks] == [
        ([3, 4, 5], 0, [0]),
        ([10, 11], 0, [1]),
    ]
    assert result.tokens == [None, 12] and (a.computed, b.computed) == (3, 2)
    assert a.tokens == [3, 4, 5, 6, 7] and b.tokens == [10, 11, 12]
    result = runner.step([("a", 5), ("b", 3)])
    assert result.tokens == [8, 13] and a.blocks == [0, 2] and b.blocks == [1]
    assert [list(c.block_table) for c in result.chunks] == [[0, 2], [1]]


def test_released_blocks_are_reused_first_in_order():
    runner = GreedyRunner(Successor(num_blocks=6))  # type: ignore[arg-type]
    runner.extend("a", list(range(9)))
    runner.step([("a", 9)])
    assert runner.sequences["a"].blocks == [0, 1, 2]
    released = runner.release("a")
    assert released is not None and released.tokens == [*range(9), 9]
    assert list(runner.free) == list(range(6)) and runner.release("a") is None
    runner.extend("b", [1])
    assert runner.reserve("b", 5) and runner.sequences["b"].blocks == [0, 1]


def test_reservations_are_all_or_nothing():
    runner = GreedyRunner(Successor(num_blocks=3))  # type: ignore[arg-type]
    runner.extend("a", list(range(8)))
    runner.extend("b", list(range(8)))
    assert runner.reserve("a", 8) and not runner.reserve("b", 8)
    assert runner.sequences["b"].blocks == [] and list(runner.free) == [2]
    with pytest.raises(OutOfBlocks, match="KV pool of 3 blocks is full"):
        runner.step([("b", 8)])
    assert runner.sequences["b"].blocks == []


def test_a_rewind_recomputes_from_the_kept_prefix_over_the_same_blocks():
    backend = Successor(num_blocks=4)
    runner = GreedyRunner(backend)  # type: ignore[arg-type]
    runner.extend("r", [1, 2, 3, 4, 5])
    runner.step([("r", 5)])  # appends 6
    runner.step([("r", 6)])  # appends 7 (known, not computed)
    runner.rewind("r", 4)
    seq = runner.sequences["r"]
    assert seq.tokens == [1, 2, 3, 4] and seq.computed == 4 and seq.blocks == [0, 1]
    runner.extend("r", [40, 41])
    assert runner.step([("r", 6)]).tokens == [42]
    assert [(list(c.token_ids), c.past_len) for c in backend.steps[-1]] == [([40, 41], 4)]
