"""The xgrammar backend (optional: `pip install xgrammar`): grammars compile ahead into per-state token caches."""
import json

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from nanovllm.structured_output.spec import GrammarSpec, grammar_syntax, open_schema, structural_tags


def grammar(spec: GrammarSpec) -> xgr.Grammar:
    """xgrammar's grammar for `spec`; a ValueError with xgrammar's message if it is not valid."""
    if spec.whitespace_pattern is not None:
        raise ValueError("whitespace_pattern is not supported by the xgrammar backend; use "
                         "structured_outputs_config={'backend': 'guidance'}")
    try:
        if spec.kind == "json":  # strict_mode: vLLM's default, xgrammar's own
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace, strict_mode=spec.strict)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            return _grammar(spec.text)
        structures, triggers = structural_tags(spec)  # their schemas compile in strict mode: say where they are open
        tags = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"],
                                      schema=json.dumps(s["schema"] if spec.strict else open_schema(s["schema"])))
                for s in structures]
        return xgr.Grammar.from_structural_tag(tags, triggers)
    except RuntimeError as e:
        raise ValueError(str(e).strip()) from None


def _grammar(text: str) -> xgr.Grammar:
    """A Lark or EBNF / GBNF grammar, told apart by `grammar_syntax` (as vLLM's xgrammar backend)."""
    if grammar_syntax(text) == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if not hasattr(xgr.Grammar, "from_lark"):
        raise ValueError("this xgrammar cannot compile Lark: upgrade it (pip install -U xgrammar), or use "
                         "structured_outputs_config={'backend': 'guidance'}")
    return xgr.Grammar.from_lark(text)


def check(spec: GrammarSpec) -> None:
    grammar(spec)


class XgrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher, tokenizer: PreTrainedTokenizerBase):
        self.matcher = matcher
        self.tokenizer = tokenizer

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def valid_prefix_length(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar accepts from here (the state is unchanged)."""
        accepted = 0
        while accepted < len(token_ids) and self.matcher.accept_token(token_ids[accepted]):
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next: the tokenizer's split of xgrammar's jump-forward string, less its last
        token (the text after it could merge into it) and cut where the grammar stops accepting them."""
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return []
        token_ids = self.tokenizer.encode(forced, add_special_tokens=False)[:-1]
        return token_ids[:self.valid_prefix_length(token_ids)]

    def fill_rows(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Row `row + j` of `bitmask`: what the grammar allows after `drafts[:j]` (drafts it accepts)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        for j, token_id in enumerate(drafts, 1):
            self.matcher.accept_token(token_id)
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
        if drafts:
            self.matcher.rollback(len(drafts))

    @property
    def is_stopped(self) -> bool:
        """The stop token was accepted (xgrammar leaves it to be sampled: only it is allowed once complete)."""
        return self.matcher.is_terminated()

    @property
    def error(self) -> str:
        return ""


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.tokenizer = tokenizer

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar(spec))

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled), self.tokenizer)

    @staticmethod
    def fill(rows: list[tuple[XgrammarMatcher, int, list[int]]], bitmask: torch.Tensor) -> None:
        """For each `(matcher, row, drafts)`: row `row + j` of `bitmask` is what `matcher` allows after
        `drafts[:j]`."""
        for m, row, drafts in rows:
            m.fill_rows(bitmask, row, drafts)
