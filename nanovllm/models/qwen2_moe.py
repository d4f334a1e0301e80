from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.sparse_moe import QWEN_EXPERT_MODULES, qwen_moe_options


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (`qkv_bias`), routed experts plus a shared expert behind a
    sigmoid gate, dense layers per `mlp_only_layers` / `decoder_sparse_step`."""

    expert_modules_mapping = QWEN_EXPERT_MODULES

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("this Qwen2-MoE config sets use_sliding_window=true; nanovllm runs full attention only")
        return DecoderOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)),
                              mlp=qwen_moe_options(config, shared_expert=True))
