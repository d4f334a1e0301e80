from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.sparse_moe import QWEN_EXPERT_MODULES, qwen_moe_options


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k RMSNorm) and routed experts without a shared one, the top-k weights
    renormalized when `norm_topk_prob` is set."""

    expert_modules_mapping = QWEN_EXPERT_MODULES

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("this Qwen3-MoE config sets use_sliding_window=true; nanovllm runs full attention only")
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qk_norm=True, qkv_bias=bias, o_bias=bias,
                              mlp=qwen_moe_options(config, shared_expert=False))
