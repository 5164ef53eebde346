/* CPU training's fused elementwise ops for Llama-family layers, forward and backward, each one pass over its
   tensors: the gated MLP's SiLU(gate) * up, and the RMS norm. Built and loaded by tandem/kernels/__init__.py, called
   by tandem/train/fused.py (the autograd functions around them).

   Why: in PyTorch ops the MLP's gate is a SiLU and a product forward (5 reads and writes of a [tokens, I] tensor,
   three of them kept for backward) and three ops backward (9), the norm ~5 ops forward and ~8 backward; at a
   training micro-batch those tensors are tens of MB, so each op is a trip through memory. Here: 3 and 5 for the
   gate, 2 and 3 for the norm, and only the inputs kept for backward.

   The math is HF's (Qwen2MLP, Qwen2RMSNorm / LlamaRMSNorm in float32), sums and exp computed here, so results
   match to float rounding, not bit for bit. Rows are split over OpenMP threads statically and a weight's gradient
   is summed per thread, then over threads in order: the same threads give the same bits, run after run. */
#include <math.h>
#include <stdint.h>

#include "exp.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static inline float sigmoid(float g) { return 1.f / (1.f + exp_clamped(-g)); }

/* y = silu(g) * u, n elements. */
void tandem_silu_mul(const float *g, const float *u, float *y, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
}

/* The gradients of silu(g) * u: dg = dy u s (1 + g (1 - s)) with s = sigmoid(g) (aten's silu_backward), du = dy
   silu(g). */
void tandem_silu_mul_backward(const float *dy, const float *g, const float *u, float *dg, float *du, int64_t n,
                              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = dy[i] * (g[i] * s);
    dg[i] = dy[i] * u[i] * (s * (1.f + g[i] * (1.f - s)));
  }
}

/* y = w * (x / sqrt(mean(x^2) + eps)) per row of E, and each row's 1 / sqrt(mean(x^2) + eps) into inv [rows]. */
void tandem_rms_norm(const float *x, const float *w, float eps, float *y, float *inv, int64_t rows, int64_t E,
                     int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * E;
    float *yr = y + r * E, ss = 0.f;
    for (int64_t i = 0; i < E; ++i) ss += xr[i] * xr[i];
    const float iv = 1.f / sqrtf(ss / (float)E + eps);
    inv[r] = iv;
    for (int64_t i = 0; i < E; ++i) yr[i] = w[i] * (xr[i] * iv);
  }
}

/* The norm's gradients from the forward's x and inv: dx = inv (dy w - x inv^2 mean(dy w x)); with dw_parts
   ([threads, E], zeroed; NULL: no weight gradient) thread t adds its rows' dy x inv into its row of it, and the
   caller sums those rows. */
void tandem_rms_norm_backward(const float *dy, const float *x, const float *w, const float *inv, float *dx,
                              float *dw_parts, int64_t rows, int64_t E, int threads) {
#pragma omp parallel num_threads(threads)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    float *dw = dw_parts ? dw_parts + (int64_t)t * E : 0;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float *xr = x + r * E, *dyr = dy + r * E;
      float *dxr = dx + r * E, dot = 0.f;
      const float iv = inv[r];
      for (int64_t i = 0; i < E; ++i) dot += dyr[i] * w[i] * xr[i];
      if (dw)
        for (int64_t i = 0; i < E; ++i) dw[i] += dyr[i] * (xr[i] * iv);
      const float c = dot * iv * iv / (float)E;
      for (int64_t i = 0; i < E; ++i) dxr[i] = iv * (dyr[i] * w[i] - xr[i] * c);
    }
  }
}
