// The quantized matrix products of quantized_matmul.py, written by hand for the CPU.
//
// At batch 1 a Linear reads every weight once for one multiply-add, so its time is the
// bytes it reads: 1 byte a weight in int8, half a byte in int4. These kernels read each
// weight block once and do the arithmetic in 8-bit integers, as llama.cpp's q8_0 x q8_0 and
// q4_0 x q8_0 do: the activations are quantized too, in blocks of 32 (one fp32 scale each),
// so 32 weights times 32 activations is a handful of integer instructions instead of a
// conversion of every weight to float.
//
//   int8, per output channel n:  W[n, k] ~ q[n, k] * scale[n]
//       y[m, n] = scale[n] * sum_b d[m, b] * (sum_{k in b} q[n, k] * xq[m, k])
//   int4, in groups g of G input channels:  W[n, k] ~ (q[n, k] - 8) * s[n, g] + zero[n, g]
//       with q in [0, 15] (the scheme's zero is the value at level 8)
//       y[m, n] = sum_g s[n, g] * sum_{b in g} d[m, b] * (sum_{k in b} q[n, k] * xq[m, k])
//                     - 8 * s[n, g] * sum_{b in g} d[m, b] * sum_{k in b} xq[m, k]
//                     + zero[n, g] * sum_{k in g} x[m, k]       (that sum exact, in fp32)
//       (the first two lines are (q - 8) times the rounded x, taken apart because the
//       integer instruction wants an unsigned q: together their rounding error scales with
//       |q - 8| as the weight's does, not with q)
//   where the activations x[m, b] ~ xq[m, b] * d[m, b], xq in [-127, 127], d = max|x| / 127.
//
// int4 weights lie two to a byte, in blocks of 32: byte j of a block holds weight j in its
// low 4 bits and weight j + 16 in its high 4 (llama.cpp's q4_0 order: one load and two masks
// give the block's 32 weights in order).
//
// Each product comes three times, one per instruction set, chosen by what the CPU has at
// run time (quantized_matmul.py asks kernel_isas() and passes the best): "portable" (plain
// C++, any CPU), "avx2" (AVX2 + FMA: 32 weights a step) and "avx512vnni" (AVX-512 with
// VNNI's 8-bit dot product instruction: 64 a step). Output rows n are split among torch's
// threads; every row of x is multiplied by a weight row while it is in the L1 cache, so each
// weight leaves memory once however many rows x has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // activations (and int4 weights) are stored in blocks of 32
constexpr float MIN_SCALE = 1e-12f;  // weight_quant.MIN_SCALE: an all-equal row or group's scale

// The next tile's rows are fetched ahead of their loads (R rows read side by side are R
// streams, which the CPU's own prefetcher follows less well than one). Into which cache
// depends on the CPU, measured on each (an output layer 128256 x 2048, 2 threads): on a Xeon
// into L1 (_MM_HINT_T0: 24 -> 29 GB/s over no prefetch, bf16), on a Zen 4 EPYC into L2
// (_MM_HINT_T1: int4 19 -> 29 GB/s, int8 18 -> 26, bf16 25 -> 28 against T0: the kernel
// built both ways, in turns in one process, on weights that stream from memory).
// (__builtin_cpu_init first: this runs as the library loads, maybe before libgcc's own
// constructor has read the CPU's identity)
const bool PREFETCH_TO_L2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();

inline __attribute__((always_inline)) void prefetch_ahead(const void* address) {
  if (PREFETCH_TO_L2)
    _mm_prefetch((const char*)address, _MM_HINT_T1);
  else
    _mm_prefetch((const char*)address, _MM_HINT_T0);
}

// run(data) with t's values as a pointer of their type: float, bf16 or fp16 (checked by the
// caller: the products take float or bf16 activations, quantizing takes any of the three)
template <typename Run>
void with_float_data(const at::Tensor& t, Run run) {
  if (t.scalar_type() == at::kFloat)
    run(t.data_ptr<float>());
  else if (t.scalar_type() == at::kBFloat16)
    run(t.data_ptr<at::BFloat16>());
  else
    run(t.data_ptr<at::Half>());
}

// ------------------------------------------------------------------ the activations, in 8 bits

// x (M, K) fp32 or bf16 -> xq (M, K) int8 and d (M, K / 32): per block of 32, d = max|x| / 127
// and xq = round(x / d), so that x ~ xq * d within d / 2. A bf16 x is read as the fp32 it is
// exactly: the same codes as for x.float(), without that copy.
template <typename T>
void quantize_activations(const T* x, int64_t M, int64_t K, int8_t* xq, float* d) {
  at::parallel_for(0, M * (K / BLOCK), 64, [&](int64_t first, int64_t end) {
    for (int64_t blk = first; blk < end; ++blk) {
      const T* xb = x + blk * BLOCK;
      float amax = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs((float)xb[i]));
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;  // an all-zero block stays zero
      d[blk] = scale;
      for (int64_t i = 0; i < BLOCK; ++i) xq[blk * BLOCK + i] = (int8_t)std::nearbyint((float)xb[i] * inverse);
    }
  });
}

