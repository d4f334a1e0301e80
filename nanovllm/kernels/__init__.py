"""Every kernel nanovllm runs, in one room; the layers above reach each family through one face:

- `attention/`: the attention backends over the paged KV cache (torch with the CPU kernels, Triton, flash-attn 2 and
  4), what each serves (`registry`), the choice (`selection`) and the per-step batch they all read (`context`).
  Layers hold a `Backend` from `load_backend` and call its `store_kvcache` and `attend`.
- `cpu.py`: the C++ CPU kernels (`csrc/`), built once per machine into the cache and loaded as `torch.ops.nanovllm`:
  paged decode attention, the decoder's small fused ops, GGML-quantized matmuls and the one-call decode stack.
- `fused.py`: `fused_op`, how a small op written once in torch runs: a CPU kernel, torch.compile on CUDA, or as is.
- `ggml.py`: GGML's block types and the matmuls and lookups over them (`ggml_linear`, `ggml_embedding`): the CPU
  kernels where they run, else a dequantizing reference.
- `triton_moe.py`: the routed experts' fused Triton kernels on CUDA.

Nothing here imports a layer, a model or the engine; Triton and flash-attn are imported only when chosen.
"""
