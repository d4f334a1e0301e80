// nanovllm's CPU kernels (paged_decode.cpp, encoder_attention.cpp, fused_ops.cpp, ggml_quant.cpp, lora_ops.cpp,
// sampling.cpp) as torch operators, `torch.ops.nanovllm.*`: a plain shared library that torch.ops.load_library loads,
// with no pybind11 and no Python headers to compile.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window, double softcap);
at::Tensor bidirectional_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cu_seqlens, double scale,
                                   int64_t window);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> apply_rotary(at::Tensor positions, at::Tensor q, at::Tensor k,
                                                at::Tensor cos_sin_cache);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor greedy_tokens(at::Tensor logits);
at::Tensor sample_tokens(at::Tensor logits, at::Tensor temperature, at::Tensor min_p, at::Tensor top_k,
                         at::Tensor top_p, at::Tensor uniform);
void store_kvcache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);
int64_t ggml_isa();
int64_t ggml_repack_lanes(int64_t qtype, int64_t isa);
at::Tensor ggml_linear(at::Tensor x, at::Tensor weight, int64_t qtype, int64_t in_features,
                       std::optional<at::Tensor> bias, int64_t isa, int64_t lanes);
at::Tensor ggml_embedding(at::Tensor weight, at::Tensor ids, int64_t qtype, int64_t in_features, at::ScalarType dtype,
                          int64_t lanes);
void lora_add(at::Tensor y, at::Tensor x, std::vector<at::Tensor> a, std::vector<at::Tensor> bt, at::Tensor slices,
              at::Tensor scales, at::Tensor row_slot, at::Tensor slot_slices);

TORCH_LIBRARY(nanovllm, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window=0, float softcap=0.0) -> Tensor", &paged_decode);
  m.def("bidirectional_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, int window=0) "
        "-> Tensor", &bidirectional_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("apply_rotary(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache) -> (Tensor, Tensor)",
        &apply_rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("greedy_tokens(Tensor logits) -> Tensor", &greedy_tokens);
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor min_p, Tensor top_k, Tensor top_p, Tensor uniform) "
        "-> Tensor", &sample_tokens);
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &store_kvcache);
  m.def("ggml_isa() -> int", &ggml_isa);
  m.def("ggml_repack_lanes(int qtype, int isa) -> int", &ggml_repack_lanes);
  m.def("ggml_linear(Tensor x, Tensor weight, int qtype, int in_features, Tensor? bias, int isa, int lanes=0) "
        "-> Tensor", &ggml_linear);
  m.def("ggml_embedding(Tensor weight, Tensor ids, int qtype, int in_features, ScalarType dtype, int lanes=0) "
        "-> Tensor", &ggml_embedding);
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor slices, Tensor scales, Tensor row_slot, "
        "Tensor slot_slices) -> ()", &lora_add);
}
