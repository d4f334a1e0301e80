"""Verification of proposed tokens (drafts) against the target model.

Point-mass drafts (n-gram lookup's, a draft model's greedy or seeded proposals: one token per position, with
probability 1):
Each verified position is sampled by the ordinary sampler, as if the drafts before it had been accepted (row j of a
sequence sees its tokens plus its first j drafts: min_tokens, bad words and allowed tokens apply there). Draft j is
accepted while the token sampled at its position equals it; the first token that differs, or the token after the
last draft, ends the step. For a point-mass draft d this is exactly speculative sampling's rule: d is accepted with
probability p(d), and on rejection the token is drawn from p with d removed and renormalised; so the output has the
target's distribution, and greedy output is the argmax at every position, as without speculation. A seeded
sequence's generator is left as if one draw per kept token had been made, so its output is the same with or
without speculation, and does not depend on its batch mates.

Sampled drafts (a draft model's, for unseeded requests at temperature > 0, with the draft's probabilities q):
speculative sampling (Leviathan et al., Chen et al.): draft d is accepted with probability min(1, p(d) / q(d)), with
p and q both as the sampler shapes them (temperature, min-p, top-k, top-p, min_tokens, allowed tokens, bad words);
the first rejected position draws from max(0, p - q) renormalised, and the position after the last accepted draft
from p. Each emitted token has the target's distribution.

Both are decided on the device: a step's tokens, acceptance counts and logprobs (and prompt logprobs, when passed)
reach the host in one transfer (`nanovllm.execution.sampler.fetch`). An accepted token's logprobs are those of its
position's row, in the sampler's `logprobs_mode`: the processed modes read the logits the row was sampled from.
"""
from bisect import bisect_right
from dataclasses import replace
from itertools import accumulate

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.execution.sampler import Pending, Sampler, SamplerOutput, SamplingRow, fetch_step, gather
from nanovllm.execution.sampling_ops import draw_tokens
from nanovllm.execution.step_inputs import to_device
from nanovllm.structured_output.bitmask import TokenBitmask


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]],
           allowed: TokenBitmask | None = None, draft_probs: dict[int, torch.Tensor] | None = None,
           prompt: Pending[dict] | None = None) -> SamplerOutput:
    """`logits` holds `len(drafts) + 1` consecutive rows per `(seq, drafts)` in `rows`: the positions of its last
    token and of each draft. Returns each sequence's accepted drafts and the token after them (see the module).
    `allowed` (structured outputs) names the rows of `logits` it masks: a constrained sequence's row j under its
    grammar after its first j drafts, so each position is sampled as it would be without drafts. `draft_probs`: per
    sequence id, the draft's probabilities at each of its drafts (`[len(drafts), vocab]`), for sequences whose drafts
    were sampled (never constrained ones: the draft model does not propose for them); the others' are point
    masses. `prompt`: the step's prompt logprobs (`Sampler.score_prompts`). Everything reaches the host in one
    transfer."""
    sampled = [i for i, (seq, _) in enumerate(rows) if draft_probs and seq.seq_id in draft_probs]
    if not sampled:
        return fetch_step(_verify_point_masses(sampler, logits, rows, allowed), prompt)
    point = [i for i in range(len(rows)) if i not in sampled]
    first_rows = list(accumulate((1 + len(drafts) for _, drafts in rows), initial=0))

    def logits_of(part: list[int]) -> torch.Tensor:
        if len(part) == len(rows):
            return logits
        index = [r for i in part for r in range(first_rows[i], first_rows[i + 1])]
        return logits[to_device(index, torch.int64, logits.device)]

    parts = [_verify_distributions(sampler, logits_of(sampled), [rows[i] for i in sampled], draft_probs)]
    if point:
        mask = None if allowed is None else replace(allowed, rows=_rows_within(point, first_rows, allowed.rows))
        parts.append(_verify_point_masses(sampler, logits_of(point), [rows[i] for i in point], mask))
    return fetch_step(gather(parts, lambda outputs: _merge([sampled, point], outputs)), prompt)


def _rows_within(part: list[int], first_rows: list[int], rows: list[int]) -> list[int]:
    """`rows` of the whole `logits` renumbered as rows of the logits of `part` (sequence indices) alone."""
    starts = dict(zip(part, accumulate((first_rows[i + 1] - first_rows[i] for i in part), initial=0)))
    renumbered = []
    for r in rows:
        i = bisect_right(first_rows, r) - 1
        renumbered.append(starts[i] + r - first_rows[i])
    return renumbered


def _merge(parts: list[list[int]], outputs: list[SamplerOutput]) -> SamplerOutput:
    """One output in `rows` order from the outputs of disjoint parts of it."""
    per_seq = {}
    for part, output in zip(parts, outputs):
        tokens = iter(output.token_ids)
        logprobs = iter(output.logprobs) if output.logprobs is not None else None
        for i, accepted in zip(part, output.num_accepted):
            per_seq[i] = ([next(tokens) for _ in range(accepted + 1)],
                          [next(logprobs) if logprobs is not None else None for _ in range(accepted + 1)], accepted)
    token_ids, logprobs, num_accepted = [], [], []
    for i in sorted(per_seq):
        token_ids += per_seq[i][0]
        logprobs += per_seq[i][1]
        num_accepted.append(per_seq[i][2])
    asked = any(output.logprobs is not None for output in outputs)
    return SamplerOutput(token_ids, logprobs if asked else None, num_accepted=num_accepted)


