// Small-batch float32 projections for CPU block servers: y[M, N] = x[M, K] @ W^T (+ bias).
//
// W is stored once, at load time, as panels of 16 output columns, each panel K-major: panels[p][k][16].
// A call streams every panel exactly once whatever M is, and each row block keeps its accumulators in
// registers, so 8 decode rows cost about twice one row (MKL's GEMM and oneDNN: three to four times).
//
// Every output element is a single FMA chain over k = 0 .. K-1 in order, whichever rows share the call
// and however they are blocked: a row's result never depends on the batch it was computed in.
//
// Built at run time by worker/cpu_gemm.py (c++ -O3); the AVX2/FMA code is selected with target
// attributes, and the caller checks that the CPU has both before using it.

#include <immintrin.h>
#include <string.h>

#define SWARM_TARGET __attribute__((target("avx2,fma")))

namespace {

constexpr long kPanel = 16;           // output columns per panel (two 8-float registers)
constexpr long kPrefetchFloats = 128;  // prefetch this far ahead in the weight stream (8 cache lines)

// R rows x C panels; R * C * 2 accumulators stay in registers (at most 12 of the 16 ymm registers).
template <int R, int C>
SWARM_TARGET inline void micro(const float* x, long ldx, long K, const float* w, long pstride, float* y,
                               long ldy, long col0, long N, const float* bias) {
  __m256 acc[R][C][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();

  for (long k = 0; k < K; ++k) {
    __m256 w0[C], w1[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float* wk = w + c * pstride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchFloats), _MM_HINT_T0);
      w0[c] = _mm256_loadu_ps(wk);
      w1[c] = _mm256_loadu_ps(wk + 8);
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

  // spill once, after the loop (indexing acc with a run-time bound would keep it in memory throughout)
  float out[R][C][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm256_storeu_ps(out[r][c], acc[r][c][0]);
      _mm256_storeu_ps(out[r][c] + 8, acc[r][c][1]);
    }
  for (int c = 0; c < C; ++c) {
    const long col = col0 + c * kPanel;
    if (col >= N) break;
    const long n = N - col < kPanel ? N - col : kPanel;  // the last panel may be padded
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

// R rows over panels [p, pend): as many panels per call as keep >= 8 independent FMA chains busy.
template <int R>
SWARM_TARGET void rows_over_panels(const float* x, long ldx, long K, const float* panels, float* y, long ldy,
                                   long N, const float* bias, long p, long pend) {
  constexpr int C = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  const long pstride = K * kPanel;
  for (; p + C <= pend; p += C) micro<R, C>(x, ldx, K, panels + p * pstride, pstride, y, ldy, p * kPanel, N, bias);
  for (; p < pend; ++p) micro<R, 1>(x, ldx, K, panels + p * pstride, pstride, y, ldy, p * kPanel, N, bias);
}

}  // namespace

extern "C" {

// Rows are taken 4 at a time (the fastest block measured on AMD EPYC / AVX2); panels `group` at a time,
// so a group's panels are still in L2 when the next row block reads them. [p_begin, p_end) lets callers
// split the columns between threads.
SWARM_TARGET void swarm_panel_gemm(const float* x, long M, long K, long ldx, const float* panels, long N, float* y,
                                   long ldy, const float* bias, long p_begin, long p_end) {
  const long group = 4, row_block = 4;
  for (long p = p_begin; p < p_end; p += group) {
    const long pend = p + group < p_end ? p + group : p_end;
    for (long r0 = 0; r0 < M;) {
      const long rows = M - r0 < row_block ? M - r0 : row_block;
      const float* xr = x + r0 * ldx;
      float* yr = y + r0 * ldy;
      switch (rows) {
        case 1: rows_over_panels<1>(xr, ldx, K, panels, yr, ldy, N, bias, p, pend); break;
        case 2: rows_over_panels<2>(xr, ldx, K, panels, yr, ldy, N, bias, p, pend); break;
        case 3: rows_over_panels<3>(xr, ldx, K, panels, yr, ldy, N, bias, p, pend); break;
        default: rows_over_panels<4>(xr, ldx, K, panels, yr, ldy, N, bias, p, pend); break;
      }
      r0 += rows;
    }
  }
}

int swarm_panel_gemm_version(void) { return 1; }

}  // extern "C"
