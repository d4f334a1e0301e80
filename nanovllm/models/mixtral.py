from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.sparse_moe import MoeOptions


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: Mistral's attention and a mixture of `num_local_experts` experts in every layer, the top-k weights
    renormalized. Checkpoints name the MLP `block_sparse_moe` and the expert projections w1 (gate), w3 (up), w2
    (down)."""

    weight_renames = {"block_sparse_moe": "mlp"}
    expert_modules_mapping = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        if getattr(config, "sliding_window", None):
            raise ValueError(f"this Mixtral config sets sliding_window={config.sliding_window}; nanovllm runs "
                             "Mixtral with full attention only (sliding_window null)")
        moe = MoeOptions(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                         intermediate_size=config.intermediate_size, renormalize=True)
        return DecoderOptions(mlp=moe)
