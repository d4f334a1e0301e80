import torch
from torch import nn

from nanovllm.utils.compile import fused_op


@fused_op
def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperatures.clamp_min(1e-5).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    sampled = (probs / torch.empty_like(probs).exponential_(1).clamp_min(1e-10)).argmax(dim=-1)
    return torch.where(temperatures == 0, greedy, sampled)


class Sampler(nn.Module):
    """Greedy where temperature is 0, else a sample from softmax(logits / temperature).

    Sampling uses the exponential-race (Gumbel-max) form: argmax(p / E) with E ~ Exp(1) is a draw
    from p, with no cumulative sums and no host sync.
    """

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return sample(logits, temperatures)
