/*
 * quantlab CPU kernels: fused dequantize + matrix multiply on quantlab's stored formats.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], where w is decoded from the codes as stored in the
 * checkpoint (no repacked copy): int8 codes, 2..8-bit packed codes with a scale (and zero
 * point) per group, and NF4 codes with a plain or double-quantized absmax per block.
 *
 * At a few rows the work is reading the weights, so the codes are decoded in registers and
 * never written out as floats. Each decoded weight equals the reference dequantization bit
 * for bit (same operations in the same order: (q - zero) * scale, levels[q] * absmax), so
 * only the order of the float sums differs from dequantize-then-matmul.
 *
 * Plain C with x86 intrinsics in functions compiled for their instruction set
 * (`target` attributes) and chosen at run time, so one build runs on every x86-64 CPU;
 * other architectures get the portable C path. Threads come from a small pool of its own (see
 * "threads" below) rather than OpenMP, so a busy machine slows a call down to one thread's
 * speed instead of stalling it.
 *
 * Build: cc -O3 -shared -fPIC -pthread -ffp-contract=off quantlab_cpu.c -o libquantlab_cpu.so
 * (-ffp-contract=off keeps a*b+c as two roundings, as torch computes them.)
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QL_X86 1
#include <immintrin.h>
#endif

#define QL_ABI_VERSION 1
#define QL_DECODE_ROWS 8 /* from this many rows on, AVX-512 decodes odd widths once into a buffer */

enum { QL_AFFINE = 0, QL_INT8 = 1, QL_NF4 = 2 };
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
    int32_t kind;             /* QL_AFFINE: (q - zero) * scale; QL_INT8: signed q * scale; QL_NF4 */
    const void *scale;        /* [n, groups]: scale, or NF4 absmax without double quantization */
    const void *zero;         /* [n, groups] or NULL (then zero_const) */
    int32_t scale_dtype;
    int32_t zero_dtype;
    float zero_const;
    float absmax_offset;      /* NF4 double quantization: absmax = map[code] * scale[block] + offset */
    const uint8_t *absmax_codes;
    const float *absmax_scale;
    int64_t absmax_block;
    float levels[16];         /* NF4 levels */
    float absmax_map[256];
} ql_weight;

/* ---- decode constants of one group, computed exactly as the reference does ---------------- */

static float ql_half_to_float(uint16_t h) {
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
    if (w->kind == QL_NF4) {
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

/* Scale and zero of every group of feature n (the per-group work hoisted out of the inner loops). */
static void ql_params_scalar(const ql_weight *w, int64_t n, float *scale, float *zero) {
    for (int64_t g = 0; g < w->groups; g++) {
        ql_group group = ql_group_at(w, n * w->groups + g);
        scale[g] = group.scale;
        zero[g] = group.zero;
    }
}

/* Value of code q before scaling; q is already sign-extended for int8. */
static inline float ql_base(const ql_weight *w, int32_t q, float zero) {
    return w->kind == QL_NF4 ? w->levels[q] : (float)q - zero;
}

static inline int32_t ql_code_at(const ql_weight *w, const uint8_t *group, int64_t j) {
    if (w->bits == 8) return w->kind == QL_INT8 ? (int32_t)(int8_t)group[j] : (int32_t)group[j];
    int64_t bit = j * w->bits, byte = bit >> 3;
    uint32_t word = group[byte];
    if (byte + 1 < w->group_bytes) word |= (uint32_t)group[byte + 1] << 8;
    return (int32_t)((word >> (bit & 7)) & ((1u << w->bits) - 1u));
}

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

static int64_t ql_round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

static ql_layout ql_make_layout(const ql_weight *w, int64_t chunk, int nibble) {
    ql_layout layout = {chunk, ql_round_up(w->group_codes, chunk), nibble};
    return layout;
}

static void ql_prepare_x(const ql_weight *w, const ql_layout *layout, const float *x, int64_t m, int64_t x_stride,
                         float *xp) {
    int64_t padded = layout->padded_group, row_length = w->groups * padded;
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * x_stride;
        for (int64_t g = 0; g < w->groups; g++) {
            float *group = xp + r * row_length + g * padded;
            int64_t first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            if (!layout->nibble) {
                memcpy(group, src + first, (size_t)valid * sizeof(float));
                memset(group + valid, 0, (size_t)(padded - valid) * sizeof(float));
                continue;
            }
            for (int64_t base = 0; base < padded; base += 32) {
                for (int64_t i = 0; i < 16; i++) {
                    int64_t even = base + 2 * i, odd = even + 1;
                    group[base + i] = even < valid ? src[first + even] : 0.0f;
                    group[base + 16 + i] = odd < valid ? src[first + odd] : 0.0f;
                }
            }
        }
    }
}

/* ---- portable path -------------------------------------------------------------------------- */

static void ql_decode_group_scalar(const ql_weight *w, int64_t n, int64_t g, float *out) {
    int64_t index = n * w->groups + g;
    const uint8_t *codes = w->codes + index * w->group_bytes;
    ql_group group = ql_group_at(w, index);
    for (int64_t j = 0; j < w->group_codes; j++) out[j] = ql_base(w, ql_code_at(w, codes, j), group.zero) * group.scale;
}

static void ql_gemm_scalar(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                           int64_t n1, float *y, int64_t y_stride, float *buffer) {
    int64_t row_length = w->groups * layout->padded_group;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < m; r++) y[r * y_stride + n] = 0.0f;
        for (int64_t g = 0; g < w->groups; g++) {
            ql_decode_group_scalar(w, n, g, buffer);
            for (int64_t r = 0; r < m; r++) {
                const float *xg = xp + r * row_length + g * layout->padded_group;
                float sum = 0.0f;
                for (int64_t j = 0; j < w->group_codes; j++) sum += buffer[j] * xg[j];
                y[r * y_stride + n] += sum;
            }
        }
    }
}

