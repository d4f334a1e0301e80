"""Encoder-only models for the pooling runner: BERT, RoBERTa and XLM-RoBERTa (transformers' `BertModel`,
`RobertaModel`, `XLMRobertaModel` and their `*ForSequenceClassification`), as transformers computes them: absolute
position embeddings (RoBERTa's offset past its padding index), token types (0, or a text pair's), post-norm layers,
and attention over each whole prompt in both directions (`bidirectional_attention`: per sequence of the step's
ragged batch, no padding, no KV cache read or written). A prompt is computed in one step: the engine turns chunked
prefill off for these models (`nanovllm.engine.setup`)."""
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from nanovllm.config import PoolerConfig
from nanovllm.kernels.attention.context import get_context
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.layers.ggml_weight import GGMLTensor
from nanovllm.layers.linear import ReplicatedLinear, linear_gelu
from nanovllm.layers.pooler import Pooler
from nanovllm.models.decoder import DecoderOptions
from nanovllm.models.hf_config import max_positions
from nanovllm.models.sentence_transformers import dense_layers, dense_tensors

BERT_ARCHITECTURES = tuple(f"{family}{kind}" for family in ("Bert", "Roberta", "XLMRoberta")
                              for kind in ("Model", "ForSequenceClassification"))
_PREFIXES = ("bert.", "roberta.")


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            window: int = 0) -> torch.Tensor:
    """Every row of each sequence of the step (`cu_seqlens_q` of the attention context) attends to all of its
    sequence's rows, or with `window` > 0 to those at most `window` positions before or after it (transformers'
    bidirectional sliding window, `|i - j| <= window`: ModernBERT's local layers); q, k, v are [rows, heads,
    head_dim]. On the CPU, the compiled kernel does it in one call (`csrc/encoder_attention.cpp`); elsewhere, or
    without it, SDPA per sequence."""
    cu_seqlens = get_context().cu_seqlens_q
    if q.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.bidirectional_attention(q, k, v, cu_seqlens, scale, window)
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds, bounds[1:]):
        heads_first = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # 4-D: SDPA's flash kernel
        mask = None
        if window and end - start > window + 1:
            rows = torch.arange(end - start, device=q.device)
            mask = (rows[:, None] - rows[None, :]).abs() <= window
        out[start:end] = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    return out


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = config.max_position_embeddings - max_positions(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(types)
        return self.LayerNorm(embeddings + self.position_embeddings(positions + self.position_offset))


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.key = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.value = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(hidden_states).view(-1, self.num_heads, self.head_dim)
                   for proj in (self.query, self.key, self.value))
        return bidirectional_attention(q, k, v, self.head_dim ** -0.5).flatten(1)


class BertOutput(nn.Module):
    """A block's projection, added to the block's input and normalized (post-norm)."""

    def __init__(self, config: PretrainedConfig, in_features: int):
        super().__init__()
        self.dense = ReplicatedLinear(in_features, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertOutput(config, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    """The MLP's widening projection and its activation; erf's GELU (`hidden_act="gelu"`) fused into the product
    (`linear_gelu`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = ACT2FN[config.hidden_act]
        self.fused_gelu = config.hidden_act == "gelu"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused_gelu:
            return linear_gelu(hidden_states, self.dense.weight, self.dense.bias)
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config, config.intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attention = self.attention(hidden_states)
        return self.output(self.intermediate(attention), attention)


class BertModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertClassifier(nn.Module):
    """The classification head at the first token: BERT's pooler (dense, tanh) then `classifier`; RoBERTa's
    `classifier.dense`, tanh, `classifier.out_proj` (transformers' names, under `score.`)."""

    def __init__(self, config: PretrainedConfig, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(pooled)))


class EncoderForPooling(nn.Module):
    """An encoder for the pooling runner: `model` (input ids and positions, and token types where it reads them, to
    hidden states), the pooler its `PoolerConfig` describes, and for a classifier its head as `score`. What the engine
    asks of a family, answered for a model that writes no KV cache."""

    rope_needs_lengths = False

    @classmethod
    def normalize_config(cls, config: PretrainedConfig) -> None:
        """The attributes the engine reads under Llama's names (the KV cache is sized by them, though these models
        write none)."""
        config.num_key_value_heads = config.num_attention_heads

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        """No sliding window over a KV cache (what the engine asks a family)."""
        return DecoderOptions()

    def __init__(self, config: PretrainedConfig, pooler_config: PoolerConfig, model: nn.Module,
                 score: nn.Module | None):
        super().__init__()
        self.model = model
        self.pooler = Pooler(pooler_config.pooling_type, dense_layers(config, pooler_config))
        self.dense_dirs = pooler_config.dense_dirs
        self.score = score

    def compute_logits(self, hidden_states: torch.Tensor) -> None:
        """No LM head: nothing to sample (the CUDA memory warm-up asks)."""
        return None


class BertForPooling(EncoderForPooling):
    """BERT, RoBERTa or XLM-RoBERTa for the pooling runner. Checkpoint names are transformers' (`bert.`/`roberta.`
    prefixed or not, as sentence-transformers saves the base model)."""

    def __init__(self, config: PretrainedConfig, pooler_config: PoolerConfig):
        num_labels = pooler_config.num_labels
        super().__init__(config, pooler_config, BertModel(config),
                         BertClassifier(config, num_labels) if num_labels else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`token_type_ids`: each row's token type (None: all 0; a BERT text pair's second text is type 1)."""
        return self.model(input_ids, positions, token_type_ids)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGMLTensor]]
                           ) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """transformers' names to the model's; a GGUF file's embedding tables (`nn.Embedding`s here) dequantized,
        its linear weights left in their blocks."""
        for name, tensor in weights:
            if isinstance(tensor, GGMLTensor) and "embeddings." in name:
                tensor = tensor.dequantize()
            name = next((name.removeprefix(p) for p in _PREFIXES if name.startswith(p)), name)
            name = name.replace("encoder.layer.", "layers.")
            if name.startswith(("pooler.dense.", "classifier.dense.")):
                yield "score.dense." + name.rsplit(".", 1)[1], tensor
            elif name.startswith(("classifier.out_proj.", "classifier.")):
                yield "score.out_proj." + name.rsplit(".", 1)[1], tensor
            else:
                yield "model." + name, tensor
        yield from dense_tensors(self.dense_dirs)
