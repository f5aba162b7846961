/*
 * Shared declarations of quantlab's CPU kernels (see matmul.c for what they compute).
 *
 * Every translation unit is plain C11; x86 code lives in functions compiled for their
 * instruction set with `target` attributes and is called only after run-time detection, so
 * one build runs on every x86-64 CPU. Only the functions marked QL_API are exported.
 */
#ifndef QUANTLAB_CPU_H
#define QUANTLAB_CPU_H

#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QL_X86 1
#include <immintrin.h>
#define QL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define QL_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#define QL_API __attribute__((visibility("default")))
#define QL_INLINE static inline __attribute__((always_inline))
#define QL_ABI_VERSION 15
#define QL_DECODE_ROWS 8 /* from this many rows on, AVX-512 decodes odd widths once into a buffer */
#define QL_DECODED_FEATURES 32 /* AVX2 at many rows: 16 features decoded, and their input-major panel (avx2.c) */
#define QL_AVX512_PANEL_ROWS 32 /* from this many rows on, AVX-512 multiplies panels of 32 decoded features (avx512.c) */
#define QL_AVX512_PANEL_FLOATS(row_length) (64 * (row_length)) /* its buffer: 32 decoded features, then their panel */

enum { QL_AFFINE = 0, QL_INT8 = 1, QL_NF4 = 2, QL_IQ4_NL = 3, QL_LUT = 4 };
#define QL_KINDS 5
enum { QL_F32 = 0, QL_F16 = 1, QL_BF16 = 2 };
enum { QL_ISA_SCALAR = 0, QL_ISA_AVX2 = 1, QL_ISA_AVX512 = 2 };
enum { QL_OK = 0, QL_BAD_FORMAT = 1, QL_NO_MEMORY = 2 };

/* One quantized weight matrix as stored (mirrors `QuantlabCpuWeight` in native.py). */
typedef struct {
    const uint8_t *codes;     /* [n, groups, group_bytes] */
    int64_t n;                /* out_features */
    int64_t k;                /* in_features */
    int64_t groups;
    int64_t group_size;       /* input features per group (the last group may be padded) */
    int64_t group_codes;      /* codes stored per group: group_size rounded up to whole bytes */
    int64_t group_bytes;
    int32_t bits;             /* 2..8 */
    int32_t kind;             /* QL_AFFINE: (q - zero) * scale; QL_INT8: signed q * scale; QL_NF4, QL_IQ4_NL, QL_LUT: levels[q] * scale */
    const void *scale;        /* [n, groups]: scale, or NF4 absmax without double quantization */
    const void *zero;         /* [n, groups] or NULL (then zero_const) */
    int32_t scale_dtype;
    int32_t zero_dtype;
    float zero_const;
    float absmax_offset;      /* NF4 double quantization: absmax = map[code] * scale[block] + offset */
    const uint8_t *absmax_codes;
    const float *absmax_scale;
    int64_t absmax_block;
    float levels[16];         /* the table of QL_NF4 and QL_IQ4_NL (fixed), or QL_LUT (the layer's own) */
    float absmax_map[256];
} ql_weight;

/* Kinds whose codes index `levels` (times the group's scale, or NF4's absmax), not integers. */
static inline int ql_table_kind(const ql_weight *w) { return w->kind == QL_NF4 || w->kind == QL_IQ4_NL || w->kind == QL_LUT; }

/* ---- decode constants of one group, computed exactly as the reference does ---------------- */

