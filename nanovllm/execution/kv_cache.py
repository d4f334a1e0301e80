"""The KV cache, set up in one place for CPU and GPU alike: its size (the memory budget, a warm-up pass on CUDA),
its memory, and its binding to the model's attention layers.

Layout `[k/v, layer, block, token in block, this rank's KV heads, head_dim]`; layer i's attention reads
`cache[:, i]`. `create_kv_cache` is called once by the model runner; it also settles `config.max_model_len`: the
model's own limit is lowered to what the cache holds (and logged), one given explicitly that does not fit is a
ValueError.
"""
import logging
import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.distributed.process_group import min_over_ranks
from nanovllm.execution.sampler import Sampler, SamplingRow
from nanovllm.kernels.attention.context import reset_context, set_context
from nanovllm.kernels.attention.kv_quant import cache_row_width
from nanovllm.layers.attention import Attention
from nanovllm.models.hf_config import head_dim
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


@dataclass
class KVCache:
    """The cache tensor and its number of blocks (the same on every tensor-parallel rank); on the CPU, `memory` is
    the anonymous map the tensor lives in. While the cache is released (`release_kv_cache`, sleep mode) on CUDA,
    `tensor` is None."""

    tensor: torch.Tensor | None
    num_blocks: int
    memory: mmap.mmap | None = None


def kv_cache_shape(config: Config, num_blocks: int) -> tuple[int, ...]:
    """(k/v, layer, block, token in block, this rank's KV heads, head dim (an int8 cache's rows: and its scale))."""
    cfg = config.hf_config
    num_kv_heads = cfg.num_key_value_heads // config.tensor_parallel_size
    width = cache_row_width(head_dim(cfg), config.kv_cache_torch_dtype)
    return 2, cfg.num_hidden_layers, num_blocks, config.kvcache_block_size, num_kv_heads, width


def kv_block_bytes(config: Config) -> int:
    """Bytes one block takes on one rank, over every layer, keys and values; with a draft model, its own cache's
    block too (the draft's cache has the same blocks, see `nanovllm.execution.draft_model`)."""
    own = math.prod(kv_cache_shape(config, 1)) * config.kv_cache_torch_dtype.itemsize
    return own + (kv_block_bytes(config.draft) if config.draft is not None else 0)


