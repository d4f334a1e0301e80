"""GPT-NeoX (Pythia) and StableLM: LayerNorm with a bias, partial rotary, optionally a parallel residual."""
import re
from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation, head_dim

_NEOX_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
               ("gpt_neox.layers.", "model.layers."), ("embed_out.", "lm_head."),
               (".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc_in."),
               (".mlp.dense_4h_to_h.", ".mlp.down_proj."))

_HEAD_NORM = re.compile(r"\.([qk])_layernorm\.norms\.(\d+)\.weight$")  # StableLM's per-head norms, one tensor each
_HEAD_NORM_STACKED = re.compile(r"\.([qk])_layernorm\.")  # all heads in one tensor (GGUF)


class GPTNeoXForCausalLM(DecoderForCausalLM):
    """GPT-NeoX: q/k/v fused per head in the checkpoint (`[heads, 3, head_dim]` rows), an ungated MLP, the parallel
    residual (x + attn(ln1(x)) + mlp(ln2(x))) unless `use_parallel_residual` is false."""

    @classmethod
    def normalize_config(cls, config: PretrainedConfig) -> None:
        config.num_key_value_heads = config.num_attention_heads

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", True))
        return DecoderOptions(layer_norm=True, gated_mlp=False, activation=activation(config), qkv_bias=bias,
                              o_bias=bias, mlp_bias=True,
                              parallel_residual="neox" if config.use_parallel_residual else "")

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.heads, self.head_dim = config.num_attention_heads, head_dim(config)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in _NEOX_NAMES:
                name = name.replace(old, new)
            if ".attention.query_key_value." in name:
                per_head = tensor.reshape(self.heads, 3, self.head_dim, *tensor.shape[1:])
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield (name.replace(".attention.query_key_value.", f".self_attn.{part}."),
                           per_head[:, i].reshape(self.heads * self.head_dim, *tensor.shape[1:]))
            else:
                yield name, tensor


class StableLmForCausalLM(DecoderForCausalLM):
    """StableLM 2 / StableLM-3B: Llama's names and gated MLP, LayerNorm, partial rotary, optional q/k/v bias and
    parallel residual (x + attn(ln(x)) + mlp(ln(x)), one norm), optional LayerNorms per query/key head
    (`qk_layernorm`, StableLM 2 12B: the checkpoint has one tensor per head, stacked here as llama.cpp does)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(layer_norm=True, activation=activation(config), qkv_bias=bool(config.use_qkv_bias),
                              parallel_residual="stablelm" if config.use_parallel_residual else "",
                              qk_norm_heads=bool(getattr(config, "qk_layernorm", False)))

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        per_head: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            found = _HEAD_NORM.search(name)
            if found is None:
                yield _HEAD_NORM_STACKED.sub(r".\1_norm.", name), tensor
                continue
            stacked = f"{name[:found.start()]}.{found.group(1)}_norm.weight"
            heads = per_head.setdefault(stacked, {})
            heads[int(found.group(2))] = tensor
            if len(heads) == self.heads[found.group(1)]:
                yield stacked, torch.stack([heads[h] for h in range(len(heads))])
                del per_head[stacked]
