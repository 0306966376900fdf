#pragma once

// Group-quantized weights (quant_gemm.h's W = scale * q + offset, 4 or 8 bits) in strips of 16
// output rows, computed against bf16 rows of x like the packed bf16 GEMM (gemm.h): each row of x
// broadcasts one k pair at a time against a vector of the strip's 16 rows, so up to kStripRows
// rows of x accumulate in registers while the strip is read once.
//
// The row layout of quant_gemm.h (a weight row's blocks after one another) suits one row of x; with
// more, each of its dot products per (row of x, weight row) ends in a sum across lanes and loads a
// whole vector of x per product, and it ran at under half the packed GEMM's rate per product. Here
// (default model's 4-bit projections, 2 cores): 1 row of x 2.6 ms against the row layout's 3.9,
// 16 rows 5.8 against 13.0 (and the packed bf16 GEMM's 6.2). Strips are packed once at load
// (`quant_strip_pack`):
//
//   4 bits: data uint8 [S = ceil(N / 16), K / 8, 64], per strip and run of 4 k pairs (columns
//     k0 = 8u .. 8u + 7 of W) 64 bytes as four 16-byte lanes. Lane l byte t holds, for the strip's
//     row 4l + (t % 8) / 2 and pair q (t < 8: q = 0 in the low nibble, q = 2 in the high one;
//     t >= 8: q = 1 and q = 3), the integer at column k0 + 2q + t % 2. One 64-byte load then gives
//     the run's four pairs as vectors of the 16 rows' bf16 pairs with four byte unpacks: a byte pair
//     (q, 0x43) is the bf16 number 128 + q, exactly (as in quant_gemm.h's bf16 path), the
//     128 * sum(x) it adds taken off with the offsets' term.
//   8 bits: data int8 [S, K / 2, 16, 2], the packed bf16 GEMM's layout in int8 (groups of a multiple
//     of 16); a pair of 16 rows is widened to float32 and rounded to bf16 (exact: every int8 is a
//     bf16 number).
//   scale, offset [S, K / group, 16]: the strip's rows side by side per group (zero rows pad N).
//
// y[m, j] = sum_g scale[j, g] * (x_g . q_jg) + offset'[j, g] * sum(x_g), offset' = offset (8 bits)
// or offset - 128 * scale (4 bits, where q_jg is 128 + q). Every product is exact in float32; the
// sums differ from dequantize-then-matmul in float32 rounding only. With int8 activations
// (strip_kernel_i8, AVX-512 VNNI) the same strips are multiplied as integers.

#include "common.h"
#include "gemm.h"
#include "quant_gemm.h"

