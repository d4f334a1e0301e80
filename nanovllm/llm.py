"""`LLM`, the public entry point, as vLLM's: `LLM(model, **engine_settings).generate(prompts, sampling_params)`."""
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Protocol

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams
from nanovllm.config import Config, VllmConfig
from nanovllm.engine.beam_search import EngineBeamSearch, PromptSearch, search_by_requests, token_decoder
from nanovllm.engine.data_parallel import DataParallelLLM
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.pooling_prompts import PoolingPromptChecker
from nanovllm.engine.prompts import CheckedPrompt, Conversation, LoRAParam, Params, Prompt, PromptChecker, with_loras
from nanovllm.engine.setup import resolve_config
from nanovllm.llm_pooling import PoolingMethods
from nanovllm.lora.request import LoRARequest
from nanovllm.metrics import Metric, metrics_from_stats
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class Handle(Protocol):
    """A submitted request as an engine tracks it."""

    request_id: str
    error: BaseException | None

    @property
    def finished(self) -> bool: ...

    def output(self) -> RequestOutput: ...

    def take_news(self) -> list[RequestOutput]: ...


class Engine(Protocol):
    """What `LLM` drives: one `LLMEngine` in this process, or a `DataParallelLLM` of replicas."""

    config: Config
    tokenizer: PreTrainedTokenizerBase | None
    vllm_config: VllmConfig
    model_config: SimpleNamespace  # vllm_config.model_config

    def submit(self, checked: list[CheckedPrompt]) -> list[Handle]: ...

    def turn(self) -> AbstractContextManager: ...

    def progress(self, handles: list[Handle]) -> dict[str, float] | None: ...

    def step(self, delta: bool = False) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def is_finished(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def stats(self) -> dict: ...

    def engine_stats(self) -> list[tuple[int, dict]]: ...

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def is_sleeping(self) -> bool: ...

    def add_lora(self, lora_request: LoRARequest) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def list_loras(self) -> set[int]: ...

    def pin_lora(self, lora_id: int) -> bool: ...

    def exit(self) -> None: ...


class LLM(PoolingMethods):
    """An offline inference engine for `model` (a Hugging Face model directory or a .gguf file), with vLLM's API.

    The settings are resolved once (`nanovllm.engine.setup.resolve_config`): every "auto" replaced by what was
    chosen, a ValueError or FileNotFoundError naming any problem before work starts. They run on `engine`: one
    `LLMEngine` in this process, or with `data_parallel_size=N` (N > 1) a `DataParallelLLM` of N engine replicas in
    worker processes; every method below works the same on both. One `LLM` serves many callers: `generate`, `chat`
    and `stream` from several threads, or interleaved streams, share the engine's batches, and each request's tokens
    reach the caller that asked. With `runner="pooling"` it embeds, classifies and scores instead
    (`nanovllm.llm_pooling`).
    """

    def __init__(self, model: str | None = None, data_parallel_size: int = 1, **settings):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        config = resolve_config(model, settings)
        self.engine: Engine = LLMEngine(config) if data_parallel_size == 1 else DataParallelLLM(config,
                                                                                            data_parallel_size)
        checker = PoolingPromptChecker if config.runner == "pooling" else PromptChecker
        self.prompts = checker(config, self.engine.tokenizer)

    @property
    def config(self) -> Config:
        """The resolved settings (device, dtype, attention backend, `max_model_len`, the model's `hf_config`, ...)."""
        return self.engine.config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (None for a model directory without tokenizer files)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine runs."""
        return self.config.max_model_len

    @property
    def llm_engine(self) -> Engine:
        """The engine, under vLLM's name: what clients read off vLLM's `LLM.llm_engine` is there, `model_config`
        (`max_model_len`, `hf_config`, ...), `vllm_config` (`nanovllm.config.VllmConfig`) and `tokenizer`."""
        return self.engine

    @property
    def model_config(self) -> SimpleNamespace:
        """vLLM's `LLM.model_config`: `llm_engine.model_config` (`nanovllm.config.VllmConfig` says what it holds)."""
        return self.engine.model_config

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (None for a model directory without tokenizer files)."""
        return self.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: Params = None, use_tqdm: bool = True,
                 priority: int | list[int] | None = None, lora_request: LoRAParam = None) -> list[RequestOutput]:
        """Complete every prompt; one `RequestOutput` per prompt, in prompt order. A prompt is text, vLLM's
        `{"prompt": text}` / `{"prompt_token_ids": ids}`, or a list of token ids; one prompt alone needs no list.
        `sampling_params` (default `SamplingParams()`) and `priority` are one value for all prompts or one per
        prompt; so is `lora_request`, the `LoRARequest` a prompt runs under (None: the base model; needs
        `enable_lora=True`)."""
        return self._run(with_loras(self.prompts.check_prompts(prompts, sampling_params, priority), lora_request),
                         use_tqdm)

    def chat(self, messages: Conversation | list[Conversation], sampling_params: Params = None,
             use_tqdm: bool = True, priority: int | list[int] | None = None,
             add_generation_prompt: bool = True, lora_request: LoRAParam = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of `{"role", "content"}` messages) or to a list of them, through the
        model's chat template, as vLLM's `LLM.chat`; one `RequestOutput` per conversation. `lora_request`: as
        `generate`'s. `chat_template_kwargs` (vLLM's) are passed to the template (Qwen3's `enable_thinking`, say)."""
        checked = self.prompts.check_conversations(messages, sampling_params, priority, add_generation_prompt,
                                                   chat_template_kwargs)
        return self._run(with_loras(checked, lora_request), use_tqdm)

    def chat_prompt(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        """The token ids `chat` sends for `conversation`, e.g. to `stream` a reply."""
        return self.tokenizer.encode(self.prompts.chat_text(conversation, add_generation_prompt),
                                     add_special_tokens=False)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request: LoRAParam = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (`nanovllm.beam_search.BeamSearchParams` says how it goes): one `BeamSearchOutput` per
        prompt, in order, its `beam_width` best beams. Prompts are taken as by `generate`. Every prompt's beams run
        in the same steps, and beams share their prompt's KV blocks (`nanovllm.engine.beam_search`); at most
        `concurrency_limit` prompts are searched at once (None: all). A beam's candidates are its `2 * beam_width`
        most likely next tokens (the vocabulary at most), whose logprobs count against `max_logprobs` as vLLM's do.
        `lora_request`: as `generate`'s; a prompt's beams all run under its adapter."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams (from nanovllm import BeamSearchParams), got "
                             f"{type(params).__name__}")
        if self.is_sleeping():
            raise RuntimeError("the engine is sleeping (sleep() was called); call wake_up() first")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
        sampling = SamplingParams(temperature=params.temperature, max_tokens=1, detokenize=False,
                                  logprobs=min(2 * params.beam_width, self.config.hf_config.vocab_size))
        checked = with_loras(self.prompts.check_prompts(prompts, sampling, None), lora_request)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(self.config.hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(self.engine, LLMEngine):
            return EngineBeamSearch(self.engine, checked, params, eos, concurrency_limit).run(use_tqdm)
        searches = [PromptSearch(prompt, params, eos, self.max_model_len) for prompt in checked]
        search_by_requests(lambda beams: self._run(self.prompts.check_prompts(beams, sampling, None), False),
                           searches, concurrency_limit, use_tqdm)
        decode = token_decoder(self.tokenizer)
        return [search.output(self.tokenizer, decode) for search in searches]

    def stream(self, prompts: Prompt | list[Prompt], sampling_params: Params = None,
               priority: int | list[int] | None = None, lora_request: LoRAParam = None) -> Iterator[RequestOutput]:
        """Complete every prompt, yielding each request's news as it is produced, in step order: a `RequestOutput`
        whose completions hold only the text and tokens (and logprobs) new since the last one; a completion's
        last one carries its `finish_reason`. Text never ends inside a multi-byte character, and the deltas of a
        completion add up to its `generate` text. Request ids are consecutive, in prompt order. The news reach this
        stream whoever runs the steps (another stream, `generate`, another thread). Leaving the loop early aborts
        the requests still running. `lora_request`: as `generate`'s."""
        handles = self.engine.submit(with_loras(self.prompts.check_prompts(prompts, sampling_params, priority),
                                                lora_request))
        try:
            while True:
                with self.engine.turn():
                    _raise_if_failed(handles)
                    news = [delta for handle in handles for delta in handle.take_news()]
                    if not news and self.engine.progress(handles) is None:
                        break
                yield from news
        except BaseException:  # leaving the loop early (GeneratorExit) included
            self.abort_request([handle.request_id for handle in handles])
            raise
        _raise_if_failed(handles)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one request and return its id; `step` runs it. Under `scheduling_policy="priority"` a lower
        `priority` runs first (and is preempted last); first-come-first-served ignores it, as vLLM. `lora_request`:
        the adapter it runs under (None: the base model)."""
        checked = with_loras([self.prompts.check_prompt(prompt, sampling_params, priority)], lora_request)
        return self.engine.submit(checked)[0].request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter now rather than at its first request (vLLM's `add_lora`); whether it was read (False:
        it was loaded). A ValueError or FileNotFoundError naming the adapter when it cannot run on this model."""
        return self._lora_engine("add_lora").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; requests of it still in flight read it again when they run. Whether it was loaded."""
        return self._lora_engine("remove_lora").remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the adapters loaded now (at most `max_cpu_loras`, besides pinned ones)."""
        return self._lora_engine("list_loras").list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded, whatever the LRU of `max_cpu_loras` would drop (vLLM's `pin_lora`)."""
        return self._lora_engine("pin_lora").pin_lora(lora_id)

    def _lora_engine(self, method: str) -> Engine:
        if not self.config.enable_lora:
            raise ValueError(f"{method}: LoRA is off; create the LLM with enable_lora=True to serve LoRA adapters")
        return self.engine

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Run one step (with data parallelism: wait for the replicas' next one); returns the outputs of the
        requests that got a token in it: everything so far, or with `delta` only what is new since their last
        delta (as `stream` yields it)."""
        return self.engine.step(delta)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever their sequences are (waiting, running or preempted) and free their blocks at
        once; they finish with `finish_reason="abort"`. Unknown or finished requests are ignored."""
        self.engine.abort_request(request_id)

    def is_finished(self) -> bool:
        """Whether no request is waiting or running."""
        return self.engine.is_finished()

    def stats(self) -> dict:
        """Counters since the engine started (see `LLMEngine.stats`): prefix-cache hits, steps, preemptions, KV
        blocks, and speculative decoding's figures; with data parallelism summed over the replicas (rates
        recomputed), with each replica's own under "replicas"."""
        return self.engine.stats()

    def get_metrics(self) -> list[Metric]:
        """`stats()` as vLLM v1's metric objects (`nanovllm.metrics`), one set per engine (label `engine`: the
        data-parallel replica, "0" without data parallelism)."""
        return [metric for index, stats in self.engine.engine_stats()
                for metric in metrics_from_stats(stats, self.config.model, self.config.max_model_len, index)]

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Replace some or all of the model's weights in place, then reset the prefix cache (as RL trainers update
        vLLM between rollouts). `weights` are (name, tensor) pairs under the model's Hugging Face checkpoint names,
        e.g. `hf_model.state_dict().items()` or a few of them ("model.layers.0.self_attn.q_proj.weight", in any
        dtype and on any device); fused and stacked parameters, tied heads and each family's renames are handled as
        at load. Every tensor-parallel rank and data-parallel replica gets the update before this returns. A weight
        kept quantized (a GGUF file, `quantization=`) is requantized into its type (Q8_0, Q4_0, Q4_1; other types
        are refused). An unknown name, a wrong shape or a type that cannot be requantized is a ValueError before
        anything changes; with a request waiting or running it is a RuntimeError (let them finish first), as while
        the weights sleep (`sleep`; after `sleep(level=2)`, `wake_up(tags=["weights"])` first)."""
        self.engine.load_weights(weights)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, so no later request reuses K/V computed before (`load_weights` does this
        itself). Blocks of running requests keep theirs; returns whether none was kept, as vLLM's."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs `LLM(..., enable_sleep_mode=True)`, else a ValueError): give the engine's memory
        back until `wake_up`, e.g. to a trainer sharing the machine. Every level resets the prefix cache and frees the
        KV cache (its K/V forgotten). `level=1` keeps the weights: on CUDA copied to host memory (the device memory
        freed), on the CPU where they are. `level=2` drops the weights too; they come back through `load_weights`
        after `wake_up(tags=["weights"])`, or, given none, from the model's checkpoint when the engine wakes. Every
        tensor-parallel rank and data-parallel replica sleeps. Refused (a RuntimeError) while requests are in
        flight; while asleep, `generate` and the other request methods raise a RuntimeError."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake from `sleep`: `tags` is vLLM's, some of "weights" and "kv_cache" (None: both), so that the weights
        can be woken (and written by `load_weights`) before the KV cache takes its memory again. The engine serves
        again once both are awake: the same greedy tokens as before it slept (after level 2, with the checkpoint's
        weights unless `load_weights` gave others)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (some of its memory is not back yet)."""
        return self.engine.is_sleeping()

    def exit(self) -> None:
        """Stop the engine and its worker processes, and free its memory; safe to call twice."""
        self.engine.exit()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    def _run(self, checked: list[CheckedPrompt], use_tqdm: bool) -> list[RequestOutput]:
        """Submit the checked prompts and run steps until all are finished; their outputs, in order."""
        handles = self.engine.submit(checked)
        try:
            with tqdm(total=len(handles), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm) as pbar:
                while (rates := self.engine.progress(handles)) is not None:
                    if use_tqdm:  # a phase shows once it has run (pooling requests never decode)
                        pbar.set_postfix({phase: f"{rate:.0f}tok/s" for phase, rate in rates.items() if rate},
                                         refresh=False)
                        pbar.update(sum(handle.finished for handle in handles) - pbar.n)
        except BaseException:
            self.abort_request([handle.request_id for handle in handles])
            raise
        _raise_if_failed(handles)
        return [handle.output() for handle in handles]


def _raise_if_failed(handles: list[Handle]) -> None:
    failed = next((handle for handle in handles if handle.error is not None), None)
    if failed is not None:
        raise failed.error
