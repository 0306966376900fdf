#pragma once

// bf16 GEMM for the model's linear layers on AVX512-BF16 CPUs:
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation, one bf16 rounding at the end.
//
// Why not torch's (oneDNN's) matmul: at decode sizes (M = 1..64 rows) it reaches only a third of
// the machine's bf16 peak on these shapes, and the weights, read once per step, are most of a
// small model's step. Here W is packed once at load time into 16-column strips whose k pairs are
// exactly the operand layout of `vdpbf16ps`, and each strip is read once per 16 rows of x while
// up to 16 rows accumulate in registers. Packed layout, [ceil(N/16), K/2, 16, 2]:
//   wp[b][p][j][0..1] = W[16b + j][2p], W[16b + j][2p + 1]   (zero rows pad N to a multiple of 16)

#include "common.h"
#include "gemm_amx.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace radixserve {

inline bool gemm_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kStrip = 16;     // output columns per packed strip (one zmm of float32)
constexpr int64_t kRowTile = 16;   // rows of x accumulated in registers per pass over a strip
constexpr int64_t kRowChunk = 128; // rows per parallel pass (keeps that slice of x cache-resident)
// Software prefetch this many k pairs (64-byte lines) ahead, into L2 (kStreamPrefetch): the strips of
// a chunk lie one after another, so the stream runs on into the next strip. Into L1 (_MM_HINT_T0),
// the lines in flight are bounded by L1's few miss buffers: the default model's decode GEMMs (all
// 30 layers and the LM head at 8 rows, one call each) read their 269 MB at ~22 GB/s that way and at
// ~30 GB/s into L2, 8.7-9.6 ms against 12.0-12.4 in alternating runs (64 pairs ahead into L2: 9.0,
// 192 and 256: 9.0-10.1). Prefill-sized calls read each strip once per 128 rows and do not
// change (M = 528: 360-367 ms against 364-395). Prefetching past the end of the weight is harmless:
// a prefetch never faults.
constexpr int64_t kPrefetchPairs = 128;

// One strip for `MT` rows. Fewer rows leave the FMA pipeline idle on one accumulator's latency,
// so small tiles split K into KC independent chains and add them at the end.
template <int MT, int KC>
inline void strip_tile(const int32_t* xq, const uint16_t* wp, int64_t pairs, const float* bias,
                       uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 acc[MT][KC];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int c = 0; c < KC; ++c) acc[m][c] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + KC <= pairs; p += KC) {
#pragma GCC unroll 8
    for (int c = 0; c < KC; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + c + kPrefetchPairs) * 2 * kStrip), kStreamPrefetch);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(wp + (p + c) * 2 * kStrip);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(xq[(p + c) * kRowTile + m]), w);
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kStrip);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_set1_epi32(xq[p * kRowTile + m]), w);
  }

  const __mmask16 mask = cols >= kStrip ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    __m512 sum = acc[m][0];
#pragma GCC unroll 8
    for (int c = 1; c < KC; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sum, b));
    _mm256_mask_storeu_epi16(y + m * ldy, mask, (__m256i)out);
  }
}

// Two adjacent strips for `MT` <= 8 rows with one chain per (row, strip), so each output element
// sums its K pairs in the same order as strip_tile<MT, 1> (the same bits). Each broadcast of a
// row's k pair feeds two products: 10 loads for 16 products, where the single-strip tile at 16
// rows issues 17.
template <int MT>
inline void strip_pair_tile(const int32_t* xq, const uint16_t* wp0, const uint16_t* wp1, int64_t pairs,
                            const float* bias, uint16_t* y, int64_t ldy, int64_t cols1) {
  __m512 acc0[MT], acc1[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(wp0 + (p + kPrefetchPairs) * 2 * kStrip), kStreamPrefetch);
    _mm_prefetch(reinterpret_cast<const char*>(wp1 + (p + kPrefetchPairs) * 2 * kStrip), kStreamPrefetch);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp0 + p * 2 * kStrip);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp1 + p * 2 * kStrip);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(xq[p * kRowTile + m]);
      acc0[m] = _mm512_dpbf16_ps(acc0[m], x, w0);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], x, w1);
    }
  }
  const __mmask16 mask1 = cols1 >= kStrip ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols1) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(mask1, bias + kStrip) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[m], b0)));
    _mm256_mask_storeu_epi16(y + m * ldy + kStrip, mask1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[m], b1)));
  }
}

