"""Reading Hugging Face model configs the same way across transformers 4 and 5 and hub-style config.json files."""
import math

from transformers import PretrainedConfig

from nanovllm.layers.activation import ACTIVATIONS
from nanovllm.layers.rotary_embedding import (
    DynamicNtkScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_types(cfg: PretrainedConfig) -> list[str]:
    """Each layer's attention: "full_attention" or "sliding_attention" (transformers' `layer_types`)."""
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)


def _rope_parameters(cfg: PretrainedConfig, layer_type: str | None = None) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters` (one dict, or one per layer type as for Gemma 3); hub
    configs and transformers 4 in `rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    if any(isinstance(value, dict) for value in params.values()):
        return params.get("full_attention") or {}
    return params


def rope_theta(cfg: PretrainedConfig, layer_type: str | None = None) -> float:
    """`rope_theta` lives at the top level of hub configs and in `rope_parameters` since transformers 5."""
    theta = _rope_parameters(cfg, layer_type).get("rope_theta")
    if theta is None:
        theta = getattr(cfg, "rope_theta", None)
    return float(10000.0 if theta is None else theta)


def rotary_dim(cfg: PretrainedConfig) -> int:
    """Features of each head that rotate: `partial_rotary_factor` (or GPT-NeoX's `rotary_pct`) of head_dim."""
    factor = _rope_parameters(cfg).get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) \
        or getattr(cfg, "rotary_pct", None) or 1.0
    return int(head_dim(cfg) * factor)


def _require(kind: str, params: dict, *keys: str) -> list:
    missing = [key for key in keys if params.get(key) is None]
    if missing:
        raise ValueError(f"{kind} rope scaling in the model config lacks {missing[0]!r}")
    return [params[key] for key in keys]


def _yarn_attention_factor(params: dict, factor: float) -> float:
    """transformers' default: 0.1 ln(factor) + 1, or the ratio of two such terms with `mscale` and `mscale_all_dim`."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


def rope_scaling(cfg: PretrainedConfig, layer_type: str | None = None) -> RopeScaling | None:
    """The model's rope frequency scaling (for one layer type where they differ): None for plain rope; an unsupported
    type is a ValueError naming it and the supported ones."""
    params = _rope_parameters(cfg, layer_type)
    kind = params.get("rope_type", params.get("type")) or "default"
    original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings",
                                                                          None) or cfg.max_position_embeddings
    if kind == "default":
        return None
    if kind == "linear":
        return LinearRopeScaling(float(*_require(kind, params, "factor")))
    if kind == "llama3":
        factor, low, high, original = _require(kind, params, "factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")
        return Llama3RopeScaling(factor=float(factor), low_freq_factor=float(low), high_freq_factor=float(high),
                                 original_max_position_embeddings=int(original))
    if kind == "yarn":
        factor = params.get("factor") or cfg.max_position_embeddings / original
        return YarnRopeScaling(factor=float(factor), original_max_position_embeddings=int(original),
                               attention_factor=_yarn_attention_factor(params, factor),
                               beta_fast=float(params.get("beta_fast") or 32),
                               beta_slow=float(params.get("beta_slow") or 1),
                               truncate=bool(params.get("truncate", True)))
    if kind == "dynamic":
        return DynamicNtkScaling(float(*_require(kind, params, "factor")), cfg.max_position_embeddings)
    if kind == "longrope":
        short, long = _require(kind, params, "short_factor", "long_factor")
        factor = params.get("factor") or cfg.max_position_embeddings / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return LongRopeScaling(tuple(map(float, short)), tuple(map(float, long)), int(original),
                               float(attention_factor))
    raise ValueError(f"unsupported rope scaling {kind!r} in the model config; nanovllm supports "
                     f"{list(SUPPORTED_ROPE_TYPES)}")


def activation(cfg: PretrainedConfig, name: str = "hidden_act") -> str:
    """The MLP activation under config key `name`; one the MLPs do not implement is a ValueError naming it."""
    act = getattr(cfg, name, None) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported {name} {act!r} in the model config; nanovllm supports {list(ACTIVATIONS)}")
    return act


def layer_windows(cfg: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention): the layers transformers marks "sliding_attention" where the
    config has `layer_types` (Gemma 2/3), else every layer when `sliding_window` is set (Mistral, Phi-3)."""
    window = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return (window,) * cfg.num_hidden_layers


def is_classifier(config: PretrainedConfig) -> bool:
    """Whether the config's architecture is a `*ForSequenceClassification` (a classification head)."""
    return any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or [])


def is_encoder(config: PretrainedConfig) -> bool:
    """Whether the config is an encoder-only model's (BERT, RoBERTa, XLM-RoBERTa, ModernBERT: bidirectional
    attention)."""
    return config.model_type in ("bert", "roberta", "xlm-roberta", "modernbert")


def reads_token_types(config: PretrainedConfig) -> bool:
    """Whether the model reads token type ids (an encoder with more than one: BERT's text pairs)."""
    return is_encoder(config) and getattr(config, "type_vocab_size", 1) > 1


def max_positions(config: PretrainedConfig) -> int:
    """The longest sequence the config's position embeddings cover: `max_position_embeddings`, less RoBERTa's offset
    (its positions start past its padding index)."""
    offset = config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta") else 0
    return config.max_position_embeddings - offset