// The offsets' sums for int4, per group g of each row of x (the formula at the top):
// sums = sum_{k in g} x[k] in fp32, rounded = sum_{b in g} d[b] * sum_{k in b} xq[k]. A plain
// loop: a few microseconds at batch 1, where the same in torch ops (six of them, each
// allocating) cost ~20 us a call, 113 calls a token at the 1B shape.
template <typename T>
void sum_groups(const T* x, const int8_t* xq, const float* d, int64_t row_groups, int64_t group_size,
                float* sums, float* rounded) {
  const int64_t blocks = group_size / BLOCK;  // per group
  for (int64_t g = 0; g < row_groups; ++g) {  // every group of every row: (M, groups) in order
    float exact = 0.f, approx = 0.f;
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      int32_t levels = 0;
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i) {
        exact += (float)x[i];
        levels += xq[i];
      }
      approx += d[b] * (float)levels;
    }
    sums[g] = exact;
    rounded[g] = approx;
  }
}

// ------------------------------------------------------------------ portable: any CPU

float int8_row_portable(const int8_t* w, const int8_t* xq, const float* d, int64_t K) {
  float sum = 0.f;
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    int32_t dot = 0;
    for (int64_t i = 0; i < BLOCK; ++i) dot += w[b * BLOCK + i] * xq[b * BLOCK + i];
    sum += d[b] * (float)dot;
  }
  return sum;
}

// the part of an int4 row's product that its levels make: sum_g s_g * sum_b d_b * dot_b
float int4_row_portable(const uint8_t* w, const at::BFloat16* s, const int8_t* xq, const float* d,
                        int64_t K, int group_shift) {
  float sum = 0.f;
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const uint8_t* wb = w + b * BLOCK / 2;
    int32_t dot = 0;
    for (int64_t j = 0; j < BLOCK / 2; ++j)
      dot += (wb[j] & 15) * xq[b * BLOCK + j] + (wb[j] >> 4) * xq[b * BLOCK + j + 16];
    sum += s[b >> group_shift] * d[b] * (float)dot;
  }
  return sum;
}

// ------------------------------------------------------------------ AVX2 + FMA: 32 at a time

__attribute__((target("avx2,fma"))) float sum_lanes_avx2(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

// 32 unsigned bytes times 32 signed ones, summed in pairs to 16 int16 and in pairs again to
// 8 int32 (no overflow: |u * s| <= 255 * 127, two of them fit in int16 only when u <= 128,
// which the callers keep: |int8| <= 127 here, int4 levels <= 15)
__attribute__((target("avx2,fma"))) __m256i dot_u8_s8_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

__attribute__((target("avx2,fma"))) float int8_row_avx2(const int8_t* w, const int8_t* xq,
                                                        const float* d, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * BLOCK));
    __m256i y = _mm256_loadu_si256((const __m256i*)(w + b * BLOCK));
    // signed times signed has no instruction: move x's sign onto y and multiply |x| by it
    __m256i dot = dot_u8_s8_avx2(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[b]), acc);
  }
  return sum_lanes_avx2(acc);
}

__attribute__((target("avx2,fma"))) float int4_row_avx2(const uint8_t* w, const at::BFloat16* s,
                                                        const int8_t* xq, const float* d,
                                                        int64_t K, int group_shift) {
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    __m128i packed = _mm_loadu_si128((const __m128i*)(w + b * BLOCK / 2));  // 16 bytes, 32 weights
    // weights 0-15 from the low halves, 16-31 from the high halves: the block in order
    __m256i levels = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
    __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * BLOCK));
    __m256i dot = dot_u8_s8_avx2(levels, x);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[b >> group_shift] * d[b]), acc);
  }
  return sum_lanes_avx2(acc);
}

// ------------------------------------------------------------------ AVX-512 VNNI: 64 at a time

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

// the scales of two neighbouring blocks, b in the low 8 lanes and b + 1 in the high 8
AVX512 __m512 two_scales(float low, float high) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(low), _mm512_set1_ps(high));
}

// int8 and int4 with AVX-512 a tile at a time: TILE weight rows against one row of x. At
// batch 1 a kernel of one row at a time (as the AVX2 ones) spent as long on its overheads as
// on the weights: per row, a horizontal sum, x's signs and scales worked out again, one
// chain of dependent additions, and for int4 the scalar loop over the groups' offsets (the
// formula's last two lines, ~40% of the instructions at K = 2048). Here each load of x and
// of its block scales serves TILE rows, the TILE sums are independent (the CPU overlaps
// them), the next tile is fetched ahead, and int4's offsets are summed 16 groups a step.
constexpr int TILE = 4;

