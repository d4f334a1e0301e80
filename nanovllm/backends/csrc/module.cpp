// The Python module of nanovllm's CPU kernels (paged_decode.cpp, fused_ops.cpp).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                                      torch::Tensor cos_sin_cache);
torch::Tensor silu_and_mul(torch::Tensor x);
void store_kvcache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention for single-query rows");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "Residual add, then RMSNorm; returns (normed, sum)");
  m.def("apply_rotary", &apply_rotary, "Rotate-half rotary embedding of q and k");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("store_kvcache", &store_kvcache, "K/V of each token into its cache slot");
}
