import ctypes
import logging
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from nanovllm.config import Config
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.execution.cpu_decode import SHORT_QUERIES, cpu_decoder
from nanovllm.execution.cpu_threads import ThreadGovernor
from nanovllm.execution.cuda_graph import DecodeGraphs, VerifyPrice, graph_batch_sizes
from nanovllm.execution.draft_model import DraftModel
from nanovllm.execution.kv_cache import bind_kv_cache, create_kv_cache, release_kv_cache, restore_kv_cache
from nanovllm.execution.logits_processors import build_logits_processors
from nanovllm.execution.model_loading import load_runner_model
from nanovllm.execution.pooling import PooledOutput, StepPooler, step_token_types
from nanovllm.execution.sampler import PromptRows, Sampler, SamplerOutput
from nanovllm.execution.step_inputs import Chunk, set_step_context, to_device
from nanovllm.execution.stopwatch import Stopwatch
from nanovllm.execution.tensor_parallel import WorkerGroup, started
from nanovllm.execution.verifier import verify
from nanovllm.kernels.attention import Platform, importable, load_backend
from nanovllm.kernels.attention.context import get_context, reset_context
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.kernels.fused import set_fused_ops
from nanovllm.lora.manager import LoRAManager
from nanovllm.lora.request import LoRARequest
from nanovllm.models.reload import (
    StowedWeights,
    adopt_weights,
    check_reload,
    release_weights,
    reload_weights,
    unwritten_shards,
    weight_pairs,
    written_shards,
)
from nanovllm.structured_output.bitmask import TokenBitmask

logger = logging.getLogger("nanovllm")

SLEEP_TAGS = ("weights", "kv_cache")  # what `wake_up` brings back, as vLLM names it


