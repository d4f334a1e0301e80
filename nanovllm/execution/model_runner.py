import logging
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from nanovllm.config import Config
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.execution.cpu_decode import cpu_decoder
from nanovllm.execution.cpu_threads import ThreadGovernor
from nanovllm.execution.cuda_graph import DecodeGraphs
from nanovllm.execution.draft_model import DraftModel
from nanovllm.execution.kv_cache import bind_kv_cache, cache_slots, create_kv_cache
from nanovllm.execution.model_loading import load_runner_model
from nanovllm.execution.sampler import PromptRows, Sampler, SamplerOutput
from nanovllm.execution.tensor_parallel import WorkerGroup, started
from nanovllm.execution.tensors import to_device
from nanovllm.execution.verifier import verify
from nanovllm.kernels.attention import Platform, importable, load_backend
from nanovllm.kernels.attention.context import get_context, reset_context, set_context
from nanovllm.kernels.attention.torch_backend import SHORT_QUERIES
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.kernels.fused import set_fused_ops
from nanovllm.structured_output.bitmask import TokenBitmask

logger = logging.getLogger("nanovllm")


class ModelRunner:
    """Owns the model and the KV cache of one tensor-parallel rank; turns batches into tensors and runs them.

    With `tensor_parallel_size > 1`, rank 0 (in the user's process) starts the workers for the other
    ranks, and `call` forwards each call to them before running it here.
    """

    def __init__(self, config: Config, rank: int = 0, eos_token_ids: Iterable[int] = ()):
        self.workers = WorkerGroup(config, type(self)) if rank == 0 and config.tensor_parallel_size > 1 else None
        with self.workers.guard(shutdown=True) if self.workers else nullcontext():
            self.setup(config, rank, eos_token_ids)
            if config.tensor_parallel_size > 1:
                started(config)

    def setup(self, config: Config, rank: int, eos_token_ids: Iterable[int]) -> None:
        """`eos_token_ids` are what `min_tokens` keeps the sampler from drawing (only rank 0 samples)."""
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        hf_config = config.hf_config
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        on_gpu = self.device.type == "cuda"
        self.backend = load_backend(config.attention_backend, Platform.probe(self.device.type))
        set_fused_ops(compiled=on_gpu and not config.enforce_eager and importable("triton"),
                      cpu_kernels=None if on_gpu else cpu_kernels())
        self.model = load_runner_model(config, self.device, self.backend, log=rank == 0)
        self.sampler = Sampler(hf_config.vocab_size, eos_token_ids, self.device)
        self.drafter = DraftModel(config.draft, self.device, self._governed) if config.draft is not None else None
        self.kv_cache = create_kv_cache(self.model, self.sampler, config, self.device)
        if self.drafter is not None:
            self.drafter.bind(self.kv_cache.num_blocks)
        self.cpu_decoder = None  # decode steps in one C++ call (`nanovllm.execution.cpu_decode`)
        if not on_gpu and cpu_kernels() is not None and not config.enforce_eager:
            self.cpu_decoder = cpu_decoder(self.model)
        self.governor = None  # tensor-parallel ranks keep their threads: a rank on one thread would hold up the rest
        if not on_gpu and config.tensor_parallel_size == 1 and torch.get_num_threads() > 1:
            self.governor = ThreadGovernor(torch.get_num_threads())
            for layer in self.model.model.layers:
                layer.register_forward_pre_hook(lambda *_: self.governor.tick())
        self.graphs = None
        if on_gpu and not config.enforce_eager and self.backend.capturable:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, config.blocks_per_sequence,
                                       config.max_model_len, hf_config.hidden_size, config.torch_dtype, self.device)

    def exit(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        if self.governor is not None:
            self.governor.restore()
        self.graphs = None
        self.cpu_decoder = None
        self.kv_cache = None
        bind_kv_cache(self.model, None)
        if self.drafter is not None:
            self.drafter.exit()

    def _governed(self) -> AbstractContextManager:
        """Around a model run: the CPU thread governor's watch, where there is one."""
        return self.governor.run() if self.governor is not None else nullcontext()

    def call(self, method: str, *args):
        """Run `method(*args)` on this rank; on rank 0 also on every worker (tensors travel by broadcast)."""
        if self.workers is None:
            return getattr(self, method)(*args)
        with self.workers.guard():
            self.workers.dispatch(method, *args)
            return getattr(self, method)(*args)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        return self._tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[PromptRows]]:
        """Set the attention context for one varlen step (sequence i computes its tokens `starts[i]` to
        `starts[i] + num_tokens[i]`; the tokens before are already in its KV cache) and return the
        input ids and positions. Logits are taken at the last row of each sequence that samples (and at the rows
        before it that verify its drafts), then at the prompt rows of sequences that asked for prompt logprobs
        (returned, in that order)."""
        input_ids, positions, slot_mapping, context_lens, logits_indices = [], [], [], [], []
        rope_lengths = [] if self.model.rope_needs_lengths else None
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        prompt_rows: list[PromptRows] = []
        for seq, start, num_tokens, samples, drafts in zip(batch.seqs, batch.starts, batch.num_tokens, batch.samples,
                                                           batch.drafts):
            end = start + num_tokens
            input_ids.extend(seq[start:end - len(drafts)] + drafts)
            positions.extend(range(start, end))
            if rope_lengths is not None:
                rope_lengths.extend(max(p + 1, seq.num_prompt_tokens) for p in range(start, end))
            slot_mapping.extend(cache_slots(seq.block_table, self.block_size, start, end))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                scored = range(start, min(end, seq.num_prompt_tokens - 1))  # position p scores prompt token p + 1
                prompt_rows.append(PromptRows(seq, start, [cu_seqlens_q[-1] + p - start for p in scored]))
            cu_seqlens_q.append(cu_seqlens_q[-1] + num_tokens)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            context_lens.append(end)
            if samples:
                logits_indices.extend(range(cu_seqlens_q[-1] - 1 - len(drafts), cu_seqlens_q[-1]))
        logits_indices += [row for rows in prompt_rows for row in rows.rows]
        set_context(cu_seqlens_q=self._tensor(cu_seqlens_q, torch.int32),
                    cu_seqlens_k=self._tensor(cu_seqlens_k, torch.int32),
                    max_seqlen_q=max(batch.num_tokens), max_seqlen_k=max(context_lens),
                    context_lens=self._tensor(context_lens, torch.int32),
                    block_tables=self.prepare_block_tables(batch.seqs),
                    slot_mapping=self._tensor(slot_mapping, torch.int64),
                    logits_indices=self._tensor(logits_indices, torch.int64),
                    rope_lengths=None if rope_lengths is None or rope_lengths == [p + 1 for p in positions]
                    else self._tensor(rope_lengths, torch.int64))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), prompt_rows

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Logits at the context's `logits_indices` (None if there are none, and on ranks other than 0).
        Decode replays a captured CUDA graph when one fits; the LM head always runs eagerly."""
        ctx = get_context()
        replay = self.graphs is not None and ctx.is_decode and ctx.rope_lengths is None
        if replay and self.graphs.fits(input_ids.size(0)):
            hidden_states = self.graphs.run(input_ids, positions, ctx)
        elif self.cpu_decoder is not None and ctx.max_seqlen_q <= SHORT_QUERIES:
            hidden_states = self.cpu_decoder(input_ids, positions)
        else:
            hidden_states = self.model(input_ids, positions)
        if not ctx.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden_states[ctx.logits_indices])

    def run(self, batch: ScheduledBatch, allowed: TokenBitmask | None = None) -> SamplerOutput | None:
        """Run one scheduled step; rank 0 returns a sampled token for each sequence that samples, in batch order
        (with drafts to verify: its accepted drafts and the token after them, see `nanovllm.execution.verifier`),
        within `allowed` (structured outputs) at the sampling rows it names."""
        if self.rank == 0:
            self.sampler.release(batch.finished_seq_ids)
        draft_probs = self.drafter.propose(batch, self.sampler) if self.drafter is not None else None
        input_ids, positions, prompt_rows = self.prepare(batch)
        with self._governed():
            started = time.perf_counter()
            logits = self.call("run_model", input_ids, positions)
        if self.drafter is not None:
            self.drafter.observe_target(time.perf_counter() - started)
        reset_context()
        if self.rank != 0:
            return None
        sampling = [(seq, drafts) for seq, drafts, samples in zip(batch.seqs, batch.drafts, batch.samples) if samples]
        num_rows = len(sampling) + sum(len(drafts) for _, drafts in sampling)
        if num_rows > len(sampling):
            output = verify(self.sampler, logits[:num_rows], sampling, allowed, draft_probs)
        else:
            output = self.sampler(logits[:num_rows], [seq for seq, _ in sampling], allowed) if sampling \
                else SamplerOutput([])
        if prompt_rows:
            output.prompt_logprobs = self.sampler.prompt_logprobs(logits[num_rows:], prompt_rows)
        return output
