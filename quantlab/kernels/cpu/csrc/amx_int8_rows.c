/* The many-row int8-activation kernel on AMX tiles (Intel Sapphire Rapids and later: TDPBSUD multiplies
 * 16 rows x 64 signed bytes by 64 x 16 unsigned bytes into 16 x 16 int32 in one instruction), for a
 * prompt's prefill with int8 activations. Same scheme, panel and results as avx512_vnni_rows.c (see
 * amx_rows_body.h); only the block dot products move from vpdpbusd to the tiles.
 *
 * Using the tiles takes three things: the CPU (cpuid leaf 7: AMX-TILE and AMX-INT8), Linux's permission
 * for the process (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), kernels from 5.16 on), and a compiler
 * that knows the instructions. `ql_amx_status` says which is missing. The kernel is off until
 * `ql_set_a8_rows(QL_ROWS_AMX)` turns it on; quantlab does that after `ql_amx_check` found it equal to
 * the AVX512-VNNI kernel on this machine and `ql_amx_speedup` found it faster (native.py). Every tile instruction also has a portable C
 * version (the emulated kernel), which the tests run on any x86 CPU against the VNNI kernel and the
 * reference. */
#define _DEFAULT_SOURCE /* syscall() */
#include "quantlab_cpu.h"

#include <stdatomic.h>

#ifdef QL_X86
#include <cpuid.h>
#include <math.h>
#include <time.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define QL_AMX_COMPILED 1
#define QL_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#else
#define QL_AMX_COMPILED 0
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The 64-byte operand of LDTILECFG: palette 1, each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) ql_tile_config;

/* Tiles 0-7 of the kernel: 16 rows x 64 bytes each (amx_rows_body.h says what each holds). */
static void ql_amx_configure(ql_tile_config *config) {
    memset(config, 0, sizeof(*config));
    config->palette = 1;
    for (int t = 0; t < 8; t++) {
        config->rows[t] = 16;
        config->colsb[t] = 64;
    }
}

/* ---- whether the tiles can run here ------------------------------------------------------------ */

static int ql_amx_cpu(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (d >> 24) & 1 && (d >> 25) & 1; /* AMX-TILE, AMX-INT8 */
}

/* Asks Linux for the tile data state (once; the grant is the whole process's, every thread's). */
static int ql_amx_permission(void) {
#ifdef __linux__
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &features) == 0 && (features >> XFEATURE_XTILEDATA) & 1;
#else
    return 0;
#endif
}

static _Atomic int ql_amx_known = -1;

/* QL_AMX_READY, or why not: QL_AMX_NO_CPU, QL_AMX_DENIED (the OS refused the permission), QL_AMX_NOT_BUILT. */
QL_API int ql_amx_status(void) {
    int known = atomic_load(&ql_amx_known);
    if (known >= 0) return known;
    if (!ql_amx_cpu())
        known = QL_AMX_NO_CPU;
    else if (!QL_AMX_COMPILED)
        known = QL_AMX_NOT_BUILT;
    else
        known = ql_amx_permission() ? QL_AMX_READY : QL_AMX_DENIED;
    atomic_store(&ql_amx_known, known);
    return known;
}

/* ---- the kernel on the tiles -------------------------------------------------------------------- */

#if QL_AMX_COMPILED
#define QL_AMX_NAME ql_rows_amx_a8
#define QL_AMX_TARGET QL_AMX
#define QL_TILES
#define QL_TILE_CONFIG(from) _tile_loadconfig(from)
#define QL_TILE_RELEASE() _tile_release()
#define QL_TILE_ZERO(t) _tile_zero(t)
#define QL_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define QL_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define QL_TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#include "amx_rows_body.h"
#undef QL_AMX_NAME
#undef QL_AMX_TARGET
#undef QL_TILES
#undef QL_TILE_CONFIG
#undef QL_TILE_RELEASE
#undef QL_TILE_ZERO
#undef QL_TILE_LOAD
#undef QL_TILE_STORE
#undef QL_TILE_DPBSUD
#endif

/* ---- the same kernel, each tile instruction in portable C --------------------------------------- */

typedef struct {
    uint8_t data[8][16][64];
    ql_tile_config config;
} ql_tile_registers;

