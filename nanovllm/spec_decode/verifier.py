"""Verification of proposed tokens (drafts) against the target model, for proposers whose draft is a point mass
(n-gram lookup proposes one token per position, with probability 1).

Each verified position is sampled by the ordinary sampler, as if the drafts before it had been accepted (row j of a
sequence sees its tokens plus its first j drafts: min_tokens, bad words and allowed tokens apply there). Draft j is
accepted while the token sampled at its position equals it; the first token that differs, or the token after the
last draft, ends the step. For a point-mass draft d this is exactly speculative sampling's rule: d is accepted with
probability p(d), and on rejection the token is drawn from p with d removed and renormalised; so the output has the
target's distribution, and greedy output is the argmax at every position, as without speculation. A seeded
sequence's generator is left as if one draw per kept token had been made, so its output is the same with or
without speculation, and does not depend on its batch mates.
"""
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.execution.sampler import Sampler, SamplerOutput, SamplingRow
from nanovllm.execution.sampling_ops import exponential_race
from nanovllm.structured_output.bitmask import TokenBitmask


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]],
           allowed: TokenBitmask | None = None) -> SamplerOutput:
    """`logits` holds `len(drafts) + 1` consecutive rows per `(seq, drafts)` in `rows`: the positions of its last
    token and of each draft. Returns each sequence's accepted drafts and the token after them (see the module).
    `allowed` (structured outputs) names the rows of `logits` it masks: a constrained sequence's row j under its
    grammar after its first j drafts, so each position is sampled as it would be without drafts."""
    virtual: list[Sequence | SamplingRow] = []
    for seq, drafts in rows:
        virtual.append(seq)
        virtual += [SamplingRow(seq.seq_id, seq.params, seq.token_ids + drafts[:j], seq.num_prompt_tokens)
                    for j in range(1, len(drafts) + 1)]
    seeded = {seq.seq_id: _state(sampler, seq) for seq, drafts in rows
              if drafts and seq.params.seed is not None and seq.params.temperature > 0}
    sampled = sampler(logits, virtual, allowed)
    token_ids, logprobs, num_accepted, row = [], [] if sampled.logprobs is not None else None, [], 0
    for seq, drafts in rows:
        accepted = 0
        while accepted < len(drafts) and sampled.token_ids[row + accepted] == drafts[accepted]:
            accepted += 1
        token_ids += sampled.token_ids[row:row + accepted + 1]
        if logprobs is not None:
            logprobs += sampled.logprobs[row:row + accepted + 1]
        num_accepted.append(accepted)
        if seq.seq_id in seeded:
            _replay(sampler, seq, seeded[seq.seq_id], accepted + 1)
        row += len(drafts) + 1
    return SamplerOutput(token_ids, logprobs, num_accepted=num_accepted)


def _state(sampler: Sampler, seq: Sequence) -> torch.Tensor | None:
    """The sequence's generator state before this step's draws (None: it has none yet, so it starts from its seed)."""
    generator = sampler.generators.get(seq.seq_id)
    return None if generator is None else generator.get_state()


def _replay(sampler: Sampler, seq: Sequence, state: torch.Tensor | None, draws: int) -> None:
    """Put the sequence's generator where `draws` samples from `state` leave it: as many as tokens were kept."""
    generator = sampler.generators[seq.seq_id]
    if state is None:
        generator.manual_seed(seq.params.seed)
    else:
        generator.set_state(state)
    probs = torch.ones(draws, sampler.vocab_size, device=sampler.device)
    exponential_race(probs, dict.fromkeys(range(draws), generator))
