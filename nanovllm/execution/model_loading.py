"""Building a model for the runner: its layers on the device in the configured dtype, its weights (from
safetensors, a GGUF file or random), prepacked for the CPU, its attention on the chosen backend. The target model's
runner and a speculative draft model both load this way."""
import logging
from contextlib import contextmanager

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.kernels.attention import Backend
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.layers.attention import Attention
from nanovllm.layers.prepack import can_prepack, prepack_linear_weights, repack_ggml_weights
from nanovllm.models import build_model
from nanovllm.models.gguf.weights import read_table
from nanovllm.models.loader import init_dummy_weights, load_model
from nanovllm.models.pooling import pooling_model

logger = logging.getLogger("nanovllm")


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_runner_model(config: Config, device: torch.device, backend: Backend, log: bool = True) -> nn.Module:
    """`config`'s model built on `device` with its weights (GGUF or quantized weights kept in their GGML blocks
    where the CPU kernels run them), prepacked for the CPU where that pays, its attention layers on `backend`."""
    on_gpu = device.type == "cuda"
    with default_dtype(config.torch_dtype), device:
        model = pooling_model(config.architecture, config.hf_config, config.pooler) if config.runner == "pooling" \
            else build_model(config.architecture, config.hf_config)
    keep_ggml = not on_gpu and cpu_kernels() is not None
    if (config.gguf_metadata or config.quantization) and not keep_ggml and log:
        why = "on CUDA" if on_gpu else "the compiled CPU kernels are unavailable"
        logger.warning("nanovllm: %s weights are dequantized to %s at load (%s)",
                       "GGUF" if config.gguf_metadata else config.quantization,
                       str(config.torch_dtype).removeprefix("torch."), why)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.hf_config, config.seed, config.quantization, keep_ggml)
    else:
        table = read_table(config.gguf_metadata) if config.gguf_metadata else None
        load_model(model, config.model, config.hf_config, table, config.quantization, keep_ggml)
    model.eval()
    if device.type == "cpu" and can_prepack(config.torch_dtype):
        prepack_linear_weights(model)
    if keep_ggml:
        repack_ggml_weights(model)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    return model
