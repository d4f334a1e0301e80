"""Execution: turning scheduled sequences into tensors and running them (model runner, CUDA graphs,
GPU memory sizing, tensor-parallel workers). Bookkeeping in `nanovllm.engine` never imports this
package's internals; only `LLMEngine` holds a `ModelRunner`."""
