/*
 * One decoding step of a Llama-family model as one call: every block's norms, projections,
 * rotary embedding, attention over the KV cache and MLP, for one token of one sequence.
 *
 * A compiled torch step runs the same work as ~300 small kernels and ~120 operator calls
 * driven from Python; at one token each of those costs more than its arithmetic. Here the
 * quantized projections run on the same kernels (ql_gemm_group: q/k/v and gate/up as one call
 * each when they share a layout) and everything between them is a loop over a few hundred
 * floats. The caller (quantlab/generation/native.py) looks the token up, computes the rotary
 * cos/sin with the model's own rotary module (so every rope variant it implements works) and
 * applies the head when it is not in a native format.
 *
 * The block (LlamaDecoderLayer and its relatives):
 *   h += o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))  with n = rms_norm(h)
 *   h += down_proj(silu(gate_proj(n)) * up_proj(n))                     with n = rms_norm(h)
 * Keys and values of the token are written at `position` of the cache; attention reads
 * positions 0..position (one sequence, no padding: the caller falls back otherwise).
 */
#include "quantlab_cpu.h"

#include <math.h>

/* ---- small vector helpers ------------------------------------------------------------------- */

#ifdef QL_X86
QL_AVX512 static float ql_dot512(const float *a, const float *b, int64_t n) {
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
        sum1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), sum1);
    }
    for (; i + 16 <= n; i += 16) sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* exp(x) of 16 lanes, as Cephes' expf computes it: x = n ln2 + r, a degree-6 polynomial in r, times 2^n.
 * Within 1 ulp of glibc's expf on every 64th float of [-87, 88]; below -87.34 (2^-126) it stays at that, which
 * against softmax's max of 1 is 0. */