// y[r] = scale[r] * (weight row r of R, R <= TILE, rows K bytes apart, times x's row)
template <int R>
AVX512 void int8_tile_avx512(const int8_t* w, int64_t K, const at::BFloat16* scale, const int8_t* xq,
                             const float* d, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= K / BLOCK; b += 2) {  // two blocks a step
    const __m512i x = _mm512_loadu_si512(xq + b * BLOCK);
    // as in AVX2, |x| times y with x's sign (AVX-512 has no sign_epi8: negate y where x < 0);
    // |x|, its signs and the two blocks' scales once for the R rows
    const __m512i abs_x = _mm512_abs_epi8(x);
    const __mmask64 negative = _mm512_movepi8_mask(x);
    const __m512 dx = two_scales(d[b], d[b + 1]);
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + (r + R) * K + b * BLOCK);  // the next tile's row at the same place
      const __m512i y_r = _mm512_loadu_si512(w + r * K + b * BLOCK);
      const __m512i signed_y = _mm512_mask_sub_epi8(y_r, negative, _mm512_setzero_si512(), y_r);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), abs_x, signed_y);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    if (b < K / BLOCK)  // an odd block
      sum += int8_row_portable(w + r * K + b * BLOCK, xq + b * BLOCK, d + b, BLOCK);
    y[r] = scale[r] * sum;
  }
}

// 16 bf16 numbers to fp32: a bf16 is the top half of an fp32 one
AVX512 __m512 bf16x16_to_fp32(const at::BFloat16* v) {
  __m256i halves = _mm256_loadu_si256((const __m256i*)v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// sum_g z[g] * sums[g] - 8 * s[g] * rounded[g] over one weight row's groups
AVX512 float int4_offsets_avx512(const at::BFloat16* s, const at::BFloat16* z, const float* sums,
                                 const float* rounded, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) {
    acc = _mm512_fmadd_ps(bf16x16_to_fp32(z + g), _mm512_loadu_ps(sums + g), acc);
    acc = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), bf16x16_to_fp32(s + g)),
                           _mm512_loadu_ps(rounded + g), acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; g < groups; ++g) sum += z[g] * sums[g] - 8.f * s[g] * rounded[g];  // the last few
  return sum;
}

// int4 on AVX-512 takes four blocks (128 weights, 64 bytes of a row) a step: one load, two
// masks, two dot products. In a 64-byte load, 128-bit lane k holds block k's 32 levels, its
// low halves weights 0-15 and high halves 16-31; so x is laid out the same way once per row
// of x (int4_x_halves: the four blocks' first halves, then their second halves) and the low
// and high levels each meet their activations without a shuffle. Then lane group k of the
// 16 int32 sums is block k's, and its scale d[k] * s[k's group] multiplies it. (Two blocks a
// step, the levels shuffled into x's order, took twice the instructions per weight.)
constexpr int64_t CHUNK = 4 * BLOCK;  // the weights of a step

// xq (K,) -> halves (K,): per chunk of four blocks, their values 0-15, then their 16-31
void int4_x_halves(const int8_t* xq, int64_t K, int8_t* halves) {
  for (int64_t c = 0; c < K / CHUNK; ++c)
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t j = 0; j < BLOCK / 2; ++j) {
        halves[c * CHUNK + k * BLOCK / 2 + j] = xq[c * CHUNK + k * BLOCK + j];
        halves[c * CHUNK + CHUNK / 2 + k * BLOCK / 2 + j] = xq[c * CHUNK + k * BLOCK + BLOCK / 2 + j];
      }
}

// d (K / 32,) -> lanes (K / 128, 16): each chunk's four block scales, each four times
void int4_x_scale_lanes(const float* d, int64_t K, float* lanes) {
  for (int64_t c = 0; c < K / CHUNK; ++c)
    for (int64_t i = 0; i < 16; ++i) lanes[c * 16 + i] = d[c * 4 + i / 4];
}

// lane i of a chunk's 16 sums is block i / 4's, whose scale is the (i / 4 >> group_shift)-th
// of those chunk_scales loads (once per product, not per tile)
std::array<int32_t, 16> int4_lane_scales(int group_shift) {
  std::array<int32_t, 16> lanes;
  for (int i = 0; i < 16; ++i) lanes[i] = (i / 4) >> group_shift;
  return lanes;
}

// a chunk's weight scales, one per lane: `count` (1, 2 or 4) bf16 scales from s, lane i
// taking scale index[i]
AVX512 __m512 chunk_scales(const at::BFloat16* s, int count, __m512i index) {
  uint64_t bits;
  if (count == 4) {
    std::memcpy(&bits, s, 8);
  } else if (count == 2) {
    uint32_t two;
    std::memcpy(&two, s, 4);
    bits = two;
  } else {
    uint16_t one;
    std::memcpy(&one, s, 2);
    bits = one;
  }
  const __m128i fp32 = _mm_slli_epi32(_mm_cvtepu16_epi32(_mm_cvtsi64_si128((long long)bits)), 16);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_castsi128_ps(fp32)));
}

