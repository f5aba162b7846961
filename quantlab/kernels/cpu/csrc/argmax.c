/* The index of the largest of n floats, the first where several tie, as torch.argmax gives it: a NaN counts
 * as larger than any number (the first NaN's index). Greedy decoding picks each token so: over SmolLM2's
 * 49,152 logits torch.argmax takes about 43 us, a tenth of the Python around a native decode step; two
 * vector passes, the maximum, then its first position, take a few (benchmarks/RESULTS.md). */
#include "quantlab_cpu.h"

#include <math.h>

static int64_t ql_first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

static int64_t ql_argmax_portable(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) {
        if (isnan(x[i])) return isnan(x[best]) ? best : i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

#ifdef QL_X86
QL_AVX512 static int64_t ql_argmax512(const float *x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    if (unordered) return ql_first_nan(x, n);
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __mmask16 equal = _mm512_mask_cmp_ps_mask(mask, _mm512_maskz_loadu_ps(mask, x + i), top, _CMP_EQ_OQ);
        if (equal) return i + __builtin_ctz(equal);
    }
    return 0; /* not reached: the maximum is one of the values */
}

QL_AVX2 static int64_t ql_argmax256(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int unordered = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (; i < n; i++) {
        unordered |= isnan(x[i]);
        top = x[i] > top ? x[i] : top;
    }
    if (unordered) return ql_first_nan(x, n);
    const __m256 wanted = _mm256_set1_ps(top);
    for (i = 0; i + 8 <= n; i += 8) {
        const int equal = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
        if (equal) return i + __builtin_ctz((unsigned)equal);
    }
    for (; i < n; i++)
        if (x[i] == top) return i;
    return 0; /* not reached */
}
#endif

/* -1 when n < 1. */
QL_API int64_t ql_argmax(const float *x, int64_t n) {
    if (n < 1) return -1;
#ifdef QL_X86
    const int isa = ql_isa();
    if (isa == QL_ISA_AVX512) return ql_argmax512(x, n);
    if (isa == QL_ISA_AVX2) return ql_argmax256(x, n);
#endif
    return ql_argmax_portable(x, n);
}
