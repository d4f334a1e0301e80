"""The sampler's tensor math: pure functions over a batch of float32 logits `[batch, vocab]`, one row per sequence,
with per-row settings as `[batch]` tensors. Each keeps the inputs unchanged; `execution/sampler.py` chains them."""
import torch

from nanovllm.kernels.fused import fused_op

NEG_INF = float("-inf")


@fused_op
def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """The repetition penalty on every token of the prompt (`prompt_mask`) or the output (`output_counts > 0`), as
    transformers and vLLM apply it: negative logits multiplied by it, the others divided; then the OpenAI-style
    frequency (per occurrence) and presence (once) penalties on output tokens."""
    in_output = output_counts > 0
    penalty = repetition.unsqueeze(1)
    repeated = torch.where(logits < 0, logits * penalty, logits / penalty)
    logits = torch.where(prompt_mask | in_output, repeated, logits)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * in_output


@fused_op(cpu_kernel="greedy_tokens")
def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (the first of equal maxima), int64 `[batch]`."""
    return logits.argmax(dim=-1)


@fused_op
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than `min_p` times the most likely one: p_i < min_p * p_max is
    logit_i < logit_max + log(min_p), so no softmax is needed. min_p 0 drops nothing."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (ties with the k-th included, as transformers' TopKLogitsWarper);
    top_k 0 keeps all. `max_top_k` (the largest k, at most the vocabulary) is passed from the host, so only
    `max_top_k` values are sorted and nothing waits on the device."""
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1).clamp_min(0).unsqueeze(1))
    kth = kth.masked_fill(top_k.unsqueeze(1) == 0, NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches `top_p`, always at least the most likely one,
    exactly as transformers' TopPLogitsWarper: in ascending order, drop tokens whose cumulative probability is at
    most 1 - top_p. top_p 1 keeps all. `candidates`: no row has more finite logits than that (top-k ran first), so
    only that many are sorted instead of the whole vocabulary."""
    if candidates is None:
        ascending, order = logits.sort(dim=-1)
    else:
        ascending, order = (t.flip(-1) for t in logits.topk(candidates, dim=-1))
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    return logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, drop), NEG_INF)


NUCLEUS_CANDIDATES = (256, 4096)


def apply_top_p_sorting_few(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`apply_top_p`, sorting only a row's most likely tokens where its nucleus lies within them (the fewest of
    `NUCLEUS_CANDIDATES` that hold it), the rows whose nucleus no candidates hold sorted whole: for the CPU, where torch
    sorted 49,152 logits in 1.5 ms a row (topk of 256: 0.06 ms; of 4,096: 0.5). The same tokens as the whole sort, up
    to which of equal logits at the boundary are kept (the sort does not order them) and to a cumulative probability
    within rounding of 1 - top_p. It reads the rows' verdicts on the host."""
    result = logits.clone()  # top_p 1 keeps every token
    pending = (top_p < 1).nonzero().squeeze(1).tolist()
    for candidates in NUCLEUS_CANDIDATES:
        if not pending or logits.size(-1) <= candidates:
            break
        kept, within = _top_p_within(logits[pending], top_p[pending], candidates)
        done, left = [], []
        for row, inside in zip(pending, within.tolist()):
            (done if inside else left).append(row)
        result[done] = kept[within]
        pending = left
    if pending:
        result[pending] = apply_top_p(logits[pending], top_p[pending])
    return result


def _top_p_within(logits: torch.Tensor, top_p: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_top_p` over each row's `candidates` most likely tokens, and whether the row's nucleus lies within them:
    the probability outside them is at most 1 - top_p, so every token outside is dropped, and each candidate's
    cumulative probability (ascending) is that outside plus the candidates' up to it."""
    top, order = logits.topk(candidates, dim=-1)  # descending
    probs = (top - logits.logsumexp(dim=-1, keepdim=True)).double().exp().flip(-1)  # ascending
    threshold = 1 - top_p.double().unsqueeze(1)
    outside = (1 - probs.sum(dim=-1, keepdim=True)).clamp_min_(0)
    drop = probs.cumsum(dim=-1) + outside <= threshold
    drop[:, -1] = False
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order.flip(-1), ~drop)
    return logits.masked_fill(~kept, NEG_INF), (outside <= threshold).squeeze(1)


def draw_tokens(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from its distribution `probs`, with no host sync. The rows in `generators` draw from their own
    generator, so their draw does not depend on the rest of the batch; the others share torch's default generator.
    On CUDA an exponential race (argmax of p / E, E ~ Exp(1) for every token; each seeded row is a launch of its own,
    never a host sync, as in vLLM V1's sampler); on the CPU, where that noise cost more than the model's step (12 ms
    for 32 rows of 49,152 tokens), the inverse of each row's cumulative distribution at one uniform draw (0.6 ms)."""
    if probs.device.type == "cpu":
        return inverse_cdf(probs, uniforms(probs.size(0), generators))
    noise = torch.empty_like(probs)
    if len(generators) < probs.size(0):
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)


def uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One float64 uniform draw in [0, 1) per row, on the CPU: the rows in `generators` from theirs, the others from
    torch's default generator (one draw each of all the rows, when any row uses it)."""
    drawn = torch.rand(rows, dtype=torch.float64) if len(generators) < rows else torch.empty(rows, dtype=torch.float64)
    for row, generator in generators.items():
        drawn[row] = torch.rand((), dtype=torch.float64, generator=generator)
    return drawn


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's first token whose cumulative probability (summed in float64) exceeds `uniform` (float64, in [0, 1))
    times the row's total: below the total, so a token of nonzero probability."""
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (uniform * cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp_max_(probs.size(-1) - 1)


def token_logprobs(scores: torch.Tensor, token_ids: torch.Tensor, num_top: int,
                   normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's value of `token_ids[row]` and its rank (how many tokens' values are at least as high, itself
    included: 1 is the highest; a token at -inf: the vocabulary's size), and the `num_top` highest values' token ids
    and values. The values are `scores` log-softmaxed (`normalize`, the `*_logprobs` modes of `logprobs_mode`) or
    `scores` as they are (the `*_logits` modes); `scores` are the model's logits (the raw modes) or the logits a row
    was sampled from (the processed ones, where tokens the sampler cannot draw are at -inf)."""
    values = scores.log_softmax(dim=-1) if normalize else scores
    chosen = values.gather(1, token_ids.unsqueeze(1))
    ranks = (values >= chosen).sum(dim=-1)
    top = values.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top.indices, top.values
