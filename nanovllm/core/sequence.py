from copy import copy
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens (prompt then completion), its KV blocks and how far the model has got.

    `num_computed_tokens` is the one measure of progress (as in vLLM V1): the first that many
    tokens have their K/V in the cache, or are being computed in the step just scheduled. A
    prompt is being prefilled while it is below `num_prompt_tokens`; a sequence samples its next
    token in a step that brings it to `len(seq)`. Preemption resets it to 0 (recompute).
    `spec_token_ids`: tokens proposed to follow it (speculative decoding), verified in its next decode step;
    `spec_trials` and `spec_accepted`: drafts it has verified up to and including the first rejected one, and of
    those the accepted ones (its per-draft acceptance, which decides how many it proposes).
    `search`: for a beam of a beam search (`nanovllm.engine.beam_search`), the search, which takes each token the
    beam samples instead of the engine appending it; `held` while the beam has sampled and waits for its search to
    choose the next beams (the scheduler neither runs nor admits it). `fork` makes a copy to share its KV blocks.
    `pooling`: for a pooling request, its `PoolingParams`: the sequence is its prompt only, pooled once computed;
    `token_type_ids`: its prompt's token types, for a model that reads them (None: all 0).
    `lora_int_id`: the LoRA adapter it runs under (0: the base model); its KV blocks are named under it.
    """

    def __init__(self, seq_id: int, token_ids: list[int], block_size: int, params: SamplingParams,
                 priority: int = 0):
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens the prefix cache served when first scheduled; -1 before that
        self.block_size = block_size
        self.block_table: list[int] = []
        self.params = params
        self.priority = priority
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.spec_token_ids: list[int] = []
        self.spec_trials = self.spec_accepted = 0
        self.grammar = None  # structured outputs: the engine's GrammarState; not scheduled until `grammar.ready`
        self.search = None
        self.held = False
        self.pooling = None
        self.token_type_ids: list[int] | None = None
        self.lora_int_id = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, seq_id: int) -> "Sequence":
        """A copy under `seq_id` with the same tokens, progress, params and search, but no blocks yet (the block
        manager's `fork` shares them) and no drafts."""
        child = copy(self)
        child.seq_id = seq_id
        child.token_ids = copy(self.token_ids)
        child.block_table = []
        child.spec_token_ids = []
        child.spec_trials = child.spec_accepted = 0
        return child
