// The matrix product of a decode step over a dense weight, written by hand for the CPU
// (dense_matmul.py says why): y = x @ W.T + bias, W bf16 or fp32 (N, K) as it lies
// (no copy, no repacking), x a few rows of fp32 or bf16, every product and sum in fp32.
//
// A decode step multiplies each weight by one row (or a batch's few), so it reads every
// weight once for one multiply-add per row: its time is the weight's bytes over the
// memory's speed. What the kernel must do is keep the loads streaming and the arithmetic
// out of their way:
//   - TILE (4) weight rows at a time, against X_ROWS (2) rows of x at a time: each weight
//     load serves both rows, and the 8 sums are independent, so the CPU overlaps them
//     instead of waiting for each multiply-add to finish before the next (a dependency
//     chain of one sum would cap the kernel below the memory's speed);
//   - more rows of x take the same tile again, from the L1 cache (4 rows of 2048 bf16
//     weights are 16 KB, fp32 32 KB), so each weight leaves memory once however many rows x has;
//   - output rows are split among torch's threads (at::parallel_for), in tiles.
//
// A bf16 number is the top half of an fp32 one, so it widens exactly by a 16-bit shift; an
// fp32 weight is loaded as it is: the same loop serves both (load8/load16 below). Each
// instruction set takes a step of its own width over K, the last (short) step from a
// zero-padded copy, so K need not be a multiple of anything:
//   "portable"    plain C++, any CPU;
//   "avx2"        AVX2 + FMA: 8 weights (widened) per step, fused multiply-add in fp32;
//   "avx512"      AVX-512F/BW: 16 a step, the same arithmetic;
//   "avx512bf16"  bf16 weights only, AVX-512 BF16's vdpbf16ps: 32 bf16 pairs multiplied and
//                 each two neighbours' products added into one of 16 fp32 sums, in one
//                 instruction, nothing widened by hand; x goes in as bf16 (rounded to it if fp32).
// dense_matmul.py asks dense_kernel_isas() and passes the best for the weight's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int TILE = 4;    // weight rows a tile multiplies at once
constexpr int X_ROWS = 2;  // rows of x a tile multiplies at once

// A tile: x rows x[i * K ..] (i < MR) times weight rows w[r * K ..] (r < R, of type W: bf16
// or float) into out[i * N + r]. Each instruction set has one (R, MR from {1, TILE} x {1, X_ROWS}), made
// of a step over WIDTH columns that every column goes through: the whole widths where they
// lie, the last K % WIDTH columns from a zero-padded copy (PaddedTail; zeros add nothing).
// The sums are an array of plain vector types (floats8, floats16) whose loops the pragmas
// unroll, so that they live in registers: an array of __m256 / __m512 (types that may
// alias any memory), or a masked load (a call that may read any memory), made the compiler
// store all 8 sums back to memory after every step, slower than the loads themselves.
using floats8 = float __attribute__((vector_size(32)));
using floats16 = float __attribute__((vector_size(64)));
#define ALWAYS_INLINE inline __attribute__((always_inline))

// The next tile's rows are fetched ahead of their loads (R rows read side by side are R
// streams, which the CPU's own prefetcher follows less well than one). Into which cache
// depends on the CPU, measured on each (an output layer 128256 x 2048, 2 threads): on a Xeon
// into L1 (_MM_HINT_T0: 24 -> 29 GB/s over no prefetch, bf16), on a Zen 4 EPYC into L2
// (_MM_HINT_T1: int4 19 -> 29 GB/s, int8 18 -> 26, bf16 25 -> 28 against T0: the kernel
// built both ways, in turns in one process, on weights that stream from memory). Every
// instruction set's step prefetches: on the Zen 4, bf16 weights through the avx2 and avx512
// steps, a sweep over the 1B shape's 113 products, 28.1 -> 34.5 and 29.5 -> 33.5 GB/s at one
// row, 18.3 -> 24.6 and 19.9 -> 28.8 at four (the library without and with it, in turns).
// (__builtin_cpu_init first: this runs as the library loads, maybe before libgcc's own
// constructor has read the CPU's identity)
const bool PREFETCH_TO_L2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();

ALWAYS_INLINE void prefetch_ahead(const void* address) {
  if (PREFETCH_TO_L2)
    _mm_prefetch((const char*)address, _MM_HINT_T1);
  else
    _mm_prefetch((const char*)address, _MM_HINT_T0);
}

