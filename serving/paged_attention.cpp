// The paged attention kernel of paged_attention.py, written by hand for the CPU.
//
// decode_attention there is the readable version: a dozen lines of PyTorch that
// torch.compile turns into loops. Those loops read the pool at a third of the memory's
// speed: for the weighted sum of values they pass over every column once per 8 values of a
// head (docs/serving.md, round 5). This kernel makes one pass per sequence: each column's key
// and value are read once, whole, for every head, and the softmax is taken on the way
// ("online softmax": a running maximum and sum per head, the partial weighted sum scaled
// down whenever the maximum grows), so nothing is written but the output.
//
// For each sequence b and query head h, over its visible columns s:
//     score_s = q[b, h] . k[slots[b, s], h / group] / sqrt(hd)
//     out[b, h] = sum_s exp(score_s - max) * v[slots[b, s], h / group] / sum_s exp(score_s - max)
//
// A quantized pool (kv_quant.py's int8 or int4 heads: codes, then float16 scales) is read
// by the same loop: each stored head of a column is dequantized into a few floats once,
// for every query head that shares it, and nothing else changes.
//
// paged_attention.py has it built on first use (kernel_build.py, torch.utils.cpp_extension)
// and calls it as torch.ops.kvcache_gpt.decode_attention (a float32 pool) and
// decode_attention_quantized (an int8 or int4 one), with decode_attention's inputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

// Asks the CPU to start loading a column's keys and values (row_bytes each; a cache line
// holds 64 bytes) before they are needed. A sequence's blocks lie anywhere in the pool,
// and the CPU's own prefetcher, which follows addresses in order, cannot guess the next
// one: this took the kernel from ~1.45 to ~1.27 ms a layer (docs/serving.md, round 8).
void prefetch_column(const char* k_pool, const char* v_pool, int64_t row_bytes) {
  for (int64_t i = 0; i < row_bytes; i += 64) {
    __builtin_prefetch(k_pool + i);
    __builtin_prefetch(v_pool + i);
  }
}

// How a stored head is read. A float32 pool's head is its hd floats, read where they lie.
struct FloatHeads {
  static constexpr int64_t bytes_per_value = 4;
  const float* read(const void* stored, float* /*scratch*/) const {
    return static_cast<const float*>(stored);
  }
};

// An int8 or int4 pool's head is kv_quant.py's QuantizedFormat: its codes, then one float16
// scale per `group` channels. Read by dequantizing it into scratch (hd floats), once for all
// the query heads that share it: codes x scale, as QuantizedFormat.decode.
struct QuantizedHeads {
  int64_t hd, bits, group;
  const float* read(const void* stored, float* scratch) const {
    const uint8_t* codes = static_cast<const uint8_t*>(stored);
    const int64_t code_bytes = hd * bits / 8;
    const c10::Half* scales = reinterpret_cast<const c10::Half*>(codes + code_bytes);
    if (bits == 8) {
      const int8_t* c = reinterpret_cast<const int8_t*>(codes);
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) scratch[d] = c[d];
    } else {  // int4: channel i in byte i's low four bits, channel i + hd/2 in its high four, + 8
      const int64_t half = hd / 2;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        scratch[i] = (codes[i] & 15) - 8;
        scratch[i + half] = (codes[i] >> 4) - 8;
      }
    }
    for (int64_t first = 0; first < hd; first += group) {
      const float s = static_cast<float>(scales[first / group]);
#pragma omp simd
      for (int64_t d = first; d < first + group; ++d) scratch[d] *= s;
    }
    return scratch;
  }
};