namespace radixserve {

constexpr int64_t kStripCols = 16;  // weight rows per strip (one float32 vector)

namespace strip_detail {

// Where W's integer (j, c) lies in a strip layout of K columns: its byte, and for 4 bits whether
// it is that byte's high nibble.
inline int64_t locate(int64_t j, int64_t c, int64_t k, int64_t bits, bool* high) {
  const int64_t s = j / kStripCols, col = j % kStripCols;
  if (bits == 8) return ((s * (k / 2) + c / 2) * kStripCols + col) * 2 + c % 2;
  const int64_t u = c / 8, r = c % 8, q = r / 2;  // run, pair in the run
  *high = q >= 2;
  const int64_t t = (q % 2 ? 8 : 0) + 2 * (col % 4) + r % 2;
  return (s * (k / 8) + u) * 64 + (col / 4) * 16 + t;
}

inline void check_data(const torch::Tensor& data, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  if (bits == 4) {
    TORCH_CHECK(data.dim() == 3 && data.size(2) == 64 && data.scalar_type() == at::kByte && data.is_contiguous(),
                "4-bit strips must be uint8 [S, K / 8, 64]");
  } else {
    TORCH_CHECK(data.dim() == 4 && data.size(2) == kStripCols && data.size(3) == 2 &&
                    data.scalar_type() == at::kChar && data.is_contiguous(),
                "8-bit strips must be int8 [S, K / 2, 16, 2]");
  }
}

inline int64_t strips_k(const torch::Tensor& data, int64_t bits) { return data.size(1) * (bits == 4 ? 8 : 2); }

}  // namespace strip_detail

// A row-layout weight (quant_gemm.h) -> [data, scale, (offset)] in strips. Load-time work, plain
// loops over the rows in parallel. 4 bits: any (groups are multiples of 32); 8 bits: groups of a multiple of 16.
inline std::vector<torch::Tensor> quant_strip_pack(const torch::Tensor& q, const torch::Tensor& scale,
                                                   const c10::optional<torch::Tensor>& offset, int64_t group,
                                                   int64_t bits) {
  const quant_detail::QuantView w = quant_detail::view_of(q, scale, offset, group, bits);
  TORCH_CHECK(bits == 4 || group % 16 == 0, "8-bit strips take groups of a multiple of 16");
  const int64_t strips = (w.n + kStripCols - 1) / kStripCols, k = w.k;
  torch::Tensor data = bits == 4 ? torch::zeros({strips, k / 8, 64}, q.options())
                                 : torch::zeros({strips, k / 2, kStripCols, 2}, q.options());
  auto* dp = static_cast<uint8_t*>(data.data_ptr());
  // Rows in parallel: a byte of the strips holds integers of one row only.
  parallel_for(0, w.n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const uint8_t* row = w.row(j);
      for (int64_t c = 0; c < k; ++c) {
        bool high = false;
        const int64_t at = strip_detail::locate(j, c, k, bits, &high);
        if (bits == 8) {
          dp[at] = row[c];
        } else {
          const uint8_t byte = row[(c / 32) * 16 + c % 16];
          const uint8_t v = (c % 32) < 16 ? byte & 15 : byte >> 4;
          dp[at] = static_cast<uint8_t>(high ? (dp[at] & 0x0F) | (v << 4) : (dp[at] & 0xF0) | v);
        }
      }
    }
  });
  const auto spread = [&](const torch::Tensor& t) {  // [N, groups] -> [S, groups, 16], zero rows past N
    torch::Tensor padded = torch::zeros({strips * kStripCols, w.groups}, t.options());
    padded.narrow(0, 0, w.n).copy_(t);
    return padded.view({strips, kStripCols, w.groups}).transpose(1, 2).contiguous();
  };
  std::vector<torch::Tensor> out{data, spread(scale)};
  if (offset.has_value()) out.push_back(spread(*offset));
  return out;
}

// The integers of strips (or of their rows `rows`, an int64 index) in the row layout: uint8
// [R, K / 2] (4 bits) or int8 [R, K] (8 bits).
inline torch::Tensor quant_strip_unpack(const torch::Tensor& data, int64_t n, int64_t bits,
                                        const c10::optional<torch::Tensor>& rows) {
  strip_detail::check_data(data, bits);
  const int64_t strips = data.size(0), k = strip_detail::strips_k(data, bits);
  TORCH_CHECK(n > (strips - 1) * kStripCols && n <= strips * kStripCols, "n does not match the strips");
  torch::Tensor idx = rows.has_value() ? rows->contiguous() : torch::arange(n, data.options().dtype(at::kLong));
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1, "rows must be int64 [R]");
  const int64_t count = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "row index out of range");
  torch::Tensor q = torch::zeros({count, bits == 4 ? k / 2 : k}, data.options());
  auto* qp = static_cast<uint8_t*>(q.data_ptr());
  const auto* dp = static_cast<const uint8_t*>(data.data_ptr());
  parallel_for(0, count, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t c = 0; c < k; ++c) {
        bool high = false;
        const uint8_t byte = dp[strip_detail::locate(ip[i], c, k, bits, &high)];
        if (bits == 8) {
          qp[i * k + c] = byte;
        } else {
          const uint8_t v = high ? byte >> 4 : byte & 15;
          uint8_t& dst = qp[i * (k / 2) + (c / 32) * 16 + c % 16];
          dst = static_cast<uint8_t>((c % 32) < 16 ? (dst & 0xF0) | v : (dst & 0x0F) | (v << 4));
        }
      }
  });
  return q;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_QUANT_STRIPS 1