static void ql_dequantize_scalar(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                 float *buffer) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t g = 0; g < w->groups; g++) {
            ql_decode_group_scalar(w, n, g, buffer);
            int64_t first = g * w->group_size, count = w->group_size;
            if (first + count > w->k) count = w->k - first;
            memcpy(out + (n - n0) * out_stride + first, buffer, (size_t)count * sizeof(float));
        }
    }
}

#ifdef QL_X86
/* ---- AVX-512 --------------------------------------------------------------------------------- */
#define QL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define QL_INLINE static inline __attribute__((always_inline))

enum { QL_MODE_NIBBLE = 0, QL_MODE_BYTE = 1, QL_MODE_BITS = 2 };

typedef struct {
    __m512i shuffle; /* generic mode: bytes of code j into dword j */
    __m512i shift;
    __m512i mask;
} ql_bits512;

static QL_AVX512 ql_bits512 ql_bits512_make(int bits) {
    uint8_t shuffle[64];
    int32_t shift[16];
    for (int j = 0; j < 16; j++) {
        int bit = j * bits, byte = bit >> 3, lane = j / 4, at = lane * 16 + (j % 4) * 4;
        shuffle[at] = (uint8_t)byte;
        shuffle[at + 1] = byte + 1 < 16 ? (uint8_t)(byte + 1) : 0x80;
        shuffle[at + 2] = shuffle[at + 3] = 0x80;
        shift[j] = bit & 7;
    }
    ql_bits512 constants;
    constants.shuffle = _mm512_loadu_si512(shuffle);
    constants.shift = _mm512_loadu_si512(shift);
    constants.mask = _mm512_set1_epi32((1 << bits) - 1);
    return constants;
}

/* Converts 16 stored floats (float32, float16 or bfloat16) exactly; `count` < 16 masks the load. */
QL_INLINE QL_AVX512 __m512 ql_load16(const void *base, int32_t dtype, int64_t i, int64_t count) {
    __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
    if (dtype == QL_F32) return _mm512_maskz_loadu_ps(mask, (const float *)base + i);
    __m256i halves = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + i);
    if (dtype == QL_F16) return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* NF4 absmax under double quantization, 16 groups at a time: map[code] * scale[block] + offset. */
QL_INLINE QL_AVX512 __m512 ql_absmax16(const ql_weight *w, int64_t first, __mmask16 mask) {
    const int shift = __builtin_ctzll(w->absmax_block);
    __m512i codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, w->absmax_codes + first));
    __m512 mapped = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, codes, w->absmax_map, 4);
    __m512i within = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(first & (w->absmax_block - 1))),
                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const float *scales = w->absmax_scale + (first >> shift);
    __m512 scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_srli_epi32(within, shift), scales, 4);
    return _mm512_add_ps(_mm512_mul_ps(mapped, scale), _mm512_set1_ps(w->absmax_offset));
}

static QL_AVX512 void ql_params512(const ql_weight *w, int64_t n, float *scale, float *zero) {
    int64_t first = n * w->groups;
    for (int64_t g = 0; g < w->groups; g += 16) {
        int64_t count = w->groups - g;
        __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        __m512 s = w->kind == QL_NF4 && w->absmax_codes ? ql_absmax16(w, first + g, mask)
                                                        : ql_load16(w->scale, w->scale_dtype, first + g, count);
        _mm512_mask_storeu_ps(scale + g, mask, s);
        __m512 z = w->kind == QL_NF4 ? _mm512_setzero_ps()
                   : w->zero         ? ql_load16(w->zero, w->zero_dtype, first + g, count)
                                     : _mm512_set1_ps(w->zero_const);
        _mm512_mask_storeu_ps(zero + g, mask, z);
    }
}

/* Decode constants of one group: a 16-entry table (codes of <= 4 bits) or zero and scale. */
typedef struct {
    __m512 table;
    __m512 zero;
    __m512 scale;
} ql_group512;

QL_INLINE QL_AVX512 ql_group512 ql_group512_make(const ql_weight *w, float scale, float zero, int use_table) {
    ql_group512 out;
    out.scale = _mm512_set1_ps(scale);
    out.zero = _mm512_set1_ps(zero);
    if (use_table) {
        __m512 base = w->kind == QL_NF4
                          ? _mm512_loadu_ps(w->levels)
                          : _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), out.zero);
        out.table = _mm512_mul_ps(base, out.scale);
    } else {
        out.table = out.scale;
    }
    return out;
}

/* Codes [c, c + 16) of a group as 16 int32, for the byte and generic modes. A load reads 16
 * bytes, past the chunk: those bytes never reach a code that meets a nonzero input. Only near
 * the end of the codes buffer (`end`, NULL when the caller knows it is far) the load is masked;
 * deciding that per block rather than per load keeps a branch out of the inner loop (measured:
 * 2.7x faster at 3 bits). */
QL_INLINE QL_AVX512 __m512i ql_codes16(const int mode, const int B, const ql_weight *w, const ql_bits512 *bits,
                                       const uint8_t *group, int64_t c, const uint8_t *end) {
    const int64_t width = B ? B : w->bits;
    const uint8_t *src = group + c * width / 8;
    __m128i bytes = end == NULL || src + 16 <= end
                        ? _mm_loadu_si128((const __m128i *)src)
                        : _mm_maskz_loadu_epi8((__mmask16)((1u << (end - src)) - 1u), src);
    if (mode == QL_MODE_BYTE) return w->kind == QL_INT8 ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    __m512i spread = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(bytes), bits->shuffle);
    return _mm512_and_si512(_mm512_srlv_epi32(spread, bits->shift), bits->mask);
}

