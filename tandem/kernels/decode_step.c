/* One decode step of a Llama-family model (Qwen2, Llama) on CPU in one call: every layer's RMS norms, rotary,
   cache writes, attention (decode_attention.c), SiLU gate and residual adds in C, its matrix products by the BLAS
   that PyTorch links (its `sgemm_`, passed in as a pointer: the routine torch.mm calls, so the products are
   PyTorch's). Built and loaded by tandem/rollout/native.py; it includes decode_attention.c, so one library holds
   both entry points.

   Why: a decode step of a few rows is ~15 small tensor ops per layer between 4 matrix products, each op a few
   microseconds of dispatch for well under a microsecond of arithmetic; here they are loops over the rows, and the
   step is one foreign call. The math is the lean decoder's (llama_decode.decode_layers) in the same order; sums
   (the norms' mean) and exp (SiLU) are computed here, so results match it to float rounding, not bit for bit.

   Layout (float32, row-major, contiguous unless a stride is given): x [B, E]; q/k/v projection [(H + 2 KV) D, E],
   gate/up [2 I, E], o [E, H D], down [E, I]; embedding [*, E], head [V, E]; rotary tables [T, D] (cos, and sin with
   its first half negated); the rows' own cache [B, KV, S, D] (float32 or bfloat16), row r's new key and value
   written at its slot `slots[r]`, its attention over its own slots 0..L-1 where `seen` allows; a prompt held once
   per group of n rows [U, KV, P, D] with strides, or none (P = 0). B is the most rows a step may feed (the
   workspace's); a step feeds `rows` of them. */
#include "decode_attention.c"

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *, const int *);

typedef struct { /* one layer's weights (a bias may be NULL) and caches */
  const float *norm1, *w_qkv, *b_qkv, *w_o, *b_o, *norm2, *w_gu, *b_gu, *w_down, *b_down;
  void *k, *v;              /* the rows' own cache */
  const void *pk, *pv;      /* the prompt held once, or NULL */
} layer_t;

typedef struct { /* a decoder: shapes, weights, caches and workspace, built once per generate (native.py mirrors it) */
  int64_t B, E, H, KV, D, I, V, Vin, T, layers, S, P, n; /* Vin: embedding rows, T: rotary positions */
  int64_t spk[3], spv[3];   /* the prompt's key and value strides (row, head, position) */
  const uint8_t *pseen;     /* [U, P]: the prompt positions a group's rows attend to */
  const float *embed, *norm, *head, *cos, *sin;
  float *x, *h, *qkv, *att, *gu, *act, *y; /* workspace: [B, E], [B, E], [B, (H+2KV) D], [B, H D], [B, 2I], [B, I], [B, E] */
  float eps, scale;
  int bf16;
  sgemm_t sgemm;
  const layer_t *layer;
} decoder_t;

/* out [rows, n_out] = in [rows, n_in] W^T (W [n_out, n_in]) + bias: as torch's linear/addmm on CPU calls the BLAS
   (the bias copied into the output, then beta = 1). */
static void linear(const decoder_t *m, const float *in, const float *w, const float *bias, float *out, int64_t rows,
                   int64_t n_in, int64_t n_out) {
  const int M = (int)n_out, N = (int)rows, K = (int)n_in;
  const float one = 1.f, zero = 0.f;
  if (bias)
    for (int64_t r = 0; r < rows; ++r) memcpy(out + r * n_out, bias, sizeof(float) * (size_t)n_out);
  m->sgemm("T", "N", &M, &N, &K, &one, w, &K, in, &K, bias ? &one : &zero, out, &M);
}

/* out = x / sqrt(mean(x^2) + eps) * w per row (F.rms_norm's float32 math). */
static void rms_norm(const float *x, const float *w, float eps, float *out, int64_t rows, int64_t E) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * E;
    float ss = 0.f;
    for (int64_t i = 0; i < E; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)E + eps);
    for (int64_t i = 0; i < E; ++i) out[r * E + i] = xr[i] * inv * w[i];
  }
}

/* Rotary on row r's query and key heads in place (x cos + swap_halves(x) signed_sin, the lean decoder's form),
   then its key and value stored in cache slot `slot`. */
