/* One sampled token per row from its logits, and its logprob: the hf engine's draw (tandem/rollout/hf.py, `_draw`)
   for sampling without top-k or top-p, in one call over the rows. Built and loaded by tandem/rollout/native.py
   (its own library: nothing in it depends on a model's head shape).

   Why: in PyTorch ops the draw is a log_softmax, an exp, a float64 running sum, a search and a gather, each a pass
   over a [rows, V] tensor it allocates; here each row is two passes over its logits, in cache, and rows that have
   finished cost nothing.

   The same draw as `_draw`'s PyTorch ops: the first token whose running sum of probabilities (float64) exceeds u
   times their total, u in [0, 1) one per row; a logit of -inf (or one more than 87 below the row's largest, whose
   probability e^-87 is below float32's resolution of the total) has probability 0 and is never drawn. Greedy
   (u NULL): the first largest logit. The logprob is under the temperature: (x - max) / T - log(total). */
#include <math.h>
#include <stdint.h>

#include "exp.h"

#define BLOCK 64 /* positions per partial sum: the search walks V / BLOCK sums, then one block */
#define MAXBLOCKS 8192 /* V up to 512 Ki */

/* A logit's unnormalized probability, with its row's largest logit m and 1 / temperature. */
static inline float weight(float x, float m, float inv_t) {
  const float t = (x - m) * inv_t;
  return t >= -87.f ? exp_clamped(t) : 0.f; /* -inf (and NaN) compare false: probability 0 */
}

/* rows x V logits (row stride `stride`); `alive` (NULL: all) marks the rows that draw, the others get `pad` and
   logprob 0; u [rows] the uniforms, or NULL for greedy; inv_t = 1 / temperature (1 when greedy). Writes tok and
   logp; returns 0, or 2 where V is beyond MAXBLOCKS blocks. */
int tandem_sample(const float *logits, int64_t rows, int64_t V, int64_t stride, float inv_t, const double *u,
                  const uint8_t *alive, int64_t pad, int64_t *tok, float *logp) {
  if (V < 1 || (V + BLOCK - 1) / BLOCK > MAXBLOCKS) return 2;
  double sums[MAXBLOCKS];
  const int64_t blocks = (V + BLOCK - 1) / BLOCK;
  for (int64_t r = 0; r < rows; ++r) {
    if (alive && !alive[r]) {
      tok[r] = pad;
      logp[r] = 0.f;
      continue;
    }
    const float *x = logits + r * stride;
    float m = x[0];
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i) /* the first largest, as torch.argmax */
      if (x[i] > m) m = x[i], best = i;
    double total = 0.;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
      double s = 0.; /* float64 sums throughout: a token of probability 1e-12 keeps its share */
      for (int64_t i = b * BLOCK; i < end; ++i) s += weight(x[i], m, inv_t);
      sums[b] = s;
      total += s;
    }
    int64_t pick = best;
    if (u) {
      const double target = u[r] * total; /* u < 1: below the total */
      double before = 0.;
      int64_t b = 0;
      while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
      /* within block b: the first position whose running sum passes the target (rounding, summed in another
         order than the block's sum, may leave none: then the block's last position of nonzero probability) */
      const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
      double acc = before;
      pick = -1;
      for (int64_t i = b * BLOCK; i < end; ++i) {
        const float w = weight(x[i], m, inv_t);
        if (w > 0.f) {
          pick = i;
          acc += w;
          if (acc > target) break;
        }
      }
      if (pick < 0) pick = best; /* a block of zeros can only be reached through rounding: the mode instead */
    }
    tok[r] = pick;
    logp[r] = (float)((double)((x[pick] - m) * inv_t) - log(total));
  }
  return 0;
}
