/* Decode attention on CPU: one query per row and head against the row's cached keys and values (float32 or
   bfloat16), the products and softmax in float32. Built and loaded by tandem/rollout/native.py.

   Why not SDPA: at decode shapes (one query, a few hundred keys of 64-128 dims) PyTorch's CPU kernel runs a
   matrix-vector product per row and head and reads about a third of the memory bandwidth; with a bf16 cache and
   no native bf16 it is slower still. Here each KV head's keys and values are read once for all the query heads
   that share them (GQA), a block of positions at a time with independent accumulators, bf16 widened to float32 by
   a shift as it is loaded. decode_step.c includes this file (the whole decode step around the attention).

   Layout: q [B, H, D], out [B, H, D] (last dim contiguous), k and v [B, KV, L, D] with any strides but a
   contiguous last dim, seen [B, L] (nonzero: the row attends to that position). H = G * KV, query head h reads KV
   head h / G (as SDPA's enable_gqa). D a multiple of 8, G <= MAXG, D <= MAXD (the caller checks).

   Built once per head shape: -DTANDEM_G (query heads per KV head) and -DTANDEM_C (D / 8) make the loop bounds
   constants, so the accumulators live in registers and the loops unroll (faster than a build with them as
   variables, which is what compiling without the two gives; a build takes well under a second). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define MAXG 16
#define MAXD 256
#define PB 4 /* positions per block in the key pass: PB * G independent accumulators */
#define CB 4 /* 8-float chunks of the head per block in the value pass */

/* A run of cached positions: keys and values [rows, KV, L, D] (strides in elements, last dim contiguous), `seen`
   [rows, L] (NULL: all seen). Row b of the batch reads row b / group of the segment: a prompt held once for its
   group of rows (group = n), or each row's own cache (group = 1). */
typedef struct {
  const void *k, *v;
  const uint8_t *seen;
  int64_t L, group, skb, skh, skl, svb, svh, svl, smb;
} segment_t;

typedef struct {
  const float *q;
  float *out;
  segment_t seg[2];
  int64_t B, H, KV, D, sqb, sqh, sob, soh;
  int bf16;
  float scale;
} job_t;

static inline v8 load8(const void *base, int64_t at, int bf16) {
  v8 f;
  if (bf16) {
    v8h h;
    memcpy(&h, (const uint16_t *)base + at, 16);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    memcpy(&f, &u, 32);
  } else {
    memcpy(&f, (const float *)base + at, 32);
  }
  return f;
}

static inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

static inline uint16_t to_bf16(float x) { /* to nearest even, as torch's .to(torch.bfloat16) */
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* A float rounded to bfloat16 and back: the query as a bf16 cache's SDPA would read it. */
static inline float round_bf16(float x) {
  const uint32_t u = (uint32_t)to_bf16(x) << 16;
  memcpy(&x, &u, 4);
  return x;
}

/* Ask for the `bytes` at `p` to be brought into cache (L2), a line at a time: a read soon, not now. */
static inline void prefetch(const void *p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)p + at, 0, 2);
}

/* Scores of row b's G query heads (q, scaled) against one segment's keys for KV head g, into s[j * stride + l]
   (-inf where unseen); each head's running max in mx. The same positions' values are prefetched as their keys are
   read, so that the value pass (`weigh`) reads them from cache: the two streams from memory overlap instead of
   following one another (the attention is memory traffic: bench_trl's large rollout's attention alone took 2.4x
   less time with this and the next item's keys prefetched, docs/design-notes.md). */
static inline __attribute__((always_inline)) void score(const segment_t *sg, int bf, int64_t b, int64_t g,
                                                        const int64_t G, const int64_t C, v8 (*q)[MAXD / 8],
                                                        float *s, int64_t stride, float *mx) {
  const int64_t r = b / sg->group, L = sg->L, kb = r * sg->skb + g * sg->skh, vb = r * sg->svb + g * sg->svh;
  const int64_t es = bf ? 2 : 4, row = 8 * C * es; /* bytes of one position's key or value */
  const uint8_t *seen = sg->seen ? sg->seen + r * sg->smb : NULL;
  int64_t l = 0;
  for (; l + PB <= L; l += PB) {
    for (int i = 0; i < PB; ++i) prefetch((const char *)sg->v + (vb + (l + i) * sg->svl) * es, row);
    v8 acc[MAXG][PB];
    for (int64_t j = 0; j < G; ++j)
      for (int i = 0; i < PB; ++i) acc[j][i] = (v8){0};
    for (int64_t c = 0; c < C; ++c) {
      v8 kr[PB];
      _Pragma("GCC unroll 8") for (int i = 0; i < PB; ++i) kr[i] = load8(sg->k, kb + (l + i) * sg->skl + 8 * c, bf);
      _Pragma("GCC unroll 16") for (int64_t j = 0; j < G; ++j)
        _Pragma("GCC unroll 8") for (int i = 0; i < PB; ++i) acc[j][i] += q[j][c] * kr[i];
    }
    for (int64_t j = 0; j < G; ++j)
      for (int i = 0; i < PB; ++i) {
        const float t = !seen || seen[l + i] ? hsum(acc[j][i]) : -INFINITY;
        s[j * stride + l + i] = t;
        mx[j] = t > mx[j] ? t : mx[j];
      }
  }
  for (; l < L; ++l)
    for (int64_t j = 0; j < G; ++j) {
      v8 acc = {0};
      for (int64_t c = 0; c < C; ++c) acc += q[j][c] * load8(sg->k, kb + l * sg->skl + 8 * c, bf);
      const float t = !seen || seen[l] ? hsum(acc) : -INFINITY;
      s[j * stride + l] = t;
      mx[j] = t > mx[j] ? t : mx[j];
    }
}

