"""Drafts of sequences under a structured-output grammar (pure bookkeeping: the grammar state is the sequence's).

Exact jump-forward: where a grammar forces the next tokens (a key, `": "`, a closing brace), they are proposed as
drafts and verified in the sequence's next step like any other draft, so the model keeps only what it would have
written itself and the output is unchanged; a forced run costs one step instead of one per token. This needs no
`speculative_config`. With one, a proposer's drafts that begin with the forced tokens are kept whole (they continue
them); others give way to the forced tokens. Then every constrained sequence's drafts are cut to the longest prefix
its grammar accepts, so verification never computes a row its mask could not sample, and the step's mask covers
every draft position (`StructuredOutputs.bitmask`).
"""
from nanovllm.core.sequence import Sequence
from nanovllm.spec_decode.proposer import draft_room, speculates

MAX_FORCED = 16  # forced tokens proposed at once: a long key or constant costs a few rows of one step


class GrammarDrafts:
    """Sets `spec_token_ids` of the running constrained sequences before the scheduler runs, after the speculative
    proposer (if any) has proposed: `proposed` says whether it has (else drafts left from an earlier step are
    dropped). `jump_forward` off: only the cut."""

    def __init__(self, jump_forward: bool, max_model_len: int):
        self.jump_forward = jump_forward
        self.max_model_len = max_model_len

    def propose(self, running: list[Sequence], proposed: bool) -> None:
        for seq in running:
            if seq.grammar is None:
                continue
            drafts = seq.spec_token_ids if proposed else []
            if self.jump_forward and len(seq.token_ids) - seq.num_computed_tokens == 1 and speculates(seq):
                forced = seq.grammar.forced_tokens()[:draft_room(seq, MAX_FORCED, self.max_model_len)]
                if drafts[:len(forced)] != forced:
                    drafts = forced
            seq.spec_token_ids = seq.grammar.valid_prefix(drafts)
