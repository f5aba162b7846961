#include "quantlab_cpu.h"

#include <stdatomic.h>

/* ---- quantization (quantize-on-load) ------------------------------------------------------------
 * The same operations in the same order as the codecs' round to nearest in quantlab/formats
 * (affine.py, nf4.py, packing.py), one row at a time, so codes and scales are bit-identical to the
 * torch definitions (only the sign of a zero point that is exactly 0 may differ: torch's amin
 * returns +0 or -0 depending on where they sit in the group; neither codes nor dequantized
 * values change).
 */

static inline uint32_t ql_bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static inline float ql_float_of(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* float32 -> float16, round to nearest even: c10's fp16_ieee_from_fp32_value, exactly. */
static uint16_t ql_float_to_half(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
    uint32_t w = ql_bits_of(f), shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = ql_float_of((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = ql_bits_of(base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16, round to nearest even: c10's round_to_nearest_even. */
static uint16_t ql_float_to_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t bits = ql_bits_of(f);
    return (uint16_t)((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16);
}

/* Cast to the storage dtype and back; *stored receives the stored bits. */
static float ql_store(float value, int32_t dtype, void *base, int64_t i) {
    if (dtype == QL_F16) {
        uint16_t half = ql_float_to_half(value);
        ((uint16_t *)base)[i] = half;
        return ql_half_to_float(half);
    }
    if (dtype == QL_BF16) {
        uint16_t half = ql_float_to_bf16(value);
        ((uint16_t *)base)[i] = half;
        return ql_float_of((uint32_t)half << 16);
    }
    ((float *)base)[i] = value;
    return value;
}

/* torch.round: to nearest, ties to even (exact for |x| < 2**22; larger values are clamped). */
static inline float ql_round(float x) {
    const float magic = 0x1.8p23f;
    if (__builtin_fabsf(x) >= 0x1.0p22f) return x;
    return (x + magic) - magic;
}

static inline float ql_clamp(float x, float low, float high) { return x < low ? low : (x > high ? high : x); }

typedef struct {
    const float *w;
    int64_t n, k, w_stride, group_size, groups;
    int bits, symmetric, scale_dtype;
    uint8_t *codes;
    void *scale, *zero;
    const float *midpoints; /* NF4 */
    float *absmax;
    int64_t per_chunk;
    int64_t groups_from; /* the scalar loops start at this group */
} ql_quantize_job;

/* Value j of group g of a row, the last group padded by repeating the row's last weight. */
static inline float ql_grouped(const float *row, int64_t k, int64_t first, int64_t j) {
    int64_t i = first + j;
    return row[i < k ? i : k - 1];
}

static void ql_quantize_affine_rows(const ql_quantize_job *job, int64_t n0, int64_t n1) {
    const int64_t gs = job->group_size;
    const float qmax_asym = (float)((1 << job->bits) - 1), qmax_sym = (float)((1 << (job->bits - 1)) - 1);
    const float offset = (float)(1 << (job->bits - 1));
    for (int64_t n = n0; n < n1; n++) {
        const float *row = job->w + n * job->w_stride;
        for (int64_t g = job->groups_from; g < job->groups; g++) {
            int64_t index = n * job->groups + g, first = g * gs;
            uint8_t *codes = job->codes + index * gs;
            if (job->symmetric) {
                float amax = 0.0f;
                for (int64_t j = 0; j < gs; j++) {
                    float a = __builtin_fabsf(ql_grouped(row, job->k, first, j));
                    amax = a > amax ? a : amax;
                }
                float scale = ql_store(amax / qmax_sym, job->scale_dtype, job->scale, index);
                if (scale == 0.0f) scale = ql_store(1.0f, job->scale_dtype, job->scale, index);
                for (int64_t j = 0; j < gs; j++) {
                    float q = ql_clamp(ql_round(ql_grouped(row, job->k, first, j) / scale), -qmax_sym, qmax_sym);
                    codes[j] = (uint8_t)(int)(q + offset);
                }
            } else {
                float low = ql_grouped(row, job->k, first, 0), high = low;
                for (int64_t j = 1; j < gs; j++) {
                    float v = ql_grouped(row, job->k, first, j);
                    low = v < low ? v : low;
                    high = v > high ? v : high;
                }
                float scale = ql_store((high - low) / qmax_asym, job->scale_dtype, job->scale, index);
                if (scale == 0.0f) scale = ql_store(1.0f, job->scale_dtype, job->scale, index);
                float zero = ql_store(-low / scale, job->scale_dtype, job->zero, index);
                for (int64_t j = 0; j < gs; j++) {
                    float q = ql_clamp(ql_round(ql_grouped(row, job->k, first, j) / scale + zero), 0.0f, qmax_asym);
                    codes[j] = (uint8_t)(int)q;
                }
            }
        }
    }
}

static void ql_quantize_nf4_rows(const ql_quantize_job *job, int64_t n0, int64_t n1) {
    const int64_t bs = job->group_size;
    for (int64_t n = n0; n < n1; n++) {
        const float *row = job->w + n * job->w_stride;
        for (int64_t g = job->groups_from; g < job->groups; g++) {
            int64_t index = n * job->groups + g, first = g * bs;
            float amax = 0.0f;
            for (int64_t j = 0; j < bs; j++) {
                float a = __builtin_fabsf(ql_grouped(row, job->k, first, j));
                amax = a > amax ? a : amax;
            }
            job->absmax[index] = amax;
            float divisor = amax < 1e-38f ? 1e-38f : amax;
            uint8_t *codes = job->codes + index * bs;
            for (int64_t j = 0; j < bs; j++) {
                float scaled = ql_clamp(ql_grouped(row, job->k, first, j) / divisor, -1.0f, 1.0f);
                uint8_t code = 0;
                for (int i = 0; i < 15; i++) code += job->midpoints[i] < scaled;
                codes[j] = code;
            }
        }
    }
}

#ifdef QL_X86
/* AVX-512 versions for groups without padding: exact max/min reductions, IEEE division and
 * round-to-nearest-even give the same results as the scalar loops above. */
static QL_AVX512 void ql_store_codes16(uint8_t *dst, __m512 q) {
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
}

static QL_AVX512 __m512 ql_round16(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

static QL_AVX512 void ql_quantize_affine_group512(const ql_quantize_job *job, const float *v, int64_t index) {
    const int64_t gs = job->group_size;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    uint8_t *codes = job->codes + index * gs;
    if (job->symmetric) {
        const float qmax = (float)((1 << (job->bits - 1)) - 1);
        __m512 amax = _mm512_setzero_ps();
        for (int64_t j = 0; j < gs; j += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(v + j)));
        float scale = ql_store(_mm512_reduce_max_ps(amax) / qmax, job->scale_dtype, job->scale, index);
        if (scale == 0.0f) scale = ql_store(1.0f, job->scale_dtype, job->scale, index);
        const __m512 s = _mm512_set1_ps(scale), low = _mm512_set1_ps(-qmax), high = _mm512_set1_ps(qmax);
        const __m512 offset = _mm512_set1_ps((float)(1 << (job->bits - 1)));
        for (int64_t j = 0; j < gs; j += 16) {
            __m512 q = ql_round16(_mm512_div_ps(_mm512_loadu_ps(v + j), s));
            ql_store_codes16(codes + j, _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(q, low), high), offset));
        }
        return;
    }
    const float qmax = (float)((1 << job->bits) - 1);
    __m512 lowest = _mm512_loadu_ps(v), highest = lowest;
    for (int64_t j = 16; j < gs; j += 16) {
        __m512 x = _mm512_loadu_ps(v + j);
        lowest = _mm512_min_ps(lowest, x);
        highest = _mm512_max_ps(highest, x);
    }
    float low = _mm512_reduce_min_ps(lowest), high = _mm512_reduce_max_ps(highest);
    float scale = ql_store((high - low) / qmax, job->scale_dtype, job->scale, index);
    if (scale == 0.0f) scale = ql_store(1.0f, job->scale_dtype, job->scale, index);
    float zero = ql_store(-low / scale, job->scale_dtype, job->zero, index);
    const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero), top = _mm512_set1_ps(qmax);
    for (int64_t j = 0; j < gs; j += 16) {
        __m512 q = ql_round16(_mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(v + j), s), z));
        ql_store_codes16(codes + j, _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), top));
    }
}