// y[r] = weight row r (of R, R <= TILE) times x's row, for r < R; the rows lie w_stride bytes
// (and `groups` scales) apart. x_halves and d_lanes: int4_x_halves and int4_x_scale_lanes
// of x's row; lane_scale[i]: which of a chunk's scales lane i takes (int4_lane_scales); the
// last blocks short of a chunk go through the portable loop.
template <int R>
AVX512 void int4_tile_avx512(const uint8_t* w, int64_t w_stride, const at::BFloat16* s,
                             const at::BFloat16* z, int64_t groups, const int8_t* xq, const int8_t* x_halves,
                             const float* d, const float* d_lanes, const float* sums, const float* rounded,
                             int64_t K, int group_shift, const int32_t* lane_scale, float* y) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const int count = group_shift >= 2 ? 1 : 4 >> group_shift;  // the groups a chunk spans
  const __m512i index = _mm512_loadu_si512(lane_scale);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t chunks = K / CHUNK;
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i x_low = _mm512_loadu_si512(x_halves + c * CHUNK);  // shared by the R rows
    const __m512i x_high = _mm512_loadu_si512(x_halves + c * CHUNK + CHUNK / 2);
    const __m512 dx = _mm512_loadu_ps(d_lanes + c * 16);
    const int64_t g = (c * 4) >> group_shift;
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + (r + R) * w_stride + c * CHUNK / 2);  // the next tile's row at the same place
      const __m512i packed = _mm512_loadu_si512(w + r * w_stride + c * CHUNK / 2);
      const __m512i low = _mm512_and_si512(packed, low4);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, x_low), high, x_high);
      const __m512 sw = chunk_scales(s + r * groups + g, count, index);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dx, sw), acc[r]);
    }
  }
  const int64_t b = chunks * 4;  // the first block left: a group's first (K is whole groups)
  for (int r = 0; r < R; ++r) {
    const at::BFloat16 *row_s = s + r * groups, *row_z = z + r * groups;
    float sum = _mm512_reduce_add_ps(acc[r]) + int4_offsets_avx512(row_s, row_z, sums, rounded, groups);
    if (b < K / BLOCK)
      sum += int4_row_portable(w + r * w_stride + b * BLOCK / 2, row_s + (b >> group_shift), xq + b * BLOCK,
                               d + b, K - b * BLOCK, group_shift);
    y[r] = sum;
  }
}

// ------------------------------------------------------------------ picking and checking

bool cpu_has(const std::string& isa) {
  if (isa == "portable") return true;
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512vnni")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  return false;
}

// The instruction sets this CPU runs, best last.
std::vector<std::string> kernel_isas() {
  std::vector<std::string> isas;
  for (const char* isa : {"portable", "avx2", "avx512vnni"})
    if (cpu_has(isa)) isas.push_back(isa);
  return isas;
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, int64_t K, const std::string& isa) {
  TORCH_CHECK(cpu_has(isa), "quantized_matmul: this CPU does not run ", isa);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous(), "quantized_matmul: x must be a contiguous (rows, in) float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) == K && K % BLOCK == 0, "quantized_matmul: x has ", x.size(1),
              " columns; the weight wants ", K, ", a multiple of ", BLOCK);
  TORCH_CHECK(w.is_contiguous(), "quantized_matmul: the weight must be contiguous");
}

// The products sum in fp32; a bf16 x gets its answer in bf16, as F.linear would give it, so
// that a bf16 model calls the operator with no conversion on either side (two fewer
// operations a Linear, 226 a token at the 1B shape).
at::Tensor in_dtype_of(const at::Tensor& y, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// x (M, K) fp32 or bf16, q (N, K) int8, scale (N,) bf16 -> (M, N) in x's dtype:
// x @ (q * scale[:, None]).T
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, std::string isa) {
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  check_inputs(x, q, K, isa);
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kBFloat16 && scale.numel() == N,
              "int8_matmul: q must be int8 (out, in) and scale bfloat16 (out,)");
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / BLOCK}, x.options().dtype(at::kFloat));
  with_float_data(x, [&](const auto* x_data) {
    quantize_activations(x_data, M, K, xq.data_ptr<int8_t>(), d.data_ptr<float>());
  });
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t *w = q.data_ptr<int8_t>(), *xq_data = xq.data_ptr<int8_t>();
  const float* d_data = d.data_ptr<float>();
  const at::BFloat16* scale_data = scale.data_ptr<at::BFloat16>();
  float* y_data = y.data_ptr<float>();
  if (isa == "avx512vnni") {
    // tiles of TILE weight rows, each against every row of x while it is in the L1 cache
    at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
      for (int64_t n = first; n < end; n += TILE) {
        auto tile = end - n >= TILE ? int8_tile_avx512<TILE> : end - n == 3 ? int8_tile_avx512<3>
                  : end - n == 2 ? int8_tile_avx512<2> : int8_tile_avx512<1>;  // the chunk's last rows
        for (int64_t m = 0; m < M; ++m)
          tile(w + n * K, K, scale_data + n, xq_data + m * K, d_data + m * (K / BLOCK), y_data + m * N + n);
      }
    });
    return in_dtype_of(y, x);
  }
  auto row = isa == "avx2" ? int8_row_avx2 : int8_row_portable;
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n)
      for (int64_t m = 0; m < M; ++m)  // the weight row stays in L1 across x's rows
        y_data[m * N + n] = scale_data[n] * row(w + n * K, xq_data + m * K, d_data + m * (K / BLOCK), K);
  });
  return in_dtype_of(y, x);
}