/* acc[j][0..cn) += the softmax weights p[j * stride + m] times one segment's values, chunks c0.. of the head.
   `ahead` (or NULL): the keys the next item will score in this segment, `row` bytes a position, position m's
   prefetched with value m, so that its key pass starts from cache. */
static inline __attribute__((always_inline)) void weigh(const segment_t *sg, int bf, int64_t b, int64_t g,
                                                        const int64_t G, int64_t c0, int64_t cn, const float *p,
                                                        int64_t stride, v8 (*acc)[CB], const char *ahead,
                                                        int64_t row) {
  const int64_t r = b / sg->group, vb = r * sg->svb + g * sg->svh, es = bf ? 2 : 4;
  const uint8_t *seen = sg->seen ? sg->seen + r * sg->smb : NULL;
  for (int64_t m = 0; m < sg->L; ++m) {
    if (ahead) prefetch(ahead + m * sg->skl * es, row);
    if (seen && !seen[m]) continue; /* its slot may hold anything, a NaN included: 0 * NaN would reach the output */
    v8 vr[CB];
    for (int i = 0; i < cn; ++i) vr[i] = load8(sg->v, vb + m * sg->svl + 8 * (c0 + i), bf);
    _Pragma("GCC unroll 16") for (int64_t j = 0; j < G; ++j) {
      const float w = p[j * stride + m];
      for (int i = 0; i < cn; ++i) acc[j][i] += w * vr[i];
    }
  }
}

/* Row b, KV head g: its G query heads' outputs over both segments, one softmax. `s` holds G * (L0 + L1) scores.
   G and C (= D / 8) are constants in a build for one head shape, so the accumulators live in registers. `ahead`:
   the next item's own keys (or NULL), prefetched during this item's value pass over its own segment. */
static inline __attribute__((always_inline)) void attend(const job_t *a, int64_t b, int64_t g, const int64_t G,
                                                         const int64_t C, float *s, const char *ahead) {
  const int bf = a->bf16;
  const int64_t L0 = a->seg[0].L, Lt = L0 + a->seg[1].L;
  v8 q[MAXG][MAXD / 8];
  for (int64_t j = 0; j < G; ++j) {
    const float *qj = a->q + b * a->sqb + (g * G + j) * a->sqh;
    for (int64_t c = 0; c < C; ++c)
      for (int i = 0; i < 8; ++i) q[j][c][i] = (bf ? round_bf16(qj[8 * c + i]) : qj[8 * c + i]) * a->scale;
  }
  float mx[MAXG];
  for (int64_t j = 0; j < G; ++j) mx[j] = -INFINITY;
  score(&a->seg[0], bf, b, g, G, C, q, s, Lt, mx);
  score(&a->seg[1], bf, b, g, G, C, q, s + L0, Lt, mx);
  float inv[MAXG];
  for (int64_t j = 0; j < G; ++j) {
    float total = 0.f;
    for (int64_t m = 0; m < Lt; ++m) {
      const float t = s[j * Lt + m];
      const float e = t == -INFINITY ? 0.f : exp_clamped(t - mx[j]);
      s[j * Lt + m] = e;
      total += e;
    }
    inv[j] = 1.f / total;
  }
  for (int64_t c0 = 0; c0 < C; c0 += CB) {
    const int64_t cn = C - c0 < CB ? C - c0 : CB;
    v8 acc[MAXG][CB];
    for (int64_t j = 0; j < G; ++j)
      for (int i = 0; i < CB; ++i) acc[j][i] = (v8){0};
    weigh(&a->seg[0], bf, b, g, G, c0, cn, s, Lt, acc, NULL, 0);
    weigh(&a->seg[1], bf, b, g, G, c0, cn, s + L0, Lt, acc, c0 ? NULL : ahead, 8 * C * (bf ? 2 : 4));
    for (int64_t j = 0; j < G; ++j) {
      float *o = a->out + b * a->sob + (g * G + j) * a->soh + 8 * c0;
      for (int i = 0; i < cn; ++i) {
        const v8 t = acc[j][i] * inv[j];
        memcpy(o + 8 * i, &t, 32);
      }
    }
  }
}