static void ql_emulated_zero(ql_tile_registers *tiles, int t) { memset(tiles->data[t], 0, sizeof(tiles->data[t])); }

static void ql_emulated_load(ql_tile_registers *tiles, int t, const void *base, int64_t stride) {
    for (int r = 0; r < tiles->config.rows[t]; r++)
        memcpy(tiles->data[t][r], (const uint8_t *)base + r * stride, tiles->config.colsb[t]);
}

static void ql_emulated_store(const ql_tile_registers *tiles, int t, void *base, int64_t stride) {
    for (int r = 0; r < tiles->config.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, tiles->data[t][r], tiles->config.colsb[t]);
}

/* TDPBSUD: c[m][n] += sum over k, i < 4 of (int8) a[m][4k + i] * (uint8) b[k][4n + i], in int32. */
static void ql_emulated_dpbsud(ql_tile_registers *tiles, int c, int a, int b) {
    const ql_tile_config *config = &tiles->config;
    const int rows = config->rows[a], depth = config->colsb[a] / 4, columns = config->colsb[c] / 4;
    for (int m = 0; m < rows; m++)
        for (int n = 0; n < columns; n++) {
            int32_t sum;
            memcpy(&sum, &tiles->data[c][m][4 * n], 4);
            for (int k = 0; k < depth; k++)
                for (int i = 0; i < 4; i++)
                    sum += (int32_t)(int8_t)tiles->data[a][m][4 * k + i] * (int32_t)tiles->data[b][k][4 * n + i];
            memcpy(&tiles->data[c][m][4 * n], &sum, 4);
        }
}

#define QL_AMX_NAME ql_rows_amx_emulated_a8
#define QL_AMX_TARGET
#define QL_TILES ql_tile_registers tiles
#define QL_TILE_CONFIG(from) (tiles.config = *(from))
#define QL_TILE_RELEASE() ((void)0)
#define QL_TILE_ZERO(t) ql_emulated_zero(&tiles, t)
#define QL_TILE_LOAD(t, base, stride) ql_emulated_load(&tiles, t, base, stride)
#define QL_TILE_STORE(t, base, stride) ql_emulated_store(&tiles, t, base, stride)
#define QL_TILE_DPBSUD(c, a, b) ql_emulated_dpbsud(&tiles, c, a, b)
#include "amx_rows_body.h"

/* ---- checked and timed on this machine before it is used ----------------------------------------- */

#if QL_AMX_COMPILED
/* A pseudo-random product to check and time the kernels on: codes of an n x k weight (enough bytes for int8),
 * per-group scales and zeros, m rows of x rounded for the int8-activation kernels, two outputs; one allocation. */
typedef struct {
    int64_t m, n, k;
    uint8_t *codes;
    float *scale, *zero, *xd, *expected, *got;
    int8_t *xq;
    int32_t *xs;
} ql_sample;

static uint32_t ql_next(uint32_t *state) { return *state = *state * 1664525u + 1013904223u; }

static int ql_sample_make(int64_t m, int64_t n, int64_t k, uint32_t seed, ql_sample *s) {
    const int64_t groups = n * k / 64, blocks = m * k / 64;
    const size_t floats = (size_t)(2 * groups + m * k + blocks + 2 * m * n);
    float *base = malloc(floats * sizeof(float) + (size_t)(blocks * 4 + m * k + n * k));
    if (!base) return 1;
    *s = (ql_sample){.m = m, .n = n, .k = k, .scale = base, .zero = base + groups, .xd = base + 2 * groups};
    float *x = s->xd + blocks;
    s->expected = x + m * k;
    s->got = s->expected + m * n;
    s->xs = (int32_t *)(s->got + m * n);
    s->xq = (int8_t *)(s->xs + blocks);
    s->codes = (uint8_t *)(s->xq + m * k);
    uint32_t state = seed;
    for (int64_t i = 0; i < n * k; i++) s->codes[i] = (uint8_t)(ql_next(&state) >> 24);
    for (int64_t i = 0; i < groups; i++) {
        s->scale[i] = 0.01f + (float)(i % 7) * 0.003f;
        s->zero[i] = (float)(i % 16);
    }
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)((int)(ql_next(&state) >> 20) - 2048) / 512.0f;
    ql_quantize_x_a8(x, m, k, 0, s->xq, s->xd, s->xs);
    return 0;
}

