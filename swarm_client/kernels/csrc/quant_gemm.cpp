// Small-batch weight-only quantized projections for CPU block servers: y[M, N] = x[M, K] @ W^T (+ bias),
// x and y float32, W stored as int8 or NF4 in the panel layout of panel_gemm.cpp (16 output columns per
// panel, K-major). Decoding streams the weights from memory once per step, so a quarter (int8) or an
// eighth (NF4) of the bytes is what makes these faster than float32 there.
//
// int8: panels[p][k][16] int8, scales[p * 16 + j] float (one per output column, symmetric):
//       y = (sum_k x[k] * q[k]) * scale + bias.
// NF4:  panels[p][k][8] bytes, byte j = column j (low nibble) | column j + 8 (high nibble), codes into the
//       16-entry NormalFloat table; absmax[p][k / 64][16] float (one per 64 weights of a column, as
//       bitsandbytes' blocksize 64): w = table[code] * absmax, y = sum_k x[k] * w[k] + bias.
//
// The weights are widened to float32 in registers and each output element is a single FMA chain over
// k = 0 .. K-1 in order, whichever rows share the call: results are batch-invariant, as panel_gemm's.
// Built at run time by worker/quant_gemm.py (c++ -O3) with AVX2/FMA target attributes.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SWARM_TARGET __attribute__((target("avx2,fma")))

namespace {

constexpr long kPanel = 16;
constexpr long kNf4Block = 64;

// Write R x C panels of accumulators (already scaled) to y, adding bias; the last panel may be padded.
template <int R, int C>
SWARM_TARGET inline void store(const float (&out)[R][C][kPanel], float* y, long ldy, long col0, long N,
                               const float* bias) {
  for (int c = 0; c < C; ++c) {
    const long col = col0 + c * kPanel;
    if (col >= N) break;
    const long n = N - col < kPanel ? N - col : kPanel;
    for (int r = 0; r < R; ++r) {
      float* dst = y + r * ldy + col;
      if (bias) {
        for (long j = 0; j < n; ++j) dst[j] = out[r][c][j] + bias[col + j];
      } else {
        memcpy(dst, out[r][c], n * sizeof(float));
      }
    }
  }
}

template <int R, int C>
SWARM_TARGET inline void micro_i8(const float* x, long ldx, long K, const int8_t* w, long pstride,
                                  const float* scales, float* y, long ldy, long col0, long N, const float* bias) {
  __m256 acc[R][C][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (long k = 0; k < K; ++k) {
    __m256 w0[C], w1[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int8_t* wk = w + c * pstride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + 512), _MM_HINT_T0);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk));
      w0[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
      w1[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm256_fmadd_ps(b, w0[c], acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(b, w1[c], acc[r][c][1]);
      }
    }
  }
  float out[R][C][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float* s = scales + col0 + c * kPanel;
      _mm256_storeu_ps(out[r][c], _mm256_mul_ps(acc[r][c][0], _mm256_loadu_ps(s)));
      _mm256_storeu_ps(out[r][c] + 8, _mm256_mul_ps(acc[r][c][1], _mm256_loadu_ps(s + 8)));
    }
  store<R, C>(out, y, ldy, col0, N, bias);
}

// The int8 micro-kernel with AVX-512, where the CPU has it: a 16-column panel is one zmm register, so a
// panel's 16 weights widen in one conversion instead of two. Each output is the same FMA chain as in
// micro_i8 (k in order, one rounding per step), so both give bit-identical results.
#define SWARM_TARGET512 __attribute__((target("avx512f,fma")))

bool use_avx512 = __builtin_cpu_supports("avx512f");

template <int R, int C>
SWARM_TARGET512 inline void micro_i8_512(const float* x, long ldx, long K, const int8_t* w, long pstride,
                                         const float* scales, float* y, long ldy, long col0, long N,
                                         const float* bias) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (long k = 0; k < K; ++k) {
    __m512 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int8_t* wk = w + c * pstride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + 512), _MM_HINT_T0);
      wv[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk))));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b, wv[c], acc[r][c]);
    }
  }
  float out[R][C][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r][c], _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(scales + col0 + c * kPanel)));
  store<R, C>(out, y, ldy, col0, N, bias);
}