QL_INLINE QL_AVX512 __m512 ql_values16(const int use_table, __m512i codes, const ql_group512 *group) {
    if (use_table) return _mm512_permutexvar_ps(codes, group->table);
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), group->zero), group->scale);
}

/* NR output features x R rows of x. In nibble mode a chunk is 32 codes: V = 2 vectors (even
 * and odd codes). One row alone keeps a separate accumulator per vector, so that FMA latency,
 * not throughput, does not limit it. B is the bit width when known at compile time. */
QL_INLINE QL_AVX512 void ql_block512(const int mode, const int use_table, const int B, const int NR, const int R,
                                     const int checked, const ql_weight *w, const ql_bits512 *bits,
                                     const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0,
                                     float *y, int64_t y_stride, const float *params) {
    const int V = mode == QL_MODE_NIBBLE ? 2 : 1;
    const int A = R == 1 ? V : 1;
    const uint8_t *end = checked ? w->codes + w->n * w->groups * w->group_bytes : NULL;
    const int64_t G = w->groups;
    __m512 acc[4][4][2];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++)
            for (int a = 0; a < A; a++) acc[j][r][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        ql_group512 constants[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            constants[j] = ql_group512_make(w, params[2 * j * G + g], params[(2 * j + 1) * G + g], use_table);
        }
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 16 * V) {
            __m512 value[4][2];
            for (int j = 0; j < NR; j++) {
                if (mode == QL_MODE_NIBBLE) {
                    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(group[j] + c / 2)));
                    value[j][0] = _mm512_permutexvar_ps(packed, constants[j].table);
                    value[j][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), constants[j].table);
                } else {
                    __m512i codes = ql_codes16(mode, B, w, bits, group[j], c, end);
                    value[j][0] = ql_values16(use_table, codes, &constants[j]);
                }
            }
            for (int r = 0; r < R; r++) {
                for (int v = 0; v < V; v++) {
                    __m512 xv = _mm512_loadu_ps(xg + r * row_length + c + 16 * v);
                    const int a = A == 1 ? 0 : v;
                    for (int j = 0; j < NR; j++) acc[j][r][a] = _mm512_fmadd_ps(value[j][v], xv, acc[j][r][a]);
                }
            }
        }
    }
    for (int j = 0; j < NR; j++) {
        for (int r = 0; r < R; r++) {
            __m512 sum = A == 2 ? _mm512_add_ps(acc[j][r][0], acc[j][r][1]) : acc[j][r][0];
            y[r * y_stride + n0 + j] = _mm512_reduce_add_ps(sum);
        }
    }
}

/* Many rows of an odd width: the 4 features of a block are decoded once into `decoded` (the
 * layout of x), then every block of 4 rows is a plain float dot product, so the decoding is
 * paid once per feature instead of once per block of rows. Measured on 2048x8192 at 128 rows:
 * 3-bit 11 % faster; 4-bit and 8-bit, whose decoding is cheap, 10-20 % slower (the buffer
 * and 4 rows of x no longer fit in L1), so they decode in registers. */
QL_INLINE QL_AVX512 void ql_decode4_512(const int mode, const int use_table, const int B, const ql_weight *w,
                                        const ql_bits512 *bits, const ql_layout *layout, int64_t n0,
                                        const float *params, float *decoded, int64_t row_length) {
    const uint8_t *end = w->codes + w->n * w->groups * w->group_bytes; /* rare path: keep the check */
    const int64_t G = w->groups;
    for (int j = 0; j < 4; j++) {
        float *row = decoded + j * row_length;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *group = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            ql_group512 constants = ql_group512_make(w, params[2 * j * G + g], params[(2 * j + 1) * G + g], use_table);
            float *out = row + g * layout->padded_group;
            int64_t c = 0;
            if (mode == QL_MODE_NIBBLE) {
                for (; c < w->group_codes; c += 32) {
                    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(group + c / 2)));
                    _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(packed, constants.table));
                    _mm512_storeu_ps(out + c + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), constants.table));
                }
            } else {
                for (; c < w->group_codes; c += 16)
                    _mm512_storeu_ps(out + c, ql_values16(use_table, ql_codes16(mode, B, w, bits, group, c, end), &constants));
            }
            for (; c < layout->padded_group; c += 16) _mm512_storeu_ps(out + c, _mm512_setzero_ps());
        }
    }
}