static inline float ql_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal half: normalise into a float32 exponent */
            int shifts = 0;
            while (!(mantissa & 0x400u)) {
                mantissa <<= 1;
                shifts++;
            }
            bits = sign | ((uint32_t)(127 - 14 - shifts) << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline float ql_load_float(const void *base, int32_t dtype, int64_t i) {
    if (dtype == QL_F16) return ql_half_to_float(((const uint16_t *)base)[i]);
    if (dtype == QL_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
        float value;
        memcpy(&value, &bits, 4);
        return value;
    }
    return ((const float *)base)[i];
}

typedef struct {
    float zero;  /* subtracted from the code (affine); 0 for int8 and NF4 */
    float scale; /* multiplies the centred code or the NF4 level */
} ql_group;

static inline ql_group ql_group_at(const ql_weight *w, int64_t index) {
    ql_group group;
    if (ql_table_kind(w)) {
        group.zero = 0.0f;
        if (w->absmax_codes) {
            float value = w->absmax_map[w->absmax_codes[index]] * w->absmax_scale[index >> __builtin_ctzll(w->absmax_block)];
            group.scale = value + w->absmax_offset;
        } else {
            group.scale = ql_load_float(w->scale, w->scale_dtype, index);
        }
    } else {
        group.scale = ql_load_float(w->scale, w->scale_dtype, index);
        group.zero = w->zero ? ql_load_float(w->zero, w->zero_dtype, index) : w->zero_const;
    }
    return group;
}

/* Value of code q before scaling; q is already sign-extended for int8. */
static inline float ql_base(const ql_weight *w, int32_t q, float zero) {
    return ql_table_kind(w) ? w->levels[q] : (float)q - zero;
}

static inline int32_t ql_code_at(const ql_weight *w, const uint8_t *group, int64_t j) {
    if (w->bits == 8) return w->kind == QL_INT8 ? (int32_t)(int8_t)group[j] : (int32_t)group[j];
    int64_t bit = j * w->bits, byte = bit >> 3;
    uint32_t word = group[byte];
    if (byte + 1 < w->group_bytes) word |= (uint32_t)group[byte + 1] << 8;
    return (int32_t)((word >> (bit & 7)) & ((1u << w->bits) - 1u));
}

static inline int64_t ql_round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

/* ---- activation layout ---------------------------------------------------------------------
 * x is copied once per call into groups padded with zeros to whole chunks of codes, so a
 * kernel never checks bounds on x and padding codes meet zeros. In the "nibble" layout
 * each 32-code chunk holds the 16 even inputs, then the 16 odd ones: the low and high
 * nibbles of 16 packed bytes line up with them without any shuffle of the codes.
 */
typedef struct {
    int64_t chunk;        /* codes per inner step */
    int64_t padded_group; /* group_codes rounded up to the chunk */
    int nibble;
} ql_layout;

static inline ql_layout ql_make_layout(const ql_weight *w, int64_t chunk, int nibble) {
    ql_layout layout = {chunk, ql_round_up(w->group_codes, chunk), nibble};
    return layout;
}

/* portable.c */
void ql_params_scalar(const ql_weight *w, int64_t n, float *scale, float *zero);
void ql_prepare_x(const ql_weight *w, const ql_layout *layout, const float *x, int64_t m, int64_t x_stride, float *xp);
void ql_gemm_scalar(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0, int64_t n1,
                    float *y, int64_t y_stride, float *buffer);
void ql_dequantize_scalar(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride, float *buffer);

#ifdef QL_X86
/* Converts 16 stored floats (float32, float16 or bfloat16) exactly; `count` < 16 masks the load. */
QL_INLINE QL_AVX512 __m512 ql_load16(const void *base, int32_t dtype, int64_t i, int64_t count) {
    __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
    if (dtype == QL_F32) return _mm512_maskz_loadu_ps(mask, (const float *)base + i);
    __m256i halves = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + i);
    if (dtype == QL_F16) return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* The sum of v's 8 lanes (avx2.c, avx2_int8.c). */
QL_INLINE QL_AVX2 float ql_sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[j] = the sum of acc[j]'s lanes for j < NR; 4 accumulators are summed together, pairwise. */
QL_INLINE QL_AVX512 void ql_store_sums(const int NR, const __m512 *acc, float *y) {
    if (NR != 4) {
        for (int j = 0; j < NR; j++) y[j] = _mm512_reduce_add_ps(acc[j]);
        return;
    }
    /* 512 -> 256 bits: lanes of accumulators 0 and 1 (then 2 and 3) side by side, halves added */
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44), _mm512_shuffle_f32x4(acc[0], acc[1], 0xee));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44), _mm512_shuffle_f32x4(acc[2], acc[3], 0xee));
    /* ab: [a0+a2, a1+a3, b0+b2, b1+b3] in 128-bit quarters (a = acc 0's quarters); the same for cd */
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    /* abcd: one 128-bit quarter per accumulator [a, b, c, d], 4 partial sums each */
    __m512 pairs = _mm512_add_ps(abcd, _mm512_permute_ps(abcd, 0x4e));
    __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xb1));
    /* lane 0 of each quarter holds that accumulator's total */
    const __m512i first_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(first_lanes, sums)));
}

