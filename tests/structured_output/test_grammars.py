"""`grammar` constraints as vLLM reads them: Lark unless a rule is defined with `::=` (EBNF / GBNF), and every valid
Lark grammar (`?rule` inlining, `%import common.*`, `/regex/` terminals, `%ignore`, ...) compiles and constrains on
both backends; EBNF / GBNF grammars still read as such; an invalid grammar is a ValueError naming the field and how
it was read."""
from types import SimpleNamespace

import pytest
import regex
import torch
from grammar_backends import GRAMMAR_BACKENDS
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.structured_output.backends import check_constraint
from nanovllm.structured_output.bitmask import allowed_tokens
from nanovllm.structured_output.manager import StructuredOutputs
from nanovllm.structured_output.spec import grammar_syntax

EOS = 0
ARITHMETIC = '''
?start: sum
?sum: product
    | sum "+" product
?product: NUMBER
    | product "*" NUMBER
NUMBER: /[0-9]+/
'''
LARK = {
    "?rule inlining, regex terminal": (ARITHMETIC, ["1+2*3", "12", "7*8+9"], ["1+", "a", "+1", "1**2"]),
    "%import common, %ignore": ('%import common.INT\n%import common.WS\n%ignore WS\nstart: INT ("," INT)*\n',
                                ["1, 2,3", "42"], ["1,", "x", "1.5"]),
    "?start on one line": ('?start: "yes" | "no"', ["yes", "no"], ["maybe", "yesno"]),
    "terminals, flags, comments": ('// words\nstart: WORD (" " WORD)*\nWORD: /[a-z]+/i\n',
                                   ["Hello world", "the Quick fox"], ["hello  world", "123", "hello "]),
    "_hidden rules, aliases": ('start: _item+\n_item: "a" -> a\n    | "b" -> b\n', ["abba", "a"], ["abc", ""]),
    "literals, ranges, repeats": ('start: "id-" DIGIT~2..3 ["!"]\nDIGIT: "0".."9"\n', ["id-12", "id-123!"],
                                  ["id-1", "id-1234", "ID-12"]),
}
EBNF = {
    "EBNF": ('root ::= item+\nitem ::= "a" | "b"\n', ["ab", "a"], ["c", ""]),
    "GBNF, comments, dashed names": ('# two words\nroot ::= word " " word\nword ::= [a-z]+  # letters\n',
                                     ["hi there"], ["hi", "hi  there"]),
    "xgrammar's EBNF, spaced, on one line": ('root  ::=  "x" ( "," "x" )*', ["x", "x,x"], ["x,", "y"]),
    "a ':' in a rule": ('root ::= key ":" value\nkey ::= [a-z]+\nvalue ::= [0-9]+\n', ["a:1"], ["a=1"]),
}


@pytest.fixture(scope="module")
def tokenizer(tied_model):
    return AutoTokenizer.from_pretrained(tied_model)


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def manager(request, tokenizer):
    return StructuredOutputs(request.param, tokenizer, 384, {EOS}, max_rows=1)


def accepts(manager, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole: every token of it, then EOS."""
    row = SimpleNamespace(grammar=manager.state(check_constraint(StructuredOutputsParams(grammar=grammar),
                                                                 manager.backend_name)))
    row.grammar.compiled.result()
    ids = tokenizer.encode(text)
    if row.grammar.valid_prefix(ids) != ids:
        return False
    for token_id in ids:
        row.grammar.accept(token_id)
    mask = manager.bitmask([(row, [])])
    return bool(allowed_tokens(mask, 384, torch.device("cpu"))[0, EOS])


@pytest.mark.parametrize("name", LARK)
def test_valid_lark_grammars_compile_and_constrain(manager, tokenizer, name):
    grammar, ok, bad = LARK[name]
    assert grammar_syntax(grammar) == "lark"
    assert all(accepts(manager, tokenizer, grammar, text) for text in ok)
    assert not any(accepts(manager, tokenizer, grammar, text) for text in bad)


@pytest.mark.parametrize("name", EBNF)
def test_ebnf_and_gbnf_grammars_still_read_as_such(manager, tokenizer, name):
    grammar, ok, bad = EBNF[name]
    assert grammar_syntax(grammar) == "ebnf"
    assert all(accepts(manager, tokenizer, grammar, text) for text in ok)
    assert not any(accepts(manager, tokenizer, grammar, text) for text in bad)


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
@pytest.mark.parametrize("grammar, message", [
    ("start: foo", r"read as Lark \(no rule is defined with '::='\): .*foo"),
    ('?start: "a" (', r"read as Lark"),
    ("rule: \"a\"", r"read as Lark .*start"),  # Lark starts at `start`
    ('root ::= "a" | b', r"read as EBNF / GBNF \(a rule is defined with '::='\): .*\bb\b"),
    ("root ::= [a-", r"read as EBNF / GBNF"),
])
def test_an_invalid_grammar_names_the_field_and_how_it_was_read(backend, grammar, message):
    with pytest.raises(ValueError, match=r"(?s)^structured_outputs.grammar is not a valid grammar \(EBNF, GBNF or "
                                         r"Lark\): " + message):
        check_constraint(StructuredOutputsParams(grammar=grammar), backend)


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_a_lark_grammar_constrains_generation(tied_model, tokenizer, backend):
    prompts = [tokenizer.encode(text) for text in ["List all primes", "The quick brown fox", "Hello, my name is"]]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC))
              for i, t in enumerate([0, 1.0, 1.0])]
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=128,
             structured_outputs_config={"backend": backend}) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text
        assert regex.fullmatch(r"[0-9]+([+*][0-9]+)*", completion.text, partial=completion.finish_reason == "length")
