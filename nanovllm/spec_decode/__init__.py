"""Speculative decoding's bookkeeping, without tensors: what each running sequence proposes before a step (`ngram`
prompt lookup, a draft model's placeholders, a grammar's forced tokens: `proposer`, `grammar_drafts`), how many of
its proposals it keeps (the adaptive rule), and the counters (`stats`).

The scheduler runs a decode row with k proposed tokens as a (k + 1)-token chunk over the KV cache; the model runner
fills a draft model's placeholders (`nanovllm.execution.draft_model`) and verifies every proposal of the step in that
one forward (`nanovllm.execution.verifier`).
"""