def _virtual_rows(rows: list[tuple[Sequence, list[int]]]) -> list[Sequence | SamplingRow]:
    """What the sampler reads at each verified position: row j of a sequence sees its tokens and first j drafts."""
    virtual: list[Sequence | SamplingRow] = []
    for seq, drafts in rows:
        virtual.append(seq)
        virtual += [SamplingRow(seq.seq_id, seq.params, seq.token_ids + drafts[:j], seq.num_prompt_tokens)
                    for j in range(1, len(drafts) + 1)]
    return virtual


def _verify_distributions(sampler: Sampler, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]],
                          draft_probs: dict[int, torch.Tensor]) -> Pending[SamplerOutput]:
    """Speculative sampling of sampled drafts (see the module), decided on the device: each sequence's drafts'
    verdicts padded into a `[sequences, max drafts]` matrix, whose cumulative product counts its leading accepted
    drafts; the row after them (the residual at the first rejected draft, else p) raced for the final token; the
    logprobs of every row computed. Draws from torch's default generator."""
    virtual = _virtual_rows(rows)
    truncated = sampler.truncated(sampler.masked(logits, virtual), virtual)  # the logits each row samples from
    p = truncated.softmax(dim=-1)
    q = torch.cat([draft_probs[seq.seq_id] for seq, _ in rows])
    lengths = [len(drafts) for _, drafts in rows]
    first_rows = list(accumulate((1 + n for n in lengths), initial=0))[:-1]
    first_drafts = list(accumulate(lengths, initial=0))
    num_seqs, num_drafts, width = len(rows), first_drafts[-1], max(lengths)
    asked = any(seq.params.logprobs is not None for seq, _ in rows)
    index = to_device([first + j for first, n in zip(first_rows, lengths) for j in range(n)]  # each draft's row
                      + [d for _, drafts in rows for d in drafts]  # each draft
                      + [first_drafts[i] + j if j < n else num_drafts for i, n in enumerate(lengths)
                         for j in range(width)]  # the padded matrix's verdicts (num_drafts: a rejection)
                      + first_rows + first_drafts[:-1] + lengths
                      + ([d for _, drafts in rows for d in drafts + [0]] if asked else []),  # each row's token
                      torch.int64, p.device)
    draft_rows, drafted, padded, seq_rows, seq_drafts, seq_lengths, row_tokens = index.split(
        [num_drafts, num_drafts, num_seqs * width, num_seqs, num_seqs, num_seqs, len(p) if asked else 0])
    ratio = p[draft_rows, drafted] / q.gather(1, drafted.unsqueeze(1)).squeeze(1)
    accepts = torch.rand(num_drafts, device=p.device) < ratio
    verdicts = torch.cat([accepts, accepts.new_zeros(1)])[padded].view(num_seqs, width)
    num_accepted = verdicts.cumprod(dim=1).sum(dim=1)
    last = seq_rows + num_accepted  # each sequence's row after its accepted drafts
    target = p[last]
    residual = (target - q[seq_drafts + torch.minimum(num_accepted, seq_lengths - 1)]).clamp_min_(0)
    rejected = (num_accepted < seq_lengths) & (residual.sum(dim=1) > 0)
    finals = draw_tokens(torch.where(rejected.unsqueeze(1), residual, target), {})
    logprobs = sampler.logprobs(logits, virtual, row_tokens.index_put((last,), finals), truncated) if asked else None

    def finish(results: list) -> SamplerOutput:
        (accepted_counts, final_tokens), row_logprobs = results
        token_ids, logprobs = [], []
        for (_, drafts), first, accepted, final in zip(rows, first_rows, accepted_counts, final_tokens):
            token_ids += drafts[:accepted] + [final]
            if row_logprobs is not None:
                logprobs += row_logprobs[first:first + accepted + 1]
        return SamplerOutput(token_ids, logprobs if row_logprobs is not None else None,
                             num_accepted=accepted_counts)

    return gather([Pending([torch.stack([num_accepted, finals])], lambda values: values[0]), logprobs], finish)


def _verify_point_masses(sampler: Sampler, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]],
                         allowed: TokenBitmask | None = None) -> Pending[SamplerOutput]:
    virtual = _virtual_rows(rows)
    seeded = {seq.seq_id: _state(sampler, seq) for seq, drafts in rows
              if drafts and seq.params.seed is not None and seq.params.temperature > 0}

    def finish(results: list) -> SamplerOutput:
        sampled = results[0]
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

    return gather([sampler.sample(logits, virtual, allowed)], finish)


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
    draw_tokens(probs, dict.fromkeys(range(draws), generator))
