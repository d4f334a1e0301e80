"""Structured outputs: completions held to a JSON schema, regex, choice or grammar (vLLM's `StructuredOutputsParams`).

`spec` turns the user's constraint into a hashable `GrammarSpec`; a grammar backend (`guidance`: llguidance, the
default; `xgrammar`: optional) checks it at submission and compiles it for the tokenizer; `manager` compiles off the
step loop, caches compiled grammars by their text, keeps each sequence's matcher and fills one bitmask per step, which
`bitmask.apply_token_bitmask` applies to the logits before sampling.
"""
