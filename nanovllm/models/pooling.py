"""The pooling runner's models: a family's decoder without its LM head, with the pooler its `PoolerConfig` describes
(sentence-transformers' Dense layers) and, for a `*ForSequenceClassification` checkpoint, transformers' `score` head
(a linear layer without bias, `num_labels` outputs, read at the last token); or an encoder (`nanovllm.models.bert`,
`nanovllm.models.modernbert`)."""
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from nanovllm.config import PoolerConfig
from nanovllm.layers.pooler import Pooler
from nanovllm.models import ENCODERS, MODEL_REGISTRY
from nanovllm.models.bert import EncoderForPooling
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.sentence_transformers import dense_layers, dense_tensors


class DecoderForPooling(DecoderForCausalLM):
    """Mixed in before a family (`pooling_model`): the family's decoder and checkpoint names, no LM head. Checkpoint
    names without the family's prefix (what sentence-transformers saves: `layers.0...`, `embed_tokens.weight`) get
    it; the Dense layers' tensors come from their folders."""

    with_lm_head = False

    def add_pooler(self, config: PretrainedConfig, pooler_config: PoolerConfig) -> None:
        self.pooler = Pooler(pooler_config.pooling_type, dense_layers(config, pooler_config))
        self.dense_dirs = pooler_config.dense_dirs
        self.score = nn.Linear(config.hidden_size, pooler_config.num_labels, bias=False) \
            if pooler_config.num_labels else None
        self.base_prefix = AutoModelForCausalLM._model_mapping[type(config)].base_model_prefix + "."

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        named = ((name if name.startswith((self.base_prefix, "score.")) else self.base_prefix + name, tensor)
                 for name, tensor in weights)
        yield from super().checkpoint_weights(named)
        yield from dense_tensors(self.dense_dirs)

    def compute_logits(self, hidden_states: torch.Tensor) -> None:
        """No LM head: nothing to sample (the CUDA memory warm-up asks)."""
        return None


def pooling_model(architecture: str, config: PretrainedConfig,
                  pooler_config: PoolerConfig) -> DecoderForPooling | EncoderForPooling:
    """The pooling model of family `architecture` (as `model_class` named it) for `config`, weights not loaded."""
    encoder = next((cls for cls in ENCODERS.values() if cls.__name__ == architecture), None)
    if encoder is not None:
        return encoder(config, pooler_config)
    family = MODEL_REGISTRY[architecture]
    cls = type(architecture.removesuffix("ForCausalLM") + "ForPooling", (DecoderForPooling, family), {})
    model = cls(config)
    model.add_pooler(config, pooler_config)
    return model