static QL_AVX512 void ql_quantize_nf4_group512(const ql_quantize_job *job, const float *v, int64_t index) {
    const int64_t bs = job->group_size;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < bs; j += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(v + j)));
    float absmax = _mm512_reduce_max_ps(amax);
    job->absmax[index] = absmax;
    const __m512 divisor = _mm512_set1_ps(absmax < 1e-38f ? 1e-38f : absmax);
    const __m512 one = _mm512_set1_ps(1.0f), minus_one = _mm512_set1_ps(-1.0f);
    const __m512i increment = _mm512_set1_epi32(1);
    uint8_t *codes = job->codes + index * bs;
    for (int64_t j = 0; j < bs; j += 16) {
        __m512 scaled = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(v + j), divisor), minus_one), one);
        __m512i code = _mm512_setzero_si512();
        for (int i = 0; i < 15; i++) {
            __mmask16 below = _mm512_cmp_ps_mask(_mm512_set1_ps(job->midpoints[i]), scaled, _CMP_LT_OQ);
            code = _mm512_mask_add_epi32(code, below, code, increment);
        }
        _mm_storeu_si128((__m128i *)(codes + j), _mm512_cvtepi32_epi8(code));
    }
}
#endif

/* Rows [n0, n1): whole groups of a multiple of 16 weights go to AVX-512 when this CPU has it. */
static void ql_quantize_rows(const ql_quantize_job *job, int64_t n0, int64_t n1, int nf4) {
#ifdef QL_X86
    if (ql_isa() == QL_ISA_AVX512 && job->group_size % 16 == 0) {
        int64_t whole = job->k / job->group_size;
        for (int64_t n = n0; n < n1; n++) {
            const float *row = job->w + n * job->w_stride;
            for (int64_t g = 0; g < whole; g++) {
                if (nf4)
                    ql_quantize_nf4_group512(job, row + g * job->group_size, n * job->groups + g);
                else
                    ql_quantize_affine_group512(job, row + g * job->group_size, n * job->groups + g);
            }
        }
        if (whole < job->groups) { /* the last group, padded: scalar */
            ql_quantize_job tail = *job;
            tail.groups_from = whole;
            if (nf4)
                ql_quantize_nf4_rows(&tail, n0, n1);
            else
                ql_quantize_affine_rows(&tail, n0, n1);
        }
        return;
    }
#endif
    if (nf4)
        ql_quantize_nf4_rows(job, n0, n1);
    else
        ql_quantize_affine_rows(job, n0, n1);
}

