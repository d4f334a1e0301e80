"""A draft model's proposals: a smaller model (or a quantized copy of the target) with the target's vocabulary runs in
the engine's process, on its device, and proposes each speculating sequence's next tokens autoregressively.

Its KV cache has the target's blocks (vLLM's design): the same block ids, block tables and slots, in a tensor shaped
for the draft, so the scheduler's one block manager serves both, and the slots the scheduler gives a step's drafts
hold the draft's K/V too. Within a step, before the target verifies: the proposer (`DraftModelProposer`) has
reserved placeholders, as many as the adaptive rule keeps; the draft catches up on the tokens it has not seen (its
prompt when it first speculates, what the target accepted since), which yields the first draft, then runs one token
per further draft, all speculating sequences batched. The draft computes lazily: a sequence that does not speculate
in a step costs it nothing. A prompt's blocks served from the prefix cache are trusted to hold the draft's K/V
too: true when the sequence that computed them speculated afterwards; otherwise (penalties, grammars, speculation
off at large batch) the draft reads stale K/V there, which lowers acceptance and never changes the output.

Greedy and seeded requests get the draft's most likely token (a point mass, verified as n-gram proposals are, so
their output is the same as without speculation); unseeded requests at temperature > 0 get a token sampled from the
draft's distribution q, kept for the verifier's speculative sampling.

The drafts stay on the device until the last one is drawn: each depth's tokens are the next forward's input ids (its
positions, slots and block tables are known on the host), bad words are matched against them there, and all the
drafts reach the host in one transfer, so a proposal never waits for the device in between.
"""
from collections.abc import Callable
from contextlib import AbstractContextManager
from itertools import accumulate

import torch

from nanovllm.config import Config
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.execution.kv_cache import allocate_kv_cache, bind_kv_cache
from nanovllm.execution.model_loading import load_runner_model
from nanovllm.execution.sampler import DeviceTail, Sampler, SamplingRow, to_host
from nanovllm.execution.sampling_ops import draw_tokens, greedy_tokens
from nanovllm.execution.step_inputs import Chunk, set_step_context, to_device
from nanovllm.execution.stopwatch import SizeClassRatios, Stopwatch
from nanovllm.kernels.attention import Platform, load_backend
from nanovllm.kernels.attention.context import get_context, reset_context

PRIOR_RATIO = 0.25  # a draft forward's cost in target steps before one was measured


def samples_drafts(seq: Sequence) -> bool:
    """Whether `seq`'s drafts are drawn from the draft's distribution (verified by speculative sampling) rather
    than its most likely token: unseeded sampling only, since a seeded request's output must not depend on how
    many drafts its steps verified."""
    return seq.params.temperature > 0 and seq.params.seed is None