// One sequence: its query heads q (nh, hd), its columns' slots and visibility (S,);
// writes out (nh, hd). Strides in bytes. acc, running_max, running_sum: scratch of
// nh * hd, nh, nh floats; k_scratch, v_scratch: hd floats each (a quantized head read).
template <typename Heads>
void attend_one_sequence(const Heads& heads, const float* q, const char* k_pool, const char* v_pool,
                         int64_t slot_stride, int64_t head_stride, const int64_t* slots,
                         const bool* visible, int64_t S, int64_t nh, int64_t n_kv_head, int64_t hd,
                         float* acc, float* running_max, float* running_sum, float* k_scratch,
                         float* v_scratch, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t group = nh / n_kv_head;  // query heads per stored head
  std::fill(acc, acc + nh * hd, 0.0f);
  std::fill(running_max, running_max + nh, -INFINITY);
  std::fill(running_sum, running_sum + nh, 0.0f);
  for (int64_t s = 0; s < S; ++s) {
    if (s + 2 < S)
      prefetch_column(k_pool + slots[s + 2] * slot_stride, v_pool + slots[s + 2] * slot_stride,
                      n_kv_head * head_stride);
    if (!visible[s]) continue;  // padding: never read
    const int64_t row = slots[s] * slot_stride;  // this column's keys (and values), all heads
    for (int64_t g = 0; g < n_kv_head; ++g) {
      const float* k = heads.read(k_pool + row + g * head_stride, k_scratch);  // the stored head
      const float* v = heads.read(v_pool + row + g * head_stride, v_scratch);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {  // the query heads reading it
        const float* qh = q + h * hd;
        float* a = acc + h * hd;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qh[d] * k[d];
        const float score = dot * scale;
        if (score > running_max[h]) {  // a new maximum: what was summed so far shrinks
          const float shrink = std::exp(running_max[h] - score);
          running_sum[h] *= shrink;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) a[d] *= shrink;
          running_max[h] = score;
        }
        const float weight = std::exp(score - running_max[h]);
        running_sum[h] += weight;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) a[d] += weight * v[d];
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = acc[h * hd + d] / running_sum[h];
}

// Every sequence of the batch, split among torch's threads (one OpenMP pool with torch's
// own operations). q (B, nh, 1, hd) float32; k_pool, v_pool (slots, n_kv_head, width), one
// layer of the pool (views of it: their strides are read); slots (B, S) int64; visible
// (B, S) bool. Returns (B, nh, 1, hd).
template <typename Heads>
at::Tensor attend(const Heads& heads, const at::Tensor& q, const at::Tensor& k_pool,
                  const at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& visible) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: a float32 query only");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && k_pool.strides() == v_pool.strides(),
              "decode_attention: each head's values must be contiguous, keys and values alike");
  TORCH_CHECK(slots.scalar_type() == at::kLong && visible.scalar_type() == at::kBool,
              "decode_attention: slots int64, visible bool");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(3), S = slots.size(1);
  TORCH_CHECK(nh % k_pool.size(1) == 0 && slots.size(0) == B && visible.sizes() == slots.sizes(),
              "decode_attention: shapes do not match");
  const at::Tensor q_ = q.contiguous(), slots_ = slots.contiguous(), visible_ = visible.contiguous();
  at::Tensor out = at::empty({B, nh, 1, hd}, q.options());
  const float* q_data = q_.data_ptr<float>();
  const char* k_data = static_cast<const char*>(k_pool.data_ptr());
  const char* v_data = static_cast<const char*>(v_pool.data_ptr());
  const int64_t item = k_pool.element_size();  // strides in bytes: one kernel for every width
  const int64_t* slot_data = slots_.data_ptr<int64_t>();
  const bool* visible_data = visible_.data_ptr<bool>();
  float* out_data = out.data_ptr<float>();
  // a slot outside the pool would be a read of someone else's memory, not an error
  for (int64_t i = 0; i < B * S; ++i)
    TORCH_CHECK(slot_data[i] >= 0 && slot_data[i] < k_pool.size(0), "decode_attention: slot ",
                slot_data[i], " outside the pool of ", k_pool.size(0));
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t end) {
    std::vector<float> acc(nh * hd), running_max(nh), running_sum(nh), k_scratch(hd), v_scratch(hd);
    for (int64_t b = first; b < end; ++b)
      attend_one_sequence(heads, q_data + b * nh * hd, k_data, v_data, k_pool.stride(0) * item,
                          k_pool.stride(1) * item, slot_data + b * S, visible_data + b * S, S, nh,
                          k_pool.size(1), hd, acc.data(), running_max.data(), running_sum.data(),
                          k_scratch.data(), v_scratch.data(), out_data + b * nh * hd);
  });
  return out;
}

// A float32 pool: k_pool, v_pool (slots, n_kv_head, hd) float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& visible) {
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "decode_attention: a float32 pool only");
  TORCH_CHECK(k_pool.size(2) == q.size(3), "decode_attention: shapes do not match");
  return attend(FloatHeads{}, q, k_pool, v_pool, slots, visible);
}

// An int8 or int4 pool: k_pool, v_pool (slots, n_kv_head, head_bytes) uint8, each head
// kv_quant.py's codes then scales; bits 8 or 4, group: channels per scale.
at::Tensor decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_pool,
                                      const at::Tensor& v_pool, const at::Tensor& slots,
                                      const at::Tensor& visible, int64_t bits, int64_t group) {
  const int64_t hd = q.size(3);
  TORCH_CHECK(k_pool.scalar_type() == at::kByte && v_pool.scalar_type() == at::kByte,
              "decode_attention_quantized: a uint8 pool only");
  TORCH_CHECK((bits == 8 || bits == 4) && group > 0 && hd % group == 0 && hd % 4 == 0 &&
                  k_pool.size(2) == hd * bits / 8 + hd / group * 2,
              "decode_attention_quantized: the pool's head bytes do not match bits, group and hd");
  return attend(QuantizedHeads{hd, bits, group}, q, k_pool, v_pool, slots, visible);
}

}  // namespace

TORCH_LIBRARY(kvcache_gpt, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor visible) -> Tensor");
  m.def("decode_attention_quantized(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor visible, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache_gpt, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_quantized", decode_attention_quantized);
}
