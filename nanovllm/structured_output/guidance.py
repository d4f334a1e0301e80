"""The llguidance backend (vLLM's "guidance"): grammars compile in about a millisecond and masks are computed lazily
per step, for all rows in one call that runs outside the GIL."""
import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from transformers import PreTrainedTokenizerBase

from nanovllm.structured_output.spec import GrammarSpec, closed_schema, grammar_syntax, structural_tags


def _json_grammar(schema: str | dict, spec: GrammarSpec) -> str:
    """llguidance's grammar for a JSON schema; llguidance reads objects and tuples open where the schema is silent,
    so a `strict` spec's schema is closed first (`closed_schema`: what xgrammar's strict mode takes)."""
    options = {"whitespace_flexible": spec.any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    if spec.strict:
        schema = closed_schema(json.loads(schema) if isinstance(schema, str) else schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _grammar(text: str) -> str:
    """llguidance's grammar for a Lark or EBNF / GBNF grammar, told apart by `grammar_syntax` (llguidance's own test
    reads a Lark grammar as GBNF unless a line starts with `start:`, which turns away `?start:` and others)."""
    if grammar_syntax(text) == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    try:
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except Exception as e:  # the converter raises its own errors, and others on what it does not expect
        raise ValueError(str(e)) from None


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    if spec.kind == "json":
        return _json_grammar(spec.text, spec)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in
                                                                            json.loads(spec.text)))
    if spec.kind == "grammar":
        return _grammar(spec.text)
    structures, triggers = structural_tags(spec)
    tags = []
    for s in structures:
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger in {triggers} begins the structure {s['begin']!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=_json_grammar(s["schema"], spec),
                                         end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def check(spec: GrammarSpec) -> None:
    """A ValueError with llguidance's message if `spec` is not a valid grammar (no tokenizer needed)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise ValueError(error)


class GuidanceMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def valid_prefix_length(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar accepts from here (the state is unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next: llguidance's split of the forced bytes, after the tokens already
        there, less a last token that the bytes after it could merge into."""
        return self.matcher.compute_ff_tokens()

    @property
    def is_stopped(self) -> bool:
        """No token but EOS can follow: the constraint is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=eos_token_ids)
        self.executor = llguidance.LLExecutor()

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar, which `matcher` copies for each sequence."""
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{spec.field}: {template.get_error()}")
        return template

    @staticmethod
    def matcher(template: llguidance.LLMatcher) -> GuidanceMatcher:
        return GuidanceMatcher(template.deep_copy())

    def fill(self, rows: list[tuple[GuidanceMatcher, int, list[int]]], bitmask: torch.Tensor) -> None:
        """For each `(matcher, row, drafts)`: row `row + j` of `bitmask` is what `matcher` allows after `drafts[:j]`
        (the drafts are ones the grammar accepts; the matcher's state is unchanged)."""
        plain = [(m.matcher, row) for m, row, drafts in rows if not drafts]
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, plain, bitmask)
        drafted = [(m.matcher, row, drafts) for m, row, drafts in rows if drafts]
        if drafted:  # llguidance's call for drafts takes no row without any
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, bitmask)