/* exp(x) of 16 lanes (softmax in attention.c, silu in decode.c), as Cephes' expf computes it: x = n ln2 + r, a degree-6 polynomial in r, times 2^n.
 * Within 1 ulp of glibc's expf on every 64th float of [-87, 88]; below -87.34 (2^-126) it stays at that, which
 * against softmax's max of 1 is 0. */
QL_INLINE QL_AVX512 __m512 ql_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts: r exact */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* ql_exp512's polynomial on 8 lanes; 2^n is built in the exponent bits, so x is also kept below
 * 88.376 (n <= 127), where expf is within 1 ulp of FLT_MAX; softmax's inputs are at most 0 and
 * silu's large ones give 0 either way. */
QL_INLINE QL_AVX2 __m256 ql_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

/* avx512.c */
enum { QL_MODE_NIBBLE = 0, QL_MODE_BYTE = 1, QL_MODE_BITS = 2 };
int ql_mode512(const ql_weight *w); /* QL_MODE_NIBBLE: the nibble layout of x, on AVX2 too */
void ql_gemm512(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0, int64_t n1,
                float *y, int64_t y_stride, float *params, float *decoded);
void ql_dequantize512(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride, float *params);
void ql_params512(const ql_weight *w, int64_t n, float *scale, float *zero); /* scale and zero of row n's groups */
void ql_params4_512(const ql_weight *w, int64_t n, float *params); /* rows n..n+3: scales at jG, zeros at (4 + j)G */
/* avx512_vnni.c: int8 activations for 4-bit and int8 weights (int8_activations.c) */
void ql_quantize_x_a8(const float *xp, int64_t m, int64_t row_length, int nibble, int8_t *xq, float *xd, int32_t *xs);
void ql_gemm512_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                   int64_t row_length, int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params, float *xz);
/* avx2.c */
void ql_gemm256(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t x_stride, int64_t m, int64_t n0, int64_t n1,
                float *y, int64_t y_stride, float *params, float *decoded); /* decoded: NULL, or QL_DECODED_FEATURES rows of x */
void ql_dequantize256(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride, float *params);
void ql_params256(const ql_weight *w, int64_t n, int count, float *scale, float *zero); /* ql_params_scalar of count features, 8 groups a step */
/* avx2_int8.c */
void ql_quantize_x_a8_256(const float *xp, int64_t m, int64_t row_length, int nibble, int8_t *xq, float *xd,
                          int32_t *xs);
void ql_gemm256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                   int64_t row_length, int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params, float *xz);
#endif

/* int8_activations.c */
enum { QL_A8_NONE = 0, QL_A8_AVX2 = 1, QL_A8_VNNI = 2 };
int ql_a8_kernel(void); /* which int8-activation kernel this CPU runs */
int ql_a8_eligible(const ql_weight *w);
void ql_zero_terms(const ql_weight *w, const float *xd, const int32_t *xs, float *xz);
QL_API int ql_has_int8_activations(void);
/* The many-row kernels' per-thread scratch (avx512_vnni_rows.c, avx2_int8_rows.c): every row's zero-point
 * terms, one panel's scales and scale * zero as [groups][panel features] (and as stored, feature by
 * feature, on their way), and its repacked codes. */
typedef struct {
    float *xz;
    float *scales;
    float *shares;
    float *stored;
    uint8_t *panel;
    int8_t *padded; /* the AMX kernel's last partial step of x: QL_AMX_STEP_ROWS rows */
} ql_a8_scratch;
int ql_a8_scratch_make(const ql_weight *w, int64_t m, int64_t panel, ql_a8_scratch *scratch); /* 0, else out of memory; free(scratch->xz) */
#ifdef QL_X86
void ql_panel_params(const ql_weight *w, int64_t n, int64_t count, int64_t panel, const ql_a8_scratch *scratch);
void ql_rows512_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m, int64_t n0,
                   int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch);