QL_INLINE QL_AVX512 void ql_dot4_512(const int R, const float *decoded, const float *xp, int64_t row_length, int64_t n0,
                                     float *y, int64_t y_stride) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < row_length; k += 16) {
        __m512 value[4];
        for (int j = 0; j < 4; j++) value[j] = _mm512_loadu_ps(decoded + j * row_length + k);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(xp + r * row_length + k);
            for (int j = 0; j < 4; j++) acc[j][r] = _mm512_fmadd_ps(value[j], xv, acc[j][r]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = _mm512_reduce_add_ps(acc[j][r]);
}

/* Features in blocks of 4, and for each, rows in blocks of 4, 2, 1: a block's codes are read
 * from memory once and stay in cache while every block of rows uses them. */

/* One block of 4 features, every row. */
QL_INLINE QL_AVX512 void ql_rows512(const int mode, const int use_table, const int B, const int checked,
                                    const ql_weight *w, const ql_bits512 *bits, const ql_layout *layout,
                                    const float *xp, int64_t row_length, int64_t m, int64_t n, float *y,
                                    int64_t y_stride, const float *params) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4)
        ql_block512(mode, use_table, B, 4, 4, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
    for (; r + 2 <= m; r += 2)
        ql_block512(mode, use_table, B, 4, 2, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
    for (; r < m; r++)
        ql_block512(mode, use_table, B, 4, 1, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
}

/* Features in blocks of 4, and for each, rows in blocks of 4, 2, 1: a block's codes are read
 * from memory once and stay in cache while every block of rows uses them. */
QL_INLINE QL_AVX512 void ql_gemm512_mode(const int mode, const int use_table, const int B, const ql_weight *w,
                                         const ql_bits512 *bits, const ql_layout *layout, const float *xp, int64_t m,
                                         int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params,
                                         float *decoded) {
    int64_t row_length = w->groups * layout->padded_group, G = w->groups;
    const uint8_t *end = w->codes + w->n * G * w->group_bytes;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int j = 0; j < 4; j++) ql_params512(w, n + j, params + 2 * j * G, params + (2 * j + 1) * G);
        if (mode == QL_MODE_BITS && m >= QL_DECODE_ROWS) {
            ql_decode4_512(mode, use_table, B, w, bits, layout, n, params, decoded, row_length);
            int64_t r = 0;
            for (; r + 4 <= m; r += 4)
                ql_dot4_512(4, decoded, xp + r * row_length, row_length, n, y + r * y_stride, y_stride);
            for (; r < m; r++) ql_dot4_512(1, decoded, xp + r * row_length, row_length, n, y + r * y_stride, y_stride);
        } else if (mode != QL_MODE_NIBBLE && w->codes + (n + 4) * G * w->group_bytes + 16 > end) {
            ql_rows512(mode, use_table, B, 1, w, bits, layout, xp, row_length, m, n, y, y_stride, params);
        } else {
            ql_rows512(mode, use_table, B, 0, w, bits, layout, xp, row_length, m, n, y, y_stride, params);
        }
    }
    for (; n < n1; n++) {
        ql_params512(w, n, params, params + G);
        for (int64_t r = 0; r < m; r++)
            ql_block512(mode, use_table, B, 1, 1, mode != QL_MODE_NIBBLE, w, bits, layout, xp + r * row_length,
                        row_length, n, y + r * y_stride, y_stride, params);
    }
}

static int ql_mode512(const ql_weight *w) {
    if (w->bits == 4 && w->kind != QL_INT8 && w->group_codes % 32 == 0) return QL_MODE_NIBBLE;
    if (w->bits == 8) return QL_MODE_BYTE;
    return QL_MODE_BITS;
}