/* Item `item`'s row b and KV head g, items ordered (group of n rows, KV head, row in group). */
static inline void locate(int64_t item, int64_t n, int64_t KV, int64_t *b, int64_t *g) {
  *b = item / (n * KV) * n + item % n;
  *g = item / n % KV;
}

/* Items [begin, end) of the B * KV (row, KV head) pairs, ordered (group, KV head, row in group) so that a group's
   rows read its shared prompt's keys for one KV head one after another, from cache. */
static int run_part(const job_t *a, int64_t begin, int64_t end) {
  const int64_t G = a->H / a->KV, C = a->D / 8, n = a->seg[0].group, Lt = a->seg[0].L + a->seg[1].L;
  float *s = (float *)malloc(sizeof(float) * (size_t)(G * (Lt > 0 ? Lt : 1)));
  if (!s) return 1;
  const segment_t *own = &a->seg[1];
  for (int64_t item = begin; item < end; ++item) {
    int64_t b, g, b1, g1;
    locate(item, n, a->KV, &b, &g);
    locate(item + 1, n, a->KV, &b1, &g1); /* the next item, whose own keys this one's value pass prefetches */
    const char *ahead = item + 1 < end ? (const char *)own->k + (b1 * own->skb + g1 * own->skh) * (a->bf16 ? 2 : 4)
                                       : NULL;
#ifdef TANDEM_G
    (void)C;
    attend(a, b, g, TANDEM_G, TANDEM_C, s, ahead);
#else
    attend(a, b, g, G, C, s, ahead);
#endif
  }
  free(s);
  return 0;
}

/* Checks a job's shapes and runs it, split over up to `threads` threads when there is enough work: 0, or nonzero
   where a shape is out of range or memory ran out (out is then not fully written). */
static int run_job(const job_t *job, int threads) {
  const int64_t B = job->B, H = job->H, KV = job->KV, D = job->D, n = job->seg[0].group;
#ifdef TANDEM_G
  if (KV <= 0 || H != TANDEM_G * KV || D != 8 * TANDEM_C) return 3; /* built for another head shape */
#endif
  if (KV <= 0 || H % KV || H / KV > MAXG || D % 8 || D > MAXD || n <= 0 || B % n || job->seg[1].group != 1 ||
      job->seg[0].L < 0 || job->seg[1].L < 0 || job->seg[0].L + job->seg[1].L <= 0)
    return 2;
  const int64_t items = B * KV, bytes = items * (job->seg[0].L / n + job->seg[1].L) * D * (job->bf16 ? 2 : 4) * 2;
  int parts_n = threads < 1 ? 1 : threads > 64 ? 64 : threads;
  if (bytes < ((int64_t)1 << 20)) parts_n = 1; /* under ~1 MB, too little to split */
  if (parts_n > items / n) parts_n = (int)(items / n);
  /* split on group boundaries, so that a group's rows stay on one thread and read its prompt from one cache; the
     threads are OpenMP's, PyTorch's own pool where its libgomp is loaded (the same soname), so no thread is started
     and none spins against torch's */
  const int64_t groups = items / n;
  int status = 0;
#pragma omp parallel for num_threads(parts_n) schedule(static) reduction(| : status)
  for (int t = 0; t < parts_n; ++t) status |= run_part(job, groups * t / parts_n * n, groups * (t + 1) / parts_n * n);
  return status;
}

/* dims: B, H, KV, D, q's strides (row, head), out's (row, head), then for the shared prompt segment and the rows'
   own segment each: L, group, k's strides (row, head, position), v's, seen's row stride. A segment of L = 0 is
   skipped (no prompt held apart: pass L = 0 and group = 1). Returns `run_job`'s code. */
int tandem_decode_attention(const float *q, float *out, const void *pk, const void *pv, const uint8_t *pseen,
                            const void *k, const void *v, const uint8_t *seen, const int64_t *dims, int bf16,
                            float scale, int threads) {
  job_t job = {q, out, {{.k = pk, .v = pv, .seen = pseen}, {.k = k, .v = v, .seen = seen}}, dims[0], dims[1],
               dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], bf16, scale};
  for (int i = 0; i < 2; ++i) {
    const int64_t *d = dims + 8 + 9 * i;
    segment_t *sg = &job.seg[i];
    sg->L = d[0], sg->group = d[1], sg->skb = d[2], sg->skh = d[3], sg->skl = d[4], sg->svb = d[5], sg->svh = d[6];
    sg->svl = d[7], sg->smb = d[8];
  }
  return run_job(&job, threads);
}
