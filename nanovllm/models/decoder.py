"""The decoder shared by every supported family: attention and an MLP on a residual stream.

A family (`llama.py`, `mistral.py`, `gemma.py`, ...) only says which of the `DecoderOptions` its checkpoints use, and,
where its checkpoint names or fused tensors differ from Llama's, how to read them (`checkpoint_weights`).
"""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.kernels.attention.context import get_context
from nanovllm.layers.activation import ActAndMul, Activation
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import HeadLayerNorm, LayerNorm, RMSNorm, ShardedRMSNorm
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.hf_config import head_dim, layer_types, rope_scaling, rope_theta, rotary_dim


@dataclass(frozen=True)
class DecoderOptions:
    """Where the families differ.

    `norm_placement`: "pre" (Llama: a norm before attention and before the MLP), "sandwich" (Gemma 2/3: also a norm on
    each block's output before it joins the residual), "post" (OLMo 2: only the norms on the blocks' outputs).
    `parallel_residual`: attention and MLP read the same stream and are added together, in GPT-NeoX's order
    ("neox": (mlp + attn) + x, each block with its own norm) or StableLM's ("stablelm": (x + attn) + mlp, one norm).
    `layer_windows`: each layer's sliding window in tokens (0: full attention); empty: full everywhere.
    `local_rope`: sliding layers take the rope settings of transformers' "sliding_attention" layer type (Gemma 3).
    """

    qk_norm: bool = False                # RMSNorm on each query/key head before rope (Qwen3, Gemma 3)
    qk_norm_full: bool = False           # RMSNorm over the whole query/key projection, across ranks (OLMo 2)
    qk_norm_heads: bool = False          # a LayerNorm per query/key head, each with its own weight (StableLM)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    gated_mlp: bool = True
    layer_norm: bool = False             # LayerNorm with bias instead of RMSNorm
    norm_weight_offset: float = 0.0      # Gemma's RMSNorm scales by (1 + w)
    norm_placement: str = "pre"
    parallel_residual: str = ""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0     # Granite: each block's output scaled before it joins the residual
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float = 0.0      # Gemma 2: scores capped by cap * tanh(score / cap)
    final_logit_softcap: float = 0.0
    logits_divisor: float = 1.0          # Granite's logits_scaling
    layer_windows: tuple[int, ...] = ()
    local_rope: bool = False
    mlp: Callable[[PretrainedConfig, "DecoderOptions", int], nn.Module] | None = None  # builds layer i's MLP (MoE)


def _norm(config: PretrainedConfig, options: DecoderOptions, size: int | None = None) -> nn.Module:
    size = size or config.hidden_size
    if options.layer_norm:
        return LayerNorm(size, eps=config.layer_norm_eps)
    return RMSNorm(size, eps=config.rms_norm_eps, weight_offset=options.norm_weight_offset)


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions, rotary_emb: RotaryEmbedding,
                 sliding_window: int = 0):
        super().__init__()
        _, tp_size = tp_rank_and_size()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=options.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=options.o_bias)
        self.rotary_emb = rotary_emb
        scale = options.attention_scale or self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, sliding_window=sliding_window,
                              softcap=options.attn_logit_softcap)
        self.qk_norm_full = options.qk_norm_full
        self.q_norm = self.k_norm = nn.Identity()
        if options.qk_norm:
            self.q_norm = _norm(config, options, self.head_dim)
            self.k_norm = _norm(config, options, self.head_dim)
        if options.qk_norm_heads:
            self.q_norm = HeadLayerNorm(config.num_attention_heads, self.head_dim, config.layer_norm_eps)
            self.k_norm = HeadLayerNorm(config.num_key_value_heads, self.head_dim, config.layer_norm_eps)
        if options.qk_norm_full:
            self.q_norm = ShardedRMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, get_context().rope_lengths)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class DecoderMLP(nn.Module):
    """Gated (`gate_up_proj`, act(gate) * up, `down_proj`) or plain (`fc_in`, act, `down_proj`)."""

    def __init__(self, config: PretrainedConfig, options: DecoderOptions, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gated = options.gated_mlp
        if self.gated:
            self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2,
                                                           bias=options.mlp_bias)
            self.act_fn = ActAndMul(options.activation)
        else:
            self.fc_in = ColumnParallelLinear(config.hidden_size, intermediate_size, bias=options.mlp_bias)
            self.act_fn = Activation(options.activation)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=options.mlp_bias,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x) if self.gated else self.fc_in(x)))


