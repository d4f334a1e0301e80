"""GPU KV-cache sizing: measure a warm-up forward pass, then give the cache what the budget leaves."""
import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.utils.context import reset_context, set_context


def kv_cache_budget(total: int, free: int, peak: int, current: int, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of the device, minus what is in use now (by this
    process and any other) and minus the warm-up's transient activations (`peak - current`),
    which later steps need again."""
    return max(0, int(total * utilization) - (total - free) - (peak - current))


def warmup_batch_size(config: Config) -> int:
    """The most max-length sequences one prefill step can hold."""
    return min(config.max_num_batched_tokens // config.max_model_len, config.max_num_seqs)


@torch.inference_mode()
def warmup(model: nn.Module, sampler: nn.Module, config: Config, device: torch.device) -> None:
    """The largest prefill the budget allows, then sampling over a full decode batch (its logits are
    `max_num_seqs x vocab` and often the biggest single allocation). No KV cache is touched."""
    num_seqs, seq_len = warmup_batch_size(config), config.max_model_len
    cu_seqlens = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * seq_len
    input_ids = torch.zeros(num_seqs * seq_len, dtype=torch.int64, device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    try:
        set_context(True, cu_seqlens, cu_seqlens, seq_len, seq_len)
        hidden_states = model(input_ids, positions)
        model.compute_logits(hidden_states)
        set_context(False)
        decode_batch = hidden_states.new_zeros(config.max_num_seqs, hidden_states.size(-1))
        del hidden_states
        logits = model.compute_logits(decode_batch)
        if logits is not None:
            sampler(logits, torch.ones(config.max_num_seqs, device=device))
    finally:
        reset_context()


def gpu_kv_cache_bytes(model: nn.Module, sampler: nn.Module, config: Config, device: torch.device) -> int:
    """Run the warm-up and size the KV cache from `gpu_memory_utilization` and what it measured."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        warmup(model, sampler, config, device)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        raise ValueError(
            f"the warm-up pass ({warmup_batch_size(config)} sequence(s) of max_model_len={config.max_model_len} "
            "tokens) ran out of GPU memory before the KV cache was allocated; lower max_num_batched_tokens, "
            "max_num_seqs or max_model_len, or free GPU memory"
        ) from e
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return kv_cache_budget(total, free, stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"],
                           config.gpu_memory_utilization)