/* The sample's weight as 4-bit affine codes with zero points (QL_AFFINE) or int8 codes (QL_INT8), groups of 64. */
static ql_weight ql_sample_weight(const ql_sample *s, int kind) {
    const int bits = kind == QL_INT8 ? 8 : 4;
    return (ql_weight){.codes = s->codes, .n = s->n, .k = s->k, .groups = s->k / 64, .group_size = 64,
                       .group_codes = 64, .group_bytes = 64 * bits / 8, .bits = bits, .kind = kind,
                       .scale = s->scale, .zero = kind == QL_INT8 ? NULL : s->zero, .scale_dtype = QL_F32,
                       .zero_dtype = QL_F32};
}

static double ql_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}
#endif

/* 0 when the tile kernel's outputs equal the AVX512-VNNI kernel's bit for bit on a 4-bit affine and an int8
 * weight (37 rows: a whole step and a partial one; 40 features: a whole panel and a partial one), 1 when
 * they differ, -1 when the tiles cannot run here or memory ran out. */
QL_API int ql_amx_check(void) {
#if QL_AMX_COMPILED
    if (ql_amx_status() != QL_AMX_READY || ql_a8_kernel() != QL_A8_VNNI) return -1;
    ql_sample s;
    if (ql_sample_make(37, 40, 256, 12345u, &s)) return -1;
    int result = 0;
    for (int kind = QL_AFFINE; kind <= QL_INT8 && result == 0; kind++) {
        const ql_weight w = ql_sample_weight(&s, kind);
        ql_a8_scratch scratch;
        if (ql_a8_scratch_make(&w, s.m, QL_AMX_PANEL, &scratch)) {
            result = -1;
            break;
        }
        ql_rows512_a8(&w, s.xq, s.xd, s.xs, s.m, 0, s.n, s.expected, s.n, &scratch);
        ql_rows_amx_a8(&w, s.xq, s.xd, s.xs, s.m, 0, s.n, s.got, s.n, &scratch);
        free(scratch.xz);
        result = memcmp(s.expected, s.got, (size_t)(s.m * s.n) * sizeof(float)) != 0;
    }
    free(s.scale);
    return result;
#else
    return -1;
#endif
}

/* The VNNI kernel's time over the tiles' on one thread, for a 4-bit affine 1024 x 512 weight in groups of 64
 * at 128 rows (a prompt's product): the fastest of 3 calls, rounds alternated; -1 where the tiles cannot run. */
QL_API double ql_amx_speedup(void) {
#if QL_AMX_COMPILED
    if (ql_amx_status() != QL_AMX_READY || ql_a8_kernel() != QL_A8_VNNI) return -1.0;
    ql_sample s;
    if (ql_sample_make(128, 512, 1024, 7u, &s)) return -1.0;
    const ql_weight w = ql_sample_weight(&s, QL_AFFINE);
    ql_a8_scratch scratch;
    double best[2] = {1e30, 1e30};
    if (!ql_a8_scratch_make(&w, s.m, QL_AMX_PANEL, &scratch)) {
        for (int round = 0; round < 3; round++)
            for (int kernel = 0; kernel < 2; kernel++)
                for (int call = 0; call < 3; call++) {
                    const double start = ql_seconds();
                    (kernel ? ql_rows_amx_a8 : ql_rows512_a8)(&w, s.xq, s.xd, s.xs, s.m, 0, s.n, s.got, s.n, &scratch);
                    const double seconds = ql_seconds() - start;
                    if (seconds < best[kernel]) best[kernel] = seconds;
                }
        free(scratch.xz);
    }
    free(s.scale);
    return best[1] < 1e30 ? best[0] / best[1] : -1.0;
#else
    return -1.0;
#endif
}
#else
QL_API int ql_amx_status(void) { return QL_AMX_NO_CPU; }
QL_API int ql_amx_check(void) { return -1; }
QL_API double ql_amx_speedup(void) { return -1.0; }
#endif