void ql_rows256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m, int64_t n0,
                   int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch);
void ql_repack_a8(const ql_weight *w, int64_t n, int64_t count, int64_t panel, int offset, uint8_t *out);
#endif
/* Which many-row kernel int8 activations take: the instruction set's (AVX512-VNNI or AVX2), AMX tiles
 * (from QL_AMX_ROWS rows on, once turned on), or the tiles emulated in C (tests). */
enum { QL_ROWS_ISA = 0, QL_ROWS_AMX = 1, QL_ROWS_AMX_EMULATED = 2 };
typedef void (*ql_a8_rows_kernel)(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                                  int64_t n0, int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch);
ql_a8_rows_kernel ql_a8_rows_for(int a8, int64_t m);
int64_t ql_a8_rows_panel(int a8, int64_t m); /* its panel of features */
QL_API int ql_set_a8_rows(int choice);       /* 0, or 1 when this machine cannot run that choice */
QL_API int ql_a8_rows_choice(void);

/* amx_int8_rows.c */
enum { QL_AMX_READY = 0, QL_AMX_NO_CPU = 1, QL_AMX_DENIED = 2, QL_AMX_NOT_BUILT = 3 };
#define QL_AMX_PANEL 32     /* features a panel: the VNNI kernel's */
#define QL_AMX_STEP_ROWS 32 /* rows a step: two tiles of 16 */
#define QL_AMX_ROWS 16      /* from this many rows on the tiles take a product (fewer pad most of a step) */
QL_API int ql_amx_status(void);
QL_API int ql_amx_check(void);
QL_API double ql_amx_speedup(void);
#ifdef QL_X86
void ql_rows_amx_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m, int64_t n0,
                    int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch);
void ql_rows_amx_emulated_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                             int64_t n0, int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch);
#endif

/* pool.c */
typedef void (*ql_task)(void *arg, int64_t chunk);
void ql_run(ql_task task, void *arg, int64_t chunks, int threads);     /* torch's team if known */
void ql_run_own(ql_task task, void *arg, int64_t chunks, int threads); /* our own pool */
void ql_run_team(void (*body)(void *), void *arg, int threads); /* body's ql_run calls on one held team */
int ql_in_team(void);                                                /* inside ql_run_team's body */
int ql_threads(int requested, int64_t work);
int64_t ql_chunk_features(int64_t n, int threads, int per_thread);

/* argmax.c */
QL_API int64_t ql_argmax(const float *x, int64_t n); /* torch.argmax of n floats; -1 when n < 1 */

/* matmul.c */
QL_API int ql_isa(void);
/* Which product a call of m rows runs (matmul.c): measured per format, shape class and row bucket (ql_set_product). */
enum { QL_PRODUCT_UNSET = 0, QL_PRODUCT_FUSED = 1, QL_PRODUCT_DECODED = 2, QL_PRODUCT_FUSED_AVX2 = 3 };
#define QL_SHAPE_CLASSES 3
#define QL_ROW_BUCKETS 4
#define QL_NARROW_OUTPUTS 512     /* shape class 0: fewer output features (few panels a thread) */
#define QL_LARGE_WEIGHT (2 << 20) /* shape class 2: weights of this many values and more */
QL_API int ql_shape_class(int64_t n, int64_t k);
QL_API int ql_row_bucket(int64_t m); /* -1 for one row */
QL_API int ql_set_product(int isa, int kind, int bits, int shape_class, int row_bucket, int product);
QL_API int ql_product(const ql_weight *w, int64_t m);
int ql_product_isa(const ql_weight *w, int64_t m, int64_t features); /* the instruction set a float product runs at */
int ql_same_layout(const ql_weight *a, const ql_weight *b); /* what ql_gemm_group needs of its weights */
QL_API int ql_gemm_group(const ql_weight *weights, int64_t count, const float *x, int64_t m, int64_t x_stride, float *y,
                         int64_t y_stride, int threads, int activation_bits);

/* decode.c: one decoding step of a Llama-family model (mirrors `NativeBlock` etc. in quantlab/generation/native.py) */
typedef struct {
    int64_t block;            /* > 0: the input is rotated by a Hadamard transform of blocks of this many values */
    int64_t core;             /* the block's non-power-of-two factor (1: the block is a power of two) */
    const float *core_signs;  /* its +-1 Hadamard matrix [core, core]; NULL when core is 1 */
} ql_rotation;