class DraftModel:
    """The draft model and its KV cache (`bind` gives it the target's number of blocks); `propose` fills a scheduled
    batch's placeholder drafts. `governed` wraps each of its forwards (the model runner's CPU thread governor)."""

    def __init__(self, config: Config, device: torch.device, governed: Callable[[], AbstractContextManager]):
        self.config = config
        self.device = device
        self.governed = governed
        self.model = load_runner_model(config, device, load_backend(config.attention_backend,
                                                                    Platform.probe(device.type)))
        if self.model.rope_needs_lengths:
            raise ValueError(f"the draft model {config.model!r} uses LongRoPE, whose K/V depend on the prompt's "
                             "length; use a draft model with plain rope")
        self.block_size = config.kvcache_block_size
        self.kv_cache = None
        self.computed: dict[int, int] = {}  # seq id -> positions whose draft K/V are in the cache
        self.last_start: dict[int, int] = {}  # seq id -> where its last scheduled chunk started
        self.ratios = SizeClassRatios(PRIOR_RATIO)  # a draft forward / a target step, by the speculating sequences
        self.last_run: tuple[int, int, Stopwatch] | None = None  # (sequences, forwards, time) of the last proposal

    def bind(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(self.model, self.config, num_blocks, self.device)

    def exit(self) -> None:
        self.kv_cache = None
        bind_kv_cache(self.model, None)

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, sampler: Sampler) -> dict[int, torch.Tensor]:
        """Replace the placeholders in `batch.drafts` by the draft's tokens (not the drafts of constrained
        sequences: `DraftModelProposer` reserves none for them, and their grammar's forced tokens stay); returns, per
        sequence whose drafts were sampled, the draft's probabilities at each of them (`[len(drafts), vocab]`)."""
        for seq_id in batch.finished_seq_ids:
            self.computed.pop(seq_id, None)
            self.last_start.pop(seq_id, None)
        speculating = []
        for seq, start, drafts in zip(batch.seqs, batch.starts, batch.drafts):
            if seq.seq_id not in self.last_start or start <= self.last_start[seq.seq_id]:
                self.computed[seq.seq_id] = start  # (re)admitted: what the prefix cache served is trusted
            self.last_start[seq.seq_id] = start
            if drafts and seq.grammar is None:  # a constrained sequence's drafts are its grammar's forced tokens
                speculating.append((seq, start, drafts))
        if not speculating:
            return {}
        chunks = []
        for seq, start, _ in speculating:
            first = min(start, self.computed[seq.seq_id])
            chunks.append(Chunk(seq, first, seq.token_ids[first:start + 1]))
        probs: dict[int, list[torch.Tensor]] = {}
        depth = max(len(drafts) for _, _, drafts in speculating)
        watch = Stopwatch(self.device)
        drawn: list[torch.Tensor] = []  # per depth j, the tokens of the sequences with more than j drafts
        for j in range(depth):
            if j == 1:
                watch.start()
            rows = [(seq, drafts) for seq, _, drafts in speculating if len(drafts) > j]
            if j == 0:
                logits = self._catch_up(chunks)
            else:  # the input ids are the last depth's tokens, on the device: the chunks hold placeholders
                logits = self._forward([Chunk(seq, start + j, [0]) for seq, start, drafts in speculating
                                        if len(drafts) > j], None, self._inputs(drawn[-1], speculating, j))
            bad_words = j > 0 and any(len(word) > 1 for seq, _ in rows for word in seq.params.bad_words_token_ids)
            tail = self._tail(speculating, drawn, j) if bad_words else None
            drawn.append(self._draw(logits, rows, j, sampler, probs, tail))
        for seq, start, drafts in speculating:
            self.computed[seq.seq_id] = start + len(drafts)
        if depth > 1:  # the first forward also catches up (prompts included): only the others are timed
            self.last_run = len(speculating), depth - 1, watch.stop()
        for j, tokens in enumerate(to_host(drawn)):  # the proposal's one wait for the device
            for drafts, token in zip([drafts for _, _, drafts in speculating if len(drafts) > j], tokens):
                drafts[j] = token
        return {seq_id: torch.stack(rows) for seq_id, rows in probs.items()}

    def observe_target(self, target: Stopwatch) -> None:
        """The target's forward of the step just proposed for took what `target` measured (read once the step's
        tokens are on the host): update what a draft forward costs against it, for the size class of the step's
        speculating sequences (a moving average). Both are timed alike (`Stopwatch`: CUDA events on a GPU)."""
        if self.last_run is None:
            return
        (num_seqs, forwards, draft), self.last_run = self.last_run, None
        self.ratios.observe(num_seqs, draft.seconds() / forwards / max(target.seconds(), 1e-6))

    def forward_ratio(self, num_seqs: int) -> float:
        """What a draft forward over `num_seqs` sequences costs in target steps: as measured for their size class,
        else an optimistic `PRIOR_RATIO`, so that every size is tried (`SizeClassRatios`)."""
        return self.ratios(num_seqs)

    @staticmethod
    def _inputs(tokens: torch.Tensor, speculating: list[tuple[Sequence, int, list[int]]], j: int) -> torch.Tensor:
        """Depth j's input ids: of `tokens` (depth j - 1's, one per sequence with more than j - 1 drafts), those of
        the sequences with more than j."""
        previous = [drafts for _, _, drafts in speculating if len(drafts) > j - 1]
        keep = [i for i, drafts in enumerate(previous) if len(drafts) > j]
        return tokens if len(keep) == len(previous) else tokens[to_device(keep, torch.int64, tokens.device)]

    @staticmethod
    def _tail(speculating: list[tuple[Sequence, int, list[int]]], drawn: list[torch.Tensor], j: int) -> DeviceTail:
        """The drafts before depth j of the sequences with more than j, as they lie in `torch.cat(drawn)`: depth t's
        tokens, one per sequence with more than t drafts, follow depth t - 1's."""
        lengths = [len(drafts) for _, _, drafts in speculating]
        index: list[list[int]] = [[] for n in lengths if n > j]
        offset = 0
        for t in range(j):
            members = [i for i, n in enumerate(lengths) if n > t]
            where = [offset + k for k, i in enumerate(members) if lengths[i] > j]
            for row, position in zip(index, where):
                row.append(position)
            offset += len(members)
        return DeviceTail(torch.cat(drawn), index)

    def _draw(self, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]], j: int, sampler: Sampler,
              probs: dict[int, list[torch.Tensor]], tail: DeviceTail | None) -> torch.Tensor:
        """Draft `j` of each of `rows` from the draft's `logits` (one row each), on the device. The drafts before
        it are placeholders in the rows' tokens: only bad words read them, in `tail` (on the device)."""
        seqs = [SamplingRow(seq.seq_id, seq.params, seq.token_ids + drafts[:j], seq.num_prompt_tokens)
                for seq, drafts in rows]
        masked = sampler.masked(logits, seqs, tail)
        tokens = greedy_tokens(masked)
        sampled = [i for i, (seq, _) in enumerate(rows) if samples_drafts(seq)]
        if sampled:
            index = slice(None) if len(sampled) == len(rows) else to_device(sampled, torch.int64, logits.device)
            q = sampler.distribution(masked[index], [seqs[i] for i in sampled])
            tokens[index] = draw_tokens(q, {})
            for i, row in zip(sampled, q):
                probs.setdefault(rows[i][0].seq_id, []).append(row)
        return tokens

    def _catch_up(self, chunks: list[Chunk]) -> torch.Tensor:
        """`_forward` over `chunks` in forwards of at most `max_num_batched_tokens` tokens, as the scheduler bounds the
        target's steps (a sequence's first speculation catches up on its whole prompt); a chunk is split where a
        forward fills up. Returns the logits at each chunk's last token."""
        budget, logits, part, wanted, used = self.config.max_num_batched_tokens, [], [], [], 0
        for chunk in chunks:
            start, tokens = chunk.start, chunk.tokens
            while tokens:
                take = min(len(tokens), budget - used)
                part.append(Chunk(chunk.seq, start, tokens[:take]))
                start, tokens, used = start + take, tokens[take:], used + take
                if not tokens:
                    wanted.append(len(part) - 1)
                if used == budget:
                    logits.append(self._forward(part, wanted))
                    part, wanted, used = [], [], 0
        if part:
            logits.append(self._forward(part, wanted))
        return torch.cat(logits)

    def _forward(self, chunks: list[Chunk], wanted: list[int] | None = None,
                 input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the draft over each chunk, writing its K/V into the chunk's sequence's blocks; returns the logits at the
        last token of the chunks `wanted` (default: every chunk's). `input_ids`: the chunks' tokens already on the
        device (then the chunks' own are placeholders)."""
        ends = list(accumulate(len(chunk.tokens) for chunk in chunks))
        rows = [ends[i] - 1 for i in (range(len(chunks)) if wanted is None else wanted)]
        placeholders, positions = set_step_context(chunks, self.block_size, self.device, rows)
        try:
            with self.governed():
                hidden_states = self.model(placeholders if input_ids is None else input_ids, positions)
                return self.model.compute_logits(hidden_states[get_context().logits_indices])
        finally:
            reset_context()
