"""Execution: turning scheduled sequences into tensors and running them. `model_runner` owns one rank's model, KV
cache (`kv_cache`) and decode graphs (`cuda_graph`), runs each step (the one-call CPU decode, `cpu_decode`, where it
applies) and samples (`sampler`, its tensor math in `sampling_ops`, vLLM V1's custom logits processors and the batch
they see in `logits_processors`); `verifier` checks drafts against the target and `draft_model` runs a speculative
draft model beside it; `tensor_parallel` drives the other ranks' runners in worker processes; `cpu_threads` keeps
torch's CPU threads from collapsing under load. Only `LLMEngine` holds a `ModelRunner`; nothing here imports the
engine."""
