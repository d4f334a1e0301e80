// A decode step of the standard pre-norm decoder (Llama's layer: RMSNorm, fused QKV, rotary, paged attention, O,
// RMSNorm, gate-up, SiLU * up, down, over GGML weights; each projection with its rows' LoRA deltas when a step has
// adapters) through all its layers in one call from Python, instead of about twenty torch operators and their Python
// glue per layer: at batch 1 that glue cost more than the matmuls.
//
// It chains the same kernels the operators run (`cpu_ops.h`) in the same order, on the same rows, so its result is
// the layer-by-layer path's bit for bit; only the tensors between them are gone (one workspace per step). The whole
// step runs in one OpenMP region: each kernel takes its thread's share and barriers order them, instead of one region
// per kernel (about 180 a step for SmolLM2: 3-5% of a batch-1 step on 2 threads, measured).
// `nanovllm.execution.cpu_decode` builds a stack, once at load, for the models whose layers are exactly this one.
#pragma GCC optimize("fp-contract=off")  // the bias added as torch adds it, not fused into an FMA
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <omp.h>

#include <cstring>
#include <vector>

#include "check.h"
#include "cpu_math.h"
#include "cpu_ops.h"

namespace {

using nanovllm::Team;

// fn(team) on every thread of one OpenMP region of torch's threads (on this thread alone where there is one).
template <typename F>
void run_team(const F& fn) {
  const int threads = at::get_num_threads();
  if (threads == 1 || at::in_parallel_region()) return fn(Team{});
  nanovllm::TeamBarrier sync;
#pragma omp parallel num_threads(threads)
  fn(Team{omp_get_thread_num(), omp_get_num_threads(), &sync});
}

// fn(m) for this thread's share of the M rows, then a barrier: the rows are ready for every thread.
template <typename F>
void for_rows(const Team& team, int64_t M, const F& fn) {
  nanovllm::split(&team, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fn(m);
  });
  team.barrier();
}

// fn(m) for rows every thread needs: all M on each thread, into its own copy, where `each` (no barrier), else as
// for_rows into the shared one.
template <typename F>
void needed_rows(const Team& team, bool each, int64_t M, const F& fn) {
  if (!each) return for_rows(team, M, fn);
  for (int64_t m = 0; m < M; ++m) fn(m);
}

// A linear layer's weight as GGML row segments of one type each, in row order (`GGMLWeight`: as the file has them, or
// repacked in tiles of `lanes` rows), and its bias.
struct GGMLLinear : torch::CustomClassHolder {
  std::vector<at::Tensor> segments;
  std::vector<int64_t> qtypes;
  int64_t in_features, lanes, out_features = 0;
  std::optional<at::Tensor> bias;

  GGMLLinear(std::vector<at::Tensor> segments_, std::vector<int64_t> qtypes_, int64_t in_features_,
             std::optional<at::Tensor> bias_, int64_t lanes_)
      : segments(std::move(segments_)), qtypes(std::move(qtypes_)), in_features(in_features_), lanes(lanes_),
        bias(std::move(bias_)) {
    TORCH_CHECK(!segments.empty() && segments.size() == qtypes.size(), "GGMLLinear: one GGML type per segment");
    for (const auto& s : segments) {
      TORCH_CHECK(s.scalar_type() == at::kByte && s.dim() == 2 && s.stride(1) == 1,
                  "GGMLLinear: segments are uint8 [rows, row_bytes] with contiguous rows");
      out_features += s.size(0);
    }
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features),
                nanovllm::message("GGMLLinear: the bias has ", bias ? bias->numel() : 0, " values for ", out_features,
                                  " outputs"));
  }

  // out [M, out_features] = x [M, in_features] . W^T + bias, as `GGMLWeight.linear` computes it, the team's share,
  // then a barrier: one segment takes the bias inside its kernel; several are computed apart into their columns, and
  // the bias is then added in T. `scratch`: the team's quantized activations, or this thread's (`own_scratch`).
  template <typename T>
  void run(const Team& team, const T* x, int64_t M, T* out, void* scratch, int64_t isa, bool own_scratch) const {
    const T* b = bias ? bias->const_data_ptr<T>() : nullptr;
    int64_t column = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      const int64_t n = segments[i].size(0);
      nanovllm::ggml_matmul<T>(x, M, in_features, segments[i].const_data_ptr<uint8_t>(), segments[i].stride(0), n,
                               qtypes[i], isa, lanes, segments.size() == 1 ? b : nullptr, out + column, out_features,
                               team, scratch, own_scratch);
      // the products done, and a shared `scratch` free for the next segment's activations
      if (!own_scratch || i + 1 == segments.size()) team.barrier();
      column += n;
    }
    if (b && segments.size() > 1)
      for_rows(team, M, [&](int64_t m) {
        for (int64_t j = 0; j < out_features; ++j)
          out[m * out_features + j] = from_float<T>(to_float(out[m * out_features + j]) + to_float(b[j]));
      });
  }
};