// Rows of x accumulated in registers per pass over a strip (a divisor of 16: a tile of x is 16
// rows). 16 rows keep 32 vectors live and spill a few; measured on the default model's 4-bit
// projections at 16 rows of x, 5.8 ms against 6.8 for two passes of 8.
constexpr int64_t kStripRows = 16;
// Bytes of the strip read ahead by software prefetch, into L2 (as gemm.h's, for the same reason).
// Batch-1 decode of the default model: int8 171-174 tok/s and gguf 198-209 against 148-150 and
// 176-185 with 2 KB ahead into L1, alternating runs; batch 16 (bound by its arithmetic) unchanged.
constexpr int64_t kStripPrefetch = 8192;

// A group's 16 scales (or offsets) of a strip as float32, stored as float16 (HALF) or float32.
template <bool HALF>
inline __m512 load_group16(const void* base, int64_t g) {
  if constexpr (HALF)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + g * 16)));
  else
    return _mm512_loadu_ps(static_cast<const float*>(base) + g * 16);
}

// MT rows of a strip's 16 outputs (+ bias) rounded to bf16; the first `cols` of each stored.
template <int MT>
inline void store_strip_rows(const __m512* acc, const float* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  const __mmask16 keep = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
    _mm256_mask_storeu_epi16(y + m * ldy, keep, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m], bv)));
}

namespace strip_detail {

// f(the strip's data, its scales, its offsets or nullptr, its first output column, its columns)
// for every strip of a weight, the strips in parallel.
template <typename F>
inline void for_each_strip(const torch::Tensor& data, const torch::Tensor& scale, const void* offset, int64_t n,
                           int64_t groups, bool half, const F& f) {
  const auto* dp = static_cast<const uint8_t*>(data.data_ptr());
  const int64_t strips = data.size(0), strip_bytes = data.numel() / strips;
  const int64_t stride = groups * kStripCols * (half ? 2 : 4);  // bytes of a strip's scales
  const auto* sp = static_cast<const char*>(scale.data_ptr());
  const auto* op = static_cast<const char*>(offset);
  parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t col = s * kStripCols;
      f(dp + s * strip_bytes, static_cast<const void*>(sp + s * stride),
        op ? static_cast<const void*>(op + s * stride) : nullptr, col, std::min(kStripCols, n - col));
    }
  });
}

}  // namespace strip_detail

// One strip for MT rows of x. xq: the rows' k pairs interleaved by row (gemm.h's interleave_rows,
// 16 entries a pair, the first of these rows at xq[0]); xsg: per group, the rows' sums of x over
// it, 16 entries a group likewise. Each row sums a group's pairs in a chain of its own, scaled
// once per group, then the offsets' term (4 bits: offset - 128 * scale) times the group's sum.
template <int MT, int BITS, bool HALF>
inline void strip_kernel(const uint8_t* data, int64_t groups, int64_t group, const void* scale, const void* offset,
                         const int32_t* xq, const float* xsg, const float* bias, uint16_t* y, int64_t ldy,
                         int64_t cols) {
  const __m512i mask = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t pairs = group / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 t[MT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_ps();
    const int32_t* xg = xq + g * pairs * 16;
    if constexpr (BITS == 4) {
      const uint8_t* run = data + g * (group / 8) * 64;
      for (int64_t u = 0; u < group / 8; ++u, run += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(run + kStripPrefetch), kStreamPrefetch);
        const __m512i v = _mm512_loadu_si512(run);
        const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        const __m512bh z[4] = {(__m512bh)_mm512_unpacklo_epi8(lo, c43), (__m512bh)_mm512_unpackhi_epi8(lo, c43),
                               (__m512bh)_mm512_unpacklo_epi8(hi, c43), (__m512bh)_mm512_unpackhi_epi8(hi, c43)};
        const int32_t* xp = xg + u * 4 * 16;
#pragma GCC unroll 4
        for (int qd = 0; qd < 4; ++qd)
#pragma GCC unroll 16
          for (int m = 0; m < MT; ++m)
            t[m] = _mm512_dpbf16_ps(t[m], z[qd], (__m512bh)_mm512_set1_epi32(xp[qd * 16 + m]));
      }
    } else {
      const auto* w = reinterpret_cast<const int8_t*>(data) + g * pairs * 32;
      for (int64_t p = 0; p < pairs; ++p, w += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kStripPrefetch), kStreamPrefetch);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
        const __m512bh z = _mm512_cvtne2ps_pbh(hi, lo);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) t[m] = _mm512_dpbf16_ps(t[m], z, (__m512bh)_mm512_set1_epi32(xg[p * 16 + m]));
      }
    }
    const __m512 s = load_group16<HALF>(scale, g);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(t[m], s, acc[m]);
    if (BITS == 4 || offset) {
      const __m512 o = offset ? load_group16<HALF>(offset, g) : _mm512_setzero_ps();
      const __m512 c = BITS == 4 ? _mm512_fmadd_ps(_mm512_set1_ps(-128.0f), s, o) : o;
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(xsg[g * 16 + m]), acc[m]);
    }
  }
  store_strip_rows<MT>(acc, bias, y, ldy, cols);
}

