/* CPU kernels for the decode hot path, called from Python through ctypes.
 *
 * Built on first use by tokenline/model/cpu_kernels.py with `-O3 -march=native -fopenmp`, linked
 * against the libgomp that torch already loaded, so these loops share torch's OpenMP threads
 * instead of fighting them for the cores.
 *
 * - tl_linear_bf16: y = x @ w^T for few rows of x (decode). oneDNN re-lays the weight out on
 *   every call at small M and reaches about half the memory bandwidth; this streams each weight
 *   row once and reuses it for all rows of x.
 * - tl_decode_attention: one query token per sequence against its paged KV cache, reading the
 *   blocks in place (no gather of the history into a padded copy, no mask).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { TL_FLOAT32 = 0, TL_BFLOAT16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does when it casts float32 to bfloat16. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int tl_has_avx512bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * y[M, N] = x[M, K] @ w[N, K]^T, bfloat16 in and out, float32 accumulation.
 * Threads split the output columns (rows of w), so each streams its own slice of the weight.
 */
#define TL_ROW_TILE 4 /* rows of x per pass */
#define TL_COL_TILE 4 /* rows of w per pass: 4 x 4 accumulators stay in registers */

#if defined(__AVX512BF16__)
/* One tile: MT rows of x (a compile-time constant after inlining, so the accumulators live in
 * registers) against TL_COL_TILE rows of w starting at n. */
static inline __attribute__((always_inline)) void linear_tile_avx512(const uint16_t *x, const uint16_t *w,
                                                                     uint16_t *y, const int MT, int64_t n,
                                                                     int64_t N, int64_t K) {
    __m512 acc[TL_ROW_TILE][TL_COL_TILE];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < TL_COL_TILE; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t k_main = K & ~(int64_t)31;
    for (int64_t k = 0; k < k_main; k += 32) {
        __m512bh wv[TL_COL_TILE];
        for (int c = 0; c < TL_COL_TILE; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n + c) * K + k));
        for (int r = 0; r < MT; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
            for (int c = 0; c < TL_COL_TILE; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if (k_main < K) {
        const __mmask32 tail = (__mmask32)((1u << (K - k_main)) - 1u);
        __m512bh wv[TL_COL_TILE];
        for (int c = 0; c < TL_COL_TILE; c++) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + (n + c) * K + k_main);
        for (int r = 0; r < MT; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * K + k_main);
            for (int c = 0; c < TL_COL_TILE; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < TL_COL_TILE; c++) y[r * N + n + c] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][c]));
}
#endif

static void linear_cols_generic(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m, int64_t n0,
                                int64_t n1, int64_t N, int64_t K) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        for (int64_t r = 0; r < m; r++) {
            const uint16_t *xr = x + r * K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
            y[r * N + n] = f32_to_bf16(acc);
        }
    }
}

/* Columns [n0, n1) of y for rows [0, m) of x. */
static void linear_cols(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m, int64_t n0, int64_t n1,
                        int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    int64_t n = n0;
    for (; n + TL_COL_TILE <= n1; n += TL_COL_TILE) {
        /* A weight tile is read from memory once, then from L1 for the following row tiles. */
        int64_t r = 0;
        for (; r + TL_ROW_TILE <= m; r += TL_ROW_TILE) linear_tile_avx512(x + r * K, w, y + r * N, 4, n, N, K);
        switch (m - r) {
        case 3: linear_tile_avx512(x + r * K, w, y + r * N, 3, n, N, K); break;
        case 2: linear_tile_avx512(x + r * K, w, y + r * N, 2, n, N, K); break;
        case 1: linear_tile_avx512(x + r * K, w, y + r * N, 1, n, N, K); break;
        default: break;
        }
    }
    linear_cols_generic(x, w, y, m, n, n1, N, K);
#else
    linear_cols_generic(x, w, y, m, n0, n1, N, K);
#endif
}

void tl_linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    /* Threads split the output columns, so each streams its own slice of the weight. */
    const int64_t chunk = 64;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += chunk) linear_cols(x, w, y, M, n0, n0 + chunk < N ? n0 + chunk : N, N, K);
}

/* ---------------------------------------------------------------------------------------------
 * Decode attention over a paged KV cache.
 *
 * q:      [D, H, Dh] (token stride q_stride elements, heads contiguous)
 * caches: [num_blocks, block_size, KVH, Dh] each, contiguous
 * tables: [D, width] int64 block ids; lens: [D] int64 tokens each query attends to
 * out:    [D, H, Dh] contiguous
 * Query head h reads KV head h / (H / KVH), as grouped-query attention does.
 */