template <int MT>
inline void strip_rows(const int32_t* xq, const uint16_t* wp, int64_t pairs, const float* bias,
                       uint16_t* y, int64_t ldy, int64_t cols) {
  constexpr int KC = MT >= 8 ? 1 : MT >= 4 ? 2 : MT >= 2 ? 4 : 8;
  strip_tile<MT, KC>(xq, wp, pairs, bias, y, ldy, cols);
}

// The fixed-order variant: every row sums its K pairs in kFixedChains interleaved chains (pair p
// into chain p % kFixedChains, the tail into chain 0), added in chain order, whatever the row count.
// Tiles of kFixedTile rows keep kFixedTile * kFixedChains = 16 accumulators in registers.
constexpr int kFixedChains = 4;
constexpr int64_t kFixedTile = 16 / kFixedChains;

template <int MT>
inline void strip_rows_fixed(const int32_t* xq, const uint16_t* wp, int64_t pairs, const float* bias,
                             uint16_t* y, int64_t ldy, int64_t cols) {
  strip_tile<MT, kFixedChains>(xq, wp, pairs, bias, y, ldy, cols);
}

using StripFn = void (*)(const int32_t*, const uint16_t*, int64_t, const float*, uint16_t*, int64_t, int64_t);

// Rows [r0, r0 + rows) of x as k pairs interleaved by row, [ceil(rows/16)][K/2][16] int32: the
// broadcasts of one k pair for a row tile then come from one cache line.
inline void interleave_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t pairs, int32_t* out) {
  for (int64_t t = 0; t * kRowTile < rows; ++t) {
    int32_t* o = out + t * pairs * kRowTile;
    const int64_t mt = std::min(kRowTile, rows - t * kRowTile);
    for (int64_t m = 0; m < mt; ++m) {
      const auto* row = reinterpret_cast<const int32_t*>(x + (t * kRowTile + m) * ldx);
      for (int64_t p = 0; p < pairs; ++p) o[p * kRowTile + m] = row[p];
    }
  }
}

template <int... MTs>
constexpr std::array<StripFn, sizeof...(MTs)> strip_table(std::integer_sequence<int, MTs...>) {
  return {&strip_rows<MTs + 1>...};
}

const auto kStripFns = strip_table(std::make_integer_sequence<int, kRowTile>{});

using StripPairFn = void (*)(const int32_t*, const uint16_t*, const uint16_t*, int64_t, const float*, uint16_t*,
                             int64_t, int64_t);

template <int... MTs>
constexpr std::array<StripPairFn, sizeof...(MTs)> strip_pair_table(std::integer_sequence<int, MTs...>) {
  return {&strip_pair_tile<MTs + 1>...};
}

// Rows per strip_pair_tile call; row tiles of fewer than this many rows keep strip_rows (which
// splits K into several chains there).
constexpr int64_t kPairRows = 8;
constexpr int64_t kPairMinRows = 32;
const auto kStripPairFns = strip_pair_table(std::make_integer_sequence<int, kPairRows>{});

template <int... MTs>
constexpr std::array<StripFn, sizeof...(MTs)> fixed_strip_table(std::integer_sequence<int, MTs...>) {
  return {&strip_rows_fixed<MTs + 1>...};
}

const auto kFixedStripFns = fixed_strip_table(std::make_integer_sequence<int, kFixedTile>{});

}  // namespace
#endif

// x [M, K] bf16 (rows contiguous), wp packed as above, n = N, bias [N] float32 or undefined.
// fixed_order: each output element's K reduction is the same for every M, so a row's result does
// not depend on the rows beside it: AMX tiles where the CPU has them (gemm_amx.h), else the
// kFixedChains chains above; one of the two for the whole process. Otherwise the number of chains
// follows the row tile (more chains for fewer rows: faster at decode sizes) and a row's rounding
// depends on M.
// allow_amx false keeps the fixed order on the AVX512-BF16 chains (tests check both variants).
inline torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t n,
                                   const c10::optional<torch::Tensor>& bias, bool fixed_order,
                                   bool allow_amx = true) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16 rows");
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.scalar_type() == at::kBFloat16 && wp.size(2) == kStrip &&
                  wp.size(3) == 2, "wp must be a packed [N/16, K/2, 16, 2] bf16 weight");
  const int64_t m = x.size(0), k = x.size(1), pairs = wp.size(1), strips = wp.size(0);
  TORCH_CHECK(k == 2 * pairs, "x has K = ", k, ", the packed weight ", 2 * pairs);
  TORCH_CHECK(n > (strips - 1) * kStrip && n <= strips * kStrip, "n does not match the packed weight");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n, "bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0);