// x (M, K) fp32 or bf16, packed (N, K / 2) uint8 (the block order above), scale and zero
// (N, K / G) bf16 (as torch's kernels take them) -> (M, N) in x's dtype: x @ W.T with
// W[n, k] = (level - 8) * scale[n, g] + zero[n, g].
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& zero, int64_t group_size, std::string isa) {
  const int64_t M = x.size(0), N = packed.size(0), K = packed.size(1) * 2, groups = K / group_size;
  check_inputs(x, packed, K, isa);
  TORCH_CHECK(packed.scalar_type() == at::kByte && group_size >= BLOCK && K % group_size == 0 &&
              (group_size & (group_size - 1)) == 0,
              "int4_matmul: packed must be uint8 (out, in / 2) and the group a power of 2 from ", BLOCK);
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16 &&
              scale.numel() == N * groups && zero.numel() == N * groups && scale.is_contiguous() &&
              zero.is_contiguous(), "int4_matmul: scale and zero must be contiguous bfloat16 (out, groups)");
  const auto fp32 = x.options().dtype(at::kFloat);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / BLOCK}, fp32);
  auto group_sums = at::empty({M, groups}, fp32), rounded_sums = at::empty({M, groups}, fp32);
  with_float_data(x, [&](const auto* x_data) {
    quantize_activations(x_data, M, K, xq.data_ptr<int8_t>(), d.data_ptr<float>());
    sum_groups(x_data, xq.data_ptr<int8_t>(), d.data_ptr<float>(), M * groups, group_size,
               group_sums.data_ptr<float>(), rounded_sums.data_ptr<float>());
  });
  // block b's group is b >> group_shift (a shift, not a division, in the innermost loop)
  const int group_shift = __builtin_ctzll(group_size / BLOCK);
  auto row = isa == "avx2" ? int4_row_avx2 : int4_row_portable;
  auto y = at::empty({M, N}, fp32);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* xq_data = xq.data_ptr<int8_t>();
  const float* d_data = d.data_ptr<float>();
  const at::BFloat16 *s = scale.data_ptr<at::BFloat16>(), *z = zero.data_ptr<at::BFloat16>();
  const float *sums = group_sums.data_ptr<float>(), *rounded = rounded_sums.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  if (isa == "avx512vnni") {
    auto halves = at::empty({M, K}, x.options().dtype(at::kChar));
    auto lanes = at::empty({M, K / CHUNK * 16}, fp32);
    int8_t* halves_data = halves.data_ptr<int8_t>();
    float* lanes_data = lanes.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      int4_x_halves(xq_data + m * K, K, halves_data + m * K);
      int4_x_scale_lanes(d_data + m * (K / BLOCK), K, lanes_data + m * (K / CHUNK * 16));
    }
    const std::array<int32_t, 16> lane_scale = int4_lane_scales(group_shift);
    // tiles of TILE weight rows, each against every row of x while it is in the L1 cache
    at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
      for (int64_t n = first; n < end; n += TILE) {
        auto tile = end - n >= TILE ? int4_tile_avx512<TILE> : end - n == 3 ? int4_tile_avx512<3>
                  : end - n == 2 ? int4_tile_avx512<2> : int4_tile_avx512<1>;  // the chunk's last rows
        for (int64_t m = 0; m < M; ++m)
          tile(w + n * K / 2, K / 2, s + n * groups, z + n * groups, groups, xq_data + m * K,
               halves_data + m * K, d_data + m * (K / BLOCK), lanes_data + m * (K / CHUNK * 16),
               sums + m * groups, rounded + m * groups, K, group_shift, lane_scale.data(), y_data + m * N + n);
      }
    });
    return in_dtype_of(y, x);
  }
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float offsets = 0.f;  // the second and third lines of the formula at the top
        for (int64_t g = 0; g < groups; ++g)
          offsets += z[n * groups + g] * sums[m * groups + g] - 8.f * s[n * groups + g] * rounded[m * groups + g];
        y_data[m * N + n] = offsets + row(w + n * K / 2, s + n * groups, xq_data + m * K,
                                          d_data + m * (K / BLOCK), K, group_shift);
      }
  });
  return in_dtype_of(y, x);
}

// ------------------------------------------------------------------ dequantizing, for a prompt

// A prompt's many rows multiply a dequantized weight through oneDNN's GEMM instead
// (weight_quant.py), a chunk of output rows at a time: the chunk is turned back into floats
// here, in one pass over its codes, where the same in tensor operations took six passes
// with fp32 temporaries (a 1024 x 4096 int4 chunk: 11.6 ms, against 2.2 ms for the bf16
// product of 512 rows by it, on a Xeon). The arithmetic is the reference's in fp32, then
// rounded to the output's dtype: the same numbers but for the last bit of the fp32 value
// (the compiler may fuse a multiply and an add), so at most one bf16 step apart.

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