// A projection's LoRA adapters for the running step, packed as `nanovllm.layers.lora.Packed` (each slot's A and B
// transposed flat; the slice table, scales, each slot's first slice); no table: none adapts it.
struct LoRAPack {
  std::vector<at::Tensor> a, bt, table;

  // y += the deltas, the team's share, then a barrier.
  template <typename T>
  void add(const Team& team, const T* x, int64_t M, int64_t in, T* y, int64_t out, const int64_t* row_slot) const {
    if (table.empty() || row_slot == nullptr) return;
    std::vector<const T*> a_ptrs, bt_ptrs;
    for (size_t i = 0; i < a.size(); ++i)
      a_ptrs.push_back(a[i].const_data_ptr<T>()), bt_ptrs.push_back(bt[i].const_data_ptr<T>());
    nanovllm::lora_rows(x, y, a_ptrs.data(), bt_ptrs.data(), table[0].const_data_ptr<int64_t>(),
                        table[1].const_data_ptr<float>(), row_slot, table[2].const_data_ptr<int64_t>(), M, in, out,
                        table[2].numel() - 1, out, &team);
    team.barrier();
  }
};

enum Projection { QKV_PROJ, O_PROJ, GATE_UP_PROJ, DOWN_PROJ, PROJECTIONS };  // the stack's order

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  c10::intrusive_ptr<GGMLLinear> qkv, o, gate_up, down;
  LoRAPack lora[PROJECTIONS];
};