using QuantStripFn = void (*)(const uint8_t*, int64_t, int64_t, const void*, const void*, const int32_t*, const float*,
                         const float*, uint16_t*, int64_t, int64_t);

template <int BITS, bool HALF, int... MTs>
constexpr std::array<QuantStripFn, sizeof...(MTs)> strip_kernel_table(std::integer_sequence<int, MTs...>) {
  return {&strip_kernel<MTs + 1, BITS, HALF>...};
}

// 16 vectors as the rows of a 16 x 16 float matrix, transposed in place.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      r[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
      r[i + 2 * h + 1] =
          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
    }
  // r[4a + b] now holds, per 128-bit lane c, rows 4a .. 4a + 3 of column 4c + b; the two rounds of
  // lane shuffles gather each column's four lanes.
  for (int i = 0; i < 16; i += 8)
    for (int h = 0; h < 4; ++h) {
      t[i + h] = _mm512_shuffle_f32x4(r[i + h], r[i + 4 + h], 0x88);
      t[i + 4 + h] = _mm512_shuffle_f32x4(r[i + h], r[i + 4 + h], 0xDD);
    }
  for (int h = 0; h < 8; ++h) {
    r[h] = _mm512_shuffle_f32x4(t[h], t[h + 8], 0x88);
    r[h + 8] = _mm512_shuffle_f32x4(t[h], t[h + 8], 0xDD);
  }
}

#endif

#if defined(RADIXSERVE_QUANT_STRIPS) && defined(__AVX512VNNI__)
#define RADIXSERVE_QUANT_STRIPS_I8 1

// The integer path over strips (int8 activations, llama.cpp's arithmetic as quant_gemm.h's
// scaled_dot_i8, in the strip layout): each row of x rounded to int8 per block of 32 (x ~ xq *
// xs[b]), the weights multiplied with it as integers by vpdpbusd, four products a 32-bit lane, one
// lane a row of the strip, against four k columns of x broadcast as one int32. Twice bf16's
// products per instruction; a block's sum is scaled once per row, xs[b] * scale_g.
//   4 bits: a run's 64 bytes (8 k columns) give, after the nibble masks, one in-lane byte shuffle
//     each into the strip's 16 rows of columns k0 .. k0 + 3 and k0 + 4 .. k0 + 7 (unsigned 0..15,
//     the instruction's unsigned operand; the offsets' term uses the exact sum of x as above).
//   8 bits: two pairs' 64 bytes, their words interleaved by row (vpermw) into 16 rows of four
//     columns, made unsigned by + 128 (xor 0x80); each row's sum starts at -128 * sum(xq_b),
//     which that adds.
// Rows of x a pass at most: a block's int32 sums and the float accumulators, two registers a row,
// stay in the 32 vector registers up to 12 rows (16 spilled ~50 vectors a block); a tile of 16 rows
// of x with more than that goes in passes of equal size (16: two of 8).
constexpr int64_t kStripRowsI8 = 12;

// One strip for MT rows of x. xq4: the rows' int8 columns four at a time (an int32), interleaved
// by row in tiles of 16 (16 entries a quad); xs: per block of 32, the rows' scales (16 entries a
// block); xc (8 bits): per block, 128 * sum(xq) of each row as int32, likewise; xsg: per group, the
// rows' exact sums of x (the offsets' term), likewise.
template <int MT, int BITS, bool HALF>
inline void strip_kernel_i8(const uint8_t* data, int64_t groups, int64_t group, const void* scale, const void* offset,
                            const int32_t* xq4, const float* xs, const int32_t* xc, const float* xsg,
                            const float* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  const __m512i mask = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // 4 bits: output byte 4r + c of a lane (row r of the lane's four, column c) from lane byte
  // (c >= 2 ? 8 : 0) + 2r + c % 2 (the strip layout's order, top of this file).
  const __m512i nibbles = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  // 8 bits: output word 2j from word j (pair p, row j), 2j + 1 from word 16 + j (pair p + 1).
  const __m512i words = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                          0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = group / 32;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = load_group16<HALF>(scale, g);
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      __m512i t[MT];
      const int32_t* xb = xq4 + b * 8 * 16;  // the block's 8 quads
      if constexpr (BITS == 4) {
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
        const uint8_t* run = data + b * 4 * 64;
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u, run += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(run + kStripPrefetch), kStreamPrefetch);
          const __m512i v = _mm512_loadu_si512(run);
          const __m512i lo = _mm512_shuffle_epi8(_mm512_and_si512(v, mask), nibbles);
          const __m512i hi = _mm512_shuffle_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), nibbles);
#pragma GCC unroll 16
          for (int m = 0; m < MT; ++m) {
            t[m] = _mm512_dpbusd_epi32(t[m], lo, _mm512_set1_epi32(xb[(2 * u) * 16 + m]));
            t[m] = _mm512_dpbusd_epi32(t[m], hi, _mm512_set1_epi32(xb[(2 * u + 1) * 16 + m]));
          }
        }
      } else {
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) t[m] = _mm512_set1_epi32(-xc[b * 16 + m]);
        const uint8_t* w = data + b * 32 * 16;  // 16 pairs of 32 bytes
#pragma GCC unroll 8
        for (int qd = 0; qd < 8; ++qd, w += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(w + kStripPrefetch), kStreamPrefetch);
          const __m512i v = _mm512_xor_si512(_mm512_permutexvar_epi16(words, _mm512_loadu_si512(w)), flip);
#pragma GCC unroll 16
          for (int m = 0; m < MT; ++m) t[m] = _mm512_dpbusd_epi32(t[m], v, _mm512_set1_epi32(xb[qd * 16 + m]));
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_mul_ps(s, _mm512_set1_ps(xs[b * 16 + m])), acc[m]);
    }
    if (offset) {
      const __m512 o = load_group16<HALF>(offset, g);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsg[g * 16 + m]), acc[m]);
    }
  }
  store_strip_rows<MT>(acc, bias, y, ldy, cols);
}

using QuantStripI8Fn = void (*)(const uint8_t*, int64_t, int64_t, const void*, const void*, const int32_t*,
                                const float*, const int32_t*, const float*, const float*, uint16_t*, int64_t, int64_t);

template <int BITS, bool HALF, int... MTs>
constexpr std::array<QuantStripI8Fn, sizeof...(MTs)> strip_kernel_i8_table(std::integer_sequence<int, MTs...>) {
  return {&strip_kernel_i8<MTs + 1, BITS, HALF>...};
}

// [bits == 8][half][MT - 1]
const std::array<std::array<std::array<QuantStripI8Fn, kStripRowsI8>, 2>, 2> kQuantStripI8Fns = {{
    {strip_kernel_i8_table<4, false>(std::make_integer_sequence<int, kStripRowsI8>{}),
     strip_kernel_i8_table<4, true>(std::make_integer_sequence<int, kStripRowsI8>{})},
    {strip_kernel_i8_table<8, false>(std::make_integer_sequence<int, kStripRowsI8>{}),
     strip_kernel_i8_table<8, true>(std::make_integer_sequence<int, kStripRowsI8>{})},
}};