class DecoderLayer(nn.Module):
    """One layer on the residual stream, kept as (hidden_states, residual): the stream is their sum, added by the
    next norm (fused with it where it can), so a layer returns its last block's output unadded."""

    def __init__(self, config: PretrainedConfig, options: DecoderOptions, rotary_emb: RotaryEmbedding,
                 layer_index: int, sliding_window: int = 0):
        super().__init__()
        self.options = options
        self.self_attn = DecoderAttention(config, options, rotary_emb, sliding_window)
        self.mlp = options.mlp(config, options, layer_index) if options.mlp else DecoderMLP(config, options)
        if options.norm_placement != "post":
            self.input_layernorm = _norm(config, options)
        if options.parallel_residual != "stablelm":
            self.post_attention_layernorm = _norm(config, options)
        if options.norm_placement == "sandwich":
            self.pre_feedforward_layernorm = _norm(config, options)
        if options.norm_placement in ("sandwich", "post"):
            self.post_feedforward_layernorm = _norm(config, options)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.options.residual_multiplier if self.options.residual_multiplier != 1.0 else x

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if self.options.parallel_residual:
            return self._parallel(positions, hidden_states, residual)
        if self.options.norm_placement == "post":
            return self._post_norm(positions, hidden_states, residual)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self._scaled(self.self_attn(positions, hidden_states))
        if self.options.norm_placement == "sandwich":
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self._scaled(self.mlp(hidden_states)), residual

    def _post_norm(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        """OLMo 2: x + norm(attn(x)), then the same for the MLP."""
        stream = hidden_states if residual is None else hidden_states + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def _parallel(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        stream = hidden_states if residual is None else hidden_states + residual
        normed = self.input_layernorm(stream)
        attn = self.self_attn(positions, normed)
        if self.options.parallel_residual == "stablelm":
            return self.mlp(normed), stream + attn
        return self.mlp(self.post_attention_layernorm(stream)) + attn, stream


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions):
        super().__init__()
        self.embedding_multiplier = options.embedding_multiplier
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        windows = options.layer_windows or (0,) * config.num_hidden_layers
        types = layer_types(config) if options.local_rope else ["full_attention"] * config.num_hidden_layers
        rotaries = {kind: RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope_theta(config, kind),
                                          rope_scaling(config, kind), rotary_dim(config)) for kind in set(types)}
        self.layers = nn.ModuleList([DecoderLayer(config, options, rotaries[kind], i, window)
                                     for i, (kind, window) in enumerate(zip(types, windows))])
        self.norm = _norm(config, options)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * torch.tensor(self.embedding_multiplier, dtype=hidden_states.dtype)
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A family subclasses this and implements `options`, which also rejects configs it cannot run."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        raise NotImplementedError

    @classmethod
    def normalize_config(cls, config: PretrainedConfig) -> None:
        """Give `config` the attributes the engine reads under Llama's names (`num_key_value_heads`, ...) where the
        family's config names them differently. Llama's names: nothing to do."""

    with_lm_head = True
    """False for the pooling runner's models (`nanovllm.models.pooling`), which read hidden states only."""

    rope_needs_lengths: bool
    """Whether rope reads `Context.rope_lengths` (LongRoPE): the model runner then sets them."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.decoder_options = options = self.options(config)
        self.model = DecoderModel(config, options)
        if self.with_lm_head:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_needs_lengths = any(m.long_after for m in self.modules() if isinstance(m, RotaryEmbedding))

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Llama's names and layout (what `load_weights` maps onto this model)."""
        return iter(weights)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None:
            return None
        if self.decoder_options.logits_divisor != 1.0:
            logits = logits / self.decoder_options.logits_divisor
        if cap := self.decoder_options.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits
