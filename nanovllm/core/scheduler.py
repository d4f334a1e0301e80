import heapq
from dataclasses import dataclass, field

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler works with (the engine's settings of the same names): its limits and policy ("fcfs" or
    "priority"), and the KV cache it hands out, `num_kv_blocks` blocks of `block_size` tokens (as many as the model
    runner could allocate). `sliding_window` > 0: every layer of the model sees only that many last positions, so
    blocks before it are released (see `BlockManager`). Without `enable_prefix_caching` no prompt reuses cached
    blocks (a model whose K/V depend on the prompt's length, LongRoPE's, cannot share them). `max_loras` > 0: at most
    that many distinct LoRA adapters among the running sequences (`Scheduler.lora_fits`)."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    scheduling_policy: str
    sliding_window: int = 0
    enable_prefix_caching: bool = True
    max_loras: int = 0


@dataclass
class ScheduledBatch:
    """One step's work: sequence i computes its tokens `starts[i]` to `starts[i] + num_tokens[i]`
    (the tokens before are in its KV cache); `samples[i]`: that reaches its end, so it samples.
    `drafts[i]`: proposed tokens after its last one (speculative decoding), the chunk's final tokens, verified in
    this step. `finished_seq_ids`: sequences that ended since the last step, whose sampling state can go."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_tokens: int, drafts: list[int] = ()) -> None:
        self.seqs.append(seq)
        self.starts.append(seq.num_computed_tokens)
        self.num_tokens.append(num_tokens)
        self.drafts.append(list(drafts))
        seq.num_computed_tokens += num_tokens
        self.samples.append(seq.num_computed_tokens == len(seq.token_ids) + len(drafts))

    def remove(self, seq: Sequence) -> int:
        """Take `seq` out again (it was preempted later in the same pass); returns its token count."""
        i = self.seqs.index(seq)
        del self.seqs[i], self.starts[i], self.samples[i], self.drafts[i]
        return self.num_tokens.pop(i)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of sequences computing just their last sampled token and its drafts: decodes (re-prefills of
        preempted ones are not)."""
        return sum(n for seq, start, n, drafts in zip(self.seqs, self.starts, self.num_tokens, self.drafts)
                   if n == 1 + len(drafts) and start >= seq.num_prompt_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_tokens) - self.num_decode_tokens


class WaitingQueue:
    """Requests waiting to (re)start, in policy order: FCFS by arrival, or by (priority, arrival).

    Arrival order is also where FCFS puts a preempted request back: ahead of everything that
    arrived after it.
    """

    def __init__(self, by_priority: bool):
        self.by_priority = by_priority
        self.heap: list[tuple[int, int, Sequence]] = []

    def key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.by_priority else 0), seq.seq_id

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self.heap, (*self.key(seq), seq))

    def peek(self) -> Sequence:
        return self.heap[0][-1]

    def pop(self) -> Sequence:
        return heapq.heappop(self.heap)[-1]

    def remove(self, seq: Sequence) -> None:
        self.heap = [entry for entry in self.heap if entry[-1] is not seq]
        heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self.heap))