namespace strip_detail {

// A row of x (bf16; k a multiple of 32) rounded as quant_detail::quantize_row_i8 rounds it (d =
// max|x_b| / 127, q = nearest of x * (1 / d), halves to even), 32 values a block in two vectors; per
// block also 128 * sum(q) and the exact float32 sum of x.
inline void quantize_bf16_row_i8(const uint16_t* x, int64_t k, int8_t* q, float* d, int32_t* qsum128,
                                 float* xsum) {
  const auto widen = [](const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 lo = widen(x + b * 32), hi = widen(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // MXCSR: to nearest even
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qh));
    d[b] = scale;
    qsum128[b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    xsum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// quant_strip_linear's integer path (arguments checked there): x's rows rounded to int8 per block
// of 32 and laid out for strip_kernel_i8 in tiles of 16 rows.
inline torch::Tensor linear_i8(const uint16_t* xb, int64_t m, int64_t k, const torch::Tensor& data,
                               const torch::Tensor& scale, const void* off, int64_t n, int64_t group, int64_t bits,
                               bool half, const float* bp) {
  const int64_t tiles = (m + 15) / 16, quads = k / 4, blocks = k / 32, groups = k / group, per_group = group / 32;
  std::vector<int32_t> xq4(static_cast<size_t>(tiles * quads * 16), 0), xc(static_cast<size_t>(tiles * blocks * 16), 0);
  std::vector<float> xs(static_cast<size_t>(tiles * blocks * 16), 0.0f), xsg(static_cast<size_t>(tiles * groups * 16), 0.0f);
  parallel_for(0, m, 8, [&](int64_t lo, int64_t hi) {
    std::vector<int8_t> q(static_cast<size_t>(k));
    std::vector<float> qs(static_cast<size_t>(blocks)), sums(static_cast<size_t>(blocks));
    std::vector<int32_t> qsum(static_cast<size_t>(blocks));
    for (int64_t i = lo; i < hi; ++i) {
      quantize_bf16_row_i8(xb + i * k, k, q.data(), qs.data(), qsum.data(), sums.data());
      const int64_t t = i / 16, r = i % 16;
      for (int64_t e = 0; e < quads; ++e) std::memcpy(&xq4[(t * quads + e) * 16 + r], &q[e * 4], 4);
      for (int64_t b = 0; b < blocks; ++b) {
        xc[(t * blocks + b) * 16 + r] = qsum[b];
        xs[(t * blocks + b) * 16 + r] = qs[b];
      }
      if (off)
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.0f;
          for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) sum += sums[b];
          xsg[(t * groups + g) * 16 + r] = sum;
        }
    }
  });
  torch::Tensor y = torch::empty({m, n}, data.options().dtype(at::kBFloat16));
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const auto& fns = kQuantStripI8Fns[bits == 8][half];
  for_each_strip(data, scale, off, n, groups, half,
                 [&](const uint8_t* strip, const void* ss, const void* os, int64_t col, int64_t cols) {
                   for (int64_t t = 0; t < tiles; ++t) {
                     const int64_t tile_rows = std::min<int64_t>(16, m - t * 16);
                     const int64_t passes = (tile_rows + kStripRowsI8 - 1) / kStripRowsI8;
                     const int64_t pass = (tile_rows + passes - 1) / passes;
                     for (int64_t at = 0; at < tile_rows; at += pass) {
                       const int64_t rows = std::min(pass, tile_rows - at), r = t * 16 + at;
                       fns[rows - 1](strip, groups, group, ss, os, xq4.data() + t * quads * 16 + at,
                                     xs.data() + t * blocks * 16 + at, xc.data() + t * blocks * 16 + at,
                                     xsg.data() + t * groups * 16 + at, bp ? bp + col : nullptr, yp + r * n + col,
                                     n, cols);
                     }
                   }
                 });
  return y;
}

}  // namespace strip_detail
#endif

