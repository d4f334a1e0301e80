"""What each running sequence proposes before a step (pure bookkeeping: no tensors), and how many of its proposed
tokens it keeps: the adaptive rule that turns speculation down where it stops paying."""
from collections.abc import Callable

from nanovllm.config import SpeculativeConfig
from nanovllm.core.sequence import Sequence
from nanovllm.spec_decode.ngram import ngram_proposal

# A sequence's per-draft acceptance before it has verified any: PRIOR_ACCEPTED of PRIOR_TRIALS.
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.4, 2.0


def speculates(seq: Sequence) -> bool:
    """Whether `seq`'s sampling can verify drafts: not under penalties, whose counts the sampler keeps per sequence
    on the device and would not see the drafts. A structured-output grammar's drafts are cut to what it accepts, and
    its mask covers every draft position (`nanovllm.spec_decode.grammar_drafts`)."""
    return not seq.params.uses_penalties


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts (at most `k`) `seq` can use: a step yields at most one token more than it verifies, and never
    runs past `max_tokens` or `max_model_len`."""
    room = min(k, max_model_len - len(seq.token_ids))
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_completion_tokens - 1)
    return max(room, 0)


def acceptance(seq: Sequence) -> float:
    """The chance that `seq`'s next draft is accepted, estimated from its history (smoothed by the prior)."""
    return (seq.spec_accepted + PRIOR_ACCEPTED) / (seq.spec_trials + PRIOR_TRIALS)


def plain_cost(step_cost: tuple[int, int], num_seqs: int, num_rows: int) -> int:
    """What a step of `num_seqs` sequences and `num_rows` rows costs before its drafts, in rows: with `step_cost`
    (fixed, per_sequence), fixed + per_sequence * num_seqs + num_rows."""
    fixed, per_sequence = step_cost
    return fixed + per_sequence * num_seqs + num_rows


def keep_drafts(proposals: dict[Sequence, list[int]], num_seqs: int, num_rows: int,
                step_cost: tuple[int, int]) -> dict[Sequence, int]:
    """How many of its proposed drafts each sequence keeps, so that the step's expected tokens per unit of cost are
    highest. With `step_cost` (fixed, per_sequence), a step of `num_seqs` sequences and `num_rows` rows costs
    fixed + per_sequence * num_seqs + num_rows, plus one per draft; each sequence yields a token, and the j-th draft
    of a sequence with acceptance a yields a**j more on average (all j must be accepted). Drafts are taken best
    first while one adds more than the step's current tokens per cost: at small batch every likely draft, at large
    batch only likely ones, and none for a sequence whose drafts are mostly rejected."""
    candidates = sorted(((acceptance(seq) ** j, i, seq) for i, (seq, drafts) in enumerate(proposals.items())
                         for j in range(1, len(drafts) + 1)), key=lambda c: (-c[0], c[1]))
    expected, cost = float(num_seqs), plain_cost(step_cost, num_seqs, num_rows)
    kept = dict.fromkeys(proposals, 0)
    for gain, _, seq in candidates:
        if gain * cost <= expected:
            break
        kept[seq] += 1
        expected, cost = expected + gain, cost + 1
    return kept