class ModelRunner:
    """Owns the model and the KV cache of one tensor-parallel rank; turns batches into tensors and runs them.

    With `tensor_parallel_size > 1`, rank 0 (in the user's process) starts the workers for the other
    ranks, and `call` forwards each call to them before running it here.

    The profiling hook: set `phase_seconds` to a dict and every later step adds, on this rank, the wall seconds of its
    phases to it: "draft" (a draft model's proposals), "prepare" (the batch's tensors), "model" (embedding, layers,
    final norm), "lm_head" and "sampler" (sampling or verifying drafts). None (the default) times nothing.
    """

    def __init__(self, config: Config, rank: int = 0, eos_token_ids: Iterable[int] = ()):
        self.phase_seconds: dict[str, float] | None = None
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
        self.loras = LoRAManager(self.model, hf_config, config.max_cpu_loras, config.max_lora_rank,
                                 config.torch_dtype, self.device, config.max_loras,
                                 graph_batch_sizes(config.max_num_seqs)[-1] if on_gpu else 0) \
            if config.enable_lora else None
        self.sampler = Sampler(hf_config.vocab_size, eos_token_ids, self.device, config.logprobs_mode)
        self.drafter = DraftModel(config.draft, self.device, self._governed) if config.draft is not None else None
        self.kv_cache = create_kv_cache(self.model, self.sampler, config, self.device)
        if rank == 0:  # custom logits processors run where the sampler samples, built after the warm-up's sampling
            self.sampler.logits_processors = build_logits_processors(config, self.device)
        self.pooler = StepPooler(self.model, config.pooler) if rank == 0 and config.runner == "pooling" else None
        if self.drafter is not None:
            self.drafter.bind(self.kv_cache.num_blocks)
        self.governor = None  # tensor-parallel ranks keep their threads: a rank on one thread would hold up the rest
        if not on_gpu and config.tensor_parallel_size == 1 and torch.get_num_threads() > 1:
            self.governor = ThreadGovernor(torch.get_num_threads())
            for layer in self.model.model.layers:
                layer.register_forward_pre_hook(lambda *_: self.governor.tick())
        # sleep mode: what sleeps (`SLEEP_TAGS`), at which level, the model's memory meanwhile (and the draft's); on
        # rank 0, after a level-2 sleep, the weights' shards no load_weights has written since (None: not tracked)
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self.stowed: StowedWeights | None = None
        self.draft_stowed: StowedWeights | None = None
        self.unwritten: dict[str, set] | None = None
        self._build_fast_paths()

    def _build_fast_paths(self) -> None:
        """What reads the weights and the KV cache where they lie, built once they are in place (at start, and when
        the engine wakes): the one-call CPU decoder (`nanovllm.execution.cpu_decode`, a C++ object holding the
        layers' weights and caches, adding LoRA deltas as the layers do) and the CUDA decode graphs (which bake in
        every address; LoRA's too, `LoRAManager.capturing`)."""
        config, on_gpu = self.config, self.device.type == "cuda"
        self.cpu_decoder = None  # decode steps in one C++ call (`nanovllm.execution.cpu_decode`)
        if not on_gpu and cpu_kernels() is not None and not config.enforce_eager:
            self.cpu_decoder = cpu_decoder(self.model)
        self.graphs = self.verify_price = None
        if on_gpu and not config.enforce_eager and self.backend.capturable and config.runner == "generate":
            with self.loras.capturing() if self.loras is not None else nullcontext():
                self.graphs = DecodeGraphs(self.model, config.max_num_seqs, config.blocks_per_sequence,
                                           config.max_model_len, config.hf_config.hidden_size, config.torch_dtype,
                                           self.device)
            self.verify_price = VerifyPrice(self.graphs.sizes[-1])
        self.replayed = False  # whether the last model run replayed a graph

    def exit(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        if self.governor is not None:
            self.governor.restore()
        self.graphs = self.verify_price = None
        self.cpu_decoder = None
        self.kv_cache = None
        self.stowed = self.draft_stowed = None
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place on every rank (`nanovllm.models.reload.reload_weights`, each rank's loaders
        keeping their slices): a ValueError from its checks means nothing changed on any rank. With tensor
        parallelism rank 0 checks first, then the tensors reach the workers by broadcast, as the steps' do (on CUDA
        from this rank's device). Refused while the weights sleep; after a level-2 sleep, what it writes is noted
        (`wake_up`)."""
        if "weights" in self.asleep:
            raise RuntimeError(f"load_weights: the weights are asleep (sleep(level={self.sleep_level})); call "
                               "wake_up(tags=['weights']) (or wake_up()) first")
        if self.workers is None:
            weights = weight_pairs(weights) if self.unwritten is not None else weights
            self.reload_weights(weights)
        else:
            weights = check_reload(self.model, weights, self.config.hf_config)
            if self.device.type == "cuda":
                weights = [(name, tensor.to(self.device)) for name, tensor in weights]
            self.call("reload_weights", weights)
        if self.unwritten is not None:
            for name, shards in written_shards(self.model, weights, self.config.hf_config).items():
                if name in self.unwritten:
                    self.unwritten[name] = set() if None in shards else self.unwritten[name] - shards

    def reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """This rank's part of `load_weights`."""
        dequantized = self.config.quantization if self.device.type == "cuda" or cpu_kernels() is None else None
        reload_weights(self.model, weights, self.config.hf_config, dequantized)

    # -- LoRA adapters, on every rank (`nanovllm.lora.manager`) --

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter on every rank (`LoRAManager.add`): rank 0 reads and checks it first, so a bad one is
        refused before any worker sees it."""
        added = self.loras.add(request)
        self._on_workers("lora_call", "add", request)
        return added

    def remove_lora(self, lora_id: int) -> bool:
        self._on_workers("lora_call", "remove", lora_id)
        return self.loras.remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        pinned = self.loras.pin(lora_id)
        self._on_workers("lora_call", "pin", lora_id)
        return pinned

    def lora_call(self, method: str, *args) -> None:
        """A worker's side of `add_lora`, `remove_lora` and `pin_lora`."""
        getattr(self.loras, method)(*args)

    def _on_workers(self, method: str, *args) -> None:
        if self.workers is not None:
            with self.workers.guard():
                self.workers.dispatch(method, *args)

    # -- sleep mode (`nanovllm.engine.llm_engine.LLMEngine.sleep`) --

    def sleep(self, level: int) -> None:
        """Every rank gives its memory back (`sleep_rank`). Rank 0; no request may be in flight."""
        self.call("sleep_rank", level)

    def sleep_rank(self, level: int) -> None:
        """This rank's part of `sleep`. The KV cache's K/V are forgotten and its memory given back (on the CPU the
        pages of its map, which stays; on CUDA the tensor). Level 1 keeps the weights: on the CPU where they are, on
        CUDA copied to (pinned) host memory, their device memory freed. Level 2 drops the weights (their buffers, the
        rotary tables, are kept, in host memory on CUDA). A draft model's weights are kept as at level 1 whatever the
        level (`load_weights` never reaches them). The C++ decoder and the CUDA graphs, which hold the old
        addresses, go; `wake_up_rank` builds them again."""
        self.graphs = self.verify_price = None
        self.cpu_decoder = None
        release_kv_cache(self.model, self.kv_cache)
        on_gpu = self.device.type == "cuda"
        if level == 2 or on_gpu:
            self.stowed = StowedWeights(self.model, keep=level == 1)
        if self.drafter is not None:
            release_kv_cache(self.drafter.model, self.drafter.kv_cache)
            if on_gpu:
                self.draft_stowed = StowedWeights(self.drafter.model, keep=True)
        self.asleep, self.sleep_level = set(SLEEP_TAGS), level
        _give_back_freed_memory(self.device)

    def wake_up(self, tags: set[str]) -> None:
        """Every rank takes back the memory of `tags` (a subset of `asleep`; `wake_up_rank`). Rank 0.

        After a level-2 sleep the weights come back zero-filled, for `load_weights` to write. When the last tag wakes
        and no load_weights wrote any of them since the sleep, the checkpoint is read again from the model's path
        (as at start: the same file, or `load_format="dummy"`'s seed), so the engine is the one that went to sleep;
        when load_weights wrote only some, this is a RuntimeError, before anything changes, naming what is left."""
        reload = False
        if self.sleep_level == 2 and not self.asleep - tags:  # the last tags wake
            unwritten = self.unwritten
            if "weights" in tags or unwritten == unwritten_shards(self.model, {}):
                reload = True
            elif unwritten and any(unwritten.values()):
                left = [f"{name} ({', '.join(sorted(map(str, shards)))})" if None not in shards else name
                        for name, shards in unwritten.items() if shards]
                shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
                raise RuntimeError(f"wake_up: after sleep(level=2), load_weights gave only some of the weights; these "
                                   f"parameters (the model's own names, with the shards missing) were not written: "
                                   f"{shown}. Give the rest with load_weights (or all of them, or none: then the "
                                   "checkpoint is read again), then wake_up()")
        self.call("wake_up_rank", sorted(tags), reload)
        if self.sleep_level == 2 and "weights" in tags and not reload:
            self.unwritten = unwritten_shards(self.model, {})  # zero-filled: load_weights is to write them
        if not self.asleep:
            self.unwritten, self.sleep_level = None, 0

    def wake_up_rank(self, tags: list[str], reload: bool) -> None:
        """This rank's part of `wake_up`: the weights back (copied back to the device, or re-allocated zero-filled),
        the KV cache back (zeroed), and when `reload`, the checkpoint read into the weights; once nothing sleeps,
        the C++ decoder and the CUDA graphs are built again (the graphs captured again: the memory is elsewhere)."""
        if "weights" in tags and "weights" in self.asleep:
            if self.stowed is not None:
                self.stowed.wake(weights=not reload)
                self.stowed = None
            if self.draft_stowed is not None:
                self.draft_stowed.wake()
                self.draft_stowed = None
            self.asleep.discard("weights")
        if reload:
            release_weights(self.model)  # any zero-filled ones: the memory is the checkpoint's next
            adopt_weights(self.model, load_runner_model(self.config, self.device, self.backend, log=False))
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            restore_kv_cache(self.model, self.config, self.kv_cache, self.device)
            if self.drafter is not None:
                restore_kv_cache(self.drafter.model, self.drafter.config, self.drafter.kv_cache, self.device)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0
            self._build_fast_paths()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[PromptRows]]:
        """Set the attention context for one varlen step (sequence i computes its tokens `starts[i]` to
        `starts[i] + num_tokens[i]`, its drafts last; the tokens before are already in its KV cache) and return the
        input ids and positions. Logits are taken at the last row of each sequence that samples (and at the rows
        before it that verify its drafts), then at the prompt rows of sequences that asked for prompt logprobs
        (returned, in that order)."""
        chunks, logits_indices, prompt_rows, rows = [], [], [], 0
        rope_lengths, needs_rope_lengths = [] if self.model.rope_needs_lengths else None, False
        for seq, start, num_tokens, samples, drafts in zip(batch.seqs, batch.starts, batch.num_tokens, batch.samples,
                                                           batch.drafts):
            end = start + num_tokens
            chunks.append(Chunk(seq, start, seq[start:end - len(drafts)] + drafts))
            if rope_lengths is not None:
                rope_lengths += (max(p + 1, seq.num_prompt_tokens) for p in range(start, end))
                needs_rope_lengths |= start + 1 < seq.num_prompt_tokens  # a prompt row before the prompt's last
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                scored = range(start, min(end, seq.num_prompt_tokens - 1))  # position p scores prompt token p + 1
                prompt_rows.append(PromptRows(seq, start, [rows + p - start for p in scored]))
            rows += num_tokens
            if samples:
                logits_indices += range(rows - 1 - len(drafts), rows)
        logits_indices += [row for rows in prompt_rows for row in rows.rows]
        input_ids, positions = set_step_context(chunks, self.block_size, self.device, logits_indices,
                                                rope_lengths if needs_rope_lengths else None)
        return input_ids, positions, prompt_rows

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                  lora_rows: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
        """Logits at the context's `logits_indices` (None if there are none, and on ranks other than 0); for the
        pooling runner, rank 0 gets every row's hidden states (`token_type_ids` for an encoder that reads them).
        `lora_rows`: each sequence's LoRA adapter and row count, in row order (`LoRAManager.start_step`).
        Decode replays a captured CUDA graph when one fits; the LM head always runs eagerly."""
        if self.loras is not None:
            self.loras.start_step(lora_rows)
        try:
            return self._run_model(input_ids, positions, token_type_ids)
        finally:
            if self.loras is not None:
                self.loras.end_step()

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   token_type_ids: torch.Tensor | None) -> torch.Tensor | None:
        ctx = get_context()
        with self._timed("model"):
            self.replayed = self.graphs is not None and ctx.is_decode and ctx.rope_lengths is None \
                and self.graphs.fits(input_ids.size(0))
            if self.replayed:
                hidden_states = self.graphs.run(input_ids, positions, ctx)
            elif self.cpu_decoder is not None and ctx.max_seqlen_q <= SHORT_QUERIES:
                hidden_states = self.cpu_decoder(input_ids, positions)
            elif token_type_ids is not None:
                hidden_states = self.model(input_ids, positions, token_type_ids)
            else:
                hidden_states = self.model(input_ids, positions)
        if self.config.runner == "pooling":  # rank 0 pools the hidden states
            return hidden_states if self.rank == 0 else None
        if not ctx.logits_indices.numel():
            return None
        with self._timed("lm_head"):
            return self.model.compute_logits(hidden_states[ctx.logits_indices])

    def run(self, batch: ScheduledBatch, allowed: TokenBitmask | None = None) -> SamplerOutput | PooledOutput | None:
        """Run one scheduled step; rank 0 returns a sampled token for each sequence that samples, in batch order
        (with drafts to verify: its accepted drafts and the token after them, see `nanovllm.execution.verifier`),
        within `allowed` (structured outputs) at the sampling rows it names. The pooling runner's rank 0 returns the
        pooled outputs of the sequences whose prompt the step completed."""
        if self.rank == 0:
            self.sampler.release(batch.finished_seq_ids)
        if self.pooler is not None:
            self.pooler.release(batch.finished_seq_ids)
        draft_probs = None
        if self.drafter is not None:
            with self._timed("draft"):
                draft_probs = self.drafter.propose(batch, self.sampler)
        with self._timed("prepare"):
            input_ids, positions, prompt_rows = self.prepare(batch)
            types = step_token_types(batch) if self.pooler is not None else None
        with self._governed():
            timed = self.drafter is not None or self.verify_price is not None
            watch = Stopwatch(self.device).start() if timed else None
            lora_rows = [(seq.lora_int_id, n) for seq, n in zip(batch.seqs, batch.num_tokens)] if self.loras else None
            logits = self.call("run_model", input_ids, positions,
                               None if types is None else to_device(types, torch.int64, self.device), lora_rows)
            if watch is not None:
                watch.stop()
        reset_context()
        if self.rank != 0:
            return None
        if self.pooler is not None:
            return self.pooler(logits, batch)  # the pooling runner's run_model gives hidden states
        with self._timed("sampler"):
            sampling = [(seq, drafts) for seq, drafts, samples in zip(batch.seqs, batch.drafts, batch.samples)
                        if samples]
            num_rows = len(sampling) + sum(len(drafts) for _, drafts in sampling)
            # prompt logprobs reach the host with the samples, in the step's one transfer
            prompt = self.sampler.score_prompts(logits[num_rows:], prompt_rows) if prompt_rows else None
            if num_rows > len(sampling):
                output = verify(self.sampler, logits[:num_rows], sampling, allowed, draft_probs, prompt)
            else:
                output = self.sampler(logits[:num_rows], [seq for seq, _ in sampling], allowed, prompt) \
                    if sampling or prompt is not None else SamplerOutput([])
        if self.drafter is not None:  # the step's tokens are on the host: reading the watch waits for nothing
            self.drafter.observe_target(watch)
        if self.verify_price is not None:
            self.verify_price.observe(batch, self.replayed, watch.seconds())
        return output

    def verify_cost(self, running: list[Sequence]) -> float:
        """What the next step of `running` costs if it verifies drafts, in steps without them: 1 but where decode
        replays CUDA graphs (`VerifyPrice`)."""
        return 1.0 if self.verify_price is None else self.verify_price(running)

    def _timed(self, phase: str) -> AbstractContextManager:
        """Around one phase of a step: nothing, unless `phase_seconds` is a dict (see `__init__`)."""
        return _NO_TIMER if self.phase_seconds is None else PhaseTimer(self.phase_seconds, phase, self.device)


_NO_TIMER = nullcontext()


def _give_back_freed_memory(device: torch.device) -> None:
    """Return what was just freed to the system: on CUDA torch's cached blocks; on the CPU glibc's free heap
    (`malloc_trim`: freed blocks below the mmap threshold stay in the heap otherwise)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PhaseTimer:
    """Adds the wall seconds of a `with` block to `seconds[phase]`; on CUDA the device's work is waited for first and
    last, so the time is the phase's own."""

    def __init__(self, seconds: dict[str, float], phase: str, device: torch.device):
        self.seconds, self.phase, self.device = seconds, phase, device

    def __enter__(self) -> None:
        self._sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + time.perf_counter() - self.start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