typedef struct {
    const float *attention_norm; /* [hidden] */
    const float *mlp_norm;       /* [hidden] */
    ql_weight q, k, v, o, gate, up, down;
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias; /* NULL: none */
    ql_rotation qkv_rotation, o_rotation, gate_up_rotation, down_rotation; /* of each projection's input */
} ql_block;

#define QL_MAX_HADAMARD_CORE 256 /* the largest such factor (quantlab/nn/rotation.py's PALEY_ORDERS) */

typedef struct {
    int64_t blocks, hidden, heads, kv_heads, head_dim, intermediate;
    float norm_eps;
    float attention_scale;
    const ql_block *block;   /* [blocks] */
    const float *final_norm; /* [hidden] */
    const ql_weight *head;   /* NULL: the caller applies the output head to the normed hidden state */
    const float *head_bias;
} ql_decoder;

typedef struct {
    float **keys;       /* [blocks] of [kv_heads, max_len, head_dim] */
    float **values;
    int64_t **lengths;  /* [blocks] of the cache's count of positions written */
    int64_t max_len;
} ql_cache;

/* Keys and values of one attention layer held as 8-bit codes (quantlab/generation/kv_cache.py's layout),
 * mirrors `NativeQuantizedCacheStruct` in quantlab/generation/native.py. Every layer's tensors: key and
 * value codes [kv_heads, capacity, head_dim] uint8; key scales and zeros [kv_heads, capacity / residual,
 * head_dim] and value scales and zeros [kv_heads, capacity, head_dim / group], float16; the float window
 * [kv_heads, residual, head_dim]. `stored` positions are codes (whole chunks of `residual`), then `window`
 * (< residual) in the window, the same in every layer; the step writes its token at slot `window`. */
typedef struct {
    uint8_t **key_codes, **value_codes;     /* [blocks] */
    uint16_t **key_scales, **key_zeros;     /* [blocks] */
    uint16_t **value_scales, **value_zeros; /* [blocks] */
    float **window_keys, **window_values;   /* [blocks] */
    int64_t capacity, residual, group;
    int64_t stored, window;
} ql_quantized_cache;

/* One key/value head of such a cache, from position 0 (kv_attention.c). */
typedef struct {
    const uint8_t *key_codes;                   /* [stored, dim] */
    const uint16_t *key_scales, *key_zeros;     /* [stored / residual, dim] */
    const uint8_t *value_codes;                 /* [stored, dim] */
    const uint16_t *value_scales, *value_zeros; /* [stored, dim / group] */
    const float *window_keys, *window_values;   /* [window, dim] */
    int64_t stored, window, residual, group;
} ql_kv_head;

#define QL_MAX_HEAD_DIM 512

/* attention.c: one-token queries over a KV cache */
void ql_scores(int isa, const float *q, const float *keys, const float *bias, int64_t length, int64_t dim, float scale,
               float *scores);
int ql_softmax(int isa, float *scores, int64_t length);
void ql_weighted_sum(int isa, const float *weights, const float *values, const float *bias, int64_t length, int64_t dim,
                     float *out);
/* kv_attention.c: one query row over a quantized cache's head (scores: stored + window floats) */
int ql_attend_quantized(int isa, const float *q, const ql_kv_head *kv, int64_t dim, float scale, float *scores,
                        float *out);
void ql_attend(int isa, const float *q, const float *keys, const float *values, const float *bias, int64_t length,
               int64_t dim, float scale, float *scores, float *out); /* one query row */
QL_API int ql_attention(const float *q, const float *keys, const float *values, const float *bias,
                        const uint8_t *allowed, int64_t batch, int64_t kv_heads, int64_t groups, int64_t length,
                        int64_t dim, float scale, float *out, int threads);

QL_API int ql_decode_step(const ql_decoder *d, const ql_cache *cache, const ql_quantized_cache *quantized,
                          float *hidden, const float *cos, const float *sin, int64_t position, float *logits,
                          int threads, int activation_bits);

#endif
