"""Execution: turning scheduled sequences into tensors and running them (model runner, KV cache sizing, CUDA graphs,
sampling, CPU threads). Bookkeeping in `nanovllm.core` and `nanovllm.engine` never imports this package's internals;
only `LLMEngine` holds a `ModelRunner`."""