static void ql_quantize_affine_chunk(void *arg, int64_t chunk) {
    const ql_quantize_job *job = (const ql_quantize_job *)arg;
    int64_t n0 = chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    ql_quantize_rows(job, n0, n1 < job->n ? n1 : job->n, 0);
}

static void ql_quantize_nf4_chunk(void *arg, int64_t chunk) {
    const ql_quantize_job *job = (const ql_quantize_job *)arg;
    int64_t n0 = chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    ql_quantize_rows(job, n0, n1 < job->n ? n1 : job->n, 1);
}

static void ql_run_rows(ql_task task, ql_quantize_job *job, int threads) {
    threads = ql_threads(threads, job->n * job->k);
    job->per_chunk = threads > 1 ? ql_chunk_features(job->n, threads, 4) : job->n;
    ql_run(task, job, (job->n + job->per_chunk - 1) / job->per_chunk, threads);
}

/* Round-to-nearest codes [n, groups, group_size] (uint8) with a scale (and zero point) per
 * group, as the affine codec's round to nearest (AffineCodec.quantize); w is [n, k] float32 with row stride w_stride. */
QL_API int ql_quantize_affine(const float *w, int64_t n, int64_t k, int64_t w_stride, int64_t group_size, int bits,
                       int symmetric, int scale_dtype, uint8_t *codes, void *scale, void *zero, int threads) {
    if (bits < 2 || bits > 8 || n < 1 || k < 1 || group_size < 1 || (!symmetric && !zero)) return QL_BAD_FORMAT;
    ql_quantize_job job = {.w = w, .n = n, .k = k, .w_stride = w_stride, .group_size = group_size,
                           .groups = (k + group_size - 1) / group_size, .bits = bits, .symmetric = symmetric,
                           .scale_dtype = scale_dtype, .codes = codes, .scale = scale, .zero = zero};
    ql_run_rows(ql_quantize_affine_chunk, &job, threads);
    return QL_OK;
}

/* NF4 codes [n, blocks, blocksize] and absmax [n, blocks], as the nf4 codec's round to nearest (NF4Codec.quantize). */
QL_API int ql_quantize_nf4(const float *w, int64_t n, int64_t k, int64_t w_stride, int64_t blocksize, const float *midpoints,
                    uint8_t *codes, float *absmax, int threads) {
    if (n < 1 || k < 1 || blocksize < 1) return QL_BAD_FORMAT;
    ql_quantize_job job = {.w = w, .n = n, .k = k, .w_stride = w_stride, .group_size = blocksize,
                           .groups = (k + blocksize - 1) / blocksize, .codes = codes, .midpoints = midpoints,
                           .absmax = absmax};
    ql_run_rows(ql_quantize_nf4_chunk, &job, threads);
    return QL_OK;
}

/* quantlab.formats.packing.pack: rows of `length` codes into rows of ceil(length / 8) * bits bytes. */
QL_API int ql_pack(const uint8_t *codes, int64_t rows, int64_t length, int bits, uint8_t *out) {
    if (bits < 1 || bits > 8) return QL_BAD_FORMAT;
    int64_t chunks = (length + 7) / 8;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = codes + r * length;
        uint8_t *dst = out + r * chunks * bits;
        for (int64_t c = 0; c < chunks; c++) {
            uint64_t word = 0;
            for (int i = 0; i < 8; i++) {
                int64_t j = c * 8 + i;
                uint64_t code = j < length ? src[j] : 0;
                word += code << (i * bits); /* a sum, as torch's pack computes it */
            }
            for (int b = 0; b < bits; b++) dst[c * bits + b] = (uint8_t)(word >> (8 * b));
        }
    }
    return QL_OK;
}

/* Number of NaN and infinite values among n float32 (a float is finite when its exponent is not all ones). */
typedef struct {
    const uint32_t *bits;
    int64_t n, per_chunk;
    _Atomic int64_t count;
} ql_count_job;

static void ql_count_chunk(void *arg, int64_t chunk) {
    ql_count_job *job = (ql_count_job *)arg;
    int64_t begin = chunk * job->per_chunk, end = begin + job->per_chunk < job->n ? begin + job->per_chunk : job->n;
    int64_t count = 0;
    for (int64_t i = begin; i < end; i++) count += (job->bits[i] & 0x7f800000u) == 0x7f800000u;
    atomic_fetch_add(&job->count, count);
}

QL_API int64_t ql_count_nonfinite(const float *values, int64_t n, int threads) {
    ql_count_job job = {.bits = (const uint32_t *)values, .n = n};
    threads = ql_threads(threads, n);
    job.per_chunk = threads > 1 ? (n + 4 * threads - 1) / (4 * threads) : (n > 0 ? n : 1);
    ql_run(ql_count_chunk, &job, (n + job.per_chunk - 1) / job.per_chunk, threads);
    return atomic_load(&job.count);
}

/* torch.bucketize(values, boundaries, right=False) for sorted boundaries: how many are < value. */
QL_API int ql_bucketize(const float *values, int64_t n, const float *boundaries, int64_t count, int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t low = 0, high = count;
        while (low < high) {
            int64_t mid = (low + high) / 2;
            if (boundaries[mid] < values[i])
                low = mid + 1;
            else
                high = mid;
        }
        out[i] = (int32_t)low;
    }
    return QL_OK;
}

/* Offset-binary bytes (q + 128) to two's complement int8 (q), in place: flip the top bit. */
QL_API int ql_offset_to_signed(uint8_t *codes, int64_t n) {
    for (int64_t i = 0; i < n; i++) codes[i] ^= 0x80u;
    return QL_OK;
}