def create_kv_cache(model: nn.Module, sampler: Sampler, config: Config, device: torch.device) -> KVCache:
    """Size, allocate and bind the KV cache: `num_kvcache_blocks` blocks, or as many as the memory budget allows on
    every rank (never more than `max_num_seqs` sequences of `max_model_len` can use)."""
    num_blocks = config.num_kvcache_blocks
    if num_blocks == -1:
        if device.type == "cuda":
            budget = _gpu_budget(model, sampler, config, device)
        else:
            budget = int(config.cpu_kvcache_gib * 2**30)
        usable = config.max_num_seqs * config.blocks_per_sequence
        num_blocks = min_over_ranks(min(budget // kv_block_bytes(config), usable), device)
    _fit_max_model_len(config, num_blocks)
    return allocate_kv_cache(model, config, num_blocks, device)


def allocate_kv_cache(model: nn.Module, config: Config, num_blocks: int, device: torch.device) -> KVCache:
    """A zeroed cache of `num_blocks` blocks shaped for `config`'s model, bound to `model`."""
    tensor, memory = _zeros(kv_cache_shape(config, num_blocks), config.kv_cache_torch_dtype, device)
    bind_kv_cache(model, tensor)
    return KVCache(tensor, num_blocks, memory)


def release_kv_cache(model: nn.Module, cache: KVCache) -> None:
    """Give the cache's memory back, its K/V forgotten (sleep mode). On the CPU its map's pages are dropped
    (`MADV_DONTNEED`): the map stays where it is, still bound, and reads as zeros again, taking memory only as blocks
    are written, as when it was made. On CUDA (and where Python has no `MADV_DONTNEED`) the tensor is freed (the
    model unbound; nothing else may hold it); `restore_kv_cache` allocates it again, at other addresses."""
    if cache.memory is not None and hasattr(mmap, "MADV_DONTNEED"):
        cache.memory.madvise(mmap.MADV_DONTNEED)
        return
    bind_kv_cache(model, None)
    cache.tensor = cache.memory = None


def restore_kv_cache(model: nn.Module, config: Config, cache: KVCache, device: torch.device) -> None:
    """After `release_kv_cache`: a zeroed cache of the same blocks bound to `model` again (where the tensor was
    freed; a map whose pages were dropped is there already)."""
    if cache.tensor is None:
        cache.tensor, cache.memory = _zeros(kv_cache_shape(config, cache.num_blocks), config.kv_cache_torch_dtype,
                                              device)
        bind_kv_cache(model, cache.tensor)


def _fit_max_model_len(config: Config, num_blocks: int) -> None:
    """Lower a `max_model_len` the cache cannot hold to what it holds (logged); a ValueError when one was given, or
    when the cache holds not even one block."""
    needed = config.blocks_per_sequence
    if num_blocks >= needed:
        return
    if num_blocks < 1 or config.max_model_len_given:
        wanted = f"one max_model_len={config.max_model_len} sequence needs {needed}" if config.max_model_len_given \
            else f"one block takes {kv_block_bytes(config)} bytes"
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {config.kvcache_block_size} tokens, but {wanted}. Give it "
            "more memory (cpu_kvcache_gib / gpu_memory_utilization / num_kvcache_blocks)"
            + (" or lower max_model_len." if config.max_model_len_given else ".")
        )
    fitted = num_blocks * config.kvcache_block_size
    logger.info("max_model_len lowered from the model's %d to %d tokens, what the KV cache holds (give "
                "max_model_len, or more memory, to choose)", config.max_model_len, fitted)
    config.max_model_len = fitted


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor | None) -> None:
    """Point the model's attention layers at `kv_cache` (layer i gets `kv_cache[:, i]`), or at no cache with None."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = (torch.tensor([]),) * 2 if kv_cache is None else kv_cache[:, i]


def copy_kv_blocks(cache: KVCache, copies: list[tuple[int, int, int]]) -> None:
    """Copy blocks' first tokens on every layer, keys and values: for each `(source, destination, num_tokens)`, the
    destination block's first `num_tokens` get the source's K/V (beam search's copy on write, `BlockManager.fork`).
    One strided copy each: only the tokens written, about half a block on average."""
    for source, destination, num_tokens in copies:
        cache.tensor[:, :, destination, :num_tokens].copy_(cache.tensor[:, :, source, :num_tokens])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    """Zeros on `device`, and on the CPU the map they live in: an anonymous memory map, whose pages read as zeros
    and take memory only once written, so a KV cache sized for the worst case costs the blocks actually used
    (torch.zeros writes every page up front). The map is released with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(shape), memory


def kv_cache_budget(total: int, free: int, peak: int, current: int, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of the device, minus what is in use now (by this
    process and any other) and minus the warm-up's transient activations (`peak - current`),
    which later steps need again."""
    return max(0, int(total * utilization) - (total - free) - (peak - current))


def warmup_length(config: Config) -> int:
    """Tokens of each warm-up sequence: max_model_len, or one budget-long chunk of a longer one (chunked prefill)."""
    return min(config.max_model_len, config.max_num_batched_tokens)


def warmup_batch_size(config: Config) -> int:
    """The most warm-up sequences one prefill step can hold."""
    return min(config.max_num_batched_tokens // warmup_length(config), config.max_num_seqs)


def warmup_cache_blocks(config: Config) -> int:
    """Blocks the warm-up batch occupies in its (one-layer) KV cache."""
    return warmup_batch_size(config) * -(-warmup_length(config) // config.kvcache_block_size)


WARMUP_SAMPLING = SamplingParams(top_p=0.9, top_k=50, min_p=0.05, seed=0, min_tokens=1, stop_token_ids=[0],
                                 repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, logprobs=20)


def warmup_sampling_rows(num_seqs: int) -> list[SamplingRow]:
    """A decode batch using every sampling feature: penalty count tables for every row, seeded draws, min-p, top-k,
    top-p (a full sort of the logits), min_tokens and logprobs."""
    return [SamplingRow(seq_id, WARMUP_SAMPLING, [0], 1) for seq_id in range(num_seqs)]


@torch.inference_mode()
def warmup(model: nn.Module, sampler: Sampler, config: Config, device: torch.device) -> None:
    """The largest prefill the budget allows; a full decode batch, every sequence at `max_model_len` (what attention
    needs over the longest contexts: the torch backend gathers them); then sampling with every feature on over it (its
    logits are `max_num_seqs x vocab` and often the biggest single allocation; the sampler keeps the count tables
    it grows here for later steps).

    The model must be bound to a cache of at least `warmup_cache_blocks(config)` blocks; every layer
    may share one, since only the attention kernels' working memory is being measured.
    """
    num_seqs, seq_len, block_size = warmup_batch_size(config), warmup_length(config), config.kvcache_block_size
    blocks_per_seq = -(-seq_len // block_size)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    block_tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device).view(num_seqs, -1)
    seq_index = torch.arange(num_seqs, device=device).repeat_interleave(seq_len)
    slot_mapping = (block_tables[seq_index, positions // block_size] * block_size + positions % block_size).long()
    context_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    cu_seqlens = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * seq_len
    try:
        set_context(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=seq_len, max_seqlen_k=seq_len,
                    context_lens=context_lens, block_tables=block_tables, slot_mapping=slot_mapping)
        hidden_states = model(torch.zeros_like(positions), positions)
        model.compute_logits(hidden_states[cu_seqlens[1:] - 1])
        del hidden_states
        logits = model.compute_logits(_decode_pass(model, config, device))
        if logits is not None:
            rows = warmup_sampling_rows(config.max_num_seqs)
            sampler(logits, rows)
            sampler.release(row.seq_id for row in rows)
    finally:
        reset_context()


def _decode_pass(model: nn.Module, config: Config, device: torch.device) -> torch.Tensor:
    """The hidden states of a decode step of `max_num_seqs` sequences at `max_model_len` tokens each, whose block
    tables reuse the warm-up's blocks and which write no K/V."""
    batch, length = config.max_num_seqs, config.max_model_len
    table = torch.arange(config.blocks_per_sequence, dtype=torch.int32, device=device) % warmup_cache_blocks(config)
    steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
    set_context(cu_seqlens_q=steps, cu_seqlens_k=steps * length, max_seqlen_q=1, max_seqlen_k=length,
                context_lens=torch.full((batch,), length, dtype=torch.int32, device=device),
                block_tables=table.repeat(batch, 1), slot_mapping=torch.full((batch,), -1, device=device))
    return model(torch.zeros(batch, dtype=torch.int64, device=device),
                 torch.full((batch,), length - 1, dtype=torch.int64, device=device))


def _gpu_budget(model: nn.Module, sampler: Sampler, config: Config, device: torch.device) -> int:
    """Run the warm-up and size the KV cache from `gpu_memory_utilization` and what it measured.

    The warm-up runs the serving attention path over a temporary cache of one layer that every
    layer shares; it is allocated before the peak is reset, so it does not count as transient memory, and freed
    before sizing.
    """
    torch.cuda.empty_cache()
    shape = list(kv_cache_shape(config, warmup_cache_blocks(config)))
    num_layers, shape[1] = shape[1], 1
    scratch = torch.zeros(shape, dtype=config.kv_cache_torch_dtype, device=device)
    bind_kv_cache(model, scratch.expand(-1, num_layers, *shape[2:]))
    torch.cuda.reset_peak_memory_stats(device)
    try:
        warmup(model, sampler, config, device)
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
    except torch.cuda.OutOfMemoryError as e:
        raise ValueError(
            f"the warm-up pass ({warmup_batch_size(config)} sequence(s) of {warmup_length(config)} tokens) ran out "
            "of GPU memory before the KV cache was allocated; lower max_num_batched_tokens, max_num_seqs or "
            "max_model_len, or free GPU memory"
        ) from e
    finally:
        bind_kv_cache(model, None)
        del scratch
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_budget(total, free, stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"],
                           config.gpu_memory_utilization)
