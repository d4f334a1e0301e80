"""What each running sequence proposes before a step (pure bookkeeping: no tensors)."""
from nanovllm.core.sequence import Sequence
from nanovllm.spec_decode.config import SpeculativeConfig
from nanovllm.spec_decode.ngram import ngram_proposal


def speculates(seq: Sequence) -> bool:
    """Whether `seq`'s sampling can verify drafts: not under penalties, whose counts the sampler keeps per sequence
    on the device and would not see the drafts."""
    return not seq.params.uses_penalties


class NgramProposer:
    """Sets `spec_token_ids` of every running sequence before the scheduler runs: prompt-lookup proposals for those
    about to decode, none for the others or when `disable_by_batch_size` sequences or more run. A proposal never
    runs past `max_tokens` or `max_model_len`."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.spec = spec
        self.max_model_len = max_model_len

    def propose(self, running: list[Sequence]) -> None:
        enabled = len(running) < self.spec.disable_by_batch_size
        for seq in running:
            if enabled and len(seq.token_ids) - seq.num_computed_tokens == 1 and speculates(seq):
                seq.spec_token_ids = ngram_proposal(seq.token_ids, self.spec.prompt_lookup_min,
                                                    self.spec.prompt_lookup_max, self._room(seq))
            elif seq.spec_token_ids:
                seq.spec_token_ids = []

    def _room(self, seq: Sequence) -> int:
        """How many drafts `seq` can use: a step yields at most one token more than it verifies."""
        room = min(self.spec.num_speculative_tokens, self.max_model_len - len(seq.token_ids))
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_completion_tokens - 1)
        return max(room, 0)
