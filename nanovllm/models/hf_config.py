"""Reading Hugging Face model configs the same way across transformers 4 and 5 and hub-style config.json files."""
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import Llama3RopeScaling

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_parameters(cfg: PretrainedConfig) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; hub configs and transformers 4 in `rope_scaling`."""
    return getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}


def rope_theta(cfg: PretrainedConfig) -> float:
    """`rope_theta` lives at the top level of hub configs and in `rope_parameters` since transformers 5."""
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = _rope_parameters(cfg).get("rope_theta", 10000.0)
    return float(theta)


def rope_scaling(cfg: PretrainedConfig) -> Llama3RopeScaling | None:
    """The model's rope frequency scaling: None for plain rope, or Llama 3.1's; anything else is rejected."""
    params = _rope_parameters(cfg)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return None
    if kind == "llama3":
        try:
            return Llama3RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                     high_freq_factor=float(params["high_freq_factor"]),
                                     original_max_position_embeddings=int(params["original_max_position_embeddings"]))
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling in the model config lacks {e.args[0]!r}") from None
    raise ValueError(f"unsupported rope scaling {kind!r} in the model config; nanovllm supports "
                     f"{list(SUPPORTED_ROPE_TYPES)}")