/* exp for x <= 0 (softmax after subtracting the max), vectorisable: 2^(x log2 e) split into an
 * integer power and a degree-6 polynomial on [-0.5, 0.5]; relative error ~2e-7. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    const float t = x * 1.44269504088896341f;
    const float fi = floorf(t + 0.5f);
    const float f = (t - fi) * 0.69314718055994531f;
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)fi << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

static inline void load_row(const void *base, int64_t index, int64_t n, int dtype, float *dst) {
    if (dtype == TL_BFLOAT16) {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX512F__)
#define TL_MAX_DH16 16   /* head_dim / 16 on the vector path (head_dim <= 256) */
#define TL_MAX_QVEC 256  /* query heads x head_dim / 16 one work item holds in vectors */

static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == TL_BFLOAT16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* exp(x) for x <= 0, 16 lanes: the same range reduction and polynomial as exp_nonpositive. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, fi), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, fi);
}

/* In-place softmax of n scores. */
static inline void softmax_avx512(float *s, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, s + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        const __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx));
        _mm512_mask_storeu_ps(s + t, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
    }
}

/* One sequence's KV heads [g0, g0 + ng) with their `group` query heads each, against `len` cached
 * tokens. Taking all of a sequence's KV heads at once reads each token's row (KVH * Dh values)
 * whole, so a block is one contiguous stream. */