static QL_AVX512 void ql_gemm512(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                                 int64_t n1, float *y, int64_t y_stride, float *params, float *decoded) {
    ql_bits512 bits = ql_bits512_make(w->bits);
    switch (ql_mode512(w) == QL_MODE_BITS ? w->bits : -ql_mode512(w)) {
    case -QL_MODE_NIBBLE:
        ql_gemm512_mode(QL_MODE_NIBBLE, 1, 4, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case -QL_MODE_BYTE:
        ql_gemm512_mode(QL_MODE_BYTE, 0, 8, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 2:
        ql_gemm512_mode(QL_MODE_BITS, 1, 2, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 3:
        ql_gemm512_mode(QL_MODE_BITS, 1, 3, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 4:
        ql_gemm512_mode(QL_MODE_BITS, 1, 4, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    default:
        ql_gemm512_mode(QL_MODE_BITS, 0, 0, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
    }
}

QL_INLINE QL_AVX512 void ql_dequantize512_mode(const int mode, const int use_table, const ql_weight *w,
                                               const ql_bits512 *bits, int64_t n0, int64_t n1, float *out,
                                               int64_t out_stride, float *params) {
    const uint8_t *end = w->codes + w->n * w->groups * w->group_bytes;
    for (int64_t n = n0; n < n1; n++) {
        float *row = out + (n - n0) * out_stride;
        ql_params512(w, n, params, params + w->groups);
        for (int64_t g = 0; g < w->groups; g++) {
            int64_t index = n * w->groups + g, first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const uint8_t *group = w->codes + index * w->group_bytes;
            ql_group512 constants = ql_group512_make(w, params[g], params[w->groups + g], use_table);
            for (int64_t c = 0; c < valid; c += 16) {
                __m512 value = ql_values16(use_table, ql_codes16(mode, 0, w, bits, group, c, end), &constants);
                int64_t left = valid - c;
                if (left >= 16)
                    _mm512_storeu_ps(row + first + c, value);
                else
                    _mm512_mask_storeu_ps(row + first + c, (__mmask16)((1u << left) - 1u), value);
            }
        }
    }
}

static QL_AVX512 void ql_dequantize512(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                       float *params) {
    ql_bits512 bits = ql_bits512_make(w->bits);
    if (w->bits == 8)
        ql_dequantize512_mode(QL_MODE_BYTE, 0, w, &bits, n0, n1, out, out_stride, params);
    else if (w->bits <= 4)
        ql_dequantize512_mode(QL_MODE_BITS, 1, w, &bits, n0, n1, out, out_stride, params);
    else
        ql_dequantize512_mode(QL_MODE_BITS, 0, w, &bits, n0, n1, out, out_stride, params);
}

/* ---- AVX2 ------------------------------------------------------------------------------------ */
#define QL_AVX2 __attribute__((target("avx2,fma")))

typedef struct {
    __m256i shuffle;
    __m256i shift;
    __m256i mask;
} ql_bits256;

static QL_AVX2 ql_bits256 ql_bits256_make(int bits) {
    uint8_t shuffle[32];
    int32_t shift[8];
    for (int j = 0; j < 8; j++) {
        int bit = j * bits, byte = bit >> 3, at = (j / 4) * 16 + (j % 4) * 4;
        shuffle[at] = (uint8_t)byte;
        shuffle[at + 1] = (uint8_t)(byte + 1);
        shuffle[at + 2] = shuffle[at + 3] = 0x80;
        shift[j] = bit & 7;
    }
    ql_bits256 constants;
    constants.shuffle = _mm256_loadu_si256((const __m256i *)shuffle);
    constants.shift = _mm256_loadu_si256((const __m256i *)shift);
    constants.mask = _mm256_set1_epi32((1 << bits) - 1);
    return constants;
}

typedef struct {
    __m256 low, high; /* NF4: levels 0-7 and 8-15, times absmax */
    __m256 zero, scale;
} ql_group256;

QL_INLINE QL_AVX2 ql_group256 ql_group256_make(const ql_weight *w, float scale, float zero) {
    ql_group256 out;
    out.zero = _mm256_set1_ps(zero);
    out.scale = _mm256_set1_ps(scale);
    if (w->kind == QL_NF4) {
        out.low = _mm256_mul_ps(_mm256_loadu_ps(w->levels), out.scale);
        out.high = _mm256_mul_ps(_mm256_loadu_ps(w->levels + 8), out.scale);
    } else {
        out.low = out.high = out.scale;
    }
    return out;
}

/* Codes [c, c + 8) of a group (`bits` bytes) as 8 floats. */
QL_INLINE QL_AVX2 __m256 ql_values8(const ql_weight *w, const ql_bits256 *bits, const uint8_t *group, int64_t c,
                                    const ql_group256 *constants) {
    const uint8_t *src = group + c * w->bits / 8;
    int64_t left = w->group_bytes - c * w->bits / 8;
    __m128i bytes;
    if (left >= 8) {
        bytes = _mm_loadl_epi64((const __m128i *)src);
    } else {
        uint8_t tail[8] = {0};
        memcpy(tail, src, (size_t)left);
        bytes = _mm_loadl_epi64((const __m128i *)tail);
    }
    __m256i codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), bits->shuffle);
    codes = _mm256_and_si256(_mm256_srlv_epi32(codes, bits->shift), bits->mask);
    if (w->kind == QL_NF4) {
        __m256 low = _mm256_permutevar8x32_ps(constants->low, codes);
        __m256 high = _mm256_permutevar8x32_ps(constants->high, codes);
        return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
    }
    if (w->kind == QL_INT8) codes = _mm256_srai_epi32(_mm256_slli_epi32(codes, 24), 24);
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), constants->zero), constants->scale);
}

QL_INLINE QL_AVX2 float ql_sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QL_INLINE QL_AVX2 void ql_block256(const int NR, const int R, const ql_weight *w, const ql_bits256 *bits,
                                   const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0, float *y,
                                   int64_t y_stride, float *params) {
    const int64_t G = w->groups;
    for (int j = 0; j < NR; j++) ql_params_scalar(w, n0 + j, params + 2 * j * G, params + (2 * j + 1) * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w->groups; g++) {
        const uint8_t *group[4];
        ql_group256 constants[4];
        for (int j = 0; j < NR; j++) {
            int64_t index = (n0 + j) * w->groups + g;
            group[j] = w->codes + index * w->group_bytes;
            constants[j] = ql_group256_make(w, params[2 * j * G + g], params[(2 * j + 1) * G + g]);
        }
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 8) {
            __m256 value[4];
            for (int j = 0; j < NR; j++) value[j] = ql_values8(w, bits, group[j], c, &constants[j]);
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_loadu_ps(xg + r * row_length + c);
                for (int j = 0; j < NR; j++) acc[j][r] = _mm256_fmadd_ps(value[j], xv, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = ql_sum256(acc[j][r]);
}

static QL_AVX2 void ql_gemm256(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                               int64_t n1, float *y, int64_t y_stride, float *params) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    int64_t row_length = w->groups * layout->padded_group;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int64_t r = 0; r < m;) {
            const float *xr = xp + r * row_length;
            float *yr = y + r * y_stride;
            if (m - r >= 4) {
                for (int j = 0; j < 4; j++) ql_block256(1, 4, w, &bits, layout, xr, row_length, n + j, yr, y_stride, params);
                r += 4;
            } else if (m - r >= 2) {
                ql_block256(2, 2, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                ql_block256(2, 2, w, &bits, layout, xr, row_length, n + 2, yr, y_stride, params);
                r += 2;
            } else {
                ql_block256(4, 1, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                r += 1;
            }
        }
    }
    for (; n < n1; n++)
        for (int64_t r = 0; r < m; r++)
            ql_block256(1, 1, w, &bits, layout, xp + r * row_length, row_length, n, y + r * y_stride, y_stride, params);
}

static QL_AVX2 void ql_dequantize256(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                     float *params) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    for (int64_t n = n0; n < n1; n++) {
        float *row = out + (n - n0) * out_stride;
        ql_params_scalar(w, n, params, params + w->groups);
        for (int64_t g = 0; g < w->groups; g++) {
            int64_t index = n * w->groups + g, first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const uint8_t *group = w->codes + index * w->group_bytes;
            ql_group256 constants = ql_group256_make(w, params[g], params[w->groups + g]);
            for (int64_t c = 0; c < valid; c += 8) {
                __m256 value = ql_values8(w, &bits, group, c, &constants);
                if (valid - c >= 8) {
                    _mm256_storeu_ps(row + first + c, value);
                } else {
                    float tail[8];
                    _mm256_storeu_ps(tail, value);
                    memcpy(row + first + c, tail, (size_t)(valid - c) * sizeof(float));
                }
            }
        }
    }
}
#endif /* QL_X86 */

/* ---- dispatch ---------------------------------------------------------------------------------- */

static int ql_forced_isa = -1;

static int ql_detect_isa(void) {
#ifdef QL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        return QL_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return QL_ISA_AVX2;
#endif
    return QL_ISA_SCALAR;
}

/* The instruction set the kernels use: the best this CPU has, or a lower one forced for tests. */
int ql_isa(void) {
    int best = ql_detect_isa();
    return ql_forced_isa >= 0 && ql_forced_isa < best ? ql_forced_isa : best;
}

void ql_force_isa(int isa) { ql_forced_isa = isa; }

int ql_abi_version(void) { return QL_ABI_VERSION; }

static int ql_check(const ql_weight *w) {
    if (w->bits < 2 || w->bits > 8 || w->groups < 1 || w->group_size < 1) return QL_BAD_FORMAT;
    if (w->kind == QL_INT8 && w->bits != 8) return QL_BAD_FORMAT;
    if (w->kind == QL_NF4 && w->bits != 4) return QL_BAD_FORMAT;
    if (w->kind != QL_INT8 && (w->group_codes % 8 || w->group_bytes != w->group_codes * w->bits / 8)) return QL_BAD_FORMAT;
    if (w->kind == QL_INT8 && w->group_bytes != w->group_codes) return QL_BAD_FORMAT;
    if (w->absmax_codes && (w->absmax_block < 16 || (w->absmax_block & (w->absmax_block - 1)))) return QL_BAD_FORMAT;
    if (w->group_codes < w->group_size || w->groups * w->group_size < w->k) return QL_BAD_FORMAT;
    return QL_OK;
}

static ql_layout ql_layout_for(const ql_weight *w, int isa) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) return ql_make_layout(w, ql_mode512(w) == QL_MODE_NIBBLE ? 32 : 16, ql_mode512(w) == QL_MODE_NIBBLE);
    if (isa == QL_ISA_AVX2) return ql_make_layout(w, 8, 0);
