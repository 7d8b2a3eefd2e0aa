"""Speculative decoding: proposers guess the next tokens cheaply, the target engine verifies them
in one step, and the rejection sampler keeps the longest prefix the target distribution allows."""

from runtime.engine.spec.draft import DraftEngineProposer
from runtime.engine.spec.factory import create_proposer
from runtime.engine.spec.ngram import NgramProposer
from runtime.engine.spec.proposer import Proposer
from runtime.engine.spec.rejection_sampler import RejectionSampler, VerifyResult

__all__ = ["DraftEngineProposer", "NgramProposer", "Proposer", "RejectionSampler", "VerifyResult", "create_proposer"]