bool cpu_has_avx512bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// any CPU, fp32 or bf16 out (T's conversion rounds to nearest even, as torch's .to() does)
template <typename T>
void int8_dequantize_portable(const int8_t* q, const at::BFloat16* scale, int64_t N, int64_t K, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n) {
      const float s = scale[n];
      for (int64_t k = 0; k < K; ++k) out[n * K + k] = (T)((float)q[n * K + k] * s);
    }
  });
}

// 16 weights a step (K is a multiple of 32), bf16 out by vcvtneps2bf16
AVX512BF16 void int8_dequantize_avx512bf16(const int8_t* q, const at::BFloat16* scale, int64_t N, int64_t K,
                                           at::BFloat16* out) {
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n) {
      const __m512 s = _mm512_set1_ps(scale[n]);
      for (int64_t k = 0; k < K; k += 16) {
        __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + n * K + k))));
        _mm256_storeu_si256((__m256i*)(out + n * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w, s)));
      }
    }
  });
}

// W[n, k] = (level - 8) * scale[n, g] + zero[n, g], the levels in pack_int4's block order
template <typename T>
void int4_dequantize_portable(const uint8_t* packed, const at::BFloat16* s, const at::BFloat16* z, int64_t N,
                              int64_t K, int64_t group_size, T* out) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n)
      for (int64_t b = 0; b < K / BLOCK; ++b) {
        const uint8_t* wb = packed + n * K / 2 + b * BLOCK / 2;
        const float scale = s[n * groups + b * BLOCK / group_size], zero = z[n * groups + b * BLOCK / group_size];
        T* o = out + n * K + b * BLOCK;
        for (int64_t j = 0; j < BLOCK / 2; ++j) {
          o[j] = (T)((float)((wb[j] & 15) - 8) * scale + zero);
          o[j + BLOCK / 2] = (T)((float)((wb[j] >> 4) - 8) * scale + zero);
        }
      }
  });
}

// a block of 32 a step: 16 bytes, their low halves weights 0-15 and high halves 16-31
AVX512BF16 void int4_dequantize_avx512bf16(const uint8_t* packed, const at::BFloat16* s, const at::BFloat16* z,
                                           int64_t N, int64_t K, int64_t group_size, at::BFloat16* out) {
  const int64_t groups = K / group_size;
  const __m128i low4 = _mm_set1_epi8(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n)
      for (int64_t b = 0; b < K / BLOCK; ++b) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(packed + n * K / 2 + b * BLOCK / 2));
        const int64_t g = n * groups + b * BLOCK / group_size;
        const __m512 scale = _mm512_set1_ps(s[g]), zero = _mm512_set1_ps(z[g]);
        for (int half = 0; half < 2; ++half) {
          const __m128i levels = _mm_and_si128(half ? _mm_srli_epi16(bytes, 4) : bytes, low4);
          const __m512 w = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(levels)), eight);
          const __m512 v = _mm512_add_ps(_mm512_mul_ps(w, scale), zero);
          _mm256_storeu_si256((__m256i*)(out + n * K + b * BLOCK + half * BLOCK / 2),
                              (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
  });
}

void check_dequantize_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize: float32 or bfloat16 out, not ", dtype);
}

// q (N, K) int8, scale (N,) bf16 -> out (N, K) fp32 or bf16: q * scale[:, None]. Into a
// tensor the caller holds: a prompt's pass dequantizes every weight of the model into one
// scratch buffer (weight_quant.py), where a new tensor each time cost more in page faults
// (a fresh 32 MB is 8,192 pages for the kernel to zero) than the dequantizing itself.
void int8_dequantize_into(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& out) {
  const int64_t N = q.size(0), K = q.size(1);
  check_dequantize_dtype(out.scalar_type());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && K % BLOCK == 0 &&
              scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "int8_dequantize: q must be contiguous int8 (out, in), in a multiple of ", BLOCK,
              ", and scale bfloat16 (out,)");
  TORCH_CHECK(out.is_contiguous() && out.numel() == N * K, "int8_dequantize: out must be contiguous, (out, in)");
  const int8_t* q_data = q.data_ptr<int8_t>();
  const at::BFloat16* s = scale.data_ptr<at::BFloat16>();
  if (out.scalar_type() == at::kFloat)
    int8_dequantize_portable(q_data, s, N, K, out.data_ptr<float>());
  else if (cpu_has_avx512bf16())
    int8_dequantize_avx512bf16(q_data, s, N, K, out.data_ptr<at::BFloat16>());
  else
    int8_dequantize_portable(q_data, s, N, K, out.data_ptr<at::BFloat16>());
}

// the same into a new tensor of dtype (what a traced graph calls: its outputs are its own)
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  auto out = at::empty({q.size(0), q.size(1)}, q.options().dtype(dtype));
  int8_dequantize_into(q, scale, out);
  return out;
}

