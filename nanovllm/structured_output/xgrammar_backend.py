"""The xgrammar backend (optional: `pip install xgrammar`): grammars compile ahead into per-state token caches."""
import json

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from nanovllm.structured_output.spec import GrammarSpec, structural_tags


def grammar(spec: GrammarSpec) -> xgr.Grammar:
    """xgrammar's grammar for `spec`; a ValueError with xgrammar's message if it is not valid."""
    if spec.whitespace_pattern is not None:
        raise ValueError("whitespace_pattern is not supported by the xgrammar backend; use "
                         "structured_outputs_config={'backend': 'guidance'}")
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
        structures, triggers = structural_tags(spec)
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in structures]
        return xgr.Grammar.from_structural_tag(tags, triggers)
    except RuntimeError as e:
        raise ValueError(str(e).strip()) from None


def check(spec: GrammarSpec) -> None:
    grammar(spec)


class XgrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

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

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar(spec))

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))

    @staticmethod
    def fill(matchers: list[XgrammarMatcher], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.matcher.fill_next_token_bitmask(bitmask, i)