template <int R, int MR, int WIDTH, typename W, typename X>
struct PaddedTail {
  W w[R][WIDTH] = {};
  X x[MR][WIDTH] = {};
  PaddedTail(const W* w_rows, const X* x_rows, int64_t K, int64_t k) {
    for (int r = 0; r < R; ++r) std::copy(w_rows + r * K + k, w_rows + (r + 1) * K, w[r]);
    for (int i = 0; i < MR; ++i) std::copy(x_rows + i * K + k, x_rows + (i + 1) * K, x[i]);
  }
};

template <int R, int MR, typename W>
void tile_portable(const W* w, int64_t K, const float* x, float* out, int64_t N) {
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += (float)w[r * K + k] * x[i * K + k];
      out[i * N + r] = sum;
    }
}

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 float sum_lanes_avx2(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

// 8 weights as fp32: bf16 ones widened (each zero-extended to 32 bits and shifted into the
// top half), fp32 ones as they are
AVX2 ALWAYS_INLINE __m256 load8(const bf16* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
}
AVX2 ALWAYS_INLINE __m256 load8(const float* w) { return _mm256_loadu_ps(w); }

// 8 columns: 8 weights of each row, times 8 fp32 of each x row
template <int R, int MR, typename W>
AVX2 ALWAYS_INLINE void step_avx2(floats8 (&acc)[MR][R], const W* w, const float* x, int64_t stride) {
  __m256 wv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    prefetch_ahead(w + (r + R) * stride);  // the next tile's row at the same columns
    wv[r] = load8(w + r * stride);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x + i * stride);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
  }
}

template <int R, int MR, typename W>
AVX2 void tile_avx2(const W* w, int64_t K, const float* x, float* out, int64_t N) {
  floats8 acc[MR][R] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) step_avx2<R, MR>(acc, w + k, x + k, K);
  if (k < K) {
    PaddedTail<R, MR, 8, W, float> tail(w, x, K, k);
    step_avx2<R, MR>(acc, &tail.w[0][0], &tail.x[0][0], 8);
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) out[i * N + r] = sum_lanes_avx2(acc[i][r]);
}

#define AVX512 __attribute__((target("avx512f,avx512bw")))

// 16 columns, as step_avx2's 8
AVX512 ALWAYS_INLINE __m512 load16(const bf16* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}
AVX512 ALWAYS_INLINE __m512 load16(const float* w) { return _mm512_loadu_ps(w); }

template <int R, int MR, typename W>
AVX512 ALWAYS_INLINE void step_avx512(floats16 (&acc)[MR][R], const W* w, const float* x, int64_t stride) {
  __m512 wv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    prefetch_ahead(w + (r + R) * stride);
    wv[r] = load16(w + r * stride);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m512 xv = _mm512_loadu_ps(x + i * stride);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
  }
}

template <int R, int MR, typename W>
AVX512 void tile_avx512(const W* w, int64_t K, const float* x, float* out, int64_t N) {
  floats16 acc[MR][R] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step_avx512<R, MR>(acc, w + k, x + k, K);
  if (k < K) {
    PaddedTail<R, MR, 16, W, float> tail(w, x, K, k);
    step_avx512<R, MR>(acc, &tail.w[0][0], &tail.x[0][0], 16);
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) out[i * N + r] = _mm512_reduce_add_ps(acc[i][r]);
}

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// 32 columns: vdpbf16ps multiplies 32 bf16 pairs and adds each two neighbours' products
// into one of the 16 fp32 sums
template <int R, int MR>
AVX512BF16 ALWAYS_INLINE void step_avx512bf16(floats16 (&acc)[MR][R], const bf16* w, const bf16* x,
                                              int64_t stride) {
  __m512i wv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    prefetch_ahead(w + (r + R) * stride);  // the next tile's row at the same columns
    wv[r] = _mm512_loadu_si512(w + r * stride);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * stride);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)wv[r], xv);
  }
}

template <int R, int MR, typename W>  // W: bf16 only (TILES names every tile the same way)
AVX512BF16 void tile_avx512bf16(const W* w, int64_t K, const bf16* x, float* out, int64_t N) {
  static_assert(std::is_same_v<W, bf16>, "vdpbf16ps multiplies bf16 pairs");
  floats16 acc[MR][R] = {};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step_avx512bf16<R, MR>(acc, w + k, x + k, K);
  if (k < K) {
    PaddedTail<R, MR, 32, bf16, bf16> tail(w, x, K, k);
    step_avx512bf16<R, MR>(acc, &tail.w[0][0], &tail.x[0][0], 32);
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) out[i * N + r] = _mm512_reduce_add_ps(acc[i][r]);
}

// ------------------------------------------------------------------ the loop over tiles

template <typename W, typename X>
using Tile = void (*)(const W*, int64_t, const X*, float*, int64_t);