class NgramProposer:
    """Sets `spec_token_ids` of every running sequence before the scheduler runs: prompt-lookup proposals for those
    about to decode, as many as `keep_drafts` finds worth it; none for the others or when `disable_by_batch_size`
    sequences or more run. A proposal never runs past `max_tokens` or `max_model_len`."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.spec = spec
        self.max_model_len = max_model_len
        self.draft_factor = 1.0  # what the last proposal's step costs for drafting, in steps of the target alone

    def propose(self, running: list[Sequence]) -> None:
        self.draft_factor = 1.0
        limit = self.spec.disable_by_batch_size
        enabled = limit is None or len(running) < limit
        proposals = {}
        for seq in running:
            seq.spec_token_ids = []
            if enabled and len(seq.token_ids) - seq.num_computed_tokens == 1 and speculates(seq):
                drafts = self._proposal(seq)
                if drafts:
                    proposals[seq] = drafts
        if not proposals:
            return
        num_rows = sum(len(seq.token_ids) - seq.num_computed_tokens for seq in running)
        for seq, count in self._keep(proposals, len(running), num_rows).items():
            seq.spec_token_ids = proposals[seq][:count]

    def _keep(self, proposals: dict[Sequence, list[int]], num_seqs: int, num_rows: int) -> dict[Sequence, int]:
        return keep_drafts(proposals, num_seqs, num_rows, self.spec.step_cost)

    def _proposal(self, seq: Sequence) -> list[int]:
        return ngram_proposal(seq.token_ids, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max,
                              self._room(seq))

    def _room(self, seq: Sequence) -> int:
        return draft_room(seq, self.spec.num_speculative_tokens, self.max_model_len)


def drafts_pay(running: list[Sequence], step_cost: tuple[int, int], price: float) -> bool:
    """Whether the running sequences' drafts (`spec_token_ids`) are worth verifying in a step that costs `price`
    times the same step without them (where a plain step replays a CUDA graph and a verify step cannot): more
    expected tokens per cost with them than without, in `keep_drafts`' cost model."""
    num_seqs = len(running)
    cost = plain_cost(step_cost, num_seqs, sum(len(seq) - seq.num_computed_tokens for seq in running))
    drafts = sum(len(seq.spec_token_ids) for seq in running)
    expected = num_seqs + sum(acceptance(seq) ** j for seq in running for j in range(1, len(seq.spec_token_ids) + 1))
    return expected / (price * (cost + drafts)) > num_seqs / cost


def keep_model_drafts(proposals: dict[Sequence, list[int]], num_seqs: int, num_rows: int,
                      step_cost: tuple[int, int], forward_ratio: float) -> dict[Sequence, int]:
    """How many drafts each sequence keeps when a draft model proposes them: the depth d (every sequence keeps up to
    d) whose step yields the most expected tokens per cost, where the step's cost is the target's (`keep_drafts`'
    model, each kept draft one more row) times 1 + d x `forward_ratio`, since each of the d draft forwards, which
    all speculating sequences share, costs `forward_ratio` target steps. Depth 0: no drafts."""
    base = plain_cost(step_cost, num_seqs, num_rows)
    best_rate, best_depth = num_seqs / base, 0
    for depth in range(1, max(map(len, proposals.values())) + 1):
        kept = {seq: min(depth, len(drafts)) for seq, drafts in proposals.items()}
        expected = num_seqs + sum(acceptance(seq) ** j for seq, n in kept.items() for j in range(1, n + 1))
        rate = expected / ((base + sum(kept.values())) * (1 + depth * forward_ratio))
        if rate > best_rate:
            best_rate, best_depth = rate, depth
    return {seq: min(best_depth, len(drafts)) for seq, drafts in proposals.items()}


class DraftModelProposer(NgramProposer):
    """Reserves a draft model's proposals: placeholder tokens (0), as many as `keep_model_drafts` keeps of the
    `num_speculative_tokens` a sequence has room for; the model runner's draft model
    (`nanovllm.execution.draft_model`) replaces them by its tokens once the scheduler has given them KV slots.
    `forward_ratio(n)`: what a draft forward over n sequences costs, in target steps (measured by the draft model)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, forward_ratio: Callable[[int], float]):
        super().__init__(spec, max_model_len)
        self.forward_ratio = forward_ratio

    def _proposal(self, seq: Sequence) -> list[int]:
        """Placeholders, none under a grammar: its drafts are the forced tokens alone
        (`nanovllm.spec_decode.grammar_drafts`), since the draft model's sampled proposals would need the grammar's
        mask at every draft step."""
        return [] if seq.grammar is not None else [0] * self._room(seq)

    def _keep(self, proposals: dict[Sequence, list[int]], num_seqs: int, num_rows: int) -> dict[Sequence, int]:
        ratio = self.forward_ratio(len(proposals))
        kept = keep_model_drafts(proposals, num_seqs, num_rows, self.spec.step_cost, ratio)
        self.draft_factor = 1 + max(kept.values()) * ratio
        return kept
