from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation, head_dim, layer_windows


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 and Phi-3.5 (dense): Llama's layers, the checkpoint's q/k/v and gate/up projections each stored as one
    fused tensor, an optional sliding window and partial rotary (`partial_rotary_factor`)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(activation=activation(config), layer_windows=layer_windows(config))

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
        self.qkv_sizes = [q, kv, kv]

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(self.qkv_sizes)):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".gate_up_proj." in name:
                for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                    yield name.replace(".gate_up_proj.", f".{part}."), piece
            else:
                yield name, tensor
