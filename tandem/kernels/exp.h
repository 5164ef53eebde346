/* e^x in float32 for tandem's kernels: decode_attention.c (the softmax), decode_step.c (SiLU), sample.c (the draw),
   train_ops.c (SiLU, forward and backward). Included, not compiled alone. */
#ifndef TANDEM_EXP_H
#define TANDEM_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x clamped to [-87, 88] (a softmax's x <= 0 after its max is subtracted; SiLU's in decode_step.c and
   train_ops.c), branch-free so the loop vectorizes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
   polynomial (relative error under 2e-7), 2^n from the exponent bits (n in -126..127: a normal float). */
static inline float exp_clamped(float x) {
  x = x > 88.f ? 88.f : x < -87.f ? -87.f : x;
  const float n = floorf(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#endif