// Steps of at most this many rows give every thread its own copy of the rows they all read whole (`step`): at batch
// 1 that was 3% faster on 2 threads, at 2 rows no faster.
constexpr int64_t COPIED_ROWS = 1;

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, at::Tensor cos_sin,
               at::Tensor final_norm, int64_t isa)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)), cos_sin_(cos_sin.contiguous()), final_norm_(final_norm.contiguous()),
        isa_(isa), hidden_(final_norm.numel()) {
    TORCH_CHECK(cos_sin_.scalar_type() == at::kFloat && cos_sin_.size(1) == head_dim,
                "DecoderStack: the rotary table is float32 [positions, head_dim]");
    TORCH_CHECK(head_dim <= nanovllm::MAX_HEAD_DIM, "DecoderStack: head_dim above 1024");
  }

  void add_layer(at::Tensor input_norm, c10::intrusive_ptr<GGMLLinear> qkv, c10::intrusive_ptr<GGMLLinear> o,
                 at::Tensor post_norm, c10::intrusive_ptr<GGMLLinear> gate_up, c10::intrusive_ptr<GGMLLinear> down,
                 at::Tensor k_cache, at::Tensor v_cache) {
    const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv->in_features == hidden_ && qkv->out_features == q + 2 * kv && o->in_features == q &&
                    o->out_features == hidden_ && gate_up->in_features == hidden_ && gate_up->out_features % 2 == 0 &&
                    down->in_features == gate_up->out_features / 2 && down->out_features == hidden_,
                "DecoderStack: the layer's projections do not fit its hidden size and heads");
    TORCH_CHECK(input_norm.numel() == hidden_ && post_norm.numel() == hidden_, "DecoderStack: bad norm weights");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                    k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads_ &&
                    k_cache.size(3) == cache_row_width(k_cache.scalar_type(), head_dim_),
                "DecoderStack: the caches must be contiguous [blocks, block_size, kv_heads, head_dim] (an int8 "
                "cache's rows head_dim + 4 wide)");
    nanovllm::check_key_tiles(k_cache.element_size(), k_cache.size(1));
    const auto dtype = final_norm_.scalar_type(), cache = k_cache.scalar_type();
    bool same = input_norm.scalar_type() == dtype && post_norm.scalar_type() == dtype &&
                v_cache.scalar_type() == cache && (layers_.empty() || layers_[0].k_cache.scalar_type() == cache) &&
                cache_serves(cache, dtype);
    bool supported = true;
    for (const auto* linear : {qkv.get(), o.get(), gate_up.get(), down.get()}) {
      same = same && (!linear->bias || linear->bias->scalar_type() == dtype);
      for (size_t i = 0; i < linear->qtypes.size(); ++i)
        supported = supported && nanovllm::ggml_supported(linear->qtypes[i], isa_, linear->lanes,
                                                          linear->segments[i].size(0));
    }
    TORCH_CHECK(same, "DecoderStack: the norms and biases must share the activations' dtype, the caches hold it (or "
                "8-bit floats or an int8 cache's bytes, in every layer)");
    TORCH_CHECK(supported, "DecoderStack: a projection's GGML type has no kernel on this path");
    layers_.push_back(
        {input_norm.contiguous(), post_norm.contiguous(), k_cache, v_cache, qkv, o, gate_up, down, {}});
    mlp_ = std::max(mlp_, gate_up->out_features);
    widest_in_ = std::max({widest_in_, hidden_, q, down->in_features});
  }

  // Layer `layer`'s projection `projection` (a `Projection`) adds the LoRA deltas of a `Packed` from now on, for the
  // rows `forward` maps to slots: each slot's A and B (in the activations' dtype) and `table` (the slice table,
  // scales and each slot's first slice; empty: no adapter).
  void set_lora(int64_t layer, int64_t projection, std::vector<at::Tensor> a, std::vector<at::Tensor> bt,
                std::vector<at::Tensor> table) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && projection >= 0 &&
                    projection < PROJECTIONS && (table.empty() || table.size() == 3),
                "DecoderStack.set_lora: a layer, a projection and the packed table (or none)");
    if (!table.empty()) {
      const auto dtype = final_norm_.scalar_type();
      bool fits = table[0].scalar_type() == at::kLong && table[1].scalar_type() == at::kFloat &&
                  table[2].scalar_type() == at::kLong && static_cast<int64_t>(a.size()) == table[2].numel() - 1 &&
                  a.size() == bt.size();
      for (size_t i = 0; fits && i < a.size(); ++i)
        fits = a[i].scalar_type() == dtype && bt[i].scalar_type() == dtype && a[i].is_contiguous() &&
               bt[i].is_contiguous();
      TORCH_CHECK(fits, "DecoderStack.set_lora: one contiguous A and B per slot in the activations' dtype, an int64 "
                  "slice table, float32 scales");
      for (auto& t : table) t = t.contiguous();
    }
    auto& pack = layers_[layer].lora[projection];
    pack.a = std::move(a), pack.bt = std::move(bt), pack.table = std::move(table);
  }

  // The final norm's output [M, hidden] for M single-query rows: hidden [M, hidden] (the embeddings), their
  // positions (int64), cache slots (int64, -1: not stored), block tables [M, width] and context lengths (int32);
  // with `row_slot` (int64, each row's LoRA adapter slot), the projections add their adapters' deltas.
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor context_lens, std::optional<at::Tensor> row_slot) {
    TORCH_CHECK(!layers_.empty() && hidden.dim() == 2 && hidden.size(1) == hidden_ &&
                    hidden.scalar_type() == final_norm_.scalar_type(),
                nanovllm::message("DecoderStack: hidden must be [rows, ", hidden_, "] in the activations' dtype"));
    TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                    block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
                "DecoderStack: positions and slots are int64, block tables and context lengths int32");
    const int64_t M = hidden.size(0);
    TORCH_CHECK(positions.numel() == M && slot_mapping.numel() == M && context_lens.numel() == M &&
                    block_tables.size(0) == M, "DecoderStack: one position, slot, block table and length per row");
    hidden = hidden.contiguous();
    positions = positions.contiguous();
    slot_mapping = slot_mapping.contiguous();
    block_tables = block_tables.contiguous();
    context_lens = context_lens.contiguous();
    if (row_slot) {
      TORCH_CHECK(row_slot->scalar_type() == at::kLong && row_slot->numel() == M,
                  "DecoderStack: one int64 LoRA slot per row");
      row_slot = row_slot->contiguous();
    }
    const int64_t* slots = row_slot ? row_slot->const_data_ptr<int64_t>() : nullptr;
    auto out = hidden.new_empty(hidden.sizes());
    const int64_t copies = M <= COPIED_ROWS ? at::get_num_threads() : 1;
    const int64_t copied = offset(WORKSPACE) - offset(FIRST_COPIED);
    auto workspace = hidden.new_empty({M * (offset(FIRST_COPIED) + copies * copied)});
    // Besides: the quantized activations of a projection (a copy each too), attention's partial results (shared).
    const int64_t xq_bytes = (nanovllm::ggml_scratch_bytes(M, widest_in_) + 63) / 64 * 64;
    const int64_t partials = nanovllm::paged_decode_partials(context_lens.const_data_ptr<int32_t>(), M, heads_,
                                                             kv_heads_, head_dim_, 0);
    auto scratch = hidden.new_empty({copies * xq_bytes + partials * 4}, hidden.options().dtype(at::kByte));  // aligned
    auto* bytes = scratch.data_ptr<uint8_t>();
    auto run = [&](auto zero) {
      using T = decltype(zero);
      with_cache_type<T>(layers_[0].k_cache.scalar_type(), [&](auto cache_zero) {
        step<T, decltype(cache_zero)>(hidden.const_data_ptr<T>(), M, positions.const_data_ptr<int64_t>(),
                                      slot_mapping.const_data_ptr<int64_t>(), block_tables.const_data_ptr<int32_t>(),
                                      block_tables.size(1), context_lens.const_data_ptr<int32_t>(), slots,
                                      out.data_ptr<T>(), workspace.data_ptr<T>(), copies, bytes, xq_bytes,
                                      reinterpret_cast<float*>(bytes + copies * xq_bytes));
      });
    };
    switch (hidden.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      case at::kHalf: run(c10::Half{}); break;
      default: TORCH_CHECK(false, "DecoderStack: activations must be float32, bfloat16 or float16");
    }
    return out;
  }

 private:
  // A step's intermediate rows, each buffer `width(buffer)` values per row, in this order in one workspace: those the
  // threads share, then those every thread reads whole (`copies` of them: one per thread at COPIED_ROWS rows).
  enum Buffer { BLOCK_OUT, QKV, Q_ROT, K_ROT, ATTN, GATE_UP, RESIDUAL, NORMED, ACT, WORKSPACE };
  static constexpr Buffer FIRST_COPIED = RESIDUAL;

  // Where `buffer` starts in a row of the workspace (WORKSPACE: the row's width with one copy).
  int64_t offset(Buffer buffer) const {
    const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    const int64_t widths[] = {hidden_, q + 2 * kv, q, kv, q, mlp_, hidden_, hidden_, mlp_ / 2};
    int64_t total = 0;
    for (int i = 0; i < buffer; ++i) total += widths[i];
    return total;
  }

  // The M rows through every layer. With `copies` > 1 (one per thread), each thread computes the rows every thread
  // needs whole (norms, SiLU, the quantized inputs of the projections) itself, into its copy, and the threads wait
  // for each other 7 times a layer instead of 14: at one row a barrier costs more than the row.
  template <typename T, typename C>
  void step(const T* hidden, int64_t M, const int64_t* positions, const int64_t* slots, const int32_t* tables,
            int64_t table_width, const int32_t* context_lens, const int64_t* lora_slots, T* out, T* workspace,
            int64_t copies, uint8_t* xq, int64_t xq_bytes, float* partials) {
    const int64_t H = hidden_, D = head_dim_, q = heads_ * D, kv = kv_heads_ * D, qkv_width = q + 2 * kv;
    auto buffer = [&](Buffer b) { return workspace + M * offset(b); };
    T *block_out = buffer(BLOCK_OUT), *qkv = buffer(QKV), *q_rot = buffer(Q_ROT), *k_rot = buffer(K_ROT),
      *attn = buffer(ATTN), *gate_up = buffer(GATE_UP);
    const float* cos_sin = cos_sin_.const_data_ptr<float>();

    run_team([&](const Team& team) {
      const bool each = copies > 1 && team.size > 1;
      const int64_t copy = each ? team.id : 0, copy_values = M * (offset(WORKSPACE) - offset(FIRST_COPIED));
      T *residual = buffer(RESIDUAL) + copy * copy_values, *normed = buffer(NORMED) + copy * copy_values,
        *act = buffer(ACT) + copy * copy_values;
      void* scratch = xq + copy * xq_bytes;
      needed_rows(team, each, M, [&](int64_t m) {
        std::memcpy(residual + m * H, hidden + m * H, H * sizeof(T));
        nanovllm::rms_norm_row(hidden + m * H, layers_[0].input_norm.const_data_ptr<T>(), normed + m * H, H, eps_);
      });
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& l = layers_[i];
        if (i > 0)
          needed_rows(team, each, M, [&](int64_t m) {
            nanovllm::add_rms_norm_row(block_out + m * H, residual + m * H, l.input_norm.const_data_ptr<T>(),
                                       normed + m * H, residual + m * H, H, eps_);
          });
        l.qkv->run(team, normed, M, qkv, scratch, isa_, each);
        l.lora[QKV_PROJ].add(team, normed, M, H, qkv, qkv_width, lora_slots);
        C* k_cache = static_cast<C*>(l.k_cache.data_ptr());
        C* v_cache = static_cast<C*>(l.v_cache.data_ptr());
        // Rotary by head (at one row, a row each left one thread idle): a query head, or a KV head's K, then its K
        // and V into the cache.
        const int64_t row_heads = heads_ + kv_heads_;
        for_rows(team, M * row_heads, [&](int64_t item) {
          const int64_t m = item / row_heads, h = item % row_heads;
          const T* row = qkv + m * qkv_width;
          const float* table = cos_sin + positions[m] * D;
          if (h < heads_) {
            nanovllm::rotary_row(row + h * D, q_rot + m * q + h * D, table, D / 2);
            if (h == 0 && context_lens[m] <= 0)  // a row that attends to nothing is zeros, as paged_decode leaves it
              std::fill(attn + m * q, attn + (m + 1) * q, from_float<T>(0.f));
            return;
          }
          const int64_t g = h - heads_;
          nanovllm::rotary_row(row + q + g * D, k_rot + m * kv + g * D, table, D / 2);
          if (slots[m] >= 0) {
            store_key(k_rot + m * kv + g * D, k_cache, slots[m], g, kv_heads_, D);
            store_value(row + q + kv + g * D, v_cache, slots[m], g, kv_heads_, D);
          }
        });
        nanovllm::paged_decode_rows(q_rot, k_cache, v_cache, tables, context_lens, attn, M, heads_, kv_heads_, D,
                                    l.k_cache.size(1), table_width, scale_, 0, 0.f, &team, partials);
        team.barrier();
        l.o->run(team, attn, M, block_out, scratch, isa_, each);
        l.lora[O_PROJ].add(team, attn, M, q, block_out, H, lora_slots);
        needed_rows(team, each, M, [&](int64_t m) {
          nanovllm::add_rms_norm_row(block_out + m * H, residual + m * H, l.post_norm.const_data_ptr<T>(),
                                     normed + m * H, residual + m * H, H, eps_);
        });
        const int64_t width = l.gate_up->out_features, half = width / 2;
        l.gate_up->run(team, normed, M, gate_up, scratch, isa_, each);
        l.lora[GATE_UP_PROJ].add(team, normed, M, H, gate_up, width, lora_slots);
        needed_rows(team, each, M, [&](int64_t m) {
          nanovllm::silu_mul_row(gate_up + m * width, gate_up + m * width + half, act + m * half, half);
        });
        l.down->run(team, act, M, block_out, scratch, isa_, each);
        l.lora[DOWN_PROJ].add(team, act, M, half, block_out, H, lora_slots);
      }
      for_rows(team, M, [&](int64_t m) {
        nanovllm::add_rms_norm_row(block_out + m * H, residual + m * H, final_norm_.const_data_ptr<T>(),
                                   out + m * H, residual + m * H, H, eps_);
      });
    });
  }

  int64_t heads_, kv_heads_, head_dim_;
  float eps_, scale_;
  at::Tensor cos_sin_, final_norm_;
  int64_t isa_, hidden_;
  int64_t mlp_ = 0, widest_in_ = 0;  // the widest gate-up, and the widest input of a projection
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanovllm, m) {
  m.class_<GGMLLinear>("GGMLLinear")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, std::optional<at::Tensor>, int64_t>());
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_lora", &DecoderStack::set_lora)
      .def("forward", &DecoderStack::forward);
}