#endif
    (void)isa;
    return ql_make_layout(w, 1, 0);
}

/* ---- threads ----------------------------------------------------------------------------------
 * A job is cut into chunks that threads claim from one atomic ticket (generation << 32 | next
 * chunk). The calling thread works too and afterwards waits only for chunks a worker has
 * claimed, never for a worker to wake up: on a loaded machine a late worker finds nothing
 * left, and the call runs at one thread's speed instead of stalling for a scheduler time
 * slice (which an OpenMP join does). Idle workers spin for a short while, so the next layer's
 * call finds them awake, then sleep on a condition variable.
 */

typedef void (*ql_task)(void *arg, int64_t chunk);

#define QL_MAX_WORKERS 63

static struct {
    pthread_mutex_t lock;     /* guards sleeping and starting workers */
    pthread_cond_t wake;
    pthread_mutex_t running;  /* one job at a time; a second caller works alone */
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    _Atomic int64_t chunks;
    _Atomic int helpers;      /* workers allowed to join the current job */
    _Atomic(ql_task) task;
    _Atomic(void *) arg;
    _Atomic int sleepers;
    int workers;
} ql_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .running = PTHREAD_MUTEX_INITIALIZER};

static int64_t ql_spin_ns = 50000;

static int64_t ql_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static inline void ql_pause(void) {
#ifdef QL_X86
    __builtin_ia32_pause();
#endif
}

static inline uint64_t ql_generation(void) { return atomic_load(&ql_pool.ticket) >> 32; }

/* Claim the next chunk of job `generation`; 0 once the job has none left (or has ended). */
static int ql_claim(uint64_t generation, int64_t *chunk) {
    uint64_t ticket = atomic_load(&ql_pool.ticket);
    for (;;) {
        if (ticket >> 32 != generation) return 0;
        int64_t next = (int64_t)(ticket & 0xffffffffu);
        if (next >= atomic_load(&ql_pool.chunks)) return 0;
        if (atomic_compare_exchange_weak(&ql_pool.ticket, &ticket, ticket + 1)) {
            *chunk = next;
            return 1;
        }
    }
}

/* A successful claim proves the job is unfinished, so task and arg read before it are its own. */
static void ql_work(uint64_t generation) {
    ql_task task = atomic_load(&ql_pool.task);
    void *arg = atomic_load(&ql_pool.arg);
    int64_t chunk;
    while (ql_claim(generation, &chunk)) {
        task(arg, chunk);
        atomic_fetch_add(&ql_pool.done, 1);
    }
}

static void *ql_worker(void *index_pointer) {
    int index = (int)(intptr_t)index_pointer;
    uint64_t seen = 0;
    for (;;) {
        uint64_t generation = ql_generation();
        if (generation != seen) {
            seen = generation;
            if (index < atomic_load(&ql_pool.helpers)) ql_work(generation);
            continue;
        }
        int64_t deadline = ql_now_ns() + ql_spin_ns;
        for (int spins = 0; ql_generation() == seen; spins++) {
            ql_pause();
            if ((spins & 63) == 0 && ql_now_ns() > deadline) break;
        }
        if (ql_generation() != seen) continue;
        pthread_mutex_lock(&ql_pool.lock);
        atomic_fetch_add(&ql_pool.sleepers, 1);
        while (ql_generation() == seen) pthread_cond_wait(&ql_pool.wake, &ql_pool.lock);
        atomic_fetch_sub(&ql_pool.sleepers, 1);
        pthread_mutex_unlock(&ql_pool.lock);
    }
    return NULL;
}

static void ql_after_fork_in_child(void) {
    /* The workers do not exist in a forked child: start over (they are restarted on demand). */
    pthread_mutex_init(&ql_pool.lock, NULL);
    pthread_cond_init(&ql_pool.wake, NULL);
    pthread_mutex_init(&ql_pool.running, NULL);
    atomic_store(&ql_pool.sleepers, 0);
    ql_pool.workers = 0;
}