QL_AVX512 static __m512 ql_exp512(__m512 x) {
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

QL_AVX512 static void ql_axpy512(float *y, float a, const float *x, int64_t n) {
    __m512 scale = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* The AVX2 versions of the helpers above, 8 lanes at a time (an AVX2-only CPU has no AVX-512). */
QL_AVX2 static float ql_dot256(const float *a, const float *b, int64_t n) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
        sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), sum1);
    }
    for (; i + 8 <= n; i += 8) sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
    float sum = ql_sum256(_mm256_add_ps(sum0, sum1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* ql_exp512's polynomial on 8 lanes; 2^n is built in the exponent bits, so x is also kept below
 * 88.376 (n <= 127), where expf is within 1 ulp of FLT_MAX; softmax's inputs are at most 0 and
 * silu's large ones give 0 either way. */
QL_AVX2 static __m256 ql_exp256(__m256 x) {
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

QL_AVX2 static void ql_axpy256(float *y, float a, const float *x, int64_t n) {
    const __m256 scale = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
#endif

static float ql_dot(int isa, const float *a, const float *b, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) return ql_dot512(a, b, n);
    if (isa == QL_ISA_AVX2) return ql_dot256(a, b, n);
#endif
    float partial[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) partial[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += partial[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void ql_axpy(int isa, float *y, float a, const float *x, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) {
        ql_axpy512(y, a, x, n);
        return;
    }
    if (isa == QL_ISA_AVX2) {
        ql_axpy256(y, a, x, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* out = weight * x / sqrt(mean(x^2) + eps), as LlamaRMSNorm computes it in float32. */
static void ql_rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    double squares = 0.0;
    for (int64_t i = 0; i < n; i++) squares += (double)x[i] * x[i];
    float inverse = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* rotate_half rope on one head: x[j], x[j + d/2] turned by the angle whose cos/sin are at j. */
static void ql_rope(float *x, const float *cos, const float *sin, int64_t head_dim) {
    int64_t half = head_dim / 2;
    for (int64_t j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        x[j] = a * cos[j] - b * sin[j];
        x[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

#ifdef QL_X86
QL_AVX512 static void ql_silu_times512(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
        const __m512 e = ql_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(gate + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
    }
}

QL_AVX2 static void ql_silu_times256(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = ql_exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
#endif

/* gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, as LlamaMLP computes it. 16 at a time with AVX-512:
 * SmolLM2 decode step, 30 x 1536 a token: 0.091 -> 0.010 ms. */
static void ql_silu_times(int isa, float *gate, const float *up, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) {
        ql_silu_times512(gate, up, n);
        return;
    }
    if (isa == QL_ISA_AVX2) {
        ql_silu_times256(gate, up, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void ql_add_bias(float *y, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) y[i] += bias[i];
}

/* ---- projections ------------------------------------------------------------------------------ */

/* y = x times each weight (outputs side by side), one grouped call when they share a layout. */
static int ql_project(const ql_weight *weights, const float *const *biases, int count, const float *x, float *y,
                      int threads, int activation_bits) {
    int same = 1;
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        total += weights[i].n;
        same &= ql_same_layout(&weights[i], &weights[0]);
    }
    if (same) {
        int status = ql_gemm_group(weights, count, x, 1, weights[0].k, y, total, threads, activation_bits);
        if (status != QL_OK) return status;
    } else {
        for (int i = 0, column = 0; i < count; column += (int)weights[i].n, i++) {
            int status = ql_gemm_group(&weights[i], 1, x, 1, weights[i].k, y + column, weights[i].n, threads,
                                       activation_bits);
            if (status != QL_OK) return status;
        }
    }
    for (int i = 0, column = 0; i < count; column += (int)weights[i].n, i++) ql_add_bias(y + column, biases[i], weights[i].n);
    return QL_OK;
}

/* ---- attention ------------------------------------------------------------------------------ */

typedef struct {
    const ql_decoder *decoder;
    const float *q;     /* [heads, head_dim], rope applied */
    const float *keys;  /* [kv_heads, max_len, head_dim] */
    const float *values;
    int64_t length;     /* positions attended: 0..length-1 */
    int64_t max_len;    /* positions the cache holds */
    int isa;
    float *scores;      /* [heads, length] */
    float *out;         /* [heads, head_dim] */
} ql_attention_job;

#ifdef QL_X86

/* One head's attention over `length` cached positions, head_dim a multiple of 16: scores 4 positions at
 * a time (4 dot products summed together), softmax 16 at a time. SmolLM2's decode step (9 heads of 64,
 * 30 layers, 32-96 positions), 4-bit e8 with int8 activations, rope + attention a token: 0.25-0.26 ms with
 * the scalar version below, 0.17-0.21 with this one (a whole token ~3.5 ms of C). */
QL_AVX512 static void ql_attention_head512(const float *q, const float *keys, const float *values, int64_t length,
                                           int64_t dim, float scale, float *scores, float *out) {
    int64_t t = 0;
    for (; t + 4 <= length; t += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q + i);
            for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys + (t + j) * dim + i), acc[j]);
        }
        ql_store_sums(4, acc, scores + t);
        _mm_storeu_ps(scores + t, _mm_mul_ps(_mm_loadu_ps(scores + t), _mm_set1_ps(scale)));
    }
    for (; t < length; t++) scores[t] = ql_dot512(q, keys + t * dim, dim) * scale;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (t = 0; t < length; t += 16) {
        const __mmask16 mask = length - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (length - t)) - 1u);
        top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, scores + t));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (t = 0; t < length; t += 16) {
        const __mmask16 mask = length - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (length - t)) - 1u);
        const __m512 e = ql_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), max));
        _mm512_mask_storeu_ps(scores + t, mask, e);
        total = _mm512_mask_add_ps(total, mask, total, e);
    }
    const float inverse = 1.0f / _mm512_reduce_add_ps(total);
    memset(out, 0, (size_t)dim * sizeof(float));
    for (t = 0; t < length; t++) ql_axpy512(out, scores[t] * inverse, values + t * dim, dim);
}

/* ql_attention_head512 on 8 lanes (head_dim a multiple of 8): scores 4 positions at a time, softmax's
 * exponentials 8 at a time. */
