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


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i, with no cumulative
    sum and no host sync. The rows in `generators` draw their E from their own generator, so their draw does not
    depend on the rest of the batch; the others share torch's default generator. Each seeded row is a launch of its
    own (a kernel launch, never a host sync, as in vLLM V1's sampler): one launch for all would need a counter-based
    generator keyed by each request's seed and draw count, which torch does not offer, and would change every seeded
    request's tokens."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.size(0):
        _exponential(noise)
    for row, generator in generators.items():
        _exponential(noise[row], generator)
    return (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)


def _exponential(out: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Fill `out` with Exp(1) draws. On CPU as -log(U), U uniform drawn in float64 (so never 0 in practice):
    2.5x faster there than `exponential_`, which is the faster one on GPUs."""
    if out.device.type != "cpu":
        out.exponential_(generator=generator)
        return
    uniform = torch.rand(out.shape, dtype=torch.float64, generator=generator)
    out.copy_(uniform.log_().neg_())


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
