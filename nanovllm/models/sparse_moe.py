"""The mixture-of-experts MLP the MoE families put in place of the dense one: a replicated router, the routed experts
(`layers/moe.py`) and, in Qwen2-MoE, a shared expert every token goes through, scaled by its own sigmoid gate."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe import FusedMoE
from nanovllm.models.decoder import DecoderMLP, DecoderOptions

QWEN_EXPERT_MODULES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                       "down_proj": ("down_proj", 0)}


@dataclass(frozen=True)
class MoeOptions:
    """A family's experts, and the `DecoderOptions.mlp` that builds them: how many, how many per token, their size,
    whether the top-k weights are renormalized to sum to 1, the shared expert's size (0: none) and which layers keep
    the dense MLP instead."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} in the model config must be between 1 and the number "
                             f"of experts ({self.num_experts})")

    def __call__(self, config: PretrainedConfig, options: DecoderOptions, layer_index: int) -> nn.Module:
        """As `DecoderOptions.mlp`: layer `layer_index`'s MLP."""
        if layer_index in self.dense_layers:
            return DecoderMLP(config, options)
        return SparseMoeBlock(config, options, self)

    def active_intermediate_size(self, config: PretrainedConfig, layer_index: int) -> int:
        """The MLP width one token of layer `layer_index` computes: its k experts' and the shared expert's."""
        if layer_index in self.dense_layers:
            return config.intermediate_size
        return self.top_k * self.intermediate_size + self.shared_expert_intermediate_size


class SparseMoeBlock(nn.Module):
    """With tensor parallelism each rank computes partial sums of the routed experts' and the shared expert's outputs
    (the shared expert's gate is replicated, so it scales each rank's part), summed by one all-reduce."""

    def __init__(self, config: PretrainedConfig, options: DecoderOptions, moe: MoeOptions):
        super().__init__()
        self.tp_size = tp_rank_and_size()[1]
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                moe.renormalize)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = DecoderMLP(config, options, moe.shared_expert_intermediate_size,
                                            reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


def qwen_moe_options(config: PretrainedConfig, shared_expert: bool) -> MoeOptions:
    """Qwen2-MoE's and Qwen3-MoE's experts: a layer is sparse unless listed in `mlp_only_layers` or off the
    `decoder_sparse_step` (every step-th layer is sparse)."""
    step = config.decoder_sparse_step
    dense = frozenset(i for i in range(config.num_hidden_layers)
                      if i in config.mlp_only_layers or not (config.num_experts > 0 and (i + 1) % step == 0))
    return MoeOptions(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                      intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                      shared_expert_intermediate_size=config.shared_expert_intermediate_size if shared_expert else 0,
                      dense_layers=dense)