// W from strips as a dense [N, K] tensor of `dtype` (float32 or bfloat16): the operand of torch's
// GEMM for prefill-sized inputs (StripTensor.linear). Per strip and 16 columns: the 16 columns as
// vectors over the strip's rows (the kernel's unpacking), scaled, then transposed into rows.
inline torch::Tensor quant_strip_dequantize(const torch::Tensor& data, const torch::Tensor& scale,
                                            const c10::optional<torch::Tensor>& offset, int64_t n, int64_t group,
                                            int64_t bits, at::ScalarType dtype) {
#if defined(RADIXSERVE_QUANT_STRIPS)
  strip_detail::check_data(data, bits);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const int64_t strips = data.size(0), k = strip_detail::strips_k(data, bits), groups = k / group;
  TORCH_CHECK(n > (strips - 1) * kStripCols && n <= strips * kStripCols, "n does not match the strips");
  TORCH_CHECK(k % 16 == 0 && group % 16 == 0, "K and the group must be multiples of 16");
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({strips, groups, kStripCols}), "scale must be [S, K / group, 16]");
  const torch::Tensor sc = scale.to(at::kFloat).contiguous();
  const torch::Tensor of = offset.has_value() ? offset->to(at::kFloat).contiguous() : torch::Tensor();
  torch::Tensor out = torch::empty({n, k}, data.options().dtype(dtype));
  const auto* dp = static_cast<const uint8_t*>(data.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const float* op = of.defined() ? of.data_ptr<float>() : nullptr;
  const int64_t strip_bytes = data.numel() / strips;
  const bool bf16 = dtype == at::kBFloat16;
  auto* yp = static_cast<char*>(out.data_ptr());
  const __m512i mask = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
  const __m512i high_words = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  parallel_for(0, strips, 4, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* d = dp + s * strip_bytes;
      const int64_t rows = std::min(kStripCols, n - s * kStripCols);
      for (int64_t c0 = 0; c0 < k; c0 += 16) {
        const int64_t g = c0 / group;
        const __m512 sv = _mm512_loadu_ps(sp + (s * groups + g) * kStripCols);
        const __m512 ov = op ? _mm512_loadu_ps(op + (s * groups + g) * kStripCols) : _mm512_setzero_ps();
        __m512 v[16];  // v[2p + e]: column c0 + 2p + e over the strip's rows
        if (bits == 4) {
          // Values 128 + q: y = scale * (v - 128) + offset, rounded as quant_gemm.h's dequant_row.
          const __m512 c128 = _mm512_set1_ps(128.0f);
          const auto dq = [&](__m512 x) { return _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(x, c128), sv), ov); };
          for (int64_t run = 0; run < 2; ++run) {
            const __m512i w = _mm512_loadu_si512(d + (c0 / 8 + run) * 64);
            const __m512i lo = _mm512_and_si512(w, mask), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
            const __m512i z[4] = {_mm512_unpacklo_epi8(lo, c43), _mm512_unpackhi_epi8(lo, c43),
                                  _mm512_unpacklo_epi8(hi, c43), _mm512_unpackhi_epi8(hi, c43)};
            for (int q = 0; q < 4; ++q) {
              const int p = static_cast<int>(run) * 4 + q;
              v[2 * p] = dq(_mm512_castsi512_ps(_mm512_slli_epi32(z[q], 16)));
              v[2 * p + 1] = dq(_mm512_castsi512_ps(_mm512_and_si512(z[q], high_words)));
            }
          }
        } else {
          for (int p = 0; p < 8; ++p) {
            const auto* w = reinterpret_cast<const int8_t*>(d) + (c0 / 2 + p) * 32;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
            const __m512 hi =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
            v[2 * p] = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, even, hi), sv, ov);
            v[2 * p + 1] = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, odd, hi), sv, ov);
          }
        }
        transpose16(v);
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t at = (s * kStripCols + j) * k + c0;
          if (bf16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + at * 2), (__m256i)_mm512_cvtneps_pbh(v[j]));
          else
            _mm512_storeu_ps(reinterpret_cast<float*>(yp) + at, v[j]);
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "quant_strip_dequantize needs a CPU with AVX512-BF16 (and a build with -march for it)");
#endif
}

#if defined(RADIXSERVE_QUANT_STRIPS)
// [bits == 8][half][MT - 1]
const std::array<std::array<std::array<QuantStripFn, kStripRows>, 2>, 2> kQuantStripFns = {{
    {strip_kernel_table<4, false>(std::make_integer_sequence<int, kStripRows>{}),
     strip_kernel_table<4, true>(std::make_integer_sequence<int, kStripRows>{})},
    {strip_kernel_table<8, false>(std::make_integer_sequence<int, kStripRows>{}),
     strip_kernel_table<8, true>(std::make_integer_sequence<int, kStripRows>{})},
}};
#endif

