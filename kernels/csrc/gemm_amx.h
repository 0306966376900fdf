#pragma once

// The fixed-order bf16 GEMM on AMX tiles, for CPUs with AMX-BF16 (csrc/gemm.h's packed layout).
//
// A packed strip of W is, 16 k pairs at a time, exactly a `tdpbf16ps` B tile (16 rows of 16
// columns x 2 bf16 = 64 bytes), and 16 rows x 32 values of x are an A tile. Every output element
// accumulates the same tile products in the same order (k blocks of 32 from 0, then the tail),
// and a tile's rows never mix, so a row's result does not depend on the rows beside it: x is
// always processed in 16-row tiles, a partial one padded with zero rows in a scratch copy. At
// prefill sizes this is several times the AVX512-BF16 kernel; at decode sizes the weight reads
// bound both alike.

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RADIXSERVE_HAVE_AMX 1

namespace radixserve {
namespace {

// Linux hands out the AMX tile state only on request, once per process (arch_prctl).
inline bool amx_usable() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;  // bf16 values of k per A tile row (64 bytes)
constexpr int64_t kAmxRowChunk = 256;  // a multiple of kTileRows

// Tiles: 0, 1 accumulators (two strips); 2 A; 3, 4 B; 5 A tail; 6, 7 B tails (K % 32 values).
inline TileConfig tile_config(int64_t tail) {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4}) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  if (tail > 0) {
    c.rows[5] = kTileRows;
    c.colsb[5] = static_cast<uint16_t>(tail * 2);
    for (int t : {6, 7}) {
      c.rows[t] = static_cast<uint8_t>(tail / 2);
      c.colsb[t] = 64;
    }
  }
  return c;
}

// One 16-row tile of x (rows `lda` elements apart) against strips s0 (and s0 + 1 when `two`),
// results to y (mt rows, ldy apart; cols0 / cols1 valid columns of each strip).
template <bool TWO>
inline void amx_tile_rows(const uint16_t* a, int64_t lda, const uint16_t* w0, const uint16_t* w1, int64_t k,
                          const float* b0, const float* b1, uint16_t* y, int64_t ldy, int64_t mt, int64_t cols0,
                          int64_t cols1, float* cbuf) {
  const int64_t blocks = k / kTileK, tail = k % kTileK;
  _tile_zero(0);
  if constexpr (TWO) _tile_zero(1);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    _tile_loadd(2, a + kb * kTileK, lda * 2);
    _tile_loadd(3, w0 + kb * kTileK * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (TWO) {
      _tile_loadd(4, w1 + kb * kTileK * 16, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  if (tail > 0) {
    _tile_loadd(5, a + blocks * kTileK, lda * 2);
    _tile_loadd(6, w0 + blocks * kTileK * 16, 64);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (TWO) {
      _tile_loadd(7, w1 + blocks * kTileK * 16, 64);
      _tile_dpbf16ps(1, 5, 7);
    }
  }
  constexpr int kStrips = TWO ? 2 : 1;
  _tile_stored(0, cbuf, 64);
  if constexpr (TWO) _tile_stored(1, cbuf + kTileRows * 16, 64);
  for (int st = 0; st < kStrips; ++st) {
    const int64_t cols = st == 0 ? cols0 : cols1;
    const float* bias = st == 0 ? b0 : b1;
    const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < mt; ++m) {
      const __m512 sum = _mm512_loadu_ps(cbuf + (st * kTileRows + m) * 16);
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sum, bv));
      _mm256_mask_storeu_epi16(y + m * ldy + st * 16, mask, (__m256i)out);
    }
  }
}

// y [m, n] = x [m, k] @ W^T (+ bias), W packed as in gemm.h (`pairs` = k / 2 k pairs per strip).
inline void packed_linear_amx(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t m, int64_t k,
                              int64_t n, int64_t strips, const float* bias, uint16_t* y) {
  const TileConfig cfg = tile_config(k % kTileK);
  const int64_t strip_elems = k * 16;  // bf16 values per packed strip
  const int64_t full = m / kTileRows * kTileRows;
  std::vector<uint16_t> pad;  // the last, partial row tile, zero-padded to 16 rows
  if (full < m) {
    pad.assign(kTileRows * k, 0);
    for (int64_t r = full; r < m; ++r) std::copy(x + r * ldx, x + r * ldx + k, pad.begin() + (r - full) * k);
  }
  const int64_t pairs_of_strips = (strips + 1) / 2;
  // Chunks of rows, each over every strip: the chunk's rows of x stay in cache while the weight
  // streams past (a whole long prompt's x re-read per strip would come from memory).
  for (int64_t c0 = 0; c0 < m; c0 += kAmxRowChunk) {
    const int64_t c1 = std::min(m, c0 + kAmxRowChunk);
    parallel_for(0, pairs_of_strips, 1, [&](int64_t p0, int64_t p1) {
      _tile_loadconfig(&cfg);
      alignas(64) float cbuf[2 * kTileRows * 16];
      for (int64_t sp = p0; sp < p1; ++sp) {
        const int64_t s0 = 2 * sp;
        const bool two = s0 + 1 < strips;
        const int64_t col0 = s0 * 16, cols0 = std::min<int64_t>(16, n - col0);
        const int64_t cols1 = two ? std::min<int64_t>(16, n - col0 - 16) : 0;
        const uint16_t* w0 = wp + s0 * strip_elems;
        const float* b0 = bias != nullptr ? bias + col0 : nullptr;
        const float* b1 = bias != nullptr && two ? bias + col0 + 16 : nullptr;
        for (int64_t r = c0; r < c1; r += kTileRows) {
          const bool partial = r >= full;
          const uint16_t* a = partial ? pad.data() : x + r * ldx;
          const int64_t lda = partial ? k : ldx, mt = std::min(kTileRows, m - r);
          if (two)
            amx_tile_rows<true>(a, lda, w0, w0 + strip_elems, k, b0, b1, y + r * n + col0, n, mt, cols0, cols1,
                                cbuf);
          else
            amx_tile_rows<false>(a, lda, w0, nullptr, k, b0, nullptr, y + r * n + col0, n, mt, cols0, 0, cbuf);
        }
      }
      _tile_release();
    });
  }
}

}  // namespace
}  // namespace radixserve
#endif
