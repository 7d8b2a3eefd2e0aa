"""The prompt-lookup proposer against exact expectations and a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.spec import NgramProposer


def reference(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Plain loops: the longest suffix (max_n .. min_n) seen earlier; its latest earlier start wins."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(context):
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    ("context", "k", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # suffix [1, 2] seen at 0: propose what followed
        ([1, 2, 3, 4, 1, 2], 9, [3, 4, 1, 2]),  # fewer than k tokens follow the match
        ([5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2], 2, [8, 3]),  # the latest earlier match wins
        ([7, 7, 7, 7], 3, [7]),  # the match may end right before the suffix
        ([1, 2, 3], 2, []),  # nothing repeats
        ([4], 2, []),  # too short to match anything
        ([1, 2, 3, 9, 2, 3, 1, 2, 3], 1, [9]),  # [1, 2, 3] beats the later [2, 3] match
        ([1, 2, 3, 4, 1, 2], 0, []),  # no room
    ],
)
def test_exact_proposals(context, k, want):
    assert NgramProposer(1, 3).propose([context], [k]) == [want]


def test_min_n_refuses_shorter_matches():
    assert NgramProposer(2, 3).propose([[1, 9, 5, 1]], [2]) == [[]]  # only a 1-token match exists
    assert NgramProposer(1, 3).propose([[1, 9, 5, 1]], [2]) == [[9, 5]]


def test_matches_the_brute_force_reference_on_random_contexts():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    contexts = [rng.integers(0, 4, int(n)).tolist() for n in rng.integers(1, 40, 300)]
    ks = rng.integers(1, 6, len(contexts)).tolist()
    got = proposer.propose(contexts, ks)
    assert got == [reference(c, k, 2, 4) for c, k in zip(contexts, ks, strict=True)]
    assert sum(bool(g) for g in got) > 100  # most contexts over 4 symbols repeat


def test_a_proposer_that_ignores_the_longest_match_is_caught():
    """The reference comparison discriminates: trying short n-grams first proposes differently."""

    class ShortestFirst(NgramProposer):
        def propose_one(self, context, k):
            for n in range(self.min_n, self.max_n + 1):
                got = NgramProposer(n, n).propose_one(context, k)
                if got:
                    return got
            return []

    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 4, 30).tolist() for _ in range(50)]
    assert ShortestFirst(1, 4).propose(contexts, [3] * 50) != [reference(c, 3, 1, 4) for c in contexts]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="min"):
        NgramProposer(0, 2)