inline bool quant_strips_available() {
#if defined(RADIXSERVE_QUANT_STRIPS)
  return true;
#else
  return false;
#endif
}

inline bool quant_strips_i8_available() {
#if defined(RADIXSERVE_QUANT_STRIPS_I8)
  return true;
#else
  return false;
#endif
}

// y [M, N] bf16 = x [M, K] bf16 @ W^T (+ bias float32 [N]), W in strips (quant_strip_pack).
// int8_x: x rounded to int8 per block of 32 and multiplied as integers (strip_kernel_i8) where
// this CPU has AVX-512 VNNI and the group is a multiple of 32; in bf16 otherwise.
inline torch::Tensor quant_strip_linear(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& scale,
                                        const c10::optional<torch::Tensor>& offset, int64_t n, int64_t group,
                                        int64_t bits, const c10::optional<torch::Tensor>& bias, bool int8_x = false) {
#if defined(RADIXSERVE_QUANT_STRIPS)
  strip_detail::check_data(data, bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16");
  const int64_t strips = data.size(0), k = strip_detail::strips_k(data, bits), m = x.size(0);
  TORCH_CHECK(x.size(1) == k, "x has K = ", x.size(1), ", the weight ", k);
  TORCH_CHECK(group > 0 && k % group == 0 && group % (bits == 4 ? 32 : 16) == 0,
              "the group must divide K and be a multiple of ", bits == 4 ? 32 : 16);
  TORCH_CHECK(n > (strips - 1) * kStripCols && n <= strips * kStripCols, "n does not match the strips");
  const int64_t groups = k / group, pairs = k / 2;
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && scale.is_contiguous() &&
                  scale.sizes() == at::IntArrayRef({strips, groups, kStripCols}),
              "scale must be float32 or float16 [S, K / group, 16]");
  const void* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == scale.scalar_type() && offset->is_contiguous() &&
                    offset->sizes() == scale.sizes(), "offset must be like scale");
    off = offset->data_ptr();
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n,
                "bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  const torch::Tensor xc = x.contiguous();
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
#if defined(RADIXSERVE_QUANT_STRIPS_I8)
  if (int8_x && group % 32 == 0) return strip_detail::linear_i8(xb, m, k, data, scale, off, n, group, bits, half, bp);
#endif
  // x as k pairs interleaved by row in tiles of 16 rows, and each row's sum per group likewise
  // (needed for the offsets' term: always at 4 bits).
  const int64_t tiles = (m + 15) / 16;
  std::vector<int32_t> xq(static_cast<size_t>(tiles * pairs * 16), 0);
  std::vector<float> xsg(static_cast<size_t>(tiles * groups * 16), 0.0f);
  interleave_rows(xb, k, m, pairs, xq.data());
  if (bits == 4 || off)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.0f;
        for (int64_t c = g * group; c < (g + 1) * group; ++c) {
          const uint32_t word = static_cast<uint32_t>(xb[i * k + c]) << 16;
          float v;
          std::memcpy(&v, &word, sizeof v);
          sum += v;
        }
        xsg[(i / 16) * groups * 16 + g * 16 + i % 16] = sum;
      }
  torch::Tensor y = torch::empty({m, n}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const auto& fns = kQuantStripFns[bits == 8][half];
  strip_detail::for_each_strip(
      data, scale, off, n, groups, half,
      [&](const uint8_t* strip, const void* ss, const void* os, int64_t col, int64_t cols) {
        for (int64_t r = 0; r < m; r += kStripRows) {
          const int64_t rows = std::min(kStripRows, m - r);
          // Row r of x sits r % 16 entries into its tile of 16 rows.
          fns[rows - 1](strip, groups, group, ss, os, xq.data() + (r / 16) * pairs * 16 + r % 16,
                        xsg.data() + (r / 16) * groups * 16 + r % 16, bp ? bp + col : nullptr, yp + r * n + col, n,
                        cols);
        }
      });
  return y;
#else
  TORCH_CHECK(false, "quant_strip_linear needs a CPU with AVX512-BF16 (and a build with -march for it)");
#endif
}

}  // namespace radixserve
