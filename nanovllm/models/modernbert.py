"""ModernBERT for the pooling runner (transformers' `ModernBertModel` and `ModernBertForSequenceClassification`), as
transformers computes it: token embeddings and their LayerNorm (no positions, no token types), pre-norm layers with
rotary position embedding (each layer type its own theta: `global_rope_theta` for full attention, `local_rope_theta`
for sliding), attention over each whole prompt in both directions or, in local layers, only `local_attention // 2`
positions either side (`bidirectional_attention`'s window), a GeGLU MLP (`Wi` fused input and gate, `Wo`), LayerNorms
with or without bias (`norm_bias`), and a final norm. A prompt is computed in one step, as BERT's (`nanovllm.models.
bert`)."""
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from nanovllm.config import PoolerConfig
from nanovllm.layers.activation import ActAndMul
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.bert import EncoderForPooling, bidirectional_attention
from nanovllm.models.decoder import DecoderOptions
from nanovllm.models.hf_config import activation, rope_scaling, rope_theta
from nanovllm.models.sentence_transformers import dense_tensors

MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification")


def layer_attention(config: PretrainedConfig) -> list[tuple[str, float]]:
    """Each layer's attention type ("full_attention" or "sliding_attention") and rope theta: transformers 5's
    `layer_types` and per-type `rope_parameters`; transformers 4's `global_attn_every_n_layers` (every n-th layer
    global, from the first), `global_rope_theta` and `local_rope_theta` (None: the global one)."""
    if getattr(config, "layer_types", None):
        return [(kind, rope_theta(config, kind)) for kind in config.layer_types]
    local = config.local_rope_theta if config.local_rope_theta is not None else config.global_rope_theta
    return [("sliding_attention", float(local)) if i % config.global_attn_every_n_layers else
            ("full_attention", float(config.global_rope_theta)) for i in range(config.num_hidden_layers)]


def _norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, window: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.window = window
        self.rotary_emb = rotary_emb
        self.Wqkv = ReplicatedLinear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.Wqkv(hidden_states).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.rotary_emb(positions, q, k)
        return self.Wo(bidirectional_attention(q, k, v, self.head_dim ** -0.5, self.window).flatten(1))


class ModernBertMLP(nn.Module):
    """GeGLU: `Wi` gives [input | gate], act(input) * gate goes through `Wo`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.Wi = ReplicatedLinear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = ActAndMul(activation(config, "hidden_activation"))
        self.Wo = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(hidden_states)))


class ModernBertLayer(nn.Module):
    """Pre-norm; the first layer's attention reads the embeddings' norm directly (no `attn_norm`)."""

    def __init__(self, config: PretrainedConfig, index: int, rotary_emb: RotaryEmbedding, window: int):
        super().__init__()
        self.attn_norm = _norm(config) if index else nn.Identity()
        self.attn = ModernBertAttention(config, rotary_emb, window)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(positions, self.attn_norm(hidden_states))
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = ModernBertEmbeddings(config)
        head_dim = config.hidden_size // config.num_attention_heads
        layers = layer_attention(config)
        rotaries = {kind: RotaryEmbedding(head_dim, config.max_position_embeddings, theta, rope_scaling(config, kind))
                    for kind, theta in set(layers)}
        half_window = config.local_attention // 2
        self.layers = nn.ModuleList([
            ModernBertLayer(config, i, rotaries[kind], half_window if kind == "sliding_attention" else 0)
            for i, (kind, _) in enumerate(layers)])
        self.final_norm = _norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.final_norm(hidden_states)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACT2FN[config.classifier_activation]
        self.norm = _norm(config)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(pooled)))


class ModernBertClassifier(nn.Module):
    """The classification head on the pooled vector (first token or mean, as `classifier_pooling` says): `head`
    (dense, activation, norm) then `classifier` (transformers' names, under `score.`)."""

    def __init__(self, config: PretrainedConfig, num_labels: int):
        super().__init__()
        self.head = ModernBertPredictionHead(config)
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled))


class ModernBertForPooling(EncoderForPooling):
    """ModernBERT for the pooling runner. Checkpoint names are transformers' (`model.` prefixed or not, as
    sentence-transformers saves the base model)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        """As every encoder's; a ValueError up front for an MLP activation the layers do not implement."""
        activation(config, "hidden_activation")
        return super().options(config)

    def __init__(self, config: PretrainedConfig, pooler_config: PoolerConfig):
        num_labels = pooler_config.num_labels
        super().__init__(config, pooler_config, ModernBertModel(config),
                         ModernBertClassifier(config, num_labels) if num_labels else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(("head.", "classifier.")):
                yield "score." + name, tensor
            else:
                yield "model." + name.removeprefix("model."), tensor
        yield from dense_tensors(self.dense_dirs)