// 16 codes (as int32 lanes) -> table values: two 8-entry permutes, blended on the code's bit 3
SWARM_TARGET inline __m256 nf4_lookup(__m256i code, __m256 lo, __m256 hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lo, code), b = _mm256_permutevar8x32_ps(hi, code);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}

template <int R, int C>
SWARM_TARGET inline void micro_nf4(const float* x, long ldx, long K, const uint8_t* w, long pstride,
                                   const float* absmax, long astride, const float* table, float* y, long ldy,
                                   long col0, long N, const float* bias) {
  const __m256 tlo = _mm256_loadu_ps(table), thi = _mm256_loadu_ps(table + 8);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[R][C][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (long k0 = 0; k0 < K; k0 += kNf4Block) {
    const long kend = k0 + kNf4Block < K ? k0 + kNf4Block : K;
    __m256 a0[C], a1[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float* a = absmax + c * astride + (k0 / kNf4Block) * kPanel;
      a0[c] = _mm256_loadu_ps(a);
      a1[c] = _mm256_loadu_ps(a + 8);
    }
    for (long k = k0; k < kend; ++k) {
      __m256 w0[C], w1[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const uint8_t* wk = w + c * pstride + k * 8;
        _mm_prefetch(reinterpret_cast<const char*>(wk + 256), _MM_HINT_T0);
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk));
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_and_si128(b, low4));
        const __m256i hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
        w0[c] = _mm256_mul_ps(nf4_lookup(lo, tlo, thi), a0[c]);
        w1[c] = _mm256_mul_ps(nf4_lookup(hi, tlo, thi), a1[c]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          acc[r][c][0] = _mm256_fmadd_ps(xb, w0[c], acc[r][c][0]);
          acc[r][c][1] = _mm256_fmadd_ps(xb, w1[c], acc[r][c][1]);
        }
      }
    }
  }
  float out[R][C][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm256_storeu_ps(out[r][c], acc[r][c][0]);
      _mm256_storeu_ps(out[r][c] + 8, acc[r][c][1]);
    }
  store<R, C>(out, y, ldy, col0, N, bias);
}

struct Args {
  const float* x;
  long ldx, K;
  const void* panels;
  const float* scales;  // int8: per column; nf4: absmax
  const float* table;   // nf4 only
  float* y;
  long ldy, N;
  const float* bias;
};

// int8 with AVX-512: up to 4 rows x 4 panels = 16 of the 32 zmm registers
template <int R>
SWARM_TARGET512 void rows_over_panels_512(const Args& a, const float* x, float* y, long p, long pend) {
  constexpr int C = R >= 3 ? 2 : 4;
  const long pstride = a.K * kPanel;
  const int8_t* w = static_cast<const int8_t*>(a.panels);
  for (; p + C <= pend; p += C)
    micro_i8_512<R, C>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales, y, a.ldy, p * kPanel, a.N, a.bias);
  for (; p < pend; ++p)
    micro_i8_512<R, 1>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales, y, a.ldy, p * kPanel, a.N, a.bias);
}