#if defined(RADIXSERVE_HAVE_AMX)
  if (fixed_order && allow_amx && amx_usable()) {
    packed_linear_amx(xd, ldx, wd, m, k, n, strips, b, yd);
    return y;
  }
#endif
  std::vector<int32_t> xq(static_cast<size_t>((std::min(kRowChunk, m) + kRowTile - 1) / kRowTile * kRowTile * pairs));
  for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, m - m0);
    interleave_rows(xd + m0 * ldx, ldx, rows, pairs, xq.data());
    const auto one_strip = [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t col = s * kStrip, cols = std::min(kStrip, n - col);
        const uint16_t* ws = wd + s * pairs * 2 * kStrip;
        const float* bs = b != nullptr ? b + col : nullptr;
        if (fixed_order) {
          // Sub-tiles of a 16-row interleaved tile: row r's k pair p is at (r / 16) * pairs * 16 +
          // p * 16 + r % 16, so a sub-tile starts r % 16 entries into its tile.
          for (int64_t r = 0; r < rows; r += kFixedTile) {
            const int64_t mt = std::min(kFixedTile, rows - r);
            kFixedStripFns[mt - 1](xq.data() + (r / kRowTile) * pairs * kRowTile + r % kRowTile, ws, pairs, bs,
                                   yd + (m0 + r) * n + col, n, cols);
          }
        } else {
          for (int64_t r = 0; r < rows; r += kRowTile) {
            const int64_t mt = std::min(kRowTile, rows - r);
            kStripFns[mt - 1](xq.data() + r * pairs, ws, pairs, bs, yd + (m0 + r) * n + col, n, cols);
          }
        }
      }
    };
    // Prefill-sized chunks take two strips at a time in tiles of kPairRows rows (where the row tile
    // sums K in one chain per row), decode-sized ones one strip. The default model's GEMMs, 3 runs
    // each: M = 2048 took 566 ms paired against 615 one strip at a time; M = 8 took 7.1 ms paired
    // against 6.2 (there the weights stream from memory, and halving the parallel chunks costs).
    const bool paired = !fixed_order && rows >= kPairMinRows && strips >= 2;
    if (!paired) {
      parallel_for(0, strips, 1, one_strip);
      continue;
    }
    const int64_t full = rows / kRowTile * kRowTile;  // rows in whole 16-row tiles
    const int64_t tail = rows - full;                 // a last, shorter tile
    parallel_for(0, (strips + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t s = 2 * q;
        if (s + 1 >= strips) {
          one_strip(s, s + 1);
          continue;
        }
        const int64_t col = s * kStrip, cols1 = std::min(kStrip, n - col - kStrip);
        const uint16_t* ws = wd + s * pairs * 2 * kStrip;
        const float* bs = b != nullptr ? b + col : nullptr;
        for (int64_t r = 0; r < full + (tail >= kPairRows ? tail : 0); r += kPairRows) {
          const int64_t mt = std::min(kPairRows, rows - r);
          // Row r's k pairs start r % 16 entries into its 16-row interleaved tile.
          kStripPairFns[mt - 1](xq.data() + (r / kRowTile) * pairs * kRowTile + r % kRowTile, ws,
                                ws + pairs * 2 * kStrip, pairs, bs, yd + (m0 + r) * n + col, n, cols1);
        }
        if (tail > 0 && tail < kPairRows) {
          for (int64_t t = s; t < s + 2; ++t) {
            const int64_t c0 = t * kStrip;
            kStripFns[tail - 1](xq.data() + full * pairs, wd + t * pairs * 2 * kStrip, pairs,
                                b != nullptr ? b + c0 : nullptr, yd + (m0 + full) * n + c0, n,
                                std::min(kStrip, n - c0));
          }
        }
      }
    });
  }
  return y;
#else
  TORCH_CHECK(false, "packed_linear needs a CPU with AVX512-BF16 (and a build with -march for it)");
#endif
}

}  // namespace radixserve