static void ql_start_workers(int wanted) {
    static int registered = 0;
    if (wanted > QL_MAX_WORKERS) wanted = QL_MAX_WORKERS;
    if (ql_pool.workers >= wanted) return;
    pthread_mutex_lock(&ql_pool.lock);
    if (!registered) {
        pthread_atfork(NULL, NULL, ql_after_fork_in_child);
        const char *spin = getenv("QUANTLAB_SPIN_US");
        if (spin) ql_spin_ns = (int64_t)atol(spin) * 1000;
        registered = 1;
    }
    while (ql_pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, ql_worker, (void *)(intptr_t)ql_pool.workers);
        pthread_attr_destroy(&attributes);
        if (failed) break;
        ql_pool.workers++;
    }
    pthread_mutex_unlock(&ql_pool.lock);
}

/* Run task(arg, c) for c in [0, chunks) on up to `threads` threads, the caller included. */
static void ql_run(ql_task task, void *arg, int64_t chunks, int threads) {
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&ql_pool.running)) {
        for (int64_t c = 0; c < chunks; c++) task(arg, c);
        return;
    }
    ql_start_workers(threads - 1);
    atomic_store(&ql_pool.task, task);
    atomic_store(&ql_pool.arg, arg);
    atomic_store(&ql_pool.chunks, chunks);
    atomic_store(&ql_pool.helpers, threads - 1);
    atomic_store(&ql_pool.done, 0);
    uint64_t generation = ql_generation() + 1;
    atomic_store(&ql_pool.ticket, generation << 32);
    if (atomic_load(&ql_pool.sleepers) > 0) {
        pthread_mutex_lock(&ql_pool.lock);
        pthread_cond_broadcast(&ql_pool.wake);
        pthread_mutex_unlock(&ql_pool.lock);
    }
    ql_work(generation);
    for (int spins = 0; atomic_load(&ql_pool.done) < chunks; spins++) {
        if (spins < 4096)
            ql_pause();
        else
            sched_yield(); /* a worker was preempted inside its chunk: let it run */
    }
    pthread_mutex_unlock(&ql_pool.running);
}

/* Chunks of whole blocks of 4 features, about 4 per thread so that threads balance. */
static int64_t ql_chunk_features(int64_t n, int threads) {
    int64_t per = (n + 4 * threads - 1) / (4 * threads);
    per = (per + 3) / 4 * 4;
    return per < 4 ? 4 : per;
}

static int ql_threads(int requested, int64_t work) {
    /* Below ~64 KiB of codes a second thread costs more than it saves. */
    if (requested < 1 || work < (1 << 16)) return 1;
    return requested;
}

static int64_t ql_scratch_params(const ql_weight *w) { return ql_round_up(8 * w->groups, 16); }

/* Per-thread scratch: scale and zero of every group of 4 features, then one decoded group
 * (portable path) or 4 decoded rows in the layout of x (`decoded_length` floats, AVX-512). */
static float *ql_scratch(const ql_weight *w, int64_t decoded_length) {
    int64_t floats = ql_scratch_params(w) + (decoded_length > w->group_codes ? decoded_length : w->group_codes);
    float *scratch = NULL;
    return posix_memalign((void **)&scratch, 64, (size_t)ql_round_up(floats, 16) * sizeof(float)) ? NULL : scratch;
}

typedef struct {
    const ql_weight *w;
    int isa;
    ql_layout layout;
    const float *xp;
    int64_t m;
    float *out;
    int64_t out_stride;
    int64_t first;    /* dequantize: first feature */
    int64_t last;
    int64_t per_chunk;
    _Atomic int failed;
} ql_job;

static void ql_gemm_chunk(void *arg, int64_t chunk) {
    ql_job *job = (ql_job *)arg;
    const ql_weight *w = job->w;
    int64_t n0 = chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    if (n1 > w->n) n1 = w->n;
    int64_t row_length = w->groups * job->layout.padded_group;
    int64_t decoded_length = 0;
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512 && ql_mode512(w) == QL_MODE_BITS && job->m >= QL_DECODE_ROWS)
        decoded_length = 4 * row_length;
#endif
    float *scratch = ql_scratch(w, decoded_length);
    if (!scratch) {
        atomic_store(&job->failed, 1);
        return;
    }
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512)
        ql_gemm512(w, &job->layout, job->xp, job->m, n0, n1, job->out, job->out_stride, scratch,
                   scratch + ql_scratch_params(w));
    else if (job->isa == QL_ISA_AVX2)
        ql_gemm256(w, &job->layout, job->xp, job->m, n0, n1, job->out, job->out_stride, scratch);
    else
#endif
        ql_gemm_scalar(w, &job->layout, job->xp, job->m, n0, n1, job->out, job->out_stride, scratch);
    free(scratch);
}

static void ql_dequantize_chunk(void *arg, int64_t chunk) {
    ql_job *job = (ql_job *)arg;
    const ql_weight *w = job->w;
    int64_t n0 = job->first + chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    if (n1 > job->last) n1 = job->last;
    float *out = job->out + (n0 - job->first) * job->out_stride;
    float *scratch = ql_scratch(w, 0);
    if (!scratch) {
        atomic_store(&job->failed, 1);
        return;
    }
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512)
        ql_dequantize512(w, n0, n1, out, job->out_stride, scratch);
    else if (job->isa == QL_ISA_AVX2)
        ql_dequantize256(w, n0, n1, out, job->out_stride, scratch);
    else
#endif
        ql_dequantize_scalar(w, n0, n1, out, job->out_stride, scratch);
    free(scratch);
}

