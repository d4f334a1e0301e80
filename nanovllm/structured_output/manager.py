"""The engine's side of structured outputs: grammars compile on a worker thread (a request waits, in the scheduler's
queue, until its grammar is ready, while the others go on), compiled grammars are cached by their text, and each step
one bitmask covers every constrained row."""
import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nanovllm.structured_output.backends import create_backend
from nanovllm.structured_output.bitmask import TokenBitmask
from nanovllm.structured_output.spec import GrammarSpec

logger = logging.getLogger("nanovllm")

CACHE_SIZE = 256


class GrammarState:
    """One sequence's grammar: compiling, then (`ready`) a matcher that follows the sequence's tokens. It stays with
    the sequence through preemption, whose recompute appends no tokens, so it needs no replay."""

    def __init__(self, compiled: Future, owner: "StructuredOutputs"):
        self.compiled = compiled
        self.owner = owner
        self._matcher = None

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = self.owner.backend.matcher(self.compiled.result())
        return self._matcher

    @property
    def is_stopped(self) -> bool:
        """The constraint is complete: only EOS could follow."""
        return self.matcher.is_stopped

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (drafts) the grammar accepts from here, and that holds no EOS (after one
        the grammar has no next mask; the model samples EOS itself); the state is unchanged."""
        eos = next((i for i, token_id in enumerate(token_ids) if token_id in self.owner.eos_token_ids), None)
        token_ids = token_ids[:eos]
        return token_ids[:self.matcher.valid_prefix_length(token_ids)] if token_ids else []

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (jump-forward's drafts); often none."""
        return self.matcher.forced_tokens()

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept(token_id):
            logger.warning("the grammar rejected token %d (%s); only EOS is allowed from here", token_id,
                           self.matcher.error)


class StructuredOutputs:
    """Compiles, caches and applies the grammars of one engine's requests; sequences carry their `GrammarState` as
    `seq.grammar` (None when unconstrained)."""

    def __init__(self, backend: str, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 eos_token_ids: set[int], max_rows: int, pin_memory: bool = False):
        self.backend_name = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_rows = max_rows
        self.pin_memory = pin_memory
        self.num_compiled = self.num_cache_hits = 0
        self._backend = None
        self._backend_lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None
        self._filler: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pending: set[Future] = set()
        self._bitmask: torch.Tensor | None = None
        self._known: torch.Tensor | None = None

    @property
    def backend(self):
        """The grammar backend, made on first use (it indexes the tokenizer's tokens once, ~0.5 s)."""
        with self._backend_lock:
            if self._backend is None:
                width = max(self.vocab_size, len(self.tokenizer))
                self._backend = create_backend(self.backend_name, self.tokenizer, width, self.eos_token_ids)
                self._allocate(width)
            return self._backend

    def _allocate(self, width: int) -> None:
        """The step's bitmask, and the tokens that may ever be allowed: those the tokenizer knows and the model can
        produce (a vocabulary padded past the tokenizer, as Qwen's, has ids neither knows)."""
        words = (width + 31) // 32
        self._bitmask = torch.zeros(self.max_rows, words, dtype=torch.int32, pin_memory=self.pin_memory)
        known = np.zeros(words * 32, dtype=bool)
        known[:min(len(self.tokenizer), self.vocab_size)] = True
        self._known = torch.from_numpy(np.packbits(known, bitorder="little").view(np.int32).copy())

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A new sequence's grammar state: the cached compiled grammar, or one compiling on the worker thread."""
        compiled = self._cache.get(spec)
        if compiled is not None and not (compiled.done() and compiled.exception() is not None):
            self._cache.move_to_end(spec)
            self.num_cache_hits += 1
        else:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-grammar")
            compiled = self._compiler.submit(self._compile, spec)
            self._pending.add(compiled)
            compiled.add_done_callback(self._pending.discard)
            self._cache[spec] = compiled
            self.num_compiled += 1
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return GrammarState(compiled, self)

    def _compile(self, spec: GrammarSpec):
        return self.backend.compile(spec)

    def wait_for_compile(self) -> bool:
        """Block until some grammar being compiled is ready; False if none is being compiled (nothing to wait for)."""
        pending = list(self._pending)
        if not pending:
            return False
        wait(pending, return_when=FIRST_COMPLETED)
        return True

    def bitmask(self, rows: list[tuple]) -> TokenBitmask | None:
        """The tokens each constrained sequence may sample at each row it samples, or None when none is constrained.
        `rows` are a step's sampling sequences with their drafts, `(seq, drafts)` in order; each takes
        `1 + len(drafts)` consecutive sampling rows, the mask of row j being what its grammar allows after
        `drafts[:j]` (constrained sequences' drafts are ones their grammar accepts, `spec_decode.grammar_drafts`).
        The grammar backend fills it on a thread of its own (the backends work outside the GIL) while the model runs;
        the sampler waits for it. Nothing may touch the matchers until then."""
        constrained, masked, first = [], [], 0  # masked: the sampling rows under a grammar, in order
        for seq, drafts in rows:
            if seq.grammar is not None:
                constrained.append((seq.grammar.matcher, len(masked), drafts))
                masked += range(first, first + 1 + len(drafts))
            first += 1 + len(drafts)
        if not constrained:
            return None
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-mask")
        if len(masked) > self._bitmask.size(0):  # drafts: more rows than sequences
            self._bitmask = torch.zeros(len(masked), self._bitmask.size(1), dtype=torch.int32,
                                        pin_memory=self.pin_memory)
        bitmask = self._bitmask[:len(masked)]
        filling = self._filler.submit(self._fill, constrained, bitmask)
        return TokenBitmask(masked, bitmask, filling)

    def _fill(self, rows: list[tuple], bitmask: torch.Tensor) -> None:
        self.backend.fill(rows, bitmask)
        bitmask &= self._known

    def shutdown(self) -> None:
        for pool in (self._compiler, self._filler):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._compiler = self._filler = None
