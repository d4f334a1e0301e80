"""The model FLOPs a run computed, for an honest model FLOP utilization (MFU).

Counted: the matmuls of every token the engine computed (prompt tokens not served from the prefix cache, and every
generated token but each request's last, which is sampled but never fed back): per layer the q/k/v, o, gate/up and
down projections (2 FLOPs per weight), and attention's QK^T and PV over the token's context (4 x context x heads x
head_dim); plus the LM head (2 x hidden x vocab) only at the rows that sample, one per generated token. Not counted:
the embedding lookup (no FLOPs), norms, rotary and softmax (small), recomputation after preemption (so the count
never exceeds the work done). MFU is that over seconds x the machine's matmul rate in the same dtype, measured next
to the run; when a probe reads below what the run achieved, the achieved rate stands in for it (and the report says
so), so MFU never exceeds 100%.

Not the engine: the MLP's shape per layer (a mixture of experts' active width) is read from the model family's options
(`nanovllm.models.model_class`, `nanovllm.models.sparse_moe.MoeOptions`) and the head size from
`nanovllm.models.hf_config.head_dim`, public functions of the models room, since the `LLM` API gives no FLOP count.
"""
from transformers import PretrainedConfig

from nanovllm.models import model_class
from nanovllm.models.hf_config import head_dim
from nanovllm.models.sparse_moe import MoeOptions


def layer_matmul_flops_per_token(cfg: PretrainedConfig) -> int:
    """2 x the weights of one token's pass through every decoder layer's projections (of a mixture of experts, the
    k experts it is routed to and any shared expert)."""
    d, heads, kv_heads, dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    attention = d * (heads + 2 * kv_heads) * dim + heads * dim * d
    mlp = model_class(cfg).options(cfg).mlp
    widths = [mlp.active_intermediate_size(cfg, i) if isinstance(mlp, MoeOptions) else cfg.intermediate_size
              for i in range(cfg.num_hidden_layers)]
    return 2 * (attention * cfg.num_hidden_layers + 3 * d * sum(widths))


def attention_flops(cfg: PretrainedConfig, first: int, last: int) -> int:
    """QK^T and PV of the tokens at positions first..last-1 (position p attends to p + 1 keys), all layers."""
    keys = (last * (last + 1) - first * (first + 1)) // 2
    return 4 * keys * cfg.num_attention_heads * head_dim(cfg) * cfg.num_hidden_layers


def run_flops(cfg: PretrainedConfig, prompt_lens: list[int], output_lens: list[int], cached_tokens: int = 0) -> int:
    """The FLOPs of serving requests with these prompt and output lengths, of whose prompt tokens `cached_tokens`
    came from the prefix cache. Which prompts they were is not known, so the attention they saved is taken at its
    most (all in the longest prompts): the count errs low, never high."""
    computed = sum(prompt_lens) - cached_tokens + sum(max(n - 1, 0) for n in output_lens)
    attention = sum(attention_flops(cfg, 0, length + max(n - 1, 0)) for length, n in zip(prompt_lens, output_lens))
    left = cached_tokens
    for length in sorted(prompt_lens, reverse=True):
        attention -= attention_flops(cfg, 0, min(length, left))
        left -= min(length, left)
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size * sum(output_lens)
    return computed * layer_matmul_flops_per_token(cfg) + attention + lm_head


def mfu(flops: int, seconds: float, probe: float) -> tuple[float, bool]:
    """Model FLOP utilization, and whether the probe read below the achieved rate (then the achieved rate is the
    peak, and MFU is 100%)."""
    achieved = flops / seconds
    return achieved / max(probe, achieved), achieved > probe
