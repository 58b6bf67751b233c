// Greedy sampling's argmax over the LM head's output (_cpu_kernels.argmax_columns).
//
// On the CPU the LM head returns logits as the transposed view of a [vocab, rows]
// product (layers/linear.py), and torch's argmax over that view's last dim walks
// memory with a stride of `rows` elements: several ms per decode step for a 49k
// vocabulary. Here the walk is over vocab rows with the request rows contiguous,
// so each step of the loop compares one contiguous run of `rows` values against
// the running maxima (vectorised by the compiler at each level).
//
// Semantics are torch.argmax's: the first index of the maximum; a NaN counts as
// larger than any number (the first NaN wins).
#include "cpu_kernels.h"

#include <cstdint>

namespace {

template <typename Load>
RS_ALWAYS_INLINE void argmax_cols(Load load, int64_t vocab, int64_t rows, int64_t* out) {
  // Blocks of 64 request rows keep the running maxima in registers.
  constexpr int64_t kBlock = 64;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t n = rows - r0 < kBlock ? rows - r0 : kBlock;
    float best[kBlock];
    int32_t idx[kBlock];
    for (int64_t j = 0; j < n; ++j) {
      best[j] = load(r0 + j);
      idx[j] = 0;
    }
    for (int64_t v = 1; v < vocab; ++v) {
      const int64_t base = v * rows + r0;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float x = load(base + j);
        const float b = best[j];
        // x != x: x is NaN; b == b: the maximum so far is not.
        const bool take = (x > b) | ((x != x) & (b == b));
        best[j] = take ? x : b;
        idx[j] = take ? static_cast<int32_t>(v) : idx[j];
      }
    }
    for (int64_t j = 0; j < n; ++j) out[r0 + j] = idx[j];
  }
}

template <int>
RS_ALWAYS_INLINE void argmax_any(const void* x, bool bf16, int64_t vocab, int64_t rows,
                                 int64_t* out) {
  if (bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(x);
    argmax_cols([p](int64_t i) { return radixserve::bf16_to_f32(p[i]); }, vocab, rows, out);
  } else {
    const float* p = static_cast<const float*>(x);
    argmax_cols([p](int64_t i) { return p[i]; }, vocab, rows, out);
  }
}

void argmax_baseline(const void* x, bool bf16, int64_t vocab, int64_t rows, int64_t* out) {
  argmax_any<0>(x, bf16, vocab, rows, out);
}

RS_TARGET_AVX2 void argmax_avx2(const void* x, bool bf16, int64_t vocab, int64_t rows,
                                int64_t* out) {
  argmax_any<1>(x, bf16, vocab, rows, out);
}

RS_TARGET_AVX512 void argmax_avx512(const void* x, bool bf16, int64_t vocab, int64_t rows,
                                    int64_t* out) {
  argmax_any<2>(x, bf16, vocab, rows, out);
}

}  // namespace

void radixserve::argmax_columns(const void* x, bool bf16, int64_t vocab, int64_t rows,
                                int64_t* out, Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return argmax_baseline(x, bf16, vocab, rows, out);
    case Isa::kAvx2:
      return argmax_avx2(x, bf16, vocab, rows, out);
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return argmax_avx512(x, bf16, vocab, rows, out);
  }
}
