"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the verification of proposed tokens, and
its counters.

The scheduler runs a decode row with k proposed tokens as a (k + 1)-token chunk over the KV cache; the model runner
verifies every proposal of the step in that one forward (`verifier`); the engine proposes before each step
(`proposer`: n-gram drafts, or a draft model's placeholders that `draft_model` fills in once the step is scheduled)
and counts what was accepted (`stats`).
"""