static void decode_attention_item_avx512(int dtype, const void *q, int64_t q_index, const void *k_cache,
                                         const void *v_cache, const int64_t *table, int64_t len, void *out,
                                         int64_t out_index, int64_t g0, int64_t ng, int64_t group, int64_t Dh,
                                         int64_t block_size, int64_t token_stride, float scale, float *scores,
                                         int64_t max_len) {
    const int64_t nv = Dh / 16;
    const int64_t heads = ng * group;
    __m512 qv[TL_MAX_QVEC];
    for (int64_t h = 0; h < heads; h++)
        for (int64_t c = 0; c < nv; c++)
            qv[h * nv + c] = _mm512_mul_ps(load16(q, q_index + h * Dh + c * 16, dtype), _mm512_set1_ps(scale));
    /* Scores, block by block. */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t off = 0; off < n; off++) {
            const int64_t row = (base + off) * token_stride + g0 * Dh;
            for (int64_t g = 0; g < ng; g++) {
                __m512 kv[TL_MAX_DH16];
                for (int64_t c = 0; c < nv; c++) kv[c] = load16(k_cache, row + g * Dh + c * 16, dtype);
                for (int64_t j = 0; j < group; j++) {
                    const int64_t h = g * group + j;
                    __m512 acc = _mm512_mul_ps(qv[h * nv], kv[0]);
                    for (int64_t c = 1; c < nv; c++) acc = _mm512_fmadd_ps(qv[h * nv + c], kv[c], acc);
                    scores[h * max_len + start + off] = _mm512_reduce_add_ps(acc);
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) softmax_avx512(scores + h * max_len, len);
    __m512 acc[TL_MAX_QVEC];
    for (int64_t i = 0; i < heads * nv; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t off = 0; off < n; off++) {
            const int64_t row = (base + off) * token_stride + g0 * Dh;
            for (int64_t g = 0; g < ng; g++) {
                __m512 vv[TL_MAX_DH16];
                for (int64_t c = 0; c < nv; c++) vv[c] = load16(v_cache, row + g * Dh + c * 16, dtype);
                for (int64_t j = 0; j < group; j++) {
                    const int64_t h = g * group + j;
                    const __m512 p = _mm512_set1_ps(scores[h * max_len + start + off]);
                    for (int64_t c = 0; c < nv; c++) acc[h * nv + c] = _mm512_fmadd_ps(p, vv[c], acc[h * nv + c]);
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t c = 0; c < nv; c++) {
            const int64_t o = out_index + h * Dh + c * 16;
            if (dtype == TL_BFLOAT16) {
                float tmp[16];
                _mm512_storeu_ps(tmp, acc[h * nv + c]);
                uint16_t *dst = (uint16_t *)out + o;
                for (int i = 0; i < 16; i++) dst[i] = f32_to_bf16(tmp[i]);
            } else {
                _mm512_storeu_ps((float *)out + o, acc[h * nv + c]);
            }
        }
    }
}
#endif

void tl_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *tables, int64_t width, const int64_t *lens, void *out, int64_t D, int64_t H,
                         int64_t KVH, int64_t Dh, int64_t block_size, int64_t max_len, float scale) {
    const int64_t group = H / KVH;
    const int64_t token_stride = KVH * Dh; /* elements between consecutive tokens of a block */
#if defined(__AVX512F__)
    const int vector_path = Dh % 16 == 0 && Dh / 16 <= TL_MAX_DH16 && group * (Dh / 16) <= TL_MAX_QVEC;
    /* A whole sequence per work item when there are enough sequences to share out and its query
     * vectors fit; otherwise one item per (sequence, KV head). */
    const int64_t kv_per_item =
        vector_path && D >= 2 * omp_get_max_threads() && H * (Dh / 16) <= TL_MAX_QVEC ? KVH : 1;
#else
    const int64_t kv_per_item = 1;
#endif
    const int64_t items_per_seq = KVH / kv_per_item;
#pragma omp parallel
    {
        /* Per-thread scratch: scores [heads of an item, max_len], query and accumulator rows, one K/V row. */
        float *scores = (float *)malloc((size_t)(kv_per_item * group * max_len) * sizeof(float));
        float *qf = (float *)malloc((size_t)(group * Dh) * sizeof(float));
        float *acc = (float *)malloc((size_t)(group * Dh) * sizeof(float));
        float *row = (float *)malloc((size_t)Dh * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < D * items_per_seq; item++) {
            const int64_t d = item / items_per_seq, g = (item % items_per_seq) * kv_per_item;
            const int64_t len = lens[d];
            const int64_t *table = tables + d * width;
#if defined(__AVX512F__)
            if (vector_path) {
                decode_attention_item_avx512(dtype, q, d * q_stride + g * group * Dh, k_cache, v_cache, table, len,
                                             out, (d * H + g * group) * Dh, g, kv_per_item, group, Dh, block_size,
                                             token_stride, scale, scores, max_len);
                continue;
            }
#endif
            for (int64_t j = 0; j < group; j++) {
                load_row(q, d * q_stride + (g * group + j) * Dh, Dh, dtype, qf + j * Dh);
                for (int64_t i = 0; i < Dh; i++) qf[j * Dh + i] *= scale;
            }
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                load_row(k_cache, slot * token_stride + g * Dh, Dh, dtype, row);
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = qf + j * Dh;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t i = 0; i < Dh; i++) s += qj[i] * row[i];
                    scores[j * max_len + t] = s;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *sj = scores + j * max_len;
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = sj[t] > mx ? sj[t] : mx;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    sj[t] = exp_nonpositive(sj[t] - mx);
                    sum += sj[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) sj[t] *= inv;
            }
            memset(acc, 0, (size_t)(group * Dh) * sizeof(float));
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                load_row(v_cache, slot * token_stride + g * Dh, Dh, dtype, row);
                for (int64_t j = 0; j < group; j++) {
                    const float p = scores[j * max_len + t];
                    float *aj = acc + j * Dh;
#pragma omp simd
                    for (int64_t i = 0; i < Dh; i++) aj[i] += p * row[i];
                }
            }
            for (int64_t j = 0; j < group; j++) {
                const int64_t o = (d * H + g * group + j) * Dh;
                if (dtype == TL_BFLOAT16) {
                    uint16_t *dst = (uint16_t *)out + o;
                    for (int64_t i = 0; i < Dh; i++) dst[i] = f32_to_bf16(acc[j * Dh + i]);
                } else {
                    memcpy((float *)out + o, acc + j * Dh, (size_t)Dh * sizeof(float));
                }
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
}

/* ---------------------------------------------------------------------------------------------
 * RMSNorm of bfloat16 rows as the reference computes it: normalise in float32, round to
 * bfloat16, then multiply by the bfloat16 weight and round again. One pass per row instead of
 * seven tensor operations.
 */
void tl_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * H;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) {
            const float v = bf16_to_f32(row[i]);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)H + eps);
        uint16_t *dst = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[i]) * scale));
            dst[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Rotary embedding (rotate-half layout) in place on the query and key heads of a fused qkv row
 * [T, row_stride]: queries are heads [0, H), keys heads [H, H + KVH), each `Dh` wide. Rounds
 * to bfloat16 after each product and after the sum, as the reference's three tensor ops do.
 */
void tl_rotary_bf16(uint16_t *qkv, int64_t row_stride, const uint16_t *cos, const uint16_t *sin, int64_t T,
                    int64_t heads, int64_t Dh) {
    const int64_t half = Dh / 2;
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * Dh, *s = sin + t * Dh;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = qkv + t * row_stride + h * Dh;
            float lo[512], hi[512];
            for (int64_t i = 0; i < half; i++) {
                lo[i] = bf16_to_f32(x[i]);
                hi[i] = bf16_to_f32(x[i + half]);
            }
            for (int64_t i = 0; i < half; i++) {
                /* out[:half] = x_lo * cos - x_hi * sin;  out[half:] = x_hi * cos + x_lo * sin */
                const float a = bf16_to_f32(f32_to_bf16(lo[i] * bf16_to_f32(c[i])));
                const float b = bf16_to_f32(f32_to_bf16(-hi[i] * bf16_to_f32(s[i])));
                x[i] = f32_to_bf16(a + b);
                const float d = bf16_to_f32(f32_to_bf16(hi[i] * bf16_to_f32(c[i + half])));
                const float e = bf16_to_f32(f32_to_bf16(lo[i] * bf16_to_f32(s[i + half])));
                x[i + half] = f32_to_bf16(d + e);
            }
        }
    }
}