template <int R, bool Nf4>
SWARM_TARGET void rows_over_panels(const Args& a, const float* x, float* y, long p, long pend) {
  constexpr int C = R >= 4 ? 1 : (R >= 2 ? 2 : (Nf4 ? 2 : 4));
  if constexpr (Nf4) {
    const long pstride = a.K * 8, astride = ((a.K + kNf4Block - 1) / kNf4Block) * kPanel;
    const uint8_t* w = static_cast<const uint8_t*>(a.panels);
    for (; p + C <= pend; p += C)
      micro_nf4<R, C>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales + p * astride, astride, a.table, y, a.ldy,
                      p * kPanel, a.N, a.bias);
    for (; p < pend; ++p)
      micro_nf4<R, 1>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales + p * astride, astride, a.table, y, a.ldy,
                      p * kPanel, a.N, a.bias);
  } else {
    const long pstride = a.K * kPanel;
    const int8_t* w = static_cast<const int8_t*>(a.panels);
    for (; p + C <= pend; p += C)
      micro_i8<R, C>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales, y, a.ldy, p * kPanel, a.N, a.bias);
    for (; p < pend; ++p)
      micro_i8<R, 1>(x, a.ldx, a.K, w + p * pstride, pstride, a.scales, y, a.ldy, p * kPanel, a.N, a.bias);
  }
}

SWARM_TARGET512 void gemm512(const Args& a, long M, long p_begin, long p_end) {
  const long group = 4, row_block = 4;
  for (long p = p_begin; p < p_end; p += group) {
    const long pend = p + group < p_end ? p + group : p_end;
    for (long r0 = 0; r0 < M;) {
      const long rows = M - r0 < row_block ? M - r0 : row_block;
      const float* xr = a.x + r0 * a.ldx;
      float* yr = a.y + r0 * a.ldy;
      switch (rows) {
        case 1: rows_over_panels_512<1>(a, xr, yr, p, pend); break;
        case 2: rows_over_panels_512<2>(a, xr, yr, p, pend); break;
        case 3: rows_over_panels_512<3>(a, xr, yr, p, pend); break;
        default: rows_over_panels_512<4>(a, xr, yr, p, pend); break;
      }
      r0 += rows;
    }
  }
}

template <bool Nf4>
SWARM_TARGET void gemm(const Args& a, long M, long p_begin, long p_end) {
  if (!Nf4 && use_avx512) {
    gemm512(a, M, p_begin, p_end);
    return;
  }
  const long group = 4, row_block = 4;
  for (long p = p_begin; p < p_end; p += group) {
    const long pend = p + group < p_end ? p + group : p_end;
    for (long r0 = 0; r0 < M;) {
      const long rows = M - r0 < row_block ? M - r0 : row_block;
      const float* xr = a.x + r0 * a.ldx;
      float* yr = a.y + r0 * a.ldy;
      switch (rows) {
        case 1: rows_over_panels<1, Nf4>(a, xr, yr, p, pend); break;
        case 2: rows_over_panels<2, Nf4>(a, xr, yr, p, pend); break;
        case 3: rows_over_panels<3, Nf4>(a, xr, yr, p, pend); break;
        default: rows_over_panels<4, Nf4>(a, xr, yr, p, pend); break;
      }
      r0 += rows;
    }
  }
}

}  // namespace

extern "C" {

// [p_begin, p_end): the panels this call computes (callers split the columns between threads).
SWARM_TARGET void swarm_int8_gemm(const float* x, long M, long K, long ldx, const int8_t* panels,
                                  const float* scales, long N, float* y, long ldy, const float* bias, long p_begin,
                                  long p_end) {
  const Args a{x, ldx, K, panels, scales, nullptr, y, ldy, N, bias};
  gemm<false>(a, M, p_begin, p_end);
}

SWARM_TARGET void swarm_nf4_gemm(const float* x, long M, long K, long ldx, const uint8_t* panels,
                                 const float* absmax, const float* table, long N, float* y, long ldy,
                                 const float* bias, long p_begin, long p_end) {
  const Args a{x, ldx, K, panels, absmax, table, y, ldy, N, bias};
  gemm<true>(a, M, p_begin, p_end);
}

int swarm_quant_gemm_version(void) { return 2; }

// Whether int8 runs on AVX-512 (default: where the CPU has it); returns the previous setting. For tests,
// which check that both paths give bit-identical results.
int swarm_quant_use_avx512(int enable) {
  const bool was = use_avx512;
  use_avx512 = enable && __builtin_cpu_supports("avx512f");
  return was;
}

}  // extern "C"