QL_AVX2 static void ql_attention_head256(const float *q, const float *keys, const float *values, int64_t length,
                                         int64_t dim, float scale, float *scores, float *out) {
    int64_t t = 0;
    for (; t + 4 <= length; t += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys + (t + j) * dim + i), acc[j]);
        }
        for (int j = 0; j < 4; j++) scores[t + j] = ql_sum256(acc[j]) * scale;
    }
    for (; t < length; t++) scores[t] = ql_dot256(q, keys + t * dim, dim) * scale;
    float top = -INFINITY;
    for (t = 0; t < length; t++) top = scores[t] > top ? scores[t] : top;
    const __m256 max = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= length; t += 8) {
        const __m256 e = ql_exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), max));
        _mm256_storeu_ps(scores + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = ql_sum256(sum);
    for (; t < length; t++) total += scores[t] = expf(scores[t] - top);
    const float inverse = 1.0f / total;
    memset(out, 0, (size_t)dim * sizeof(float));
    for (t = 0; t < length; t++) ql_axpy256(out, scores[t] * inverse, values + t * dim, dim);
}
#endif

static void ql_attention_head(void *arg, int64_t head) {
    const ql_attention_job *job = (const ql_attention_job *)arg;
    const ql_decoder *d = job->decoder;
    int64_t dim = d->head_dim, kv = head / (d->heads / d->kv_heads);
    const float *q = job->q + head * dim;
    const float *keys = job->keys + kv * job->max_len * dim, *values = job->values + kv * job->max_len * dim;
    float *scores = job->scores + head * job->length, *out = job->out + head * dim;
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512 && dim % 16 == 0) {
        ql_attention_head512(q, keys, values, job->length, dim, d->attention_scale, scores, out);
        return;
    }
    if (job->isa == QL_ISA_AVX2 && dim % 8 == 0) {
        ql_attention_head256(q, keys, values, job->length, dim, d->attention_scale, scores, out);
        return;
    }
#endif
    float top = -INFINITY;
    for (int64_t t = 0; t < job->length; t++) {
        scores[t] = ql_dot(job->isa, q, keys + t * dim, dim) * d->attention_scale;
        if (scores[t] > top) top = scores[t];
    }
    float total = 0.0f;
    for (int64_t t = 0; t < job->length; t++) total += scores[t] = expf(scores[t] - top);
    memset(out, 0, (size_t)dim * sizeof(float));
    for (int64_t t = 0; t < job->length; t++) ql_axpy(job->isa, out, scores[t] / total, values + t * dim, dim);
}

/* ---- the step --------------------------------------------------------------------------------- */

static int ql_check_decoder(const ql_decoder *d, int64_t position, int64_t max_len) {
    if (d->blocks < 1 || d->hidden < 1 || d->heads < 1 || d->kv_heads < 1 || d->heads % d->kv_heads ||
        d->head_dim < 2 || d->head_dim % 2 || d->intermediate < 1 || position < 0 || position >= max_len)
        return QL_BAD_FORMAT;
    for (int64_t b = 0; b < d->blocks; b++) {
        const ql_block *block = &d->block[b];
        if (block->q.k != d->hidden || block->q.n != d->heads * d->head_dim || block->k.n != d->kv_heads * d->head_dim ||
            block->v.n != d->kv_heads * d->head_dim || block->o.k != d->heads * d->head_dim || block->o.n != d->hidden ||
            block->gate.n != d->intermediate || block->up.n != d->intermediate || block->down.k != d->intermediate ||
            block->down.n != d->hidden || block->k.k != d->hidden || block->v.k != d->hidden ||
            block->gate.k != d->hidden || block->up.k != d->hidden)
            return QL_BAD_FORMAT;
    }
    if (d->head && (d->head->k != d->hidden)) return QL_BAD_FORMAT;
    return QL_OK;
}

/* hidden: in, the token's embedding [hidden]; out, the final norm's output. cos/sin: [head_dim]
 * for the token's position. The token's keys and values go to `position` of every layer's
 * cache (cache->keys[b]: [kv_heads, max_len, head_dim]) and cache->lengths[b] (the cache's own
 * count of positions written) grows by one. logits [head->n] when the decoder has a head. */