class Scheduler:
    """Decides what every step computes under one token budget, as vLLM V1 does; never touches tensors.

    Running sequences go first, decodes before prompts being prefilled: each takes the tokens it
    needs next (1 to decode, else the next chunk of its prompt); at most `max_num_seqs` run, and
    never more than the budget, so no decode is ever starved. When one cannot get a KV block, the
    lowest-priority running sequence (the youngest, under FCFS) is preempted: its blocks are freed
    and it is recomputed later. Then, if nobody was preempted, waiting sequences are admitted in policy order with as
    much of their prompt (after any prefix-cache hit) as the budget and the free blocks allow.
    With `enable_chunked_prefill=False` a step is nano-vLLM's instead: whole prompts only, and
    only when none waits does every running sequence decode.

    Beam search's sequences (`Sequence.search`) run as any other, without drafts; one that is `held` (it has sampled
    and waits for the other beams of its search) is neither run nor admitted, and `fork` adds a copy of one that
    shares its KV blocks. When nothing else can run because held beams fill the cache or `max_num_seqs`, the
    youngest are preempted so that the beams they wait for get in.

    With LoRA (`max_loras` > 0), the running sequences hold at most `max_loras` distinct adapters, so every step runs
    at most that many; a waiting sequence whose adapter would be one too many is held back, and so is every adapter
    sequence behind it in the queue (base-model ones still go), so the running adapters drain and the held one gets
    the first free place: held back, never starved.
    """

    def __init__(self, config: SchedulerConfig):
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.prefix_caching = config.enable_prefix_caching
        self.max_loras = config.max_loras
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.sliding_window)
        self.waiting = WaitingQueue(by_priority=config.scheduling_policy == "priority")
        self.running: list[Sequence] = []
        self.unfinished: dict[int, Sequence] = {}
        self.finished_seq_ids: list[int] = []
        self.in_flight = ScheduledBatch()
        self.num_preemptions = self.num_cached_tokens = 0
        self.num_steps = self.num_chunked_steps = self.num_mixed_steps = 0
        self.num_draft_tokens = self.num_accepted_tokens = self.num_spec_rows = 0
        self.num_accepted_per_position: list[int] = []  # drafts accepted at each draft position (0: a row's first)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def reset_prefix_cache(self) -> bool:
        """`BlockManager.reset_prefix_cache`: no later request hits a block computed before; whether no block in use
        kept its name."""
        return self.block_manager.reset_prefix_cache()

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; a ValueError if it could never be scheduled, so nothing waits forever."""
        self.check(seq)
        self.waiting.push(seq)
        self.unfinished[seq.seq_id] = seq

    def check(self, seq: Sequence) -> None:
        """A ValueError if `seq` could never be scheduled."""
        if seq.num_blocks > len(self.block_manager.blocks):
            raise ValueError(f"request {seq.seq_id} needs {seq.num_blocks} KV blocks for its {len(seq)} prompt "
                             f"tokens but the cache has {len(self.block_manager.blocks)}")
        if not self.chunked_prefill and len(seq) > self.max_num_batched_tokens:
            raise ValueError(f"request {seq.seq_id} has {len(seq)} prompt tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}, and chunked prefill is off")

    def schedule(self) -> ScheduledBatch:
        batch = self.in_flight = ScheduledBatch(finished_seq_ids=self.finished_seq_ids)
        self.finished_seq_ids = []
        budget = self.max_num_batched_tokens
        if self.chunked_prefill:
            budget, preempted = self._schedule_running(batch, budget)
            if not preempted:
                self._schedule_waiting(batch, budget)
        elif not self._schedule_waiting(batch, budget):
            self._schedule_running(batch, budget)
        while not batch.seqs and self.waiting and any(seq.held for seq in self.running):
            self.preempt(max((seq for seq in self.running if seq.held), key=self.waiting.key))
            self._schedule_waiting(batch, budget)
        if batch.seqs:
            self.num_steps += 1
            self.num_chunked_steps += not all(batch.samples)
            self.num_mixed_steps += 0 < batch.num_decode_tokens < len(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        preempted = False
        for seq in sorted(self.running, key=lambda seq: len(seq.token_ids) - seq.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING or seq.held:  # preempted earlier in this pass, or a held beam
                continue
            num_tokens = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            drafts = seq.spec_token_ids[:budget - 1] if num_tokens == 1 and seq.search is None else []
            if drafts and self.block_manager.allocate(seq, 1 + len(drafts)):
                batch.add(seq, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
                continue
            while not self.block_manager.allocate(seq, num_tokens):
                victim = max(self.running, key=self.waiting.key)
                self.preempt(victim)
                if victim in batch.seqs:
                    budget += batch.remove(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.add(seq, num_tokens)
                budget -= num_tokens
        return budget, preempted

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> bool:
        admitted = False
        compiling = []  # set aside while their grammar compiles, held beams, adapters held back; the rest go on
        adapters = {seq.lora_int_id for seq in self.running if seq.lora_int_id} if self.max_loras else set()
        lora_held = False
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq.held or seq.grammar is not None and not seq.grammar.ready:
                compiling.append(self.waiting.pop())
                continue
            if seq.lora_int_id and not self.lora_fits(seq.lora_int_id, adapters, lora_held):
                lora_held = True
                compiling.append(self.waiting.pop())
                continue
            shares = self.prefix_caching and seq.params.prompt_logprobs is None
            cached = self.block_manager.cached_prefix(seq) if shares else []
            num_cached = len(cached) * self.block_manager.block_size
            num_tokens = len(seq) - num_cached
            if num_tokens > budget:
                if not self.chunked_prefill:
                    break
                num_tokens = budget
            if not self.block_manager.allocate(seq, num_tokens, cached):
                break
            self.waiting.pop()
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
            self.num_cached_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora_int_id:
                adapters.add(seq.lora_int_id)
            batch.add(seq, num_tokens)
            budget -= num_tokens
            admitted = True
        for seq in compiling:
            self.waiting.push(seq)
        return admitted

    def lora_fits(self, lora_int_id: int, adapters: set[int], held: bool) -> bool:
        """Whether a waiting sequence of adapter `lora_int_id` may start beside the running `adapters`: not after a
        sequence before it was held back for its adapter (`held`), and only as one of at most `max_loras`."""
        return not held and (lora_int_id in adapters or len(adapters) < self.max_loras)

    def fork(self, seq: Sequence, child_id: int,
             may_copy: bool = True) -> tuple[Sequence, list[tuple[int, int, int]]]:
        """A new sequence `child_id` with `seq`'s tokens (a beam search's beam forking: `seq` has sampled, and each
        will get a different next token). If `seq` runs, `max_num_seqs` allows one more, and its last block, when
        partial, can be copied (`may_copy`; a free block), the child runs beside it, sharing its KV blocks
        (`BlockManager.fork`), and the block copies it needs are returned for the model runner's caches; otherwise
        the child waits, to be computed when admitted (its full blocks served from the prefix cache)."""
        child = seq.fork(child_id)
        copies = None
        if seq.status == SequenceStatus.RUNNING and len(self.running) < self.max_num_seqs:
            copies = self.block_manager.fork(seq, child, may_copy)
        if copies is None:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self.waiting.push(child)
        else:
            self.running.append(child)
        self.unfinished[child.seq_id] = child
        return child, copies or []

    def preempt(self, seq: Sequence) -> None:
        self._free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        self.waiting.push(seq)
        self.num_preemptions += 1

    def _free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; K/V of a step that was scheduled but has not run are not valid."""
        valid = None
        if seq in self.in_flight.seqs:
            valid = self.in_flight.starts[self.in_flight.seqs.index(seq)]
        self.block_manager.deallocate(seq, valid)

    def new_tokens(self, batch: ScheduledBatch, token_ids: list[int],
                   num_accepted: list[int] | None = None) -> list[tuple[Sequence, list[int]]]:
        """Each sequence that samples, in batch order, with its new tokens, not yet appended: one sampled token
        each, or with `num_accepted` (speculative decoding) its first `num_accepted[i]` drafts and the token
        sampled after them (`token_ids` flat over all of them). The engine appends them one at a time, since it may
        end a sequence at any of them, then calls `settle` on the others. The K/V of rejected drafts stop counting
        as computed here."""
        self.in_flight = ScheduledBatch()
        sampled, offset = [], 0
        rows = [(seq, drafts) for seq, drafts, samples in zip(batch.seqs, batch.drafts, batch.samples) if samples]
        for i, (seq, drafts) in enumerate(rows):
            n = 1 if num_accepted is None else num_accepted[i] + 1
            sampled.append((seq, token_ids[offset:offset + n]))
            offset += n
            if drafts:
                seq.num_computed_tokens -= len(drafts) - (n - 1)
                seq.spec_trials += min(n, len(drafts))
                seq.spec_accepted += n - 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += n - 1
                self.num_spec_rows += 1
                self.num_accepted_per_position += [0] * (n - 1 - len(self.num_accepted_per_position))
                for position in range(n - 1):
                    self.num_accepted_per_position[position] += 1
        return sampled

    def settle(self, seq: Sequence) -> None:
        """After `seq` took a verification step's tokens: name the blocks its accepted tokens filled (prefix caching
        registers accepted tokens only) and free the blocks that only rejected drafts used."""
        self.block_manager.settle(seq)

    def finish_prompts(self, batch: ScheduledBatch) -> list[Sequence]:
        """After a pooling step (pooling requests never sample): each sequence whose prompt the step completed ends
        ("stop"), its blocks freed at once; returns them, in batch order."""
        self.in_flight = ScheduledBatch()
        done = [seq for seq, samples in zip(batch.seqs, batch.samples) if samples]
        for seq in done:
            self.finish(seq, "stop")
        return done

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` wherever it is (running, waiting or preempted) and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        del self.unfinished[seq.seq_id]
        self.finished_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def abort(self, seq_id: int) -> None:
        """Finish an unfinished request as aborted; unknown or finished ids are ignored."""
        if seq_id in self.unfinished:
            self.finish(self.unfinished[seq_id], "abort")

    def abort_all(self) -> None:
        """Finish every unfinished request as aborted and free its blocks (after an error mid-generate)."""
        for seq_id in list(self.unfinished):
            self.abort(seq_id)
        self.in_flight = ScheduledBatch()