static void rotate_and_store(const decoder_t *m, const layer_t *l, int64_t r, int64_t pos, int64_t slot) {
  const int64_t D = m->D, half = D / 2, heads = m->H + m->KV;
  const float *c = m->cos + pos * D, *s = m->sin + pos * D;
  float *row = m->qkv + r * (m->H + 2 * m->KV) * D, t[MAXD];
  for (int64_t h = 0; h < heads; ++h) {
    float *x = row + h * D;
    for (int64_t i = 0; i < D; ++i) t[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
    memcpy(x, t, sizeof(float) * (size_t)D);
  }
  for (int64_t g = 0; g < m->KV; ++g) {
    const int64_t at = ((r * m->KV + g) * m->S + slot) * D;
    const float *k = row + (m->H + g) * D, *v = row + (m->H + m->KV + g) * D;
    if (m->bf16) {
      for (int64_t i = 0; i < D; ++i) ((uint16_t *)l->k)[at + i] = to_bf16(k[i]);
      for (int64_t i = 0; i < D; ++i) ((uint16_t *)l->v)[at + i] = to_bf16(v[i]);
    } else {
      memcpy((float *)l->k + at, k, sizeof(float) * (size_t)D);
      memcpy((float *)l->v + at, v, sizeof(float) * (size_t)D);
    }
  }
}

/* Attention of the rows' queries (in the q/k/v workspace) over their prompt held once, if any, and their own
   slots 0..L-1 where `seen` [rows, L] (row stride `sms`; NULL: all) allows, into the attention workspace. */
static int attention(const decoder_t *m, const layer_t *l, int64_t rows, int64_t L, const uint8_t *seen,
                     int64_t sms, int threads) {
  const int64_t D = m->D, S = m->S;
  job_t job = {m->qkv, m->att, {{0}, {0}}, rows, m->H, m->KV, D, (m->H + 2 * m->KV) * D, D, m->H * D, D, m->bf16,
               m->scale};
  job.seg[0] = (segment_t){.k = l->pk, .v = l->pv, .seen = m->pseen, .L = m->P, .group = m->P ? m->n : 1,
                           .skb = m->spk[0], .skh = m->spk[1], .skl = m->spk[2], .svb = m->spv[0], .svh = m->spv[1],
                           .svl = m->spv[2], .smb = m->P};
  job.seg[1] = (segment_t){.k = l->k, .v = l->v, .seen = seen, .L = L, .group = 1, .skb = m->KV * S * D,
                           .skh = S * D, .skl = D, .svb = m->KV * S * D, .svh = S * D, .svl = D, .smb = sms};
  return run_job(&job, threads);
}

/* Logits [rows, V] of the next token after feeding `tokens` [rows] at rotary `positions` [rows], row r's key and
   value stored at its own slot `slots[r]`, attention over own slots 0..L-1 where `seen` [rows, L] (row stride
   `sms`; NULL: all) allows. 0, or nonzero where an argument is out of range (4) or run_job's code (the logits then
   not fully written). */
int tandem_decode_step(const decoder_t *m, int64_t rows, const int64_t *tokens, const int64_t *positions,
                       const int64_t *slots, int64_t L, const uint8_t *seen, int64_t sms, float *logits,
                       int threads) {
  const int64_t B = rows, E = m->E, I = m->I, QKV = (m->H + 2 * m->KV) * m->D;
  if (rows < 1 || rows > m->B || L < 1 || L > m->S || (m->P && rows != m->B)) return 4;
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] < 0 || slots[r] >= L || tokens[r] < 0 || tokens[r] >= m->Vin) return 4;
  for (int64_t r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= m->T) return 4;
  for (int64_t r = 0; r < B; ++r) memcpy(m->x + r * E, m->embed + tokens[r] * E, sizeof(float) * (size_t)E);
  for (int64_t i = 0; i < m->layers; ++i) {
    const layer_t *l = &m->layer[i];
    rms_norm(m->x, l->norm1, m->eps, m->h, B, E);
    linear(m, m->h, l->w_qkv, l->b_qkv, m->qkv, B, E, QKV);
    for (int64_t r = 0; r < B; ++r) rotate_and_store(m, l, r, positions[r], slots[r]);
    const int rc = attention(m, l, B, L, seen, sms, threads);
    if (rc) return rc;
    linear(m, m->att, l->w_o, l->b_o, m->y, B, m->H * m->D, E);
    for (int64_t j = 0; j < B * E; ++j) m->x[j] += m->y[j];
    rms_norm(m->x, l->norm2, m->eps, m->h, B, E);
    linear(m, m->h, l->w_gu, l->b_gu, m->gu, B, E, 2 * I);
    for (int64_t r = 0; r < B; ++r) {
      const float *g = m->gu + r * 2 * I, *u = g + I;
      float *a = m->act + r * I;
      for (int64_t j = 0; j < I; ++j) a[j] = g[j] / (1.f + exp_clamped(-g[j])) * u[j];
    }
    linear(m, m->act, l->w_down, l->b_down, m->y, B, I, E);
    for (int64_t j = 0; j < B * E; ++j) m->x[j] += m->y[j];
  }
  rms_norm(m->x, m->norm, m->eps, m->h, B, E);
  linear(m, m->h, m->head, NULL, logits, B, E, m->V);
  return 0;
}