/* y[m, n] (row stride y_stride) = x[m, k] (row stride x_stride) times the weight, transposed. */
int ql_gemm(const ql_weight *w, const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride, int threads) {
    int status = ql_check(w);
    if (status != QL_OK) return status;
    ql_job job = {.w = w, .isa = ql_isa(), .m = m, .out = y, .out_stride = y_stride};
    job.layout = ql_layout_for(w, job.isa);
    int64_t row_length = w->groups * job.layout.padded_group;
    float *xp = NULL;
    if (posix_memalign((void **)&xp, 64, (size_t)ql_round_up(m * row_length * (int64_t)sizeof(float) + 64, 64)))
        return QL_NO_MEMORY;
    ql_prepare_x(w, &job.layout, x, m, x_stride, xp);
    job.xp = xp;
    threads = ql_threads(threads, w->n * w->groups * w->group_bytes * (m < 4 ? 1 : m / 4));
    job.per_chunk = threads > 1 ? ql_chunk_features(w->n, threads) : w->n;
    ql_run(ql_gemm_chunk, &job, (w->n + job.per_chunk - 1) / job.per_chunk, threads);
    free(xp);
    return atomic_load(&job.failed) ? QL_NO_MEMORY : QL_OK;
}

/* Rows [n0, n1) of the float weight into out (row stride out_stride). */
int ql_dequantize(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride, int threads) {
    int status = ql_check(w);
    if (status != QL_OK) return status;
    if (n0 < 0 || n1 > w->n || n0 >= n1) return n0 == n1 ? QL_OK : QL_BAD_FORMAT;
    ql_job job = {.w = w, .isa = ql_isa(), .out = out, .out_stride = out_stride, .first = n0, .last = n1};
    threads = ql_threads(threads, (n1 - n0) * w->groups * w->group_bytes);
    job.per_chunk = threads > 1 ? ql_chunk_features(n1 - n0, threads) : n1 - n0;
    ql_run(ql_dequantize_chunk, &job, (n1 - n0 + job.per_chunk - 1) / job.per_chunk, threads);
    return atomic_load(&job.failed) ? QL_NO_MEMORY : QL_OK;
}

/* ---- quantization (quantize-on-load) ------------------------------------------------------------
 * The same operations in the same order as quantlab/formats (affine.py, nf4.py, packing.py),
 * one row at a time, so codes and scales are bit-identical to the torch implementation (only
 * the sign of a zero point that is exactly 0 may differ: torch's amin returns +0 or -0
 * depending on where they sit in the group; neither codes nor dequantized values change).
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
    job->per_chunk = threads > 1 ? ql_chunk_features(job->n, threads) : job->n;
    ql_run(task, job, (job->n + job->per_chunk - 1) / job->per_chunk, threads);
}

/* Round-to-nearest codes [n, groups, group_size] (uint8) with a scale (and zero point) per
 * group, as quantlab.formats.affine.quantize; w is [n, k] float32 with row stride w_stride. */
int ql_quantize_affine(const float *w, int64_t n, int64_t k, int64_t w_stride, int64_t group_size, int bits,
                       int symmetric, int scale_dtype, uint8_t *codes, void *scale, void *zero, int threads) {
    if (bits < 2 || bits > 8 || n < 1 || k < 1 || group_size < 1 || (!symmetric && !zero)) return QL_BAD_FORMAT;
    ql_quantize_job job = {.w = w, .n = n, .k = k, .w_stride = w_stride, .group_size = group_size,
                           .groups = (k + group_size - 1) / group_size, .bits = bits, .symmetric = symmetric,
                           .scale_dtype = scale_dtype, .codes = codes, .scale = scale, .zero = zero};
    ql_run_rows(ql_quantize_affine_chunk, &job, threads);
    return QL_OK;
}

/* NF4 codes [n, blocks, blocksize] and absmax [n, blocks], as quantlab.formats.nf4.quantize. */
int ql_quantize_nf4(const float *w, int64_t n, int64_t k, int64_t w_stride, int64_t blocksize, const float *midpoints,
                    uint8_t *codes, float *absmax, int threads) {
    if (n < 1 || k < 1 || blocksize < 1) return QL_BAD_FORMAT;
    ql_quantize_job job = {.w = w, .n = n, .k = k, .w_stride = w_stride, .group_size = blocksize,
                           .groups = (k + blocksize - 1) / blocksize, .codes = codes, .midpoints = midpoints,
                           .absmax = absmax};
    ql_run_rows(ql_quantize_nf4_chunk, &job, threads);
    return QL_OK;
}

/* quantlab.formats.packing.pack: rows of `length` codes into rows of ceil(length / 8) * bits bytes. */
int ql_pack(const uint8_t *codes, int64_t rows, int64_t length, int bits, uint8_t *out) {
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

int64_t ql_count_nonfinite(const float *values, int64_t n, int threads) {
    ql_count_job job = {.bits = (const uint32_t *)values, .n = n};
    threads = ql_threads(threads, n);
    job.per_chunk = threads > 1 ? (n + 4 * threads - 1) / (4 * threads) : (n > 0 ? n : 1);
    ql_run(ql_count_chunk, &job, (n + job.per_chunk - 1) / job.per_chunk, threads);
    return atomic_load(&job.count);
}

/* torch.bucketize(values, boundaries, right=False) for sorted boundaries: how many are < value. */
int ql_bucketize(const float *values, int64_t n, const float *boundaries, int64_t count, int32_t *out) {
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
int ql_offset_to_signed(uint8_t *codes, int64_t n) {
    for (int64_t i = 0; i < n; i++) codes[i] ^= 0x80u;
    return QL_OK;
}