// an instruction set's four tiles: [whole weight tile or one row][X_ROWS rows of x or one]
template <typename W, typename X>
struct Tiles {
  Tile<W, X> of[2][2];
};
#define TILES(tile, W) {{{tile<TILE, X_ROWS, W>, tile<TILE, 1, W>}, {tile<1, X_ROWS, W>, tile<1, 1, W>}}}

// y (M, N) fp32 = x (M, K) @ w.T + bias (nullptr: none), a tile at a time (the last N % TILE
// weight rows and M % X_ROWS rows of x by the smaller tiles)
template <typename W, typename X>
void dense_rows(const W* w, const X* x, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                const Tiles<W, X>& tiles) {
  at::parallel_for(0, (N + TILE - 1) / TILE, 16, [&](int64_t first, int64_t end) {
    for (int64_t n = first * TILE; n < std::min(end * TILE, N); n += TILE) {
      const int64_t rows = std::min<int64_t>(TILE, N - n);
      for (int64_t m = 0; m < M; m += X_ROWS) {  // the tile stays in L1 across x's rows
        const int64_t x_rows = std::min<int64_t>(X_ROWS, M - m);
        const Tile<W, X> tile = tiles.of[rows == TILE ? 0 : 1][x_rows == X_ROWS ? 0 : 1];
        for (int64_t r = 0; r < rows; r += (rows == TILE ? TILE : 1))  // a whole tile, or row by row
          tile(w + (n + r) * K, K, x + m * K, y + m * N + n + r, N);
        if (bias)
          for (int64_t i = 0; i < x_rows; ++i)
            for (int64_t r = 0; r < rows; ++r) y[(m + i) * N + n + r] += bias[n + r];
      }
    }
  });
}

// ------------------------------------------------------------------ picking and checking

bool cpu_has(const std::string& isa) {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == "portable") return true;
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512") return avx512;
  if (isa == "avx512bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
  return false;
}

// The instruction sets this CPU runs, best last.
std::vector<std::string> dense_kernel_isas() {
  std::vector<std::string> isas;
  for (const char* isa : {"portable", "avx2", "avx512", "avx512bf16"})
    if (cpu_has(isa)) isas.push_back(isa);
  return isas;
}

// The rows of x times a weight of type W with a non-bf16 instruction set: x in fp32.
template <typename W>
void widened_rows(const W* w, const at::Tensor& x, const float* b, float* y, int64_t N, int64_t K,
                  const std::string& isa) {
  static const Tiles<W, float> portable = TILES(tile_portable, W), avx2 = TILES(tile_avx2, W),
                               avx512 = TILES(tile_avx512, W);
  auto xf = x.to(at::kFloat).contiguous();
  dense_rows(w, xf.data_ptr<float>(), b, y, x.size(0), N, K, isa == "avx512" ? avx512 : isa == "avx2" ? avx2 : portable);
}

// x (M, K) fp32 or bf16, w (N, K) bf16 or fp32 row-major, bias (N,) or None -> (M, N) in x's dtype.
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        std::string isa) {
  TORCH_CHECK(cpu_has(isa), "dense_matmul: this CPU does not run ", isa);
  const bool bf16_weight = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.dim() == 2 && (bf16_weight || w.scalar_type() == at::kFloat) && w.is_contiguous(),
              "dense_matmul: the weight must be a contiguous (out, in) bfloat16 or float32 tensor");
  TORCH_CHECK(bf16_weight || isa != "avx512bf16", "dense_matmul: avx512bf16 multiplies bfloat16 weights only");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "dense_matmul: x must be (rows, ", K, ") float32 or bfloat16");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "dense_matmul: bias must be (", N, ",)");
  auto bias_fp32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias ? bias_fp32.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* y_data = y.data_ptr<float>();
  if (isa == "avx512bf16") {
    static const Tiles<bf16, bf16> tiles = TILES(tile_avx512bf16, bf16);
    auto xb = x.to(at::kBFloat16).contiguous();
    dense_rows(w.data_ptr<bf16>(), xb.data_ptr<bf16>(), b, y_data, M, N, K, tiles);
  } else if (bf16_weight) {
    widened_rows(w.data_ptr<bf16>(), x, b, y_data, N, K, isa);
  } else {
    widened_rows(w.data_ptr<float>(), x, b, y_data, N, K, isa);
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(kvcache_gpt_dense, m) {
  m.def("dense_kernel_isas() -> str[]", dense_kernel_isas);
  m.def("dense_matmul(Tensor x, Tensor w, Tensor? bias, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache_gpt_dense, CPU, m) {
  m.impl("dense_matmul", dense_matmul);
}
