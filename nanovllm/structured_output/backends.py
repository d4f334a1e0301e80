"""The grammar backends by name (`nanovllm.config.STRUCTURED_OUTPUT_BACKENDS` lists them), and the check every
constraint passes at submission (before any work)."""
from functools import lru_cache
from importlib import import_module

from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.structured_output.spec import GrammarSpec, grammar_spec, grammar_syntax

_MODULES = {"guidance": ("nanovllm.structured_output.guidance", "GuidanceBackend"),
            "xgrammar": ("nanovllm.structured_output.xgrammar_backend", "XgrammarBackend")}
_CHECKED = 4096


@lru_cache(maxsize=_CHECKED)
def _problem(spec: GrammarSpec, backend: str) -> str | None:
    try:
        import_module(_MODULES[backend][0]).check(spec)
    except ValueError as e:
        return str(e)
    return None


def check_constraint(params: StructuredOutputsParams, backend: str) -> GrammarSpec:
    """The spec of `params`, checked by `backend` (results are cached, so 10,000 requests with one schema check it
    once); a ValueError naming the field and the backend's message if it is not a valid constraint."""
    spec = grammar_spec(params)
    problem = _problem(spec, backend)
    if problem is not None:
        read_as = ""
        if spec.kind == "grammar":
            read_as = ("read as EBNF / GBNF (a rule is defined with '::='): " if grammar_syntax(spec.text) == "ebnf"
                       else "read as Lark (no rule is defined with '::='): ")
        raise ValueError(f"structured_outputs.{spec.field} is not a valid {_WHAT[spec.field]}: {read_as}{problem}")
    return spec


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression", "choice": "choice",
         "grammar": "grammar (EBNF, GBNF or Lark)", "structural_tag": "structural tag"}


def create_backend(name: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]):
    """The backend `name` for this tokenizer, its token masks `vocab_size` wide (~0.5 s: the tokenizer's tokens are
    indexed)."""
    module, cls = _MODULES[name]
    return getattr(import_module(module), cls)(tokenizer, vocab_size, eos_token_ids)
