from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {"qwen3": Qwen3ForCausalLM}


def build_model(config: PretrainedConfig) -> nn.Module:
    return MODEL_REGISTRY[config.model_type](config)