QL_API int ql_decode_step(const ql_decoder *d, const ql_cache *cache, float *hidden, const float *cos, const float *sin,
                          int64_t position, float *logits, int threads, int activation_bits) {
    int status = ql_check_decoder(d, position, cache->max_len);
    if (status != QL_OK) return status;
    int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim, length = position + 1;
    int64_t widest = q_size + 2 * kv_size;
    if (2 * d->intermediate > widest) widest = 2 * d->intermediate;
    if (d->hidden > widest) widest = d->hidden;
    float *buffer = malloc((size_t)(widest + d->hidden + q_size + d->hidden + d->heads * length) * sizeof(float));
    if (!buffer) return QL_NO_MEMORY;
    float *wide = buffer, *normed = wide + widest, *attended = normed + d->hidden, *delta = attended + q_size;
    float *scores = delta + d->hidden;
    int isa = ql_isa();
    for (int64_t b = 0; b < d->blocks && status == QL_OK; b++) {
        const ql_block *block = &d->block[b];
        float *keys = cache->keys[b], *values = cache->values[b];
        ql_rms_norm(hidden, block->attention_norm, d->hidden, d->norm_eps, normed);
        const ql_weight qkv[3] = {block->q, block->k, block->v};
        const float *qkv_bias[3] = {block->q_bias, block->k_bias, block->v_bias};
        status = ql_project(qkv, qkv_bias, 3, normed, wide, threads, activation_bits);
        if (status != QL_OK) break;
        float *q = wide, *k = wide + q_size, *v = k + kv_size;
        for (int64_t h = 0; h < d->heads; h++) ql_rope(q + h * d->head_dim, cos, sin, d->head_dim);
        for (int64_t h = 0; h < d->kv_heads; h++) {
            ql_rope(k + h * d->head_dim, cos, sin, d->head_dim);
            memcpy(keys + (h * cache->max_len + position) * d->head_dim, k + h * d->head_dim, (size_t)d->head_dim * sizeof(float));
            memcpy(values + (h * cache->max_len + position) * d->head_dim, v + h * d->head_dim, (size_t)d->head_dim * sizeof(float));
        }
        ql_attention_job attention = {d, q, keys, values, length, cache->max_len, isa, scores, attended};
        ql_run(ql_attention_head, &attention, d->heads, length * d->heads * d->head_dim >= 32768 ? threads : 1);
        const float *o_bias[1] = {block->o_bias};
        status = ql_project(&block->o, o_bias, 1, attended, delta, threads, activation_bits);
        if (status != QL_OK) break;
        for (int64_t i = 0; i < d->hidden; i++) hidden[i] += delta[i];

        ql_rms_norm(hidden, block->mlp_norm, d->hidden, d->norm_eps, normed);
        const ql_weight gate_up[2] = {block->gate, block->up};
        const float *gate_up_bias[2] = {block->gate_bias, block->up_bias};
        status = ql_project(gate_up, gate_up_bias, 2, normed, wide, threads, activation_bits);
        if (status != QL_OK) break;
        float *gate = wide, *up = wide + d->intermediate;
        ql_silu_times(isa, gate, up, d->intermediate);
        const float *down_bias[1] = {block->down_bias};
        status = ql_project(&block->down, down_bias, 1, gate, delta, threads, activation_bits);
        if (status != QL_OK) break;
        for (int64_t i = 0; i < d->hidden; i++) hidden[i] += delta[i];
    }
    if (status == QL_OK) {
        ql_rms_norm(hidden, d->final_norm, d->hidden, d->norm_eps, normed);
        memcpy(hidden, normed, (size_t)d->hidden * sizeof(float));
        for (int64_t b = 0; b < d->blocks; b++) cache->lengths[b][0] += 1;
        if (d->head) {
            const float *no_bias[1] = {d->head_bias};
            status = ql_project(d->head, no_bias, 1, hidden, logits, threads, activation_bits);
        }
    }
    free(buffer);
    return status;
}