// packed (N, K / 2) uint8, scale and zero (N, K / G) bf16 -> out (N, K) fp32 or bf16
void int4_dequantize_into(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                          int64_t group_size, const at::Tensor& out) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_dequantize_dtype(out.scalar_type());
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              group_size >= BLOCK && group_size % BLOCK == 0 && K % group_size == 0,
              "int4_dequantize: packed must be contiguous uint8 (out, in / 2), the group a multiple of ", BLOCK);
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16 &&
              scale.numel() == N * (K / group_size) && zero.numel() == scale.numel() && scale.is_contiguous() &&
              zero.is_contiguous(), "int4_dequantize: scale and zero must be contiguous bfloat16 (out, groups)");
  TORCH_CHECK(out.is_contiguous() && out.numel() == N * K, "int4_dequantize: out must be contiguous, (out, in)");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::BFloat16 *s = scale.data_ptr<at::BFloat16>(), *z = zero.data_ptr<at::BFloat16>();
  if (out.scalar_type() == at::kFloat)
    int4_dequantize_portable(w, s, z, N, K, group_size, out.data_ptr<float>());
  else if (cpu_has_avx512bf16())
    int4_dequantize_avx512bf16(w, s, z, N, K, group_size, out.data_ptr<at::BFloat16>());
  else
    int4_dequantize_portable(w, s, z, N, K, group_size, out.data_ptr<at::BFloat16>());
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t group_size, at::ScalarType dtype) {
  auto out = at::empty({packed.size(0), packed.size(1) * 2}, packed.options().dtype(dtype));
  int4_dequantize_into(packed, scale, zero, group_size, out);
  return out;
}

// ------------------------------------------------------------------ quantizing, while loading

// What weight_quant.quantize_int8 / quantize_int4 compute, in one pass over each row with no
// temporaries (the Python reference makes five or six fp32 copies of each chunk of rows,
// which cost most of a 1B model's loading time and leave the allocator's heap fragmented).
// The same operations in the same order (a max, a division, a rounding to nearest even),
// so the same codes and scales to the bit: tests check it.
template <typename T>
void int8_quantize_rows(const T* w, int64_t N, int64_t K, int8_t* q, float* scale) {
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n) {
      const T* row = w + n * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs((float)row[k]));
      const float s = std::max(amax / 127.f, MIN_SCALE);
      scale[n] = s;
      for (int64_t k = 0; k < K; ++k)
        q[n * K + k] = (int8_t)std::clamp(std::nearbyint((float)row[k] / s), -127.f, 127.f);
    }
  });
}

// per group of G weights: lo, scale = max((hi - lo) / 15, MIN_SCALE), level = round((w - lo) /
// scale) in [0, 15], packed in pack_int4's order (byte j of a block of 32: weight j low, j + 16 high)
template <typename T>
void int4_quantize_rows(const T* w, int64_t N, int64_t K, int64_t group_size, uint8_t* packed, float* scale,
                        float* lo) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    std::vector<uint8_t> levels(group_size);
    for (int64_t n = first; n < end; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        const T* group = w + n * K + g * group_size;
        float least = (float)group[0], most = least;
        for (int64_t k = 1; k < group_size; ++k) {
          least = std::min(least, (float)group[k]);
          most = std::max(most, (float)group[k]);
        }
        const float s = std::max((most - least) / 15.f, MIN_SCALE);
        scale[n * groups + g] = s, lo[n * groups + g] = least;
        for (int64_t k = 0; k < group_size; ++k)
          levels[k] = (uint8_t)std::clamp(std::nearbyint(((float)group[k] - least) / s), 0.f, 15.f);
        uint8_t* out = packed + n * K / 2 + g * group_size / 2;
        for (int64_t b = 0; b < group_size; b += BLOCK)
          for (int64_t j = 0; j < BLOCK / 2; ++j)
            out[b / 2 + j] = levels[b + j] | (levels[b + j + BLOCK / 2] << 4);
      }
  });
}

// The same in AVX-512, 16 weights a step (exact IEEE division and rounding to nearest even
// as the loops above: the same numbers to the bit), where the CPU has it.
#define AVX512F_BW __attribute__((target("avx512f,avx512bw")))

bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

// 16 weights as fp32, exactly (a bf16's 16 bits are the top half of its fp32)
AVX512F_BW inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512F_BW inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
AVX512F_BW inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

constexpr int ROUND_EVEN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

template <typename T>
AVX512F_BW void int8_quantize_rows_avx512(const T* w, int64_t N, int64_t K, int8_t* q, float* scale) {
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n) {
      const T* row = w + n * K;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + k)));
      const float s = std::max(_mm512_reduce_max_ps(amax) / 127.f, MIN_SCALE);
      scale[n] = s;
      const __m512 sv = _mm512_set1_ps(s), least = _mm512_set1_ps(-127.f), most = _mm512_set1_ps(127.f);
      for (int64_t k = 0; k < K; k += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k), sv), ROUND_EVEN);
        v = _mm512_min_ps(_mm512_max_ps(v, least), most);
        _mm_storeu_si128((__m128i*)(q + n * K + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
      }
    }
  });
}

