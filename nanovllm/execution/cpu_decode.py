"""Decode steps of the standard decoder on the CPU in one C++ call (`kernels/csrc/decoder_stack.cpp`).

At batch 1 a small model's decode step spent more time in Python between the operators (module calls, views, a few
hundred tensor allocations, some twenty operators per layer) than in its matmuls. For a model whose every layer is
exactly Llama's (a pre-norm RMSNorm layer: fused QKV, rotary over whole heads, full attention without a cap, a gated
SiLU MLP, no multipliers) with its linear weights in GGML blocks, the model runner builds a `CpuDecoder` once at
load, and decode steps run every layer in one call, through the same kernels in the same order: the hidden states
are the layer-by-layer path's, bit for bit. So do steps whose every sequence has at most `SHORT_QUERIES` queries
(drafts being verified: speculation, a grammar's forced tokens), each query row attending as its token's decode, as
the layer-by-layer path computes them. Longer prompt steps, and every other model, run layer by layer. A step with
LoRA adapters runs here too: the stack holds each projection's packed adapters (`set_lora`, again only when the
step's adapters change) and adds each row's delta with the kernel the layers call (`nanovllm.layers.lora`).
"""
import torch

from nanovllm.kernels.attention.context import get_context
from nanovllm.kernels.attention.kv_quant import INT8_CACHE
from nanovllm.kernels.attention.torch_backend import TorchBackend, query_rows
from nanovllm.kernels.ggml import kernel_isa
from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.lora import Packed, lora_step
from nanovllm.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP, DecoderOptions

SHORT_QUERIES = 16
"""Steps whose every sequence has at most this many queries (decodes, drafts being verified, short chunks) run here."""
STANDARD = DecoderOptions()
"""The options of the layer the C++ stack computes, apart from the biases (which it adds) and what happens before the
first layer or after the final norm (embedding, logits)."""
ANY = ("qkv_bias", "o_bias", "mlp_bias", "norm_weight_offset", "embedding_multiplier", "final_logit_softcap",
       "logits_divisor", "attention_scale", "layer_windows")


class CpuDecoder:
    """`model`'s embedding, then every layer and the final norm in one call to the stack."""

    def __init__(self, model: DecoderForCausalLM, stack: torch.ScriptObject):
        self.model = model.model
        self.stack = stack
        self.adapted = any(linear.lora is not None for layer in self.model.layers for linear in _projections(layer))
        self.packs: dict[tuple[int, int], Packed | None] = {}  # what the stack holds, by (layer, projection)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final norm's hidden states of a step whose every sequence has at most `SHORT_QUERIES` queries (see
        `Context`): decodes, drafts being verified, short prompts. Each query row attends as its token's decode
        would, as the layer-by-layer path computes every row (`query_rows`)."""
        ctx = get_context()
        block_tables, context_lens = ctx.block_tables, ctx.context_lens
        if not ctx.is_decode:
            sequences, _, lengths = query_rows(ctx.cu_seqlens_q.tolist(), context_lens.tolist())
            block_tables = block_tables[torch.tensor(sequences)]
            context_lens = torch.tensor(lengths, dtype=torch.int32)
        hidden_states = self.model.embed(input_ids)
        row_slots = None  # each row's LoRA adapter, when the step has any
        if self.adapted and (step := lora_step()).adapters:
            self._set_loras(step.adapters)
            row_slots = step.token_index
        return self.stack.forward(hidden_states, positions, ctx.slot_mapping, block_tables, context_lens, row_slots)

    def _set_loras(self, adapters: tuple[int, ...]) -> None:
        """Give the stack each projection's packing of `adapters` where it holds another."""
        for i, layer in enumerate(self.model.layers):
            for j, linear in enumerate(_projections(layer)):
                packed = None if linear.lora is None else linear.lora.packed(adapters)
                if self.packs.get((i, j)) is not packed:
                    if packed is None:
                        self.stack.set_lora(i, j, [], [], [])
                    else:
                        table = [packed.slices, packed.scales, packed.slot_slices]
                        self.stack.set_lora(i, j, packed.a, packed.bt, table)
                    self.packs[i, j] = packed


def cpu_decoder(model: torch.nn.Module) -> CpuDecoder | None:
    """The one-call decode path for `model` (on the CPU, its KV cache bound, the compiled kernels loaded), or None
    when some layer is not the standard one, a weight is not in GGML blocks, or it is split over ranks."""
    if not isinstance(model, DecoderForCausalLM) or not _standard(model.decoder_options):
        return None
    layers = list(model.model.layers)
    norm = model.model.norm
    if not (isinstance(norm, RMSNorm) and norm.eps == layers[0].input_layernorm.eps
            and all(_standard_layer(layer, layers[0]) for layer in layers)):
        return None
    attention = layers[0].self_attn
    stack = torch.classes.nanovllm.DecoderStack(attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                                norm.eps, attention.attn.scale, attention.rotary_emb.cos_sin_cache,
                                                norm.weight,
                                                kernel_isa())
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        stack.add_layer(layer.input_layernorm.weight, _linear(attention.qkv_proj), _linear(attention.o_proj),
                        layer.post_attention_layernorm.weight, _linear(mlp.gate_up_proj), _linear(mlp.down_proj),
                        attention.attn.k_cache, attention.attn.v_cache)
    return CpuDecoder(model, stack)


def _projections(layer: DecoderLayer) -> tuple[LinearBase, ...]:
    """The layer's projections in the stack's order (QKV, O, GATE_UP, DOWN)."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _standard(options: DecoderOptions) -> bool:
    return all(getattr(options, name) == getattr(STANDARD, name) or name in ANY
               for name in DecoderOptions.__dataclass_fields__) and not any(options.layer_windows)


def _standard_layer(layer: DecoderLayer, first: DecoderLayer) -> bool:
    """Llama's layer, on one rank, its linears over GGML blocks, sharing the first layer's rotary table and norm
    epsilon, attending through the torch backend's paged decode."""
    attention, mlp = layer.self_attn, layer.mlp
    rotary, attn = attention.rotary_emb, attention.attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = (attention.qkv_proj, attention.o_proj, getattr(mlp, "gate_up_proj", None), mlp.down_proj)
    return (isinstance(mlp, DecoderMLP) and mlp.gated
            and all(isinstance(n, RMSNorm) and n.eps == first.input_layernorm.eps for n in norms)
            and all(isinstance(linear, LinearBase) and isinstance(linear.weight, GGMLWeight) and linear.tp_size == 1
                    for linear in linears)
            and rotary is first.self_attn.rotary_emb and not rotary.partial and not rotary.long_after
            and attn.sliding_window == 0 and attn.softcap == 0
            and attn.backend.attend == TorchBackend.attend and attn.backend.store_kvcache == TorchBackend.store_kvcache
            and attn.k_cache.dim() == 4
            and attn.k_cache.dtype in (layer.input_layernorm.weight.dtype, torch.float8_e4m3fn, torch.float8_e5m2,
                                       INT8_CACHE))


def _linear(layer: LinearBase) -> torch.ScriptObject:
    weight = layer.weight
    return torch.classes.nanovllm.GGMLLinear([s.data for s in weight.segments], weight.qtypes, weight.in_features,
                                             layer.bias, weight.lanes)
