from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import layer_windows
from nanovllm.models.sparse_moe import MoeOptions


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: Mistral's attention and a mixture of `num_local_experts` experts in every layer, the top-k weights
    renormalized. Checkpoints name the MLP `block_sparse_moe` and the expert projections w1 (gate), w3 (up), w2
    (down)."""

    expert_modules_mapping = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        moe = MoeOptions(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                         intermediate_size=config.intermediate_size, renormalize=True)
        return DecoderOptions(mlp=moe, layer_windows=layer_windows(config))

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