template <typename T>
AVX512F_BW void int4_quantize_rows_avx512(const T* w, int64_t N, int64_t K, int64_t group_size, uint8_t* packed,
                                          float* scale, float* lo) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t end) {
    const __m512 top = _mm512_set1_ps(15.f), bottom = _mm512_setzero_ps();
    for (int64_t n = first; n < end; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        const T* group = w + n * K + g * group_size;
        __m512 least = load16(group), most = least;
        for (int64_t k = 16; k < group_size; k += 16) {
          const __m512 v = load16(group + k);
          least = _mm512_min_ps(least, v), most = _mm512_max_ps(most, v);
        }
        const float l = _mm512_reduce_min_ps(least);
        const float s = std::max((_mm512_reduce_max_ps(most) - l) / 15.f, MIN_SCALE);
        scale[n * groups + g] = s, lo[n * groups + g] = l;
        const __m512 lv = _mm512_set1_ps(l), sv = _mm512_set1_ps(s);
        uint8_t* out = packed + n * K / 2 + g * group_size / 2;
        for (int64_t b = 0; b < group_size; b += BLOCK) {
          __m128i halves[2];  // the block's levels 0-15 and 16-31, a byte each
          for (int h = 0; h < 2; ++h) {
            __m512 v = _mm512_div_ps(_mm512_sub_ps(load16(group + b + h * BLOCK / 2), lv), sv);
            v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, ROUND_EVEN), bottom), top);
            halves[h] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
          }
          _mm_storeu_si128((__m128i*)(out + b / 2), _mm_or_si128(halves[0], _mm_slli_epi16(halves[1], 4)));
        }
      }
  });
}

void check_quantize_input(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % BLOCK == 0 &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              name, ": the weight must be a contiguous float32, bfloat16 or float16 (out, in), in a multiple of ",
              BLOCK);
}

// w (N, K) -> (q (N, K) int8, scale (N,) fp32): weight_quant.quantize_int8's numbers
std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& w) {
  check_quantize_input(w, "int8_quantize");
  const int64_t N = w.size(0), K = w.size(1);
  auto q = at::empty({N, K}, w.options().dtype(at::kChar));
  auto scale = at::empty({N}, w.options().dtype(at::kFloat));
  with_float_data(w, [&](const auto* data) {
    if (cpu_has_avx512())
      int8_quantize_rows_avx512(data, N, K, q.data_ptr<int8_t>(), scale.data_ptr<float>());
    else
      int8_quantize_rows(data, N, K, q.data_ptr<int8_t>(), scale.data_ptr<float>());
  });
  return {q, scale};
}

// w (N, K) -> (packed (N, K / 2) uint8, scale (N, K / G) fp32, lo (N, K / G) fp32): the levels
// of weight_quant.quantize_int4, packed as pack_int4 packs them; its zero is lo + 8 * scale
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_quantize(const at::Tensor& w, int64_t group_size) {
  check_quantize_input(w, "int4_quantize");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group_size >= BLOCK && group_size % BLOCK == 0 && K % group_size == 0,
              "int4_quantize: the group must be a multiple of ", BLOCK, " that divides the width");
  auto packed = at::empty({N, K / 2}, w.options().dtype(at::kByte));
  auto scale = at::empty({N, K / group_size}, w.options().dtype(at::kFloat));
  auto lo = at::empty_like(scale);
  with_float_data(w, [&](const auto* data) {
    if (cpu_has_avx512())
      int4_quantize_rows_avx512(data, N, K, group_size, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                lo.data_ptr<float>());
    else
      int4_quantize_rows(data, N, K, group_size, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                         lo.data_ptr<float>());
  });
  return {packed, scale, lo};
}

}  // namespace

TORCH_LIBRARY(kvcache_gpt_quant, m) {
  m.def("kernel_isas() -> str[]", kernel_isas);
  m.def("int8_matmul(Tensor x, Tensor q, Tensor scale, str isa) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size, str isa) -> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, Tensor zero, int group_size, ScalarType dtype) -> Tensor");
  m.def("int8_dequantize_into(Tensor q, Tensor scale, Tensor(a!) out) -> ()");
  m.def("int4_dequantize_into(Tensor packed, Tensor scale, Tensor zero, int group_size, Tensor(a!) out) -> ()");
  m.def("int8_quantize(Tensor w) -> (Tensor, Tensor)");
  m.def("int4_quantize(Tensor w, int group_size) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache_gpt_quant, CPU, m) {
  m.impl("int8_matmul", int8_matmul);
  m.impl("int4_matmul", int4_matmul);
  m.impl("int8_dequantize", int8_dequantize);
  m.impl("int4_dequantize", int4_dequantize);
  m.impl("int8_dequantize_into", int8_dequantize_into);
  m.impl("int4_dequantize_into", int4_dequantize_into);
  m.impl("int8_quantize", int8_quantize);
  m.impl("int4_quantize", int4_quantize);
}
