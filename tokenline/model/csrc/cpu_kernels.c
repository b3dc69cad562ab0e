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
 *   blocks in place (no gather of the history into a padded copy, no mask). The cache is in the
 *   queries' dtype, or bfloat16 beside float32 queries (--kv-cache-dtype bfloat16, the quantized
 *   layers of a bfloat16 model: rows widened as they are read). With a sliding `window` (> 0) a query reads only the last
 *   `window` positions, its own included: older blocks are never touched (they may be freed).
 * - tl_linear_panels_f32: y = x @ w^T in float32 for up to a few hundred rows, w held in column
 *   panels for an outer-product register tile (faster than MKL's sgemm on the plain weight there).
 * - tl_linear_q: y = x @ w^T with w in ggml's Q4_1 or Q8_0 blocks (weight-only quantization),
 *   read in place and widened to floats in registers; tl_linear_q_bf16: the same for bfloat16 rows,
 *   each panel of 16 weight rows expanded once to bfloat16 codes for every row (AVX-512 BF16);
 *   tl_linear_qp: the blocks repacked at load into 16-row panels, times rows rounded to int8 (VNNI).
 * - tl_decode_layer_f32: a whole Llama decoder layer for a few float32 decode rows in one call,
 *   its weights float32 or quantized; tl_decode_layer_bf16 the same on packed bfloat16 tiles. Both
 *   take Gemma 3's layer through an options struct (tl_layer_opts): q/k norms, post norms, GELU, a window.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { TL_FLOAT32 = 0, TL_BFLOAT16 = 1 };

/* Portable vectors (GCC vector extensions): AVX2 registers here, halves of AVX-512 ones or pairs of
 * SSE ones where the build has those. */
typedef float tl_v8 __attribute__((vector_size(32)));
typedef float tl_v8u __attribute__((vector_size(32), aligned(4))); /* an unaligned load */
typedef int32_t tl_v8i __attribute__((vector_size(32)));

static inline float hsum8(tl_v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

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

/* exp(f) for f in [-ln2/2, ln2/2], degree 6 (Horner): one definition for a float, a tl_v8 and an
 * __m512 (GCC's vector arithmetic takes all three; it contracts each step into an FMA). */
#define TL_EXP_POLY(f)                                                                                     \
    ((((((1.0f / 720.0f * (f) + 1.0f / 120.0f) * (f) + 1.0f / 24.0f) * (f) + 1.0f / 6.0f) * (f) + 0.5f) * (f) + \
      1.0f) * (f) + 1.0f)

/* exp for x <= 0 (softmax after subtracting the max), vectorisable: 2^(x log2 e) split into an
 * integer power and a degree-6 polynomial on [-0.5, 0.5]; relative error ~2e-7. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    const float t = x * 1.44269504088896341f;
    const float fi = floorf(t + 0.5f);
    const float f = (t - fi) * 0.69314718055994531f;
    float p = TL_EXP_POLY(f);
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

/* Decode attention rescales its running sums only when a score passes the running max by this much
 * (attend_item, attend_item_v8): weights up to e^slack are harmless in float32. */
#define TL_RESCALE_SLACK 8.0f

/* The tile of a sequence's tokens that starts at t (< end): at most `span` tokens, all in one block,
 * so its rows lie token_stride apart. Returns its length; *row0 = its first row's element offset. */
static inline int64_t kv_tile(const int64_t *table, int64_t t, int64_t end, int64_t span, int64_t block_size,
                              int64_t token_stride, int64_t *row0) {
    const int64_t off = t % block_size;
    const int64_t n = block_size - off < end - t ? block_size - off : end - t;
    *row0 = (table[t / block_size] * block_size + off) * token_stride;
    return n < span ? n : span;
}

#if defined(__AVX512F__)
#define TL_TILE 16       /* tokens per score vector, one lane each */
#define TL_MAX_DH16 16   /* head_dim / 16 on the vector path (head_dim <= 256) */
#define TL_MAX_QVEC 256  /* query heads x head_dim / 16 one work item holds in vectors */

static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == TL_BFLOAT16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* exp(x) for x <= 0, 16 lanes: the same range reduction and polynomial as exp_nonpositive. Also exact
 * enough for small positive x (attend_item's slack): the power of two goes through scalef. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, fi), _mm512_set1_ps(0.69314718055994531f));
    return _mm512_scalef_ps(TL_EXP_POLY(f), fi);
}

/* Lane t of the result is the sum of v[t]'s 16 lanes: one transpose-and-add tree for 16 tokens
 * (45 instructions) instead of 16 separate horizontal reductions. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 v[TL_TILE]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (v2i, v2i+1, v2i, v2i+1) partial sums */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: (v4i .. v4i+3) */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* then across the four 128-bit lanes */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* bf16 queries meet bf16 keys in VDPBF16PS (exact products, float32 sums) where the CPU has it;
 * otherwise both are widened to float32. */
#if defined(__AVX512BF16__)
#define TL_DP_BF16 1
#else
#define TL_DP_BF16 0
#endif

/* q . k for one query head (prepared by prepare_query) and the key row at `index`. */
static inline __attribute__((always_inline)) __m512 dot_row(const int dtype, const int kv_dtype, const int64_t nv,
                                                            const __m512 *qh, const void *k_cache, int64_t index) {
#if TL_DP_BF16
    if (dtype == TL_BFLOAT16) {
        const uint16_t *k = (const uint16_t *)k_cache + index;
        __m512 acc = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 2 <= nv; c += 2)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qh[c / 2], (__m512bh)_mm512_loadu_si512((const void *)(k + c * 16)));
        if (c < nv)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qh[c / 2], (__m512bh)_mm512_maskz_loadu_epi16(0xffff, k + c * 16));
        return acc;
    }
#endif
    __m512 acc = _mm512_mul_ps(qh[0], load16(k_cache, index, kv_dtype));
    for (int64_t c = 1; c < nv; c++) acc = _mm512_fmadd_ps(qh[c], load16(k_cache, index + c * 16, kv_dtype), acc);
    return acc;
}

/* Query head vectors in the form dot_row takes: raw bf16 pairs for VDPBF16PS, else float32. */
static inline __attribute__((always_inline)) void prepare_query(const int dtype, const int64_t nv, const void *q,
                                                                int64_t index, __m512 *qh) {
#if TL_DP_BF16
    if (dtype == TL_BFLOAT16) {
        const uint16_t *src = (const uint16_t *)q + index;
        for (int64_t c = 0; c < nv; c += 2)
            qh[c / 2] = _mm512_castsi512_ps(
                _mm512_maskz_loadu_epi16(c + 2 <= nv ? 0xffffffffu : 0xffffu, src + c * 16));
        return;
    }
#endif
    for (int64_t c = 0; c < nv; c++) qh[c] = load16(q, index + c * 16, dtype);
}

/* always_inline: as an out-of-line function GCC finds it free of side effects and drops the calls.
 * Into L2 (T1), not L1: a tile's 32-64 lines requested at once into L1 held up the loads behind them
 * on the AVX-512 EPYC here (batch 32 x 320 tokens from memory: 785 -> 392 us a layer; docs/benchmarks). */
static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t index, int64_t n, int dtype) {
    const char *p = (const char *)base + index * (dtype == TL_BFLOAT16 ? 2 : 4);
    const int64_t bytes = n * (dtype == TL_BFLOAT16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* Scores of one query head against a tile of n <= 16 key rows (a row repeats past the tile's
 * end; the caller masks those lanes). Called with n a constant for full tiles. */
static inline __attribute__((always_inline)) __m512 tile_scores(const int dtype, const int kv_dtype, const int64_t nv,
                                                                const __m512 *qh,
                                                                const void *k_cache, int64_t krow, int64_t stride,
                                                                const int64_t n) {
    __m512 sv[TL_TILE];
    for (int64_t i = 0; i < TL_TILE; i++) sv[i] = dot_row(dtype, kv_dtype, nv, qh, k_cache, krow + (i < n ? i : n - 1) * stride);
    return reduce16(sv);
}

#if TL_DP_BF16
/* acc[G][nv] += sum over the tile's tokens of p[j][t] * v[t], in VDPBF16PS: two tokens' value rows
 * interleaved element by element meet each head's (p_t, p_t+1) bf16 pair, so there is no
 * widening and half the multiply-adds. The interleave leaves acc permuted (unpermute_pairs).
 * The value dimension goes in chunks of CH vectors with G x CH <= 16 accumulators, the tile's rows
 * read once per chunk: at head_dim 256 and 4 heads, G x nv = 64 accumulators spilled (32 registers). */
static inline __attribute__((always_inline)) void pv_pairs_bf16(const int G, const int64_t nv, const uint16_t *v,
                                                                int64_t stride, int64_t n, const uint32_t *pp,
                                                                __m512 *acc) {
    int64_t CH = (16 / G) & ~1; /* even: a pair of value vectors per load */
    while (nv % CH) CH -= 2;    /* nv is even here */
    for (int64_t c0 = 0; c0 < nv; c0 += CH) {
        __m512 r[4][16];
        for (int j = 0; j < G; j++)
            for (int64_t c = 0; c < CH; c++) r[j][c] = acc[j * nv + c0 + c];
        for (int64_t k = 0; 2 * k < n; k++) {
            const uint16_t *a = v + 2 * k * stride + c0 * 16;
            const uint16_t *b = 2 * k + 1 < n ? a + stride : a; /* an odd last token pairs with itself, weight 0 */
            __m512bh w[4];
            for (int j = 0; j < G; j++) w[j] = (__m512bh)_mm512_set1_epi32((int)pp[j * 8 + k]);
            for (int64_t c = 0; c < CH; c += 2) {
                const __m512i x = _mm512_loadu_si512((const void *)(a + c * 16));
                const __m512i y = _mm512_loadu_si512((const void *)(b + c * 16));
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
                for (int j = 0; j < G; j++) {
                    r[j][c] = _mm512_dpbf16_ps(r[j][c], lo, w[j]);
                    r[j][c + 1] = _mm512_dpbf16_ps(r[j][c + 1], hi, w[j]);
                }
            }
        }
        for (int j = 0; j < G; j++)
            for (int64_t c = 0; c < CH; c++) acc[j * nv + c0 + c] = r[j][c];
    }
}

/* Back to element order: per 32 elements, the low unpack holds 0-3, 8-11, 16-19, 24-27 and the
 * high one 4-7, 12-15, 20-23, 28-31. */
static inline void unpermute_pairs(__m512 *acc, int64_t nv) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < nv; c += 2) {
        const __m512 lo = acc[c], hi = acc[c + 1];
        acc[c] = _mm512_permutex2var_ps(lo, first, hi);
        acc[c + 1] = _mm512_permutex2var_ps(lo, second, hi);
    }
}
#endif

/* Tokens [t0, t1) of one sequence against query heads of KV heads [g0, g0 + ng), in tiles of up
 * to 16 tokens inside a block, with an online softmax: each tile's K and V are read once, for
 * all query heads of their group, while the next tile is prefetched. Leaves, per item head, the
 * running max m, the sum of exponentials l and the unnormalised output acc. */
static inline __attribute__((always_inline)) void attend_item(
    const int dtype, const int kv_dtype, const int64_t nv, const void *q, int64_t q_index, const void *k_cache,
    const void *v_cache, const int64_t *table, int64_t t0, int64_t t1, int64_t g0, int64_t ng, int64_t group, int64_t block_size,
    int64_t token_stride, float scale, float *m, float *l, __m512 *acc) {
    const int64_t Dh = nv * 16;
    const int64_t heads = ng * group;
    const int64_t qchunks = TL_DP_BF16 && dtype == TL_BFLOAT16 ? (nv + 1) / 2 : nv;
    const int pv_pairs = TL_DP_BF16 && dtype == TL_BFLOAT16 && nv % 2 == 0;
    __m512 qv[TL_MAX_QVEC], lsum[TL_MAX_QVEC];
    for (int64_t h = 0; h < heads; h++) {
        prepare_query(dtype, nv, q, q_index + h * Dh, qv + h * qchunks);
        m[h] = -INFINITY;
        lsum[h] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; c++) acc[h * nv + c] = _mm512_setzero_ps();
    }
    float p[TL_MAX_QVEC][TL_TILE];     /* this tile's softmax weights, per query head of a group */
    uint32_t pp[TL_MAX_QVEC][TL_TILE / 2]; /* the same as bf16 pairs, for pv_pairs_bf16 */
    float vf[TL_TILE * TL_MAX_DH16 * 16]; /* this tile's values of one KV head in float32 */
    float kf[TL_TILE * TL_MAX_DH16 * 16]; /* and its keys, beside float32 queries: widened once, not per head */
    const int widen_k = dtype == TL_FLOAT32 && kv_dtype == TL_BFLOAT16;
    for (int64_t t = t0, n; t < t1; t += n) {
        int64_t row0, next_row0 = 0, next_n = 0;
        n = kv_tile(table, t, t1, TL_TILE, block_size, token_stride, &row0);
        row0 += g0 * Dh;
        /* The next tile, requested now so that it arrives while this one computes. */
        if (t + n < t1) {
            next_n = kv_tile(table, t + n, t1, TL_TILE, block_size, token_stride, &next_row0);
            next_row0 += g0 * Dh;
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int64_t g = 0; g < ng; g++) {
            const int64_t krow = row0 + g * Dh;
            for (int64_t i = 0; i < next_n; i++)
                prefetch_row(k_cache, next_row0 + i * token_stride + g * Dh, Dh, kv_dtype);
            if (widen_k)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t c = 0; c < nv; c++)
                        _mm512_storeu_ps(kf + i * Dh + c * 16, load16(k_cache, krow + i * token_stride + c * 16, kv_dtype));
            const void *kt = widen_k ? (const void *)kf : k_cache;
            const int kt_dtype = widen_k ? TL_FLOAT32 : kv_dtype;
            const int64_t kt_row = widen_k ? 0 : krow, kt_stride = widen_k ? Dh : token_stride;
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const __m512 *qh = qv + h * qchunks;
                const __m512 raw = n == TL_TILE ? tile_scores(dtype, kt_dtype, nv, qh, kt, kt_row, kt_stride, TL_TILE)
                                                : tile_scores(dtype, kt_dtype, nv, qh, kt, kt_row, kt_stride, n);
                const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, raw, _mm512_set1_ps(scale));
                /* Rescale only when a score passes the running max by TL_RESCALE_SLACK: weights up to
                 * e^slack are harmless in float32 and the branch is then almost never taken, instead
                 * of a horizontal max and a mispredicted branch on every tile. */
                if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[h] + TL_RESCALE_SLACK), _CMP_GT_OQ)) {
                    const float tile_max = _mm512_reduce_max_ps(s);
                    const __m512 correction = _mm512_set1_ps(exp_nonpositive(m[h] - tile_max));
                    m[h] = tile_max;
                    lsum[h] = _mm512_mul_ps(lsum[h], correction);
                    for (int64_t c = 0; c < nv; c++) acc[h * nv + c] = _mm512_mul_ps(acc[h * nv + c], correction);
                }
                const __m512 e = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m[h]))));
                lsum[h] = _mm512_add_ps(lsum[h], e);
#if TL_DP_BF16
                if (pv_pairs) {
                    _mm256_storeu_si256((__m256i *)pp[j], (__m256i)_mm512_cvtneps_pbh(e));
                    continue;
                }
#endif
                _mm512_storeu_ps(p[j], e);
            }
            const int64_t vrow = row0 + g * Dh;
            for (int64_t i = 0; i < next_n; i++)
                prefetch_row(v_cache, next_row0 + i * token_stride + g * Dh, Dh, kv_dtype);
#if TL_DP_BF16
            if (pv_pairs) {
                const uint16_t *v = (const uint16_t *)v_cache + vrow;
                for (int64_t j = 0; j < group; j += 4) {
                    __m512 *a = acc + (g * group + j) * nv;
                    switch (group - j < 4 ? group - j : 4) {
                    case 1: pv_pairs_bf16(1, nv, v, token_stride, n, pp[j], a); break;
                    case 2: pv_pairs_bf16(2, nv, v, token_stride, n, pp[j], a); break;
                    case 3: pv_pairs_bf16(3, nv, v, token_stride, n, pp[j], a); break;
                    default: pv_pairs_bf16(4, nv, v, token_stride, n, pp[j], a); break;
                    }
                }
                continue;
            }
#endif
            /* Values widened once per tile, then each query head of the group sums over them. */
            const float *vt = kv_dtype == TL_BFLOAT16 ? vf : (const float *)v_cache + vrow;
            const int64_t vt_stride = kv_dtype == TL_BFLOAT16 ? Dh : token_stride;
            if (kv_dtype == TL_BFLOAT16)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t c = 0; c < nv; c++)
                        _mm512_storeu_ps(vf + i * Dh + c * 16,
                                         load16(v_cache, vrow + i * token_stride + c * 16, kv_dtype));
            for (int64_t j = 0; j < group; j++) {
                __m512 *a = acc + (g * group + j) * nv;
                __m512 r[TL_MAX_DH16];
                for (int64_t c = 0; c < nv; c++) r[c] = a[c];
                for (int64_t i = 0; i < n; i++) {
                    const __m512 w = _mm512_set1_ps(p[j][i]);
                    for (int64_t c = 0; c < nv; c++)
                        r[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + i * vt_stride + c * 16), r[c]);
                }
                for (int64_t c = 0; c < nv; c++) a[c] = r[c];
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        l[h] = _mm512_reduce_add_ps(lsum[h]);
#if TL_DP_BF16
        if (pv_pairs) unpermute_pairs(acc + h * nv, nv);
#endif
    }
}

static inline void store_row(int dtype, void *out, int64_t index, const __m512 *acc, int64_t nv, float factor) {
    for (int64_t c = 0; c < nv; c++) {
        const __m512 x = _mm512_mul_ps(acc[c], _mm512_set1_ps(factor));
        if (dtype == TL_BFLOAT16) {
            float tmp[16];
            _mm512_storeu_ps(tmp, x);
            uint16_t *dst = (uint16_t *)out + index + c * 16;
            for (int i = 0; i < 16; i++) dst[i] = f32_to_bf16(tmp[i]);
        } else {
            _mm512_storeu_ps((float *)out + index + c * 16, x);
        }
    }
}

/* One work item; head_dim 64, 128 and 256 get their own copies with the vector count a constant.
 * The cache is in the queries' dtype, or bfloat16 beside float32 queries (widened as it is read). */
static void attend_item_dispatch(int dtype, int kv_dtype, int64_t nv, const void *q, int64_t q_index, const void *k_cache,
                                 const void *v_cache, const int64_t *table, int64_t t0, int64_t t1, int64_t g0,
                                 int64_t ng, int64_t group, int64_t block_size, int64_t token_stride, float scale,
                                 float *m, float *l, __m512 *acc) {
#define TL_ATTEND(DT, KDT, NV) \
    attend_item(DT, KDT, NV, q, q_index, k_cache, v_cache, table, t0, t1, g0, ng, group, block_size, token_stride, \
                scale, m, l, acc)
#define TL_ATTEND_NV(DT, KDT) \
    do { \
        if (nv == 4) TL_ATTEND(DT, KDT, 4); \
        else if (nv == 8) TL_ATTEND(DT, KDT, 8); \
        else if (nv == 16) TL_ATTEND(DT, KDT, 16); \
        else TL_ATTEND(DT, KDT, nv); \
    } while (0)
    if (dtype == TL_BFLOAT16) TL_ATTEND_NV(TL_BFLOAT16, TL_BFLOAT16);
    else if (kv_dtype == TL_BFLOAT16) TL_ATTEND_NV(TL_FLOAT32, TL_BFLOAT16);
    else TL_ATTEND_NV(TL_FLOAT32, TL_FLOAT32);
#undef TL_ATTEND_NV
#undef TL_ATTEND
}
#endif

/* Vector path for any CPU (AVX2 where there is no AVX-512): a work item is one sequence's KV heads
 * (all of them when there are sequences enough for every thread, so each token's row streams
 * whole; else one), its tokens in tiles of up to 16 inside one block with an online softmax, so K and
 * V are each read once, in place, the next tile prefetched. Eight partial dot products reduce into
 * one vector of scores by a shuffle tree (no horizontal sum per token); bf16 rows are widened into a
 * per-tile scratch. */
#define TL_V8_TILE 8       /* tokens per score vector */
#define TL_V8_SPAN 16      /* tokens per tile: two score vectors, one online-softmax step */
#define TL_V8_MAX_NV 32     /* head_dim / 8 (head_dim <= 256) */
#define TL_V8_MAX_VECS 512  /* query heads x head_dim / 8 in one work item (16 KB of accumulators) */
#define TL_V8_MAX_HEADS 64

static inline tl_v8 v8_select(tl_v8i mask, tl_v8 a, tl_v8 b) { /* mask ? a : b, lane by lane */
    return (tl_v8)((mask & (tl_v8i)a) | (~mask & (tl_v8i)b));
}

/* Lane i of the result = the sum of v[i]'s lanes: a transpose-and-add tree whose shuffles are each
 * one instruction on AVX (in-lane shufps, then a 128-bit lane swap), 21 in all. */
static inline tl_v8 reduce8(const tl_v8 v[8]) {
    const tl_v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    const tl_v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    tl_v8 p[4], r[2];
    for (int i = 0; i < 4; i++)
        p[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) + __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        r[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], even) + __builtin_shuffle(p[2 * i], p[2 * i + 1], odd);
    return __builtin_shuffle(r[0], r[1], lo4) + __builtin_shuffle(r[0], r[1], hi4);
}

static inline tl_v8 v8_max(tl_v8 a, tl_v8 b) { return v8_select(a > b, a, b); }

static inline float hmax8(tl_v8 v) {
    v = v8_max(v, __builtin_shuffle(v, (tl_v8i){4, 5, 6, 7, 0, 1, 2, 3}));
    v = v8_max(v, __builtin_shuffle(v, (tl_v8i){2, 3, 0, 1, 6, 7, 4, 5}));
    return v[0] > v[1] ? v[0] : v[1];
}

static inline const float *v8_row(int dtype, const void *cache, int64_t index, int64_t Dh, float *scratch) {
    if (dtype == TL_FLOAT32) return (const float *)cache + index;
    load_row(cache, index, Dh, dtype, scratch);
    return scratch;
}

/* exp(x) for x <= ~80, eight at a time: exp_nonpositive's polynomial with the power of two rounded
 * to nearest by the 1.5 * 2^23 trick, so that the small positive arguments the rescale slack allows
 * stay exact as well as x <= 0 (x below -87 gives ~1e-38, not 0). */
static inline tl_v8 exp8(tl_v8 x) {
    x = v8_max(x, (tl_v8){0} - 87.0f);
    const tl_v8 t = x * 1.44269504088896341f;
    const tl_v8 r = (t + 12582912.0f) - 12582912.0f;
    const tl_v8 f = (t - r) * 0.69314718055994531f;
    return (tl_v8)((tl_v8i)TL_EXP_POLY(f) + (__builtin_convertvector(r, tl_v8i) << 23));
}

/* Scores of eight rows (row i at rows[i]) against one query head's vectors qh: eight independent
 * FMA chains, the query vector in a register and the rows read in place, then one reduce. */
static inline __attribute__((always_inline)) tl_v8 scores8(const int64_t nv, const tl_v8 *qh,
                                                          const float *const rows[TL_V8_TILE]) {
    tl_v8 part[TL_V8_TILE];
    for (int i = 0; i < TL_V8_TILE; i++) part[i] = qh[0] * *(const tl_v8u *)rows[i];
    for (int64_t c = 1; c < nv; c++) {
        const tl_v8 qc = qh[c];
        for (int i = 0; i < TL_V8_TILE; i++) part[i] += qc * *(const tl_v8u *)(rows[i] + 8 * c);
    }
    return reduce8(part);
}

static inline __attribute__((always_inline)) void attend_item_v8(
    int dtype, int kv_dtype, const int64_t nv, const void *q, int64_t q_index, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t start, int64_t len, void *out, int64_t out_index, int64_t g0, int64_t kvn,
    const int64_t group, int64_t block_size, int64_t token_stride, float scale, float *partial) {
    /* Tokens [start, len) against KV heads g0 .. g0+kvn of one sequence; query heads (g0 + g) * group + j
     * are row g * group + j here. With `partial`, leave each head's (m, l, unnormalised acc[Dh]) there
     * for a merge with the sequence's other runs instead of writing out. Tiles of up to 16 tokens
     * inside one block: their rows lie token_stride apart, one table lookup a tile. */
    const int64_t Dh = nv * 8, heads = kvn * group;
    const int64_t kv_bytes = kv_dtype == TL_FLOAT32 ? 4 : 2;
    const int64_t row_bytes = kvn * Dh * kv_bytes; /* the item's heads of one token: contiguous */
    tl_v8 qv[TL_V8_MAX_VECS], acc[TL_V8_MAX_VECS], lsum[TL_V8_MAX_HEADS];
    float m[TL_V8_MAX_HEADS];
    float qf[TL_V8_MAX_NV * 8] __attribute__((aligned(32)));
    float p[TL_V8_MAX_HEADS][TL_V8_SPAN] __attribute__((aligned(32))); /* a tile's weights, per head of a group */
    float kt[TL_V8_SPAN][TL_V8_MAX_NV * 8] __attribute__((aligned(32)));
    float vt[TL_V8_SPAN][TL_V8_MAX_NV * 8] __attribute__((aligned(32)));
    for (int64_t h = 0; h < heads; h++) {
        load_row(q, q_index + h * Dh, Dh, dtype, qf);
        for (int64_t c = 0; c < nv; c++) {
            qv[h * nv + c] = *(const tl_v8u *)(qf + 8 * c) * scale;
            acc[h * nv + c] = (tl_v8){0};
        }
        m[h] = -INFINITY;
        lsum[h] = (tl_v8){0};
    }
    const tl_v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t t = start, n; t < len; t += n) {
        int64_t row0, next_row0 = 0, next_n = 0;
        n = kv_tile(table, t, len, TL_V8_SPAN, block_size, token_stride, &row0);
        const tl_v8i valid0 = lane < (tl_v8i){0} + (int32_t)n, valid1 = lane + 8 < (tl_v8i){0} + (int32_t)n;
        /* The next tile, requested while this one computes (blocks are scattered: the hardware
         * prefetcher cannot guess them), a share of its lines before each query head, so that the
         * requests stream evenly under the arithmetic instead of queueing up in one burst. */
        if (t + n < len) next_n = kv_tile(table, t + n, len, TL_V8_SPAN, block_size, token_stride, &next_row0);
        const int64_t pf_share = (next_n * ((row_bytes + 63) / 64) + heads - 1) / heads;
        int64_t pf_row = 0, pf_byte = 0;
        for (int64_t g = 0; g < kvn; g++) {
            const int64_t head_off = (g0 + g) * Dh;
            /* Rows past the tile's end point at its first (masked out of the scores, weight 0). */
            const float *krow[TL_V8_SPAN], *vrow[TL_V8_SPAN];
            for (int64_t i = 0; i < n; i++) {
                krow[i] = v8_row(kv_dtype, k_cache, row0 + i * token_stride + head_off, Dh, kt[i]);
                vrow[i] = v8_row(kv_dtype, v_cache, row0 + i * token_stride + head_off, Dh, vt[i]);
            }
            for (int64_t i = n; i < TL_V8_SPAN; i++) krow[i] = krow[0], vrow[i] = vrow[0];
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const tl_v8 *qh = qv + h * nv;
                for (int64_t r = 0; r < pf_share && pf_row < next_n; r++) {
                    const int64_t e = (next_row0 + pf_row * token_stride + g0 * Dh) * kv_bytes + pf_byte;
                    __builtin_prefetch((const char *)k_cache + e);
                    __builtin_prefetch((const char *)v_cache + e);
                    pf_byte += 64;
                    if (pf_byte >= row_bytes) pf_row++, pf_byte = 0;
                }
                const tl_v8 s0 = v8_select(valid0, scores8(nv, qh, krow), (tl_v8){0} - INFINITY);
                const tl_v8 s1 = n > 8 ? v8_select(valid1, scores8(nv, qh, krow + 8), (tl_v8){0} - INFINITY)
                                       : (tl_v8){0} - INFINITY;
                /* Rescale only past TL_RESCALE_SLACK: the branch is then almost never taken, instead
                 * of a horizontal max and a mispredicted branch on every tile. */
                const tl_v8 mx = v8_max(s0, s1);
                const tl_v8i over = mx > (tl_v8){0} + (m[h] + TL_RESCALE_SLACK);
                if (over[0] | over[1] | over[2] | over[3] | over[4] | over[5] | over[6] | over[7]) {
                    const float m_new = hmax8(mx);
                    const float alpha = exp_nonpositive(m[h] - m_new);
                    lsum[h] *= alpha;
                    for (int64_t c = 0; c < nv; c++) acc[h * nv + c] *= alpha;
                    m[h] = m_new;
                }
                const tl_v8 mh = (tl_v8){0} + m[h];
                const tl_v8 e0 = v8_select(valid0, exp8(s0 - mh), (tl_v8){0});
                const tl_v8 e1 = v8_select(valid1, exp8(s1 - mh), (tl_v8){0});
                lsum[h] += e0 + e1;
                *(tl_v8 *)p[j] = e0;
                *(tl_v8 *)(p[j] + 8) = e1;
            }
            /* Then the values, for all the group's heads at once: the value dimension in chunks of CH
             * vectors with group x CH <= 16 accumulators (head_dim 256 and 4 heads held 4 x 32 before,
             * spilled), each value row read once per chunk for every head. */
            int64_t CH = group < 16 ? 16 / group : 1;
            while (nv % CH) CH--;
            for (int64_t c0 = 0; c0 < nv; c0 += CH) {
                tl_v8 r[TL_V8_MAX_HEADS];
                for (int64_t j = 0; j < group; j++)
                    for (int64_t c = 0; c < CH; c++) r[j * CH + c] = acc[(g * group + j) * nv + c0 + c];
                for (int64_t i = 0; i < n; i++)
                    for (int64_t c = 0; c < CH; c++) {
                        const tl_v8 vv = *(const tl_v8u *)(vrow[i] + 8 * (c0 + c));
                        for (int64_t j = 0; j < group; j++) r[j * CH + c] += p[j][i] * vv;
                    }
                for (int64_t j = 0; j < group; j++)
                    for (int64_t c = 0; c < CH; c++) acc[(g * group + j) * nv + c0 + c] = r[j * CH + c];
            }
        }
    }
    for (int64_t h = 0; h < heads && partial; h++) {
        float *rec = partial + h * (Dh + 2);
        rec[0] = m[h];
        rec[1] = hsum8(lsum[h]);
        for (int64_t c = 0; c < nv; c++) *(tl_v8u *)(rec + 2 + 8 * c) = acc[h * nv + c];
    }
    for (int64_t h = 0; h < heads && !partial; h++) {
        const float l = hsum8(lsum[h]);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int64_t o = out_index + h * Dh;
        for (int64_t c = 0; c < nv; c++) {
            const tl_v8 r = acc[h * nv + c] * inv;
            for (int i = 0; i < 8; i++) {
                if (dtype == TL_BFLOAT16) ((uint16_t *)out)[o + 8 * c + i] = f32_to_bf16(r[i]);
                else ((float *)out)[o + 8 * c + i] = r[i];
            }
        }
    }
}

/* The common shapes with their loop bounds known to the compiler. */
static void attend_item_v8_dispatch(int dtype, int kv_dtype, int64_t nv, const void *q, int64_t q_index, const void *k_cache,
                                    const void *v_cache, const int64_t *table, int64_t start, int64_t len, void *out,
                                    int64_t out_index, int64_t g0, int64_t kvn, int64_t group, int64_t block_size,
                                    int64_t token_stride, float scale, float *partial) {
#define TL_V8_CASE(NV, G)                                                                                       \
    case NV * 64 + G:                                                                                           \
        attend_item_v8(dtype, kv_dtype, NV, q, q_index, k_cache, v_cache, table, start, len, out, out_index, g0, kvn, \
                       G, block_size, token_stride, scale, partial);                                            \
        return;
    switch (nv * 64 + group) {
        TL_V8_CASE(8, 1) TL_V8_CASE(8, 2) TL_V8_CASE(8, 3) TL_V8_CASE(8, 4) TL_V8_CASE(8, 8)
        TL_V8_CASE(16, 1) TL_V8_CASE(16, 2) TL_V8_CASE(16, 4) TL_V8_CASE(16, 8)
        TL_V8_CASE(32, 1) TL_V8_CASE(32, 2) TL_V8_CASE(32, 4) TL_V8_CASE(32, 8)
    default:
        attend_item_v8(dtype, kv_dtype, nv, q, q_index, k_cache, v_cache, table, start, len, out, out_index, g0, kvn,
                       group, block_size, token_stride, scale, partial);
    }
#undef TL_V8_CASE
}

/* Portable path: one (sequence, KV head) at a time, scores kept whole, two passes. */
static void decode_attention_item_generic(int dtype, int kv_dtype, const void *q, int64_t q_index, const void *k_cache,
                                          const void *v_cache, const int64_t *table, int64_t first, int64_t len, void *out,
                                          int64_t out_index, int64_t g, int64_t group, int64_t Dh,
                                          int64_t block_size, int64_t token_stride, float scale, float *scores,
                                          float *qf, float *acc, float *row, int64_t max_len) {
    for (int64_t j = 0; j < group; j++) {
        load_row(q, q_index + j * Dh, Dh, dtype, qf + j * Dh);
        for (int64_t i = 0; i < Dh; i++) qf[j * Dh + i] *= scale;
    }
    for (int64_t t = first; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(k_cache, slot * token_stride + g * Dh, Dh, kv_dtype, row);
        for (int64_t j = 0; j < group; j++) {
            const float *qj = qf + j * Dh;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < Dh; i++) s += qj[i] * row[i];
            scores[j * max_len + t - first] = s; /* max_len >= len - first */
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * max_len - first; /* sj[t] for t in [first, len) */
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = first; t < len; t++) mx = sj[t] > mx ? sj[t] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = first; t < len; t++) {
            sj[t] = exp_nonpositive(sj[t] - mx);
            sum += sj[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = first; t < len; t++) sj[t] *= inv;
    }
    memset(acc, 0, (size_t)(group * Dh) * sizeof(float));
    for (int64_t t = first; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(v_cache, slot * token_stride + g * Dh, Dh, kv_dtype, row);
        for (int64_t j = 0; j < group; j++) {
            const float p = scores[j * max_len + t - first];
            float *aj = acc + j * Dh;
#pragma omp simd
            for (int64_t i = 0; i < Dh; i++) aj[i] += p * row[i];
        }
    }
    for (int64_t j = 0; j < group; j++) {
        const int64_t o = out_index + j * Dh;
        if (dtype == TL_BFLOAT16) {
            uint16_t *dst = (uint16_t *)out + o;
            for (int64_t i = 0; i < Dh; i++) dst[i] = f32_to_bf16(acc[j * Dh + i]);
        } else {
            memcpy((float *)out + o, acc + j * Dh, (size_t)Dh * sizeof(float));
        }
    }
}

/* Runs each sequence is cut into when `items` (sequence, KV heads) work items are too few for
 * `threads` (two items a thread wanted), each run at least four blocks long; 1: no split. */
static int64_t split_runs(int64_t items, int64_t threads, int64_t max_len, int64_t block_size) {
    if (items >= 2 * threads) return 1;
    const int64_t by_threads = (2 * threads + items - 1) / items;
    const int64_t by_length = (max_len + 4 * block_size - 1) / (4 * block_size);
    const int64_t chunks = by_threads < by_length ? by_threads : by_length;
    return chunks > 1 ? chunks : 1;
}

void tl_decode_attention(int dtype, int kv_dtype, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *tables, int64_t width, const int64_t *lens, void *out, int64_t D, int64_t H,
                         int64_t KVH, int64_t Dh, int64_t block_size, int64_t max_len, float scale, int64_t window) {
    const int64_t group = H / KVH;
    const int64_t token_stride = KVH * Dh; /* elements between consecutive tokens of a block */
    /* A sliding window: each query reads positions [len - window, len); runs split that span only. */
#define TL_FIRST(len) (window > 0 && (len) > window ? (len) - window : 0)
    if (window > 0 && max_len > window) max_len = window;
#if defined(__AVX512F__)
    const int64_t nv = Dh / 16;
    if ((dtype == kv_dtype || kv_dtype == TL_BFLOAT16) && Dh % 16 == 0 && nv <= TL_MAX_DH16 && group * nv <= TL_MAX_QVEC) {
        /* A work item is (sequence, run of its tokens, KV heads): all KV heads when their query
         * vectors fit, so each token's row streams whole. Few sequences are cut into runs of
         * whole blocks (split-K) so that every thread streams; the runs merge afterwards. */
        const int64_t threads = omp_get_max_threads();
        const int64_t kv_per_item = H * nv <= TL_MAX_QVEC ? KVH : 1;
        const int64_t kv_items = KVH / kv_per_item;
        const int64_t heads = kv_per_item * group;
        int64_t chunks = split_runs(D * kv_items, threads, max_len, block_size);
        const int64_t blocks_per_chunk = ((max_len + block_size - 1) / block_size + chunks - 1) / chunks;
        const int64_t items = D * kv_items * chunks;
        /* Split runs leave (m, l, acc[Dh]) per head for the merge. */
        float *partial = chunks > 1 ? (float *)malloc((size_t)(items * heads * (Dh + 2)) * sizeof(float)) : NULL;
#pragma omp parallel
        {
            float m[TL_MAX_QVEC], l[TL_MAX_QVEC];
            __m512 acc[TL_MAX_QVEC];
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++) {
                const int64_t d = item / (kv_items * chunks);
                const int64_t g0 = (item / chunks % kv_items) * kv_per_item;
                const int64_t chunk = item % chunks;
                const int64_t len = lens[d];
                const int64_t t0 = TL_FIRST(len) + chunk * blocks_per_chunk * block_size;
                const int64_t run_end = t0 + blocks_per_chunk * block_size;
                const int64_t t1 = chunks == 1 || run_end > len ? len : run_end; /* unsplit: all, whatever max_len */
                attend_item_dispatch(dtype, kv_dtype, nv, q, d * q_stride + g0 * group * Dh, k_cache, v_cache,
                                     tables + d * width, t0, t1, g0, kv_per_item, group, block_size, token_stride,
                                     scale, m, l, acc);
                for (int64_t h = 0; h < heads; h++) {
                    if (chunks == 1) {
                        store_row(dtype, out, (d * H + g0 * group + h) * Dh, acc + h * nv, nv,
                                  l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
                    } else {
                        float *rec = partial + (item * heads + h) * (Dh + 2);
                        rec[0] = m[h];
                        rec[1] = l[h];
                        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(rec + 2 + c * 16, acc[h * nv + c]);
                    }
                }
            }
        }
        if (chunks > 1) {
            /* Every run is done: rescale each to the common max. Runs exist only for a few
             * sequences, so this is a few rows, merged here rather than behind a second barrier. */
            for (int64_t dh = 0; dh < D * H; dh++) {
                const int64_t d = dh / H, h = dh % H;
                const int64_t kv_item = h / heads, hi = h % heads;
                const int64_t first = (d * kv_items + kv_item) * chunks;
                float mx = -INFINITY;
                for (int64_t c = 0; c < chunks; c++) {
                    const float mc = partial[((first + c) * heads + hi) * (Dh + 2)];
                    mx = mc > mx ? mc : mx;
                }
                float total = 0.0f;
                __m512 sum[TL_MAX_DH16];
                for (int64_t v = 0; v < nv; v++) sum[v] = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++) {
                    const float *rec = partial + ((first + c) * heads + hi) * (Dh + 2);
                    if (rec[1] == 0.0f) continue; /* a run past this sequence's end */
                    const float w = exp_nonpositive(rec[0] - mx);
                    total += w * rec[1];
                    for (int64_t v = 0; v < nv; v++)
                        sum[v] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(rec + 2 + v * 16), sum[v]);
                }
                store_row(dtype, out, dh * Dh, sum, nv, total > 0.0f ? 1.0f / total : 0.0f);
            }
        }
        free(partial);
        return;
    }
#endif
    if (Dh % 8 == 0 && Dh / 8 <= TL_V8_MAX_NV && group * (Dh / 8) <= TL_V8_MAX_VECS && group <= TL_V8_MAX_HEADS) {
        /* A work item is a sequence's KV heads: all of them (each token's row streams whole) when
         * there are sequences enough to keep every thread busy and their query vectors fit. */
        const int64_t nv = Dh / 8, threads = omp_get_max_threads();
        const int kv_all = D >= 2 * threads && H * nv <= TL_V8_MAX_VECS && H <= TL_V8_MAX_HEADS;
        const int64_t kvn = kv_all ? KVH : 1, kv_items = KVH / kvn;
        /* Few (sequence, KV head) items for the threads (batch 1: three KV heads on two threads):
         * cut each sequence into runs of whole blocks, as the AVX-512 path does, and merge them. */
        int64_t chunks = split_runs(D * kv_items, threads, max_len, block_size);
        const int64_t run = ((max_len + block_size - 1) / block_size + chunks - 1) / chunks * block_size;
        const int64_t heads = kvn * group, items = D * kv_items * chunks;
        float *partial = chunks > 1 ? (float *)malloc((size_t)(items * heads * (Dh + 2)) * sizeof(float)) : NULL;
        if (chunks > 1 && !partial) chunks = 1; /* no room to merge: whole sequences, as before */
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t item = 0; item < D * kv_items * chunks; item++) {
            const int64_t d = item / (kv_items * chunks), g0 = item / chunks % kv_items * kvn, chunk = item % chunks;
            const int64_t t0 = TL_FIRST(lens[d]) + chunk * run;
            const int64_t t1 = chunks == 1 || t0 + run > lens[d] ? lens[d] : t0 + run;
            attend_item_v8_dispatch(dtype, kv_dtype, nv, q, d * q_stride + g0 * group * Dh, k_cache, v_cache,
                                    tables + d * width, t0 < t1 ? t0 : t1, t1, out, (d * H + g0 * group) * Dh, g0,
                                    kvn, group, block_size, token_stride, scale,
                                    chunks > 1 ? partial + item * heads * (Dh + 2) : NULL);
        }
        if (chunks > 1) {
            /* Each head's runs rescaled to their common max and summed: a few rows. */
            for (int64_t dh = 0; dh < D * H; dh++) {
                const int64_t d = dh / H, h = dh % H, kv_item = h / heads, hi = h % heads;
                const float *first = partial + (d * kv_items + kv_item) * chunks * heads * (Dh + 2);
                float mx = -INFINITY, total = 0.0f, sum[TL_V8_MAX_NV * 8];
                for (int64_t c = 0; c < chunks; c++) {
                    const float mc = first[(c * heads + hi) * (Dh + 2)];
                    mx = mc > mx ? mc : mx;
                }
                for (int64_t i = 0; i < Dh; i++) sum[i] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    const float *rec = first + (c * heads + hi) * (Dh + 2);
                    if (rec[1] == 0.0f) continue; /* a run past this sequence's end */
                    const float w = exp_nonpositive(rec[0] - mx);
                    total += w * rec[1];
                    for (int64_t i = 0; i < Dh; i++) sum[i] += w * rec[2 + i];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t i = 0; i < Dh; i++) {
                    if (dtype == TL_BFLOAT16) ((uint16_t *)out)[dh * Dh + i] = f32_to_bf16(sum[i] * inv);
                    else ((float *)out)[dh * Dh + i] = sum[i] * inv;
                }
            }
            free(partial);
        }
        return;
    }
#pragma omp parallel
    {
        /* Per-thread scratch: scores [group, max_len], query and accumulator rows, one K/V row. */
        float *scores = (float *)malloc((size_t)(group * max_len) * sizeof(float));
        float *qf = (float *)malloc((size_t)(group * Dh) * sizeof(float));
        float *acc = (float *)malloc((size_t)(group * Dh) * sizeof(float));
        float *row = (float *)malloc((size_t)Dh * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < D * KVH; item++) {
            const int64_t d = item / KVH, g = item % KVH;
            decode_attention_item_generic(dtype, kv_dtype, q, d * q_stride + g * group * Dh, k_cache, v_cache,
                                          tables + d * width, TL_FIRST(lens[d]), lens[d], out, (d * H + g * group) * Dh,
                                          g, group, Dh,
                                          block_size, token_stride, scale, scores, qf, acc, row, max_len);
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
#undef TL_FIRST
}

/* ---------------------------------------------------------------------------------------------
 * Prefill attention over a paged bfloat16 KV cache (AVX512-BF16 only; returns 0 elsewhere and the
 * caller keeps SDPA). torch's CPU flash attention runs the default model's 256-token causal spans at
 * ~30 GFLOP/s: most of its time is per-block overhead around small GEMMs.
 *
 * q:       [T, H, Dh] bf16, token stride q_stride elements, heads contiguous
 * caches:  [num_blocks, block_size, KVH, Dh] bf16 each (this step's K/V already written)
 * spans:   starts, ntoks, ctxs [S] int64 (token i of span s is at position ctx - ntok + i and sees
 *          keys 0 .. that position, or with window > 0 only the last `window` of them); tables [S, width] int64
 * out:     [T, H, Dh] bf16 contiguous (only the spans' rows are written)
 *
 * A work item is (span, 16 query rows, KV head) with the KV head's group of query heads. Scores are
 * kept transposed, a key per vector and a query per lane: q.k is VDPBF16PS of the item's transposed
 * queries (built once) against each key's dimension pairs broadcast from the cache, so the online
 * softmax is lane-wise (no horizontal reductions), and p.v is VDPBF16PS of (p_j, p_j+1) rounded to bf16
 * (as torch's flash attention rounds p) against (v_j[d], v_j+1[d]), the value rows of a tile
 * interleaved once for all query heads. The output accumulates transposed, [Dh][16 queries].
 */
#if defined(__AVX512BF16__)
#define TL_PF_Q 16 /* query rows per item: one per lane */

static void prefill_item(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         int64_t block_size, int64_t KVH, int64_t Dh, int64_t group, int64_t g, int64_t start,
                         int64_t ntok, int64_t ctx, const int64_t *table, int64_t q0, float scale, int64_t window,
                         uint16_t *out, int64_t H, uint32_t *qt, float *ot, uint32_t *vp) {
    const int64_t nq = ntok - q0 < TL_PF_Q ? ntok - q0 : TL_PF_Q, np = Dh / 2, ts = KVH * Dh;
    const int64_t pos0 = ctx - ntok + q0; /* position of the item's first query */
    /* qt[h][p][i]: dimension pair p of query row i, head g * group + h (zeros past nq) */
    for (int64_t h = 0; h < group; h++)
        for (int64_t i = 0; i < TL_PF_Q; i++) {
            const uint32_t *row = (const uint32_t *)(q + (start + q0 + i) * q_stride + (g * group + h) * Dh);
            for (int64_t p = 0; p < np; p++) qt[(h * np + p) * TL_PF_Q + i] = i < nq ? row[p] : 0u;
        }
    memset(ot, 0, (size_t)(group * Dh * TL_PF_Q) * sizeof(float));
    __m512 m[8], l[8];
    for (int64_t h = 0; h < group; h++) m[h] = _mm512_set1_ps(-INFINITY), l[h] = _mm512_setzero_ps();
    const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32((int)pos0),
                                          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const int64_t kv_end = pos0 + nq; /* keys 0 .. the last query's position */
    /* A sliding window: keys from the first query's window on; lane i sees keys past qpos_i - window. */
    const int64_t kv_start = window > 0 && pos0 >= window ? pos0 - window + 1 : 0;
    const __m512i qlow = _mm512_sub_epi32(qpos, _mm512_set1_epi32(window > 0 ? (int)window : (int)(pos0 + TL_PF_Q + 1)));
    /* permutex2var indices: 16-bit element 2i takes a[i], 2i + 1 takes b[i] (b's elements are 32 + i) */
    uint16_t lo_idx[32], hi_idx[32];
    for (int i = 0; i < 32; i++) lo_idx[i] = (uint16_t)(i / 2 + (i % 2 ? 32 : 0)), hi_idx[i] = (uint16_t)(lo_idx[i] + 16);
    const __m512i pair_lo = _mm512_loadu_si512((const void *)lo_idx), pair_hi = _mm512_loadu_si512((const void *)hi_idx);
    for (int64_t t = kv_start; t < kv_end;) {
        int64_t row0;
        const int64_t n = kv_tile(table, t, kv_end, TL_TILE, block_size, ts, &row0);
        const uint16_t *kt = k_cache + row0 + g * Dh, *vt = v_cache + row0 + g * Dh;
        const int64_t npair = (n + 1) / 2;
        for (int64_t j = 0; j < npair; j++) { /* vp[j][d] = (v_2j[d], v_2j+1[d]), zero past n */
            const uint16_t *a = vt + 2 * j * ts, *b = 2 * j + 1 < n ? a + ts : NULL;
            for (int64_t d = 0; d < Dh; d += 32) { /* 32 dims of each row -> 32 pairs, two permutes */
                const __mmask32 lanes = Dh - d >= 32 ? 0xFFFFFFFFu : (1u << (Dh - d)) - 1u;
                const __m512i va = _mm512_maskz_loadu_epi16(lanes, a + d);
                const __m512i vb = b ? _mm512_maskz_loadu_epi16(lanes, b + d) : _mm512_setzero_si512();
                const __mmask16 out_lo = Dh - d >= 16 ? 0xFFFF : (__mmask16)((1u << (Dh - d)) - 1u);
                const __mmask16 out_hi = Dh - d >= 32 ? 0xFFFF : Dh - d > 16 ? (__mmask16)((1u << (Dh - d - 16)) - 1u) : 0;
                _mm512_mask_storeu_epi32(vp + j * Dh + d, out_lo, _mm512_permutex2var_epi16(va, pair_lo, vb));
                _mm512_mask_storeu_epi32(vp + j * Dh + d + 16, out_hi, _mm512_permutex2var_epi16(va, pair_hi, vb));
            }
        }
        /* some key of the tile lies after some query, or before the window of some query */
        const int masked = t + n - 1 > pos0 || (window > 0 && t <= pos0 + nq - 1 - window);
        for (int64_t h = 0; h < group; h++) {
            const uint32_t *qh = qt + h * np * TL_PF_Q;
            __m512 s[TL_TILE];
            for (int64_t j0 = 0; j0 < n; j0 += 4) {
                const uint32_t *k0 = (const uint32_t *)(kt + j0 * ts);
                const int64_t o1 = j0 + 1 < n ? ts / 2 : 0, o2 = j0 + 2 < n ? ts : 0, o3 = j0 + 3 < n ? 3 * ts / 2 : 0;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t p = 0; p < np; p++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qh + p * TL_PF_Q));
                    a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_set1_epi32((int)k0[p]));
                    a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_set1_epi32((int)k0[o1 + p]));
                    a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_set1_epi32((int)k0[o2 + p]));
                    a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_set1_epi32((int)k0[o3 + p]));
                }
                s[j0] = a0, s[j0 + 1] = a1, s[j0 + 2] = a2, s[j0 + 3] = a3;
            }
            __m512 mx = m[h];
            __mmask16 valid[TL_TILE];
            for (int64_t j = 0; j < n; j++) {
                s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(scale));
                /* lane i sees key t + j when that position <= its own */
                const __m512i key = _mm512_set1_epi32((int)(t + j));
                valid[j] = masked ? _mm512_cmp_epi32_mask(key, qpos, _MM_CMPINT_LE) &
                                        _mm512_cmp_epi32_mask(key, qlow, _MM_CMPINT_NLE)
                                  : (__mmask16)0xFFFF;
                mx = _mm512_mask_max_ps(mx, valid[j], mx, s[j]);
            }
            /* Without a window key 0 is in every lane's first tile, so mx is finite from the first tile
             * on; with one a lane may see none of its keys yet (mx still -inf): it keeps alpha 0, not NaN. */
            const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                                     exp512_nonpositive(_mm512_sub_ps(m[h], mx)));
            m[h] = mx;
            __m512 sum = _mm512_setzero_ps();
            __m512bh pp[TL_TILE / 2];
            for (int64_t j = 0; j < 2 * npair; j += 2) {
                const __m512 p0 = _mm512_maskz_mov_ps(valid[j], exp512_nonpositive(_mm512_sub_ps(s[j], mx)));
                const __m512 p1 = j + 1 < n ? _mm512_maskz_mov_ps(valid[j + 1], exp512_nonpositive(_mm512_sub_ps(s[j + 1], mx)))
                                            : _mm512_setzero_ps();
                const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
                const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
                pp[j / 2] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                /* l sums the weights as rounded, the ones p.v uses */
                sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                                       _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
            }
            l[h] = _mm512_fmadd_ps(l[h], alpha, sum);
            float *oh = ot + h * Dh * TL_PF_Q;
            for (int64_t d0 = 0; d0 < Dh; d0 += 8) {
                __m512 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm512_mul_ps(_mm512_loadu_ps(oh + (d0 + u) * TL_PF_Q), alpha);
                for (int64_t j = 0; j < npair; j++) {
                    const uint32_t *vj = vp + j * Dh + d0;
                    for (int u = 0; u < 8; u++)
                        acc[u] = _mm512_dpbf16_ps(acc[u], pp[j], (__m512bh)_mm512_set1_epi32((int)vj[u]));
                }
                for (int u = 0; u < 8; u++) _mm512_storeu_ps(oh + (d0 + u) * TL_PF_Q, acc[u]);
            }
        }
        t += n;
    }
    for (int64_t h = 0; h < group; h++) {
        float inv[TL_PF_Q];
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l[h]));
        const float *oh = ot + h * Dh * TL_PF_Q;
        for (int64_t i = 0; i < nq; i++) {
            uint16_t *o = out + (start + q0 + i) * H * Dh + (g * group + h) * Dh;
            for (int64_t d = 0; d < Dh; d++) o[d] = f32_to_bf16(oh[d * TL_PF_Q + i] * inv[i]);
        }
    }
}
#endif

int tl_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                              int64_t block_size, int64_t H, int64_t KVH, int64_t Dh, int64_t S, const int64_t *starts,
                              const int64_t *ntoks, const int64_t *ctxs, const int64_t *tables, int64_t width,
                              float scale, int64_t window, uint16_t *out) {
#if defined(__AVX512BF16__)
    const int64_t group = H / KVH;
    if (H % KVH || group > 8 || Dh % 8 || Dh > 256 || S < 1) return 0;
    int64_t items = 0;
    for (int64_t s = 0; s < S; s++) items += (ntoks[s] + TL_PF_Q - 1) / TL_PF_Q * KVH;
    int64_t *work = malloc((size_t)(3 * items) * sizeof(int64_t));
    if (!work) return 0;
    int64_t w = 0;
    for (int64_t s = 0; s < S; s++) /* the longest items (last query rows) of each span first */
        for (int64_t q0 = (ntoks[s] - 1) / TL_PF_Q * TL_PF_Q; q0 >= 0; q0 -= TL_PF_Q)
            for (int64_t g = 0; g < KVH; g++) work[w++] = s, work[w++] = q0, work[w++] = g;
    int failed = 0;
#pragma omp parallel
    {
        uint32_t *qt = malloc((size_t)(group * Dh / 2 * TL_PF_Q) * sizeof(uint32_t));
        float *ot = malloc((size_t)(group * Dh * TL_PF_Q) * sizeof(float));
        uint32_t *vp = malloc((size_t)(TL_TILE / 2 * Dh) * sizeof(uint32_t));
        if (!qt || !ot || !vp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!qt || !ot || !vp) continue;
            const int64_t s = work[3 * i], q0 = work[3 * i + 1], g = work[3 * i + 2];
            prefill_item(q, q_stride, k_cache, v_cache, block_size, KVH, Dh, group, g, starts[s], ntoks[s], ctxs[s],
                         tables + s * width, q0, scale, window, out, H, qt, ot, vp);
        }
        free(qt), free(ot), free(vp);
    }
    free(work);
    return failed ? -1 : 1;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_size, (void)H, (void)KVH, (void)Dh, (void)S;
    (void)starts, (void)ntoks, (void)ctxs, (void)tables, (void)width, (void)scale, (void)window, (void)out;
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * RMSNorm of bfloat16 rows as the reference computes it: normalise in float32, round to
 * bfloat16, then multiply by the bfloat16 weight and round again. One pass per row instead of
 * seven tensor operations.
 */
/* 1 / rms of a bfloat16 row, summed in float32: both bfloat16 RMSNorms' first pass. */
static inline float bf16_row_inv_rms(const uint16_t *row, int64_t H, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; i++) {
        const float v = bf16_to_f32(row[i]);
        sum += v * v;
    }
    return 1.0f / sqrtf(sum / (float)H + eps);
}

void tl_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * H;
        const float scale = bf16_row_inv_rms(row, H, eps);
        uint16_t *dst = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[i]) * scale));
            dst[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
}

#if defined(__AVX512F__)
/* Each lane rounded to the nearest bfloat16 (ties to even), still as a float32; as f32_to_bf16 (NaN aside). */
static inline __m512 round512_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

/* silu(gate) * up for bfloat16 rows [T, 2I] of gate | up (a merged projection's output) into
 * out [T, I], rounded where the reference's two tensor ops round: silu to bfloat16, then the product.
 * One pass instead of silu over a strided half (slow in torch) and a multiply. The same bits as torch
 * for gates above about -87 (below, torch's exp(-x) overflows and it returns -0; this the tiny value). */
void tl_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I) {
    /* Threads from 16k outputs: a 32-row step of the default model (49k) ran it on one core before. */
#pragma omp parallel for schedule(static) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= I; i += 16) {
            const __m512 x = load16(g, i, TL_BFLOAT16);
            const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
            const __m512 e = exp512_nonpositive(neg_abs);
            const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
            const __m512 num = _mm512_mask_mov_ps(_mm512_mul_ps(x, e), positive, x);
            const __m512 silu = round512_bf16(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            const __m512 prod = _mm512_mul_ps(silu, load16(u, i, TL_BFLOAT16));
            _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round512_bf16(prod)), 16)));
        }
#endif
        for (; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            const float e = exp_nonpositive(x > 0.0f ? -x : x); /* exp(-|x|): never overflows */
            const float silu = (x > 0.0f ? x : x * e) / (1.0f + e);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu)) * bf16_to_f32(u[i]));
        }
    }
}

/* Index of each row's largest value, the first on ties (as torch's max and argmax): rows [rows, cols]
 * of float32 or bfloat16 (dtype), `stride` elements apart; rows must hold no NaN. The greedy sampler's
 * pass over a step's logits, ~1.4 ms in torch at 32 x 49152 bfloat16. Each lane keeps the first index
 * of its own maximum; the lanes' equal maxima then give the smallest index. Returns 0 (nothing done)
 * where the build has no AVX-512: torch's max is vectorized there. */
int tl_argmax_rows(int dtype, const void *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
#if defined(__AVX512F__)
    const int64_t elem = dtype == TL_BFLOAT16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)x + r * stride * elem;
        int64_t i = 0, best_i = 0;
        float best = -INFINITY;
        if (cols >= 16) {
            __m512 vmax = load16(row, 0, dtype);
            __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512i cur = vidx;
            const __m512i step = _mm512_set1_epi32(16);
            for (i = 16; i + 16 <= cols; i += 16) {
                cur = _mm512_add_epi32(cur, step);
                const __m512 v = load16(row, i, dtype);
                const __mmask16 greater = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
                vmax = _mm512_mask_mov_ps(vmax, greater, v);
                vidx = _mm512_mask_mov_epi32(vidx, greater, cur);
            }
            best = _mm512_reduce_max_ps(vmax);
            const __mmask16 at_best = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
            best_i = _mm512_mask_reduce_min_epi32(at_best, vidx);
        }
        for (; i < cols; i++) { /* the tail: later indices, so only a strictly larger value wins */
            const float v = dtype == TL_BFLOAT16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
            if (v > best || (i == 0 && cols < 16)) {
                best = v;
                best_i = i;
            }
        }
        out[r] = best_i;
    }
    return 1;
#else
    (void)dtype, (void)x, (void)rows, (void)cols, (void)stride, (void)out;
    return 0;
#endif
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

/* ---------------------------------------------------------------------------------------------
 * y[M, N] = x[M, K] @ w^T with w in oneDNN's packed layout for bfloat16 inner products
 * (AB<P>b<NB>a2b): tiles of NB output columns x 2P inputs, ordered by column block then input
 * block; inside a tile, input pair p holds NB columns x 2 inputs. N and K are zero-padded to
 * whole tiles. Reading this copy lets a layer keep one weight: oneDNN serves larger batches from
 * the same bytes. Threads split the column blocks. Each input pair is one dpbf16 per 16 columns
 * against the broadcast pair of x: no horizontal sums.
 */
static void blocked_tile_generic(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m, int64_t jb,
                                 int64_t N, int64_t K, int64_t NB, int64_t P, int64_t kblocks) {
    const uint16_t *tile = w + jb * kblocks * P * NB * 2;
    for (int64_t c = 0; c < NB && jb * NB + c < N; c++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const int64_t kb = k / (2 * P), p = (k % (2 * P)) / 2;
            acc += bf16_to_f32(x[m * K + k]) * bf16_to_f32(tile[((kb * P + p) * NB + c) * 2 + (k & 1)]);
        }
        y[m * N + jb * NB + c] = f32_to_bf16(acc);
    }
}

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void blocked_tile_avx512(const uint16_t *x, const uint16_t *w,
                                                                      uint16_t *y, const int MT, const int NV,
                                                                      int64_t m0, int64_t jb, int64_t N,
                                                                      int64_t K, int64_t P, int64_t kblocks) {
    const int64_t NB = 16 * NV;
    /* Few accumulators (one row, narrow tiles) would wait on each other's latency: then even and
     * odd pairs go to two sets, summed at the end. */
    const int SETS = MT * NV <= 8 ? 2 : 1;
    __m512 acc[2][4][4];
    for (int s = 0; s < SETS; s++)
        for (int r = 0; r < MT; r++)
            for (int v = 0; v < NV; v++) acc[s][r][v] = _mm512_setzero_ps();
    const uint16_t *tile = w + jb * kblocks * P * NB * 2;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const int64_t k0 = kb * 2 * P;
        const int64_t left = (K - k0 + 1) / 2;
        const int64_t pairs = left < P ? left : P;
        const uint16_t *t = tile + kb * P * NB * 2;
        /* Unrolled by two so that the accumulator set is a constant (a runtime index would keep
         * the accumulators in memory). */
#define TL_BLOCKED_PAIR(P_, S_)                                                                           \
    do {                                                                                                 \
        const int64_t k = k0 + 2 * (P_);                                                                 \
        __m512bh wv[4];                                                                                  \
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(t + (P_) * NB * 2 + v * 32);   \
        for (int r = 0; r < MT; r++) {                                                                   \
            const uint16_t *xr = x + (m0 + r) * K + k;                                                   \
            uint32_t pair;                                                                               \
            if (k + 1 < K) {                                                                             \
                memcpy(&pair, xr, sizeof pair); /* one broadcast load */                                 \
            } else {                                                                                     \
                pair = xr[0]; /* odd K: the padding input's weight is 0, its x must be too */            \
            }                                                                                            \
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                                  \
            for (int v = 0; v < NV; v++) acc[S_][r][v] = _mm512_dpbf16_ps(acc[S_][r][v], wv[v], xv);     \
        }                                                                                                \
    } while (0)
        int64_t p = 0;
        for (; p + 1 < pairs; p += 2) {
            TL_BLOCKED_PAIR(p, 0);
            TL_BLOCKED_PAIR(p + 1, SETS - 1);
        }
        if (p < pairs) TL_BLOCKED_PAIR(p, 0);
#undef TL_BLOCKED_PAIR
    }
    if (SETS == 2)
        for (int r = 0; r < MT; r++)
            for (int v = 0; v < NV; v++) acc[0][r][v] = _mm512_add_ps(acc[0][r][v], acc[1][r][v]);
    for (int r = 0; r < MT; r++)
        for (int v = 0; v < NV; v++) {
            const int64_t n0 = jb * NB + v * 16;
            if (n0 >= N) continue;
            const int64_t count = N - n0 < 16 ? N - n0 : 16;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[0][r][v]);
            _mm256_mask_storeu_epi16(y + (m0 + r) * N + n0, (__mmask16)((1u << count) - 1u), out);
        }
}

#define TL_BLOCKED_ROWS(NV)                                                                              \
    switch (mt) {                                                                                        \
    case 4: blocked_tile_avx512(x, w, y, 4, NV, m0, jb, N, K, P, kblocks); break;                       \
    case 3: blocked_tile_avx512(x, w, y, 3, NV, m0, jb, N, K, P, kblocks); break;                       \
    case 2: blocked_tile_avx512(x, w, y, 2, NV, m0, jb, N, K, P, kblocks); break;                       \
    default: blocked_tile_avx512(x, w, y, 1, NV, m0, jb, N, K, P, kblocks); break;                      \
    }
#endif

#if defined(__AVX512BF16__)
/* The many-row path. Rows go in balanced register tiles of at most TL_BLOCKED_TILE_ROWS (6 rows x 4
 * column vectors = 24 accumulators, beside 4 weight vectors and a broadcast in AVX-512's 32
 * registers), each accumulator one dpbf16 chain over the inputs in order, so a row's outputs do not
 * depend on the tile it falls in. */
#define TL_BLOCKED_TILE_ROWS 6
#define TL_BLOCKED_MANY_ROWS 12 /* from here the many-row path; below, one weight pass serves all rows */

/* Rows m0 .. m0 + MT of y, column vectors V0 .. V0 + NV of one column block (tile: the block's
 * [pairs][NB][2] values), over every input; meanwhile prefetches pf_lines cache lines from pf into L2,
 * spread over the pairs. */
static inline __attribute__((always_inline)) void blocked_rows_avx512(const uint16_t *x, const uint16_t *tile,
                                                                      uint16_t *y, const int MT, const int NV,
                                                                      const int V0, int64_t m0, int64_t n_base,
                                                                      int64_t NB, int64_t N, int64_t K,
                                                                      const char *pf, int64_t pf_lines) {
    __m512 acc[TL_BLOCKED_TILE_ROWS][4];
    for (int r = 0; r < MT; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    const uint16_t *xr[TL_BLOCKED_TILE_ROWS];
    for (int r = 0; r < MT; r++) xr[r] = x + (m0 + r) * K;
    const uint16_t *t = tile + V0 * 32;
    const int64_t pairs = (K + 1) / 2;
    const int64_t pf_per_pair = (pf_lines + pairs - 1) / pairs;
    for (int64_t q = 0; q < pairs; q++) {
        for (int64_t l = q * pf_per_pair; l < (q + 1) * pf_per_pair && l < pf_lines; l++)
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        __m512bh wv[4];
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(t + q * NB * 2 + v * 32);
        for (int r = 0; r < MT; r++) {
            uint32_t pair;
            if (2 * q + 1 < K) {
                memcpy(&pair, xr[r] + 2 * q, sizeof pair); /* one broadcast load */
            } else {
                pair = xr[r][2 * q]; /* odd K: the padding input's weight is 0, its x must be too */
            }
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xv);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int v = 0; v < NV; v++) {
            const int64_t n0 = n_base + (V0 + v) * 16;
            if (n0 >= N) continue;
            const int64_t count = N - n0 < 16 ? N - n0 : 16;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
            _mm256_mask_storeu_epi16(y + (m0 + r) * N + n0, (__mmask16)((1u << count) - 1u), out);
        }
}

#define TL_ROWS_TILE(MT_, NV_, V0_) \
    blocked_rows_avx512(x, tile, y, MT_, NV_, V0_, m0, jb * NB, NB, N, K, pf, pf_lines)
#define TL_ROWS_BY_MT(NV_, V0_)                                                                          \
    switch (mt) {                                                                                        \
    case 6: TL_ROWS_TILE(6, NV_, V0_); break;                                                            \
    case 5: TL_ROWS_TILE(5, NV_, V0_); break;                                                            \
    case 4: TL_ROWS_TILE(4, NV_, V0_); break;                                                            \
    case 3: TL_ROWS_TILE(3, NV_, V0_); break;                                                            \
    case 2: TL_ROWS_TILE(2, NV_, V0_); break;                                                            \
    default: TL_ROWS_TILE(1, NV_, V0_); break;                                                           \
    }

/* Many rows (M >= TL_BLOCKED_MANY_ROWS, NB 16, 32 or 64). Each thread takes an even share of the
 * 16-column vectors, not of whole blocks: a 9-block projection (hidden 576) otherwise leaves one of two
 * threads a block behind, and a thread's part of a shared block reads only its own cache lines of each
 * pair. Each row tile's pass over a block prefetches its share of the thread's next block into L2, so
 * the weights' DRAM stream is spread over all the passes instead of stalling the first (the default
 * model's gate|up at 32 rows, 2 threads: 0.86x the time; docs/benchmarks, "Dispatch at small batches"). */
static void linear_bf16_blocked_many(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                                     int64_t K, int64_t NB, int64_t P) {
    const int64_t per_block = NB / 16;
    const int64_t tile_values = (K + 2 * P - 1) / (2 * P) * P * NB * 2;
    const int64_t tile_lines = tile_values * (int64_t)sizeof(uint16_t) / 64;
    const int64_t vectors = (N + 15) / 16;
    const int64_t groups = (M + TL_BLOCKED_TILE_ROWS - 1) / TL_BLOCKED_TILE_ROWS;
    const int64_t lines_per_pass = (tile_lines + groups - 1) / groups;
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t v_end = vectors * (id + 1) / threads;
        for (int64_t v = vectors * id / threads; v < v_end;) {
            const int64_t jb = v / per_block, lo = v % per_block;
            const int64_t hi = (jb + 1) * per_block <= v_end ? per_block : v_end - jb * per_block;
            const uint16_t *tile = w + jb * tile_values;
            const int has_next = (jb + 1) * per_block < v_end;
            const int nv = (int)(hi - lo);
            for (int64_t m0 = 0, g = 0; m0 < M; g++) {
                const int64_t mt = (M - m0 + (groups - g) - 1) / (groups - g);
                const int64_t first = g * lines_per_pass;
                const int64_t left = tile_lines - first;
                const int64_t pf_lines = !has_next || left <= 0 ? 0 : left < lines_per_pass ? left : lines_per_pass;
                const char *pf = (const char *)(tile + tile_values) + first * 64;
                if (nv == 4) {
                    TL_ROWS_BY_MT(4, 0)
                } else if (nv == 3) {
                    if (lo == 0) { TL_ROWS_BY_MT(3, 0) } else { TL_ROWS_BY_MT(3, 1) }
                } else if (nv == 2) {
                    if (lo == 0) { TL_ROWS_BY_MT(2, 0) } else if (lo == 1) { TL_ROWS_BY_MT(2, 1) } else { TL_ROWS_BY_MT(2, 2) }
                } else {
                    switch (lo) {
                    case 0: TL_ROWS_BY_MT(1, 0) break;
                    case 1: TL_ROWS_BY_MT(1, 1) break;
                    case 2: TL_ROWS_BY_MT(1, 2) break;
                    default: TL_ROWS_BY_MT(1, 3) break;
                    }
                }
                m0 += mt;
            }
            v = jb * per_block + hi;
        }
    }
}
#undef TL_ROWS_BY_MT
#undef TL_ROWS_TILE
#endif

void tl_linear_bf16_blocked(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                            int64_t NB, int64_t P) {
#if defined(__AVX512BF16__)
    if (M >= TL_BLOCKED_MANY_ROWS && (NB == 16 || NB == 32 || NB == 64)) {
        linear_bf16_blocked_many(x, w, y, M, N, K, NB, P);
        return;
    }
#endif
    const int64_t kblocks = (K + 2 * P - 1) / (2 * P);
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t jb = 0; jb < nblocks; jb++) {
#if defined(__AVX512BF16__)
        if (NB == 16 || NB == 32 || NB == 64) {
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t mt = M - m0 < 4 ? M - m0 : 4;
                if (NB == 16) {
                    TL_BLOCKED_ROWS(1)
                } else if (NB == 32) {
                    TL_BLOCKED_ROWS(2)
                } else {
                    TL_BLOCKED_ROWS(4)
                }
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < M; m++) blocked_tile_generic(x, w, y, m, jb, N, K, NB, P, kblocks);
    }
}

/* ---------------------------------------------------------------------------------------------
 * One Llama decoder layer for a few float32 decode rows, in one call: at batch 1 the torch path
 * spends as long dispatching its ~25 operators a layer as reading the layer's weights.
 *
 *   x += o_proj(attention(rope(qkv_proj(rms_norm(x) * ln1)), paged KV))
 *   x += down_proj(silu(gate) * up),  gate|up = gate_up_proj(rms_norm(x) * ln2)
 *
 * x [M, H] is updated in place. Weights are [N, K] matrices (q|k|v rows, gate|up rows, as the model
 * holds them): float32 column panels (below) or, by wfmt, row-major ggml Q4_1 / Q8_0 blocks (norms
 * stay float32); cos/sin [M, Dh] (full rotary, rotate-half); slots [M] the cache slot of each row's
 * new K/V; tables/lens as tl_decode_attention takes them. scratch holds M * (H + (heads + 2 KVH) Dh +
 * heads Dh + 2 I) floats, then M block sums of the widest K (see cpu_kernels.py). Each matrix product
 * streams each weight once for all M rows, threads splitting the output columns (portable vector
 * code: GCC vector extensions compile to AVX2 or AVX-512 as the build allows).
 */
#define TL_ROW_GROUP 4 /* rows of x per register tile of the quantized kernel (qgemv_tile) */

/* ---- float32 matrix products over column panels ----
 * A float32 weight [N, K] is held as panels of TL_PANEL output columns, input-major inside a panel:
 * panel t is K x TL_PANEL floats, element [k][j] = w[t * TL_PANEL + j, k], zero past N (see
 * model/panel_weight.py). A register tile is then an outer product: per input k, one panel row (two
 * vectors) times each of up to TL_MR_MAX rows of x broadcast, two accumulators a row (at most 12 of
 * AVX2's 16 registers, 24 of AVX-512's 32), two loads a broadcast instead of a row-major dot
 * product's load per FMA. Each output is one FMA chain over k in order, so a row's outputs are the
 * same bits whatever M and whatever the tile. Rows go in tiles of TL_MR, the last up to TL_MR_MAX
 * rows in one tile: with AVX-512's registers that is 12, so 7-12 rows are one tile instead of a full
 * one and a tile of 1-6 rows whose few FMA chains wait on each other's latency (a step's linears at
 * 7 rows 0.73x the time, single thread, docs/benchmarks). */
#define TL_PANEL 16
#define TL_MR 6
#if defined(__AVX512F__)
#define TL_MR_MAX 12
#else
#define TL_MR_MAX 6
#endif
#define TL_PANEL_PREFETCH 32 /* panel rows ahead */
#define TL_KC 256 /* at most this many inputs per pass: a panel's slice (16 KB) stays in L1 while every row
                     group of x passes over it */

/* y[m, 0 .. cols) for the MR rows of x over kc inputs of one panel (p at input k0, x and y at their
 * first row and column): from zero, or from y's values (a later K slice, or a residual). */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K, const float *p, float *y,
                                                             int64_t N, const int MR, int64_t kc, int from_y,
                                                             int cols, int prefetch) {
    tl_v8 acc[TL_MR_MAX][2];
    for (int m = 0; m < MR; m++) {
        float row[TL_PANEL] = {0};
        if (from_y) memcpy(row, y + m * N, (size_t)cols * sizeof(float));
        acc[m][0] = *(const tl_v8u *)row;
        acc[m][1] = *(const tl_v8u *)(row + 8);
    }
    for (int64_t k = 0; k < kc; k++) {
        if (prefetch) __builtin_prefetch(p + (k + TL_PANEL_PREFETCH) * TL_PANEL);
        const tl_v8 w0 = *(const tl_v8u *)(p + k * TL_PANEL), w1 = *(const tl_v8u *)(p + k * TL_PANEL + 8);
        for (int m = 0; m < MR; m++) {
            const float s = x[m * K + k];
            const tl_v8 xb = {s, s, s, s, s, s, s, s}; /* a broadcast load ({0} + s would add first) */
            acc[m][0] += xb * w0;
            acc[m][1] += xb * w1;
        }
    }
    for (int m = 0; m < MR; m++) {
        float row[TL_PANEL];
        *(tl_v8u *)row = acc[m][0];
        *(tl_v8u *)(row + 8) = acc[m][1];
        memcpy(y + m * N, row, (size_t)cols * sizeof(float));
    }
}

static void panel_tile_dispatch(const float *x, int64_t K, const float *p, float *y, int64_t N, int MR, int64_t kc,
                                int from_y, int cols, int prefetch) {
    switch (MR) { /* each row count its own loop, the accumulators in registers */
    case 1: panel_tile(x, K, p, y, N, 1, kc, from_y, cols, prefetch); break;
    case 2: panel_tile(x, K, p, y, N, 2, kc, from_y, cols, prefetch); break;
    case 3: panel_tile(x, K, p, y, N, 3, kc, from_y, cols, prefetch); break;
    case 4: panel_tile(x, K, p, y, N, 4, kc, from_y, cols, prefetch); break;
    case 5: panel_tile(x, K, p, y, N, 5, kc, from_y, cols, prefetch); break;
#if TL_MR_MAX > 6
    case 6: panel_tile(x, K, p, y, N, 6, kc, from_y, cols, prefetch); break;
    case 7: panel_tile(x, K, p, y, N, 7, kc, from_y, cols, prefetch); break;
    case 8: panel_tile(x, K, p, y, N, 8, kc, from_y, cols, prefetch); break;
    case 9: panel_tile(x, K, p, y, N, 9, kc, from_y, cols, prefetch); break;
    case 10: panel_tile(x, K, p, y, N, 10, kc, from_y, cols, prefetch); break;
    case 11: panel_tile(x, K, p, y, N, 11, kc, from_y, cols, prefetch); break;
#endif
    default: panel_tile(x, K, p, y, N, TL_MR_MAX, kc, from_y, cols, prefetch); break;
    }
}

/* y[M, 0 .. cols) (+)= x[M, K] @ one panel: K in equal slices of at most TL_KC, all of x's row groups
 * over each slice before the next. `accumulate`: add into y (a residual) instead of storing. */
static void panel_rows(const float *x, const float *panel, float *y, int64_t M, int64_t N, int64_t K, int accumulate,
                       int cols) {
    const int64_t slices = (K + TL_KC - 1) / TL_KC, kc = (K + slices - 1) / slices;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t width = K - k0 < kc ? K - k0 : kc;
        for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
            rows = M - m0 <= TL_MR_MAX ? M - m0 : TL_MR; /* the rest in one tile once it fits */
            /* The slice's first row group reads it from memory. With 2-16 rows, too little arithmetic
             * a slice to hide that, prefetch it 32 panel rows (2 KB) ahead, on into the next slice or
             * panel: a step's linears at 8 rows 0.82-0.97x the time (A/B, four runs). One row keeps
             * up without; from 32 rows the prefetches cost more than they hide (1.09x). */
            panel_tile_dispatch(x + m0 * K + k0, K, panel + k0 * TL_PANEL, y + m0 * N, N, rows, width,
                                k0 > 0 || accumulate, cols, m0 == 0 && M > 1 && M <= 16);
        }
    }
}

#if defined(__AVX512F__)
/* Two adjacent panels at once in AVX-512's registers: per input, one 16-float row of each panel (a
 * 512-bit vector apiece) times each row of x broadcast, so each broadcast feeds two 512-bit FMAs
 * where the tile above feeds two 256-bit ones. On Intel cores with two 512-bit FMA units that is
 * twice the arithmetic a cycle (the default model's linears at 32-256 rows ran at 34-67 GFLOP/s
 * against MKL's 110 on a 2-core Ice Lake Xeon); an output is still one FMA chain over k in order,
 * so its bits match the single-panel tile's (which takes an odd last panel). The second panel of a
 * pair may be the matrix's last, narrower. */
typedef float tl_v16 __attribute__((vector_size(64)));
typedef float tl_v16u __attribute__((vector_size(64), aligned(4)));
/* Tuned on the 2-core Ice Lake Xeon, the default model's projections, A/B in one process: tiles of
 * TL_MR_MAX (12) rows, 24 accumulators (6 was 1.13x the time at 32 rows), slices of up to 256 inputs
 * (both panels' 32 KB; 128 was 1.07x at 32 rows), and the slice prefetched ahead up to 64 rows (at
 * 32 rows the first row group otherwise waits on memory: 1.11x; at 1 row 1.06x). One row takes
 * pairs too: two streams read the weights at ~0.8x the single-panel tile's time. */
#define TL_KC_PAIR 256
#define TL_PAIR_PREFETCH_ROWS 64

static inline __attribute__((always_inline)) void panel_pair_tile(const float *x, int64_t K, const float *p0,
                                                                  const float *p1, float *y, int64_t N, const int MR,
                                                                  int64_t kc, int from_y, int cols1, int prefetch) {
    tl_v16 acc[TL_MR_MAX][2];
    for (int m = 0; m < MR; m++) {
        float row[2 * TL_PANEL] = {0};
        if (from_y) memcpy(row, y + m * N, (size_t)(TL_PANEL + cols1) * sizeof(float));
        acc[m][0] = *(const tl_v16u *)row;
        acc[m][1] = *(const tl_v16u *)(row + TL_PANEL);
    }
    for (int64_t k = 0; k < kc; k++) {
        if (prefetch) {
            __builtin_prefetch(p0 + (k + TL_PANEL_PREFETCH) * TL_PANEL);
            __builtin_prefetch(p1 + (k + TL_PANEL_PREFETCH) * TL_PANEL);
        }
        const tl_v16 w0 = *(const tl_v16u *)(p0 + k * TL_PANEL), w1 = *(const tl_v16u *)(p1 + k * TL_PANEL);
        for (int m = 0; m < MR; m++) {
            const float s = x[m * K + k];
            const tl_v16 xb = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
            acc[m][0] += xb * w0;
            acc[m][1] += xb * w1;
        }
    }
    for (int m = 0; m < MR; m++) {
        float row[2 * TL_PANEL];
        *(tl_v16u *)row = acc[m][0];
        *(tl_v16u *)(row + TL_PANEL) = acc[m][1];
        memcpy(y + m * N, row, (size_t)(TL_PANEL + cols1) * sizeof(float));
    }
}

static void panel_pair_dispatch(const float *x, int64_t K, const float *p0, const float *p1, float *y, int64_t N,
                                int MR, int64_t kc, int from_y, int cols1, int prefetch) {
    switch (MR) { /* each row count its own loop, the accumulators in registers */
    case 1: panel_pair_tile(x, K, p0, p1, y, N, 1, kc, from_y, cols1, prefetch); break;
    case 2: panel_pair_tile(x, K, p0, p1, y, N, 2, kc, from_y, cols1, prefetch); break;
    case 3: panel_pair_tile(x, K, p0, p1, y, N, 3, kc, from_y, cols1, prefetch); break;
    case 4: panel_pair_tile(x, K, p0, p1, y, N, 4, kc, from_y, cols1, prefetch); break;
    case 5: panel_pair_tile(x, K, p0, p1, y, N, 5, kc, from_y, cols1, prefetch); break;
    case 6: panel_pair_tile(x, K, p0, p1, y, N, 6, kc, from_y, cols1, prefetch); break;
    case 7: panel_pair_tile(x, K, p0, p1, y, N, 7, kc, from_y, cols1, prefetch); break;
    case 8: panel_pair_tile(x, K, p0, p1, y, N, 8, kc, from_y, cols1, prefetch); break;
    case 9: panel_pair_tile(x, K, p0, p1, y, N, 9, kc, from_y, cols1, prefetch); break;
    case 10: panel_pair_tile(x, K, p0, p1, y, N, 10, kc, from_y, cols1, prefetch); break;
    case 11: panel_pair_tile(x, K, p0, p1, y, N, 11, kc, from_y, cols1, prefetch); break;
    default: panel_pair_tile(x, K, p0, p1, y, N, TL_MR_MAX, kc, from_y, cols1, prefetch); break;
    }
}

/* panel_rows over panels t and t + 1 (the second's first `cols1` columns are real). */
static void panel_pair_rows(const float *x, const float *p0, const float *p1, float *y, int64_t M, int64_t N,
                            int64_t K, int accumulate, int cols1) {
    const int64_t slices = (K + TL_KC_PAIR - 1) / TL_KC_PAIR, kc = (K + slices - 1) / slices;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t width = K - k0 < kc ? K - k0 : kc;
        for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
            rows = M - m0 < TL_MR_MAX ? M - m0 : TL_MR_MAX;
            panel_pair_dispatch(x + m0 * K + k0, K, p0 + k0 * TL_PANEL, p1 + k0 * TL_PANEL, y + m0 * N, N, rows,
                                width, k0 > 0 || accumulate, cols1, m0 == 0 && M <= TL_PAIR_PREFETCH_ROWS);
        }
    }
}
#endif

/* y[M, N] (+)= x[M, K] @ w^T, w as panels: threads split the panels (in pairs with AVX-512, the odd
 * last one alone), each streamed once for all M rows. */
static void panels_f32(const float *x, const float *panels, float *y, int64_t M, int64_t N, int64_t K,
                       int accumulate) {
    const int64_t count = (N + TL_PANEL - 1) / TL_PANEL;
#if defined(__AVX512F__)
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (count + 1) / 2; i++) {
        const int64_t t = 2 * i;
        if (t + 1 < count) {
            const int cols1 = (int)(N - (t + 1) * TL_PANEL < TL_PANEL ? N - (t + 1) * TL_PANEL : TL_PANEL);
            panel_pair_rows(x, panels + t * K * TL_PANEL, panels + (t + 1) * K * TL_PANEL, y + t * TL_PANEL, M, N, K,
                            accumulate, cols1);
        } else {
            panel_rows(x, panels + t * K * TL_PANEL, y + t * TL_PANEL, M, N, K, accumulate, (int)(N - t * TL_PANEL));
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < count; t++) {
        const int cols = (int)(N - t * TL_PANEL < TL_PANEL ? N - t * TL_PANEL : TL_PANEL);
        panel_rows(x, panels + t * K * TL_PANEL, y + t * TL_PANEL, M, N, K, accumulate, cols);
    }
#endif
}

/* y[M, N] = x[M, K] @ w^T in float32 for up to a few hundred rows (a decode step, a short prefill
 * chunk, the LM head's rows): against MKL's sgemm on the plain weight, on the 2-core AVX2 box here,
 * the default model's four projections at 8 / 32 / 64 / 256 rows take 0.4x / 0.65x / 0.75x / 1.0x
 * its time; from ~512 rows, where x no longer stays in L2 across the panels, MKL wins (layers.py). */
void tl_linear_panels_f32(const float *x, const float *panels, float *y, int64_t M, int64_t N, int64_t K) {
    panels_f32(x, panels, y, M, N, K, 0);
}

/* ---- Weight-only quantization: ggml's Q4_1 and Q8_0 blocks of 32 weights along K ----
 * Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (weight j = qs[j] & 15, weight j + 16 = qs[j] >> 4),
 *       w = d * q + m.  Q8_0: fp16 d, 32 int8, w = d * q.
 * The activations stay float32 (llama.cpp quantizes them to 8 bits too; we keep the float model's
 * numbers): a block's dot product is d * sum(q x) (+ m * sum(x), the row's block sum, computed once
 * per matrix product), the codes widened to floats in registers, each block read once for all rows. */
#define TL_QK 32
enum { TL_W_F32 = 0, TL_W_Q4_1 = 1, TL_W_Q8_0 = 2 }; /* a decode layer's weights: float32 panels, or blocks */

static inline int64_t q_block_bytes(int fmt) { return fmt == TL_W_Q4_1 ? 20 : 34; }

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h); /* blocks are 20 or 34 bytes: unaligned */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 0x1f ? 0x7f800000u : (exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* xs[m, b] = the sum of x[m] over block b (what a Q4_1 block's minimum multiplies). */
static void block_sums(const float *x, int64_t M, int64_t K, float *xs) {
    for (int64_t r = 0; r < M * (K / TL_QK); r++) {
        float sum = 0.0f;
        for (int i = 0; i < TL_QK; i++) sum += x[r * TL_QK + i];
        xs[r] = sum;
    }
}

/* count blocks of w to floats, as ggml dequantizes (d * q + m; d * q). */
static void dequantize_blocks(int fmt, const uint8_t *w, float *out, int64_t count) {
    const int64_t bb = q_block_bytes(fmt);
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *blk = w + r * bb;
        float *o = out + r * TL_QK;
        const float d = f16_to_f32(blk);
        if (fmt == TL_W_Q4_1) {
            const float m = f16_to_f32(blk + 2);
            for (int i = 0; i < TL_QK / 2; i++) {
                o[i] = d * (float)(blk[4 + i] & 0x0F) + m;
                o[i + TL_QK / 2] = d * (float)(blk[4 + i] >> 4) + m;
            }
        } else {
            for (int i = 0; i < TL_QK; i++) o[i] = d * (float)(int8_t)blk[2 + i];
        }
    }
}

#if defined(__AVX2__)
/* A block's 32 codes as four vectors of floats, in weight order. */
static inline __attribute__((always_inline)) void block_codes(const int fmt, const uint8_t *blk, __m256 q[4]) {
    if (fmt == TL_W_Q4_1) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4)), nibble = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, nibble), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 2)), b = _mm_loadu_si128((const __m128i *)(blk + 18));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    }
}
#endif

/* y[m, n0 .. n0+NT) (+)= x[m] . w[n] for M rows of x, w in blocks: NT weight rows stream once for all
 * M rows, M * NT accumulators in registers. */
static inline __attribute__((always_inline)) void qgemv_tile(const int fmt, const float *x, const float *xs,
                                                             const uint8_t *w, float *y, const int M, const int NT,
                                                             int64_t n0, int64_t N, int64_t K, int accumulate) {
    const int64_t nb = K / TL_QK, bb = q_block_bytes(fmt), row_bytes = nb * bb;
    float sums[TL_ROW_GROUP][4];
#if defined(__AVX2__)
    __m256 acc[TL_ROW_GROUP][4];
    float offset[TL_ROW_GROUP][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm256_setzero_ps(), offset[m][j] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        for (int j = 0; j < NT; j++) {
            const uint8_t *blk = w + (n0 + j) * row_bytes + b * bb;
            /* Two tiles ahead in row j's stream (rows are contiguous): a row is a few hundred bytes,
             * too short for the hardware prefetchers to ramp up, and a head of 30 MB read without
             * this ran at a third of the bandwidth. */
            __builtin_prefetch(blk + 2 * NT * row_bytes);
            __m256 q[4];
            block_codes(fmt, blk, q);
            const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
            const float mw = fmt == TL_W_Q4_1 ? f16_to_f32(blk + 2) : 0.0f;
            for (int m = 0; m < M; m++) {
                const float *xb = x + m * K + b * TL_QK;
                __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), dot);
                dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), dot);
                dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), dot);
                acc[m][j] = _mm256_fmadd_ps(d, dot, acc[m][j]);
                if (fmt == TL_W_Q4_1) offset[m][j] += mw * xs[m * nb + b];
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) sums[m][j] = hsum8((tl_v8)acc[m][j]) + offset[m][j];
#else
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + (n0 + j) * row_bytes + b * bb;
                const float *xb = x + m * K + b * TL_QK;
                float dot = 0.0f;
                if (fmt == TL_W_Q4_1) {
                    for (int i = 0; i < TL_QK / 2; i++)
                        dot += (float)(blk[4 + i] & 0x0F) * xb[i] + (float)(blk[4 + i] >> 4) * xb[i + TL_QK / 2];
                    total += f16_to_f32(blk + 2) * xs[m * nb + b];
                } else {
                    for (int i = 0; i < TL_QK; i++) dot += (float)(int8_t)blk[2 + i] * xb[i];
                }
                total += f16_to_f32(blk) * dot;
            }
            sums[m][j] = total;
        }
#endif
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) {
            if (accumulate) y[m * N + n0 + j] += sums[m][j];
            else y[m * N + n0 + j] = sums[m][j];
        }
}

#define TL_QCASE(F, MM, NT_)                                                                   \
    case (F) * 100 + (MM) * 10 + (NT_):                                                        \
        qgemv_tile(F, x, xs, w, y, MM, NT_, n0, N, K, accumulate);                             \
        break;
#define TL_QCASES_M(F, MM) TL_QCASE(F, MM, 1) TL_QCASE(F, MM, 2) TL_QCASE(F, MM, 4)
#define TL_QCASES(F) TL_QCASES_M(F, 1) TL_QCASES_M(F, 2) TL_QCASES_M(F, 3) TL_QCASES_M(F, 4)

/* One tile with the format, row count and tile width as constants (each case its own loop). */
static void qgemv_tile_dispatch(int fmt, const float *x, const float *xs, const uint8_t *w, float *y, int M,
                                int NT, int64_t n0, int64_t N, int64_t K, int accumulate) {
    switch (fmt * 100 + M * 10 + NT) {
        TL_QCASES(TL_W_Q4_1)
        TL_QCASES(TL_W_Q8_0)
    default: break;
    }
}

/* y[m, n0 .. n0+NT) (+)= x[m] . w[n] for the M rows, w row-major floats (quantized rows just expanded):
 * NT weight rows stream once, M * NT accumulator vectors stay in registers. `accumulate`: add into y
 * (a residual) instead of storing. */
static inline __attribute__((always_inline)) void gemv_tile_f32(const float *x, const float *w, float *y,
                                                                const int M, const int NT, int64_t n0,
                                                                int64_t N, int64_t K, int accumulate) {
    tl_v8 acc[TL_ROW_GROUP][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = (tl_v8){0};
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        tl_v8 xv[TL_ROW_GROUP];
        for (int m = 0; m < M; m++) xv[m] = *(const tl_v8u *)(x + m * K + k);
        for (int j = 0; j < NT; j++) {
            const tl_v8 wv = *(const tl_v8u *)(w + (n0 + j) * K + k);
            /* The same row two tiles ahead, a cache line at a time (as qgemv_tile does, for a head
             * streamed from memory). */
            if (!(k & 15)) __builtin_prefetch(w + (n0 + j + 2 * NT) * K + k);
            for (int m = 0; m < M; m++) acc[m][j] += xv[m] * wv;
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NT; j++) {
            float s = hsum8(acc[m][j]);
            for (int64_t k = K8; k < K; k++) s += x[m * K + k] * w[(n0 + j) * K + k];
            if (accumulate) y[m * N + n0 + j] += s;
            else y[m * N + n0 + j] = s;
        }
}

#define TL_DQ_TILE 16 /* weight rows a thread dequantizes at once: 16 x K floats stay in L1/L2 */

static void gemv_tile_f32_dispatch(const float *x, const float *w, float *y, int M, int NT, int64_t n0, int64_t N,
                                   int64_t K, int accumulate) {
    switch (M * 8 + NT) {
    case 1 * 8 + 1: gemv_tile_f32(x, w, y, 1, 1, n0, N, K, accumulate); break;
    case 2 * 8 + 1: gemv_tile_f32(x, w, y, 2, 1, n0, N, K, accumulate); break;
    case 3 * 8 + 1: gemv_tile_f32(x, w, y, 3, 1, n0, N, K, accumulate); break;
    case 4 * 8 + 1: gemv_tile_f32(x, w, y, 4, 1, n0, N, K, accumulate); break;
    case 1 * 8 + 2: gemv_tile_f32(x, w, y, 1, 2, n0, N, K, accumulate); break;
    case 2 * 8 + 2: gemv_tile_f32(x, w, y, 2, 2, n0, N, K, accumulate); break;
    case 3 * 8 + 2: gemv_tile_f32(x, w, y, 3, 2, n0, N, K, accumulate); break;
    case 4 * 8 + 2: gemv_tile_f32(x, w, y, 4, 2, n0, N, K, accumulate); break;
    case 1 * 8 + 4: gemv_tile_f32(x, w, y, 1, 4, n0, N, K, accumulate); break;
    default: gemv_tile_f32(x, w, y, 2, 4, n0, N, K, accumulate); break;
    }
}

/* More rows (a decode batch past 8): each thread dequantizes 16 weight
 * rows into a small float buffer and runs every row of x over it with the float tile, so the blocks
 * are read once and expanded once, whatever M (widening per block and row would repeat the
 * expansion M / 4 times). Expanding into a float32 panel for the outer-product tile instead was
 * slower up to 32 rows (the default model's layer at 9 / 32 rows: 3.4 / 4.4 vs 2.2 / 3.9 ms): the
 * transposing scatter costs more than the faster tile saves. */
static void qgemv_tiles(int fmt, const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K,
                        int accumulate) {
    const int64_t nb = K / TL_QK, row_bytes = nb * q_block_bytes(fmt), tiles = (N + TL_DQ_TILE - 1) / TL_DQ_TILE;
#pragma omp parallel
    {
        float *buf = malloc((size_t)(TL_DQ_TILE * K) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * TL_DQ_TILE, cols = N - n0 < TL_DQ_TILE ? N - n0 : TL_DQ_TILE;
            if (!buf) { /* never silently wrong */
                for (int64_t m = 0; m < M; m++)
                    for (int64_t j = 0; j < cols; j++) y[m * N + n0 + j] = NAN;
                continue;
            }
            dequantize_blocks(fmt, w + n0 * row_bytes, buf, cols * nb);
            for (int64_t m0 = 0; m0 < M; m0 += TL_ROW_GROUP) {
                const int rows = (int)(M - m0 < TL_ROW_GROUP ? M - m0 : TL_ROW_GROUP);
                int64_t j = 0; /* buf holds weight rows n0 .. n0 + cols: index them from 0, y from n0 */
                for (; j + 2 <= cols; j += 2)
                    gemv_tile_f32_dispatch(x + m0 * K, buf, y + m0 * N + n0, rows, 2, j, N, K, accumulate);
                for (; j < cols; j++)
                    gemv_tile_f32_dispatch(x + m0 * K, buf, y + m0 * N + n0, rows, 1, j, N, K, accumulate);
            }
        }
        free(buf);
    }
}

#define TL_Q_DIRECT_ROWS 8 /* up to here widening per block and row group beats expanding tiles */

static void qgemv(int fmt, const float *x, const float *xs, const uint8_t *w, float *y, int64_t M, int64_t N,
                  int64_t K, int accumulate) {
    if (M > TL_Q_DIRECT_ROWS) {
        qgemv_tiles(fmt, x, w, y, M, N, K, accumulate);
        return;
    }
    const int NT = M <= 2 ? 4 : 2; /* AVX2's 16 registers: M x NT accumulators and a block's codes */
    const int64_t nb = K / TL_QK, tiles = N / NT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t <= tiles; t++) {
        const int width = t < tiles ? NT : 1; /* the last "tile": the leftover columns one by one */
        const int64_t first = t * NT, last = t < tiles ? first + NT : N;
        for (int64_t n0 = first; n0 < last; n0 += width)
            for (int64_t m0 = 0; m0 < M; m0 += TL_ROW_GROUP) {
                const int rows = (int)(M - m0 < TL_ROW_GROUP ? M - m0 : TL_ROW_GROUP);
                qgemv_tile_dispatch(fmt, x + m0 * K, xs + m0 * nb, w, y + m0 * N, rows, width, n0, N, K, accumulate);
            }
    }
}

void tl_linear_q(int fmt, const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    if (M > TL_Q_DIRECT_ROWS) {
        qgemv_tiles(fmt, x, w, y, M, N, K, 0);
        return;
    }
    float *xs = malloc((size_t)(M * (K / TL_QK)) * sizeof(float) + sizeof(float)); /* the rows' block sums */
    if (!xs) {
        for (int64_t i = 0; i < M * N; i++) y[i] = NAN; /* never silently wrong */
        return;
    }
    block_sums(x, M, K, xs);
    qgemv(fmt, x, xs, w, y, M, N, K, 0);
    free(xs);
}

/* w [N, K] in blocks to float32 out [N, K], as ggml dequantizes (d * q + m; d * q): for a prefill's
 * many rows a float matrix product beats reading the blocks row group by row group. */
void tl_dequantize_q(int fmt, const uint8_t *w, float *out, int64_t N, int64_t K) {
    const int64_t nb = K / TL_QK, bb = q_block_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) dequantize_blocks(fmt, w + n * nb * bb, out + n * K, nb);
}

/* ---- Quantized blocks times bfloat16 rows, batched (AVX-512 BF16) ----
 * The float kernels above widen each block's codes per row group, so their cost grows with the rows
 * and past a few rows they fell to a quarter of the bfloat16 kernel's speed. Here each thread expands
 * a panel of 16 weight rows once into an L2-resident tile of bfloat16 *codes* (small integers, exact
 * in bfloat16), input pairs by column as vdpbf16ps reads them, with the blocks' scales (and Q4_1's
 * minimums) as 16-lane vectors beside it; then every row of x runs over the tile: per block, 16
 * vdpbf16ps into a block sum, scaled by the 16 columns' d in one FMA (+ m times the row's block sum
 * of x for Q4_1). So the weight is what the blocks say, exactly, and x is the bfloat16 rows the model
 * holds: the same products as the float kernel, summed in another order. */
#define TL_QB_ROWS 8 /* rows of x per register tile: 8 block sums + 8 accumulators + weight, d, m */

#if defined(__AVX512F__)
/* y[m0 + r, n0 .. n0 + 16) (+)= acc[r] for r < MT, the columns past N left alone: a register tile's
 * store, shared by the quantized kernels. */
static inline __attribute__((always_inline)) void store_rows16(const __m512 *acc, const int MT, float *y, int64_t m0,
                                                               int64_t n0, int64_t N, int accumulate) {
    const int64_t cols = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (int r = 0; r < MT; r++) {
        float *out = y + (m0 + r) * N + n0;
        __m512 v = acc[r];
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out));
        _mm512_mask_storeu_ps(out, mask, v);
    }
}
#endif

#if defined(__AVX512BF16__)
/* The 16 x 16 transpose of 32-bit elements (r[j] lane p -> r[p] lane j): a block's 16 rows of 16
 * code pairs become 16 vectors of one pair for each of the 16 columns. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}

/* A block's 32 codes as bfloat16 integers, in weight order (pair p in 32-bit lane p). */
static inline __attribute__((always_inline)) __m512i block_codes_bf16(const int fmt, const uint8_t *blk) {
    if (fmt == TL_W_Q4_1) {
        /* bytes 0..15 twice as words; the upper copy shifted by 4: the high nibbles, weights 16..31 */
        const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 4))));
        const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi16(0x0F));
        /* bfloat16 of 0..15 (their float32's upper halves), looked up by code */
        const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                             0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
                                             0x4040, 0x4000, 0x3F80, 0x0000);
        return _mm512_permutexvar_epi16(codes, lut);
    }
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Weight rows n0 .. n0 + 16 (zero past N) into tile [nb][16 pairs][16 columns][2] bfloat16 codes,
 * d [nb][16] and, for Q4_1, mins [nb][16]. */
static void expand_panel(int fmt, const uint8_t *w, int64_t n0, int64_t N, int64_t nb, uint16_t *tile, float *d,
                         float *mins) {
    const int64_t bb = q_block_bytes(fmt), row_bytes = nb * bb;
    const int cols = N - n0 < 16 ? (int)(N - n0) : 16;
    const uint8_t *rows[16];
    for (int j = 0; j < 16; j++) rows[j] = w + (n0 + (j < cols ? j : 0)) * row_bytes; /* past N: any row, masked */
    for (int64_t b = 0; b < nb; b++) {
        __m512i r[16];
        uint16_t dh[16], mh[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const uint8_t *blk = rows[j] + b * bb;
            r[j] = block_codes_bf16(fmt, blk);
            memcpy(&dh[j], blk, 2);
            memcpy(&mh[j], blk + 2, 2);
        }
        transpose16_epi32(r);
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(tile + (b * 16 + p) * 32, r[p]);
        /* the scales as 16-lane vectors; zero for the columns past N, so theirs sum to 0 */
        const __mmask16 live = (__mmask16)((1u << cols) - 1u);
        _mm512_storeu_ps(d + b * 16, _mm512_maskz_cvtph_ps(live, _mm256_loadu_si256((const __m256i *)dh)));
        if (fmt == TL_W_Q4_1)
            _mm512_storeu_ps(mins + b * 16, _mm512_maskz_cvtph_ps(live, _mm256_loadu_si256((const __m256i *)mh)));
    }
}

/* y[m0 .. m0 + MT, n0 .. n0 + 16) (+)= x rows times the expanded panel. */
static inline __attribute__((always_inline)) void qbf16_rows(const int fmt, const int MT, const uint16_t *x,
                                                             const float *xs, const uint16_t *tile,
                                                             const float *d, const float *mins, float *y,
                                                             int64_t m0, int64_t n0, int64_t N, int64_t K,
                                                             int accumulate) {
    const int64_t nb = K / TL_QK;
    __m512 acc[TL_QB_ROWS], sum[TL_QB_ROWS];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < MT; r++) sum[r] = _mm512_setzero_ps();
        const uint16_t *t = tile + b * 16 * 32;
        for (int p = 0; p < 16; p++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(t + p * 32);
            for (int r = 0; r < MT; r++) {
                uint32_t pair;
                memcpy(&pair, x + (m0 + r) * K + b * TL_QK + 2 * p, sizeof pair);
                sum[r] = _mm512_dpbf16_ps(sum[r], wv, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
        const __m512 dv = _mm512_loadu_ps(d + b * 16);
        for (int r = 0; r < MT; r++) acc[r] = _mm512_fmadd_ps(sum[r], dv, acc[r]);
        if (fmt == TL_W_Q4_1) {
            const __m512 mv = _mm512_loadu_ps(mins + b * 16);
            for (int r = 0; r < MT; r++) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(m0 + r) * nb + b]), acc[r]);
        }
    }
    store_rows16(acc, MT, y, m0, n0, N, accumulate);
}

#define TL_QB_CASE(F, MT_)                                                                        \
    case (F) * 16 + (MT_):                                                                        \
        qbf16_rows(F, MT_, x, xs, tile, d, mins, y, m0, n0, N, K, accumulate);                    \
        break;
#define TL_QB_CASES(F) TL_QB_CASE(F, 1) TL_QB_CASE(F, 2) TL_QB_CASE(F, 3) TL_QB_CASE(F, 4) \
    TL_QB_CASE(F, 5) TL_QB_CASE(F, 6) TL_QB_CASE(F, 7) TL_QB_CASE(F, 8)

/* Returns 0 when a thread's tile could not be allocated (y then holds NaN there). */
static int linear_q_bf16_avx512(int fmt, const uint16_t *x, const uint8_t *w, float *y, int64_t M, int64_t N,
                                int64_t K, int accumulate, float *xs) {
    const int64_t nb = K / TL_QK, panels = (N + 15) / 16;
    if (fmt == TL_W_Q4_1)
        for (int64_t i = 0; i < M * nb; i++) { /* the rows' block sums, for the minimums */
            float s = 0.0f;
            for (int k = 0; k < TL_QK; k++) s += bf16_to_f32(x[i * TL_QK + k]);
            xs[i] = s;
        }
    int ok = 1;
#pragma omp parallel
    {
        uint16_t *tile = aligned_alloc(64, (size_t)(nb * 16 * 32) * sizeof(uint16_t));
        float *d = malloc((size_t)(nb * 16 * 2) * sizeof(float));
        float *mins = d ? d + nb * 16 : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < panels; t++) {
            const int64_t n0 = t * 16;
            if (!tile || !d) {
                for (int64_t m = 0; m < M; m++)
                    for (int64_t j = n0; j < N && j < n0 + 16; j++) y[m * N + j] = NAN;
                ok = 0;
                continue;
            }
            expand_panel(fmt, w, n0, N, nb, tile, d, mins);
            /* balanced row tiles of at most TL_QB_ROWS */
            const int64_t groups = (M + TL_QB_ROWS - 1) / TL_QB_ROWS;
            for (int64_t m0 = 0, g = 0; m0 < M; g++) {
                const int mt = (int)((M - m0 + (groups - g) - 1) / (groups - g));
                switch (fmt * 16 + mt) {
                    TL_QB_CASES(TL_W_Q4_1)
                    TL_QB_CASES(TL_W_Q8_0)
                default: break;
                }
                m0 += mt;
            }
        }
        free(tile);
        free(d);
    }
    return ok;
}
#undef TL_QB_CASES
#undef TL_QB_CASE
#endif

/* y = x @ w^T (or y += with accumulate) for bfloat16 rows x [M, K] and quantized w [N, K], y float32.
 * xs: M * K / 32 floats of scratch. Without AVX-512 BF16 the rows are widened to float32 and go
 * through the float kernels (the same products). */
static void linear_q_bf16(int fmt, const uint16_t *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K,
                          int accumulate, float *xs) {
#if defined(__AVX512BF16__)
    linear_q_bf16_avx512(fmt, x, w, y, M, N, K, accumulate, xs);
#else
    float *wide = malloc((size_t)(M * K) * sizeof(float));
    if (!wide) {
        for (int64_t i = 0; i < M * N; i++) y[i] = NAN; /* never silently wrong */
        return;
    }
    for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_f32(x[i]);
    if (M > TL_Q_DIRECT_ROWS) {
        qgemv_tiles(fmt, wide, w, y, M, N, K, accumulate);
    } else {
        block_sums(wide, M, K, xs);
        qgemv(fmt, wide, xs, w, y, M, N, K, accumulate);
    }
    free(wide);
#endif
}

void tl_linear_q_bf16(int fmt, const uint16_t *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    float *xs = malloc((size_t)(M * (K / TL_QK)) * sizeof(float) + sizeof(float));
    if (!xs) {
        for (int64_t i = 0; i < M * N; i++) y[i] = NAN;
        return;
    }
    linear_q_bf16(fmt, x, w, y, M, N, K, 0, xs);
    free(xs);
}

/* ---- Quantized blocks repacked at load time, times int8 rows (AVX-512 VNNI) ----
 * The layout (quantization.pack_panels; the same bytes as the blocks, reordered): per panel of 16
 * weight rows and block of 32 inputs, one chunk: the 16 rows' d (fp16; Q4_1: then their m), then the
 * codes as vpdpbusd reads them, 32-bit lane j holding 4 consecutive codes of row j: Q8_0's as
 * unsigned bytes q + 128 (8 vectors of 64 bytes), Q4_1's 4-bit codes two a byte (4 vectors: the low
 * nibbles the first 16 inputs' groups, the high nibbles the last 16's), so a mask and a shift give the
 * lanes. No transpose, no conversion per call: 8 vpdpbusd (64 products each) a block for each row.
 * The rows are quantized to int8 per block of 32 (d_x = max|x| / 127, as llama.cpp quantizes
 * activations for these formats), so the products differ from the dequantized weight times x by that
 * rounding: at most d_x / 2 an input, times the weights' magnitudes (tests argue the tolerance so). */
#define TL_W_PACKED 32 /* added to fmt for the decode layer: the weights are in the packed layout */
#define TL_QP_ROWS 8   /* rows per register tile: 8 accumulators + the block's 8 code vectors */

int tl_has_avx512vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
/* Row-block r of x (float32, bfloat16, or float32 rounded to bfloat16 first: xdtype 0 / 1 / 2) to int8
 * xq, its scale dx, -128 times the sum of its codes (where Q8_0's sums start: its codes are stored + 128;
 * kept whole so a row tile's start is one broadcast load) and the sum of its values (Q4_1's m). */
static inline void quantize_block_q8(int xdtype, const void *x, int64_t r, int8_t *xq, float *dx, int32_t *qsum,
                                     float *xsum) {
    __m512 v[2];
    for (int h = 0; h < 2; h++) {
        const int64_t at = r * TL_QK + 16 * h;
        if (xdtype == 1) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        } else {
            v[h] = _mm512_loadu_ps((const float *)x + at);
            if (xdtype == 2) v[h] = round512_bf16(v[h]);
        }
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv))); /* nearest */
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128((__m128i *)(xq + r * TL_QK + 16 * h), _mm512_cvtsepi32_epi8(q));
    }
    dx[r] = d;
    qsum[r] = -128 * _mm512_reduce_add_epi32(sum);
    xsum[r] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
}

/* y[m0 .. m0 + MT, panel's 16 columns) (+)= the quantized rows times the panel. */
static inline __attribute__((always_inline)) void qp_rows(const int fmt, const int MT, const int8_t *xq,
                                                          const float *dx, const int32_t *qsum, const float *xsum,
                                                          const uint8_t *panel, float *y, int64_t m0, int64_t n0,
                                                          int64_t N, int64_t K, int accumulate) {
    const int64_t nb = K / TL_QK, chunk = 16 * q_block_bytes(fmt);
    __m512 acc[TL_QP_ROWS];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = panel + b * chunk;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c));
        __m512i wv[8];
        __m512 mw = _mm512_setzero_ps();
        if (fmt == TL_W_Q4_1) {
            mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 32)));
            const __m512i nibble = _mm512_set1_epi8(0x0F);
            for (int h = 0; h < 4; h++) {
                const __m512i raw = _mm512_loadu_si512(c + 64 + 64 * h);
                wv[h] = _mm512_and_si512(raw, nibble);
                wv[h + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
        } else {
            for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512(c + 32 + 64 * g);
        }
        /* Q8_0's codes are stored + 128: each row's sum starts from -128 times its block's code sum.
         * Rows inner: MT independent vpdpbusd chains in flight, not one chain of 8 (latency-bound). */
        __m512i isum[TL_QP_ROWS];
        for (int r = 0; r < MT; r++)
            isum[r] = fmt == TL_W_Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(qsum[(m0 + r) * nb + b]);
        for (int g = 0; g < 8; g++)
            for (int r = 0; r < MT; r++) {
                const int32_t *xr = (const int32_t *)(xq + ((m0 + r) * nb + b) * TL_QK);
                isum[r] = _mm512_dpbusd_epi32(isum[r], wv[g], _mm512_set1_epi32(xr[g]));
            }
        for (int r = 0; r < MT; r++) {
            const int64_t rb = (m0 + r) * nb + b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[rb])), acc[r]);
            if (fmt == TL_W_Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[rb]), acc[r]);
        }
    }
    store_rows16(acc, MT, y, m0, n0, N, accumulate);
}

#define TL_QP_CASE(F, MT_)                                                                        \
    case (F) * 16 + (MT_):                                                                        \
        qp_rows(F, MT_, xq, dx, qsum, xsum, panel, y, m0, n0, N, K, accumulate);                  \
        break;
#define TL_QP_CASES(F) TL_QP_CASE(F, 1) TL_QP_CASE(F, 2) TL_QP_CASE(F, 3) TL_QP_CASE(F, 4) \
    TL_QP_CASE(F, 5) TL_QP_CASE(F, 6) TL_QP_CASE(F, 7) TL_QP_CASE(F, 8)
#endif

/* y (+)= x @ w^T for packed w [N, K] (N a multiple of 16) and rows x of xdtype (see quantize_block_q8).
 * Without AVX-512 VNNI nothing is packed (tl_has_avx512vnni), and this writes NaN: never silently wrong. */
static void linear_qp(int fmt, int xdtype, const void *x, const uint8_t *w, float *y, int64_t M, int64_t N,
                      int64_t K, int accumulate) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
    const int64_t nb = K / TL_QK, panels = N / 16, chunk = 16 * q_block_bytes(fmt);
    int8_t *xq = malloc((size_t)(M * K) + (size_t)(M * nb) * (2 * sizeof(float) + sizeof(int32_t)) + 64);
    if (xq && !(N % 16)) {
        float *dx = (float *)(xq + ((M * K + 63) & ~(int64_t)63)), *xsum = dx + M * nb;
        int32_t *qsum = (int32_t *)(xsum + M * nb);
        const int64_t groups = (M + TL_QP_ROWS - 1) / TL_QP_ROWS;
        /* One parallel region: the threads quantize the rows (a prefill chunk's are worth sharing),
         * then, after the loop's barrier, split the panels. */
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M * nb; r++) quantize_block_q8(xdtype, x, r, xq, dx, qsum, xsum);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < panels; t++) {
                const int64_t n0 = t * 16;
                const uint8_t *panel = w + t * nb * chunk;
                for (int64_t m0 = 0, g = 0; m0 < M; g++) { /* balanced row tiles of at most TL_QP_ROWS */
                    const int mt = (int)((M - m0 + (groups - g) - 1) / (groups - g));
                    switch (fmt * 16 + mt) {
                        TL_QP_CASES(TL_W_Q4_1)
                        TL_QP_CASES(TL_W_Q8_0)
                    default: break;
                    }
                    m0 += mt;
                }
            }
        }
        free(xq);
        return;
    }
    free(xq);
#else
    (void)fmt; (void)xdtype; (void)x; (void)w; (void)K; (void)accumulate;
#endif
    for (int64_t i = 0; i < M * N; i++) y[i] = NAN;
}

void tl_linear_qp(int fmt, int xdtype, const void *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    linear_qp(fmt, xdtype, x, w, y, M, N, K, 0);
}

/* A decode layer's projection: float32 panels through panels_f32, quantized blocks through qgemv
 * (the rows' block sums in the layer's scratch), or with TL_W_BF16_ROWS in fmt (a bfloat16 model's
 * layer) and enough rows, the rows rounded to bfloat16, as that model's own operators round them, and
 * multiplied by tl_linear_q_bf16's batched kernel. xb: M * K bfloat16 values of scratch. */
#define TL_W_BF16_ROWS 16
#define TL_QB_MIN_ROWS 4 /* layers.QUANTIZED_BF16_ROWS */
static void layer_linear(int fmt, const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K,
                         int accumulate, float *xs, uint16_t *xb) {
    if (fmt == TL_W_F32) {
        panels_f32(x, (const float *)w, y, M, N, K, accumulate);
        return;
    }
    if (fmt & TL_W_PACKED) { /* rows rounded to bfloat16 first under TL_W_BF16_ROWS, as the per-op path has them */
        linear_qp(fmt & 15, (fmt & TL_W_BF16_ROWS) ? 2 : 0, x, (const uint8_t *)w, y, M, N, K, accumulate);
        return;
    }
#if defined(__AVX512BF16__)
    if ((fmt & TL_W_BF16_ROWS) && M >= TL_QB_MIN_ROWS) {
        for (int64_t i = 0; i < M * K; i++) xb[i] = f32_to_bf16(x[i]);
        linear_q_bf16(fmt & ~TL_W_BF16_ROWS, xb, (const uint8_t *)w, y, M, N, K, accumulate, xs);
        return;
    }
#else
    (void)xb;
#endif
    fmt &= ~TL_W_BF16_ROWS;
    block_sums(x, M, K, xs);
    qgemv(fmt, x, xs, (const uint8_t *)w, y, M, N, K, accumulate);
}

/* silu(gate) * up for M rows of [gate | up] (each 2I wide), packed to [M, I] at the front. The
 * sigmoid from exp(-|g|) (the vector exp takes x <= 0 only), threads over rows, each row in place
 * over its own gate; then the rows move down to their packed places, in order. */
static void silu_mul_f32(float *gate_up, int64_t M, int64_t I) {
    const int64_t I8 = I & ~(int64_t)7;
#pragma omp parallel for schedule(static) if (M * I >= 16384)
    for (int64_t m = 0; m < M; m++) {
        float *g = gate_up + m * 2 * I;
        const float *up = g + I;
        for (int64_t i = 0; i < I8; i += 8) {
            const tl_v8 gv = *(const tl_v8u *)(g + i);
            const tl_v8 e = exp8(v8_select(gv > 0.0f, (tl_v8){0} - gv, gv)); /* exp(-|g|) */
            const tl_v8 sig = v8_select(gv > 0.0f, 1.0f / (1.0f + e), e / (1.0f + e));
            *(tl_v8u *)(g + i) = gv * sig * *(const tl_v8u *)(up + i);
        }
        for (int64_t i = I8; i < I; i++) {
            const float e = exp_nonpositive(g[i] > 0.0f ? -g[i] : g[i]);
            g[i] = g[i] * (g[i] > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * up[i];
        }
    }
    for (int64_t m = 1; m < M; m++) memmove(gate_up + m * I, gate_up + m * 2 * I, (size_t)I * sizeof(float));
}

/* out = w * (x / rms(x)), as the float32 reference computes it. */
static void rms_norm_f32(const float *x, const float *weight, float *out, int64_t M, int64_t H, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * H;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) sum += row[i] * row[i];
        const float scale = 1.0f / sqrtf(sum / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[m * H + i] = weight[i] * (row[i] * scale);
    }
}

/* Optional parts of a decode layer beyond Llama's (Gemma 3), all off when the pointer is NULL or a field
 * 0: per-head RMSNorms of q and k before RoPE, RMSNorms of o_proj's and down_proj's outputs before each
 * residual add, tanh-GELU in place of SiLU, a sliding window, and (bfloat16 layer) norm weights held in
 * float32 that scale before the rounding, as a zero-centred (1 + w) norm does (w + 1 folded at load). */
typedef struct {
    const void *q_norm, *k_norm;               /* [Dh], the layer's norm dtype (float32 under f32_norms) */
    const void *post_attn_norm, *post_ff_norm; /* [H] */
    int64_t gelu;                              /* 1: gelu_tanh(gate) * up */
    int64_t window;                            /* > 0: each row sees its last `window` positions */
    int64_t f32_norms;                         /* tl_decode_layer_bf16: every norm weight is float32 */
} tl_layer_opts;

static const tl_layer_opts TL_LLAMA_LAYER = {0};

/* torch's gelu(approximate="tanh"), 0.5 g (1 + tanh(v)), as g sigmoid(2v): 1 + tanh(v) cancels to 0 in
 * float32 below v ~ -9, where the GELU is still ~1e-7 g. */
static inline float gelu_tanh(float g) {
    const float v = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = expf(-2.0f * fabsf(v));
    return (v > 0.0f ? g : g * e) / (1.0f + e);
}

/* gelu_tanh(gate) * up for M rows of [gate | up], packed to [M, I] at the front (as silu_mul_f32):
 * tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|), eight at a time (the vector exp takes x <= 0). */
static void gelu_mul_f32(float *gate_up, int64_t M, int64_t I) {
    const int64_t I8 = I & ~(int64_t)7;
#pragma omp parallel for schedule(static) if (M * I >= 16384)
    for (int64_t m = 0; m < M; m++) {
        float *g = gate_up + m * 2 * I;
        const float *up = g + I;
        for (int64_t i = 0; i < I8; i += 8) {
            const tl_v8 gv = *(const tl_v8u *)(g + i);
            const tl_v8 u = 0.7978845608028654f * (gv + 0.044715f * gv * gv * gv);
            const tl_v8 abs_u = v8_select(u > 0.0f, u, (tl_v8){0} - u);
            const tl_v8 e = exp8((tl_v8){0} - 2.0f * abs_u);
            const tl_v8 t = (1.0f - e) / (1.0f + e);
            *(tl_v8u *)(g + i) = 0.5f * gv * (1.0f + v8_select(u > 0.0f, t, (tl_v8){0} - t)) * *(const tl_v8u *)(up + i);
        }
        for (int64_t i = I8; i < I; i++) g[i] = gelu_tanh(g[i]) * up[i];
    }
    for (int64_t m = 1; m < M; m++) memmove(gate_up + m * I, gate_up + m * 2 * I, (size_t)I * sizeof(float));
}

/* x += in @ w^T, or with a post norm x += norm(in @ w^T) (the projection first into proj, [M, H]). */
static void layer_out_f32(int wfmt, const float *in, const void *w, float *x, float *proj, const float *post_norm,
                          int64_t M, int64_t H, int64_t K, float eps, float *xs, uint16_t *xb) {
    if (!post_norm) {
        layer_linear(wfmt, in, w, x, M, H, K, 1, xs, xb);
        return;
    }
    layer_linear(wfmt, in, w, proj, M, H, K, 0, xs, xb);
    rms_norm_f32(proj, post_norm, proj, M, H, eps);
    for (int64_t i = 0; i < M * H; i++) x[i] += proj[i];
}

void tl_decode_layer_f32(int wfmt, int kv_dtype, float *x, int64_t M, int64_t H, float eps, const float *ln1, const void *w_qkv,
                         const void *w_o, const float *ln2, const void *w_gate_up, const void *w_down,
                         int64_t I, int64_t heads, int64_t kv_heads, int64_t Dh, const float *cos, const float *sin,
                         void *k_cache, void *v_cache, const int64_t *slots, const int64_t *tables, int64_t width,
                         const int64_t *lens, int64_t block_size, int64_t max_len, float scale, float *scratch,
                         const tl_layer_opts *opts) {
    const tl_layer_opts *o = opts ? opts : &TL_LLAMA_LAYER;
    const int64_t q_width = heads * Dh, kv_width = kv_heads * Dh, qkv_width = q_width + 2 * kv_width;
    float *h = scratch;                  /* [M, H] normed rows */
    float *qkv = h + M * H;              /* [M, qkv_width] */
    float *attn = qkv + M * qkv_width;   /* [M, q_width] */
    float *gate_up = attn + M * q_width; /* [M, 2I], then silu(gate) * up in its first I columns */
    float *xs = gate_up + M * 2 * I;     /* [M, widest K / 32]: block sums for quantized weights */
    const int64_t widest = H > q_width ? (H > I ? H : I) : (q_width > I ? q_width : I);
    uint16_t *xb = (uint16_t *)(xs + M * (widest / TL_QK)); /* [M, widest K] bfloat16: TL_W_BF16_ROWS' rows */

    rms_norm_f32(x, ln1, h, M, H, eps);
    layer_linear(wfmt, h, w_qkv, qkv, M, qkv_width, H, 0, xs, xb);
    const int64_t half = Dh / 2;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * qkv_width;
        if (o->q_norm) rms_norm_f32(row, (const float *)o->q_norm, row, heads, Dh, eps); /* in place, head by head */
        if (o->k_norm) rms_norm_f32(row + q_width, (const float *)o->k_norm, row + q_width, kv_heads, Dh, eps);
        const float *c = cos + m * Dh, *s = sin + m * Dh;
        for (int64_t head = 0; head < heads + kv_heads; head++) { /* q heads, then k heads */
            float *v = qkv + m * qkv_width + head * Dh;
            for (int64_t i = 0; i < half; i++) {
                const float lo = v[i], hi = v[i + half];
                v[i] = lo * c[i] - hi * s[i];
                v[i + half] = hi * c[i + half] + lo * s[i + half];
            }
        }
        const float *k = qkv + m * qkv_width + q_width;
        if (kv_dtype == TL_BFLOAT16) {
            uint16_t *kc = (uint16_t *)k_cache + slots[m] * kv_width, *vc = (uint16_t *)v_cache + slots[m] * kv_width;
            for (int64_t i = 0; i < kv_width; i++) {
                kc[i] = f32_to_bf16(k[i]);
                vc[i] = f32_to_bf16(k[kv_width + i]);
            }
        } else {
            memcpy((float *)k_cache + slots[m] * kv_width, k, (size_t)kv_width * sizeof(float));
            memcpy((float *)v_cache + slots[m] * kv_width, k + kv_width, (size_t)kv_width * sizeof(float));
        }
    }
    tl_decode_attention(TL_FLOAT32, kv_dtype, qkv, qkv_width, k_cache, v_cache, tables, width, lens, attn, M, heads, kv_heads,
                        Dh, block_size, max_len, scale, o->window);
    layer_out_f32(wfmt, attn, w_o, x, h, (const float *)o->post_attn_norm, M, H, q_width, eps, xs, xb);

    rms_norm_f32(x, ln2, h, M, H, eps);
    layer_linear(wfmt, h, w_gate_up, gate_up, M, 2 * I, H, 0, xs, xb);
    if (o->gelu)
        gelu_mul_f32(gate_up, M, I);
    else
        silu_mul_f32(gate_up, M, I);
    layer_out_f32(wfmt, gate_up, w_down, x, h, (const float *)o->post_ff_norm, M, H, I, eps, xs, xb);
}

/* x = bf16(x + y) for n values: a residual add as torch adds two bfloat16 tensors. */
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

/* RMSNorm of bfloat16 rows: Llama's (tl_rms_norm_bf16, a bfloat16 weight) or, with f32 (a zero-centred
 * norm's float32 1 + w), bf16(x / rms(x) * w) with one rounding at the end, as ZeroCenteredRMSNorm. */
static void norm_bf16(int f32, const uint16_t *x, const void *weight, uint16_t *out, int64_t T, int64_t H, float eps) {
    if (!f32) {
        tl_rms_norm_bf16(x, (const uint16_t *)weight, out, T, H, eps);
        return;
    }
    const float *w = (const float *)weight;
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * H;
        const float scale = bf16_row_inv_rms(row, H, eps);
        uint16_t *dst = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) dst[i] = f32_to_bf16(bf16_to_f32(row[i]) * scale * w[i]);
    }
}

/* gelu_tanh(gate) * up of bfloat16 rows [T, 2I] into out [T, I], rounded where torch's two ops round.
 * Sixteen at a time as tl_silu_mul_bf16: 0.5 x (1 + tanh(v)) = x sigmoid(2v) = x / (1 + e) for v > 0,
 * x e / (1 + e) else, e = exp(-2|v|) (no cancellation where 1 + tanh(v) is tiny). The scalar tanhf was
 * ~12 ms of a 32-row Gemma 3 270M step. */
void tl_gelu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= I; i += 16) {
            const __m512 x = load16(g, i, TL_BFLOAT16);
            const __m512 v = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            const __m512 e = exp512_nonpositive(-2.0f * _mm512_abs_ps(v));
            const __mmask16 positive = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
            /* Below v = -43 the exp is clamped (e^-87): the GELU is 0 there, not x e^-87 (-4.9 at x = -3e38). */
            const __mmask16 vanishing = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-43.0f), _CMP_LT_OQ);
            const __m512 num = _mm512_maskz_mov_ps(~vanishing, _mm512_mask_mov_ps(x * e, positive, x));
            const __m512 gelu = round512_bf16(num / (1.0f + e));
            const __m512 prod = round512_bf16(gelu * load16(u, i, TL_BFLOAT16));
            _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(prod), 16)));
        }
#endif
        for (; i < I; i++) o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gelu_tanh(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
    }
}

/* One Llama decoder layer for a few bfloat16 decode rows in one call: the same kernels, in the same
 * order and with the same roundings, as the per-operator path of a bfloat16 model at a handful of rows
 * (tl_rms_norm_bf16, tl_linear_bf16_blocked on oneDNN's packed weights, tl_rotary_bf16, the K/V write,
 * tl_decode_attention, bfloat16 residual adds, tl_silu_mul_bf16), so the outputs are the same bits;
 * only the ~25 Python-level operators a layer between them are gone.
 *
 * x [M, H] bfloat16, updated in place. w_qkv, w_o, w_gate_up, w_down: packed tiles, their (NB, P) in
 * blocking[0..8) in that order; norms [H] bfloat16; cos/sin [M, Dh] bfloat16; the rest as
 * tl_decode_layer_f32 takes it. scratch holds M * (2 H + (heads + 2 KVH) Dh + heads Dh + 3 I)
 * bfloat16 values. */
void tl_decode_layer_bf16(uint16_t *x, int64_t M, int64_t H, float eps, const void *ln1, const uint16_t *w_qkv,
                          const uint16_t *w_o, const void *ln2, const uint16_t *w_gate_up, const uint16_t *w_down,
                          const int64_t *blocking, int64_t I, int64_t heads, int64_t kv_heads, int64_t Dh,
                          const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache,
                          const int64_t *slots, const int64_t *tables, int64_t width, const int64_t *lens,
                          int64_t block_size, int64_t max_len, float scale, uint16_t *scratch,
                          const tl_layer_opts *opts) {
    const tl_layer_opts *o = opts ? opts : &TL_LLAMA_LAYER;
    const int64_t q_width = heads * Dh, kv_width = kv_heads * Dh, qkv_width = q_width + 2 * kv_width;
    uint16_t *h = scratch;                  /* [M, H] normed rows */
    uint16_t *qkv = h + M * H;              /* [M, qkv_width] */
    uint16_t *attn = qkv + M * qkv_width;   /* [M, q_width] */
    uint16_t *gate_up = attn + M * q_width; /* [M, 2I] */
    uint16_t *act = gate_up + M * 2 * I;    /* [M, I]: silu(gate) * up */
    uint16_t *proj = act + M * I;           /* [M, H]: o_proj's or down_proj's output, before the residual */

    const int f32 = (int)o->f32_norms;
    norm_bf16(f32, x, ln1, h, M, H, eps);
    tl_linear_bf16_blocked(h, w_qkv, qkv, M, qkv_width, H, blocking[0], blocking[1]);
    for (int64_t m = 0; m < M && (o->q_norm || o->k_norm); m++) {
        uint16_t *row = qkv + m * qkv_width;
        if (o->q_norm) norm_bf16(f32, row, o->q_norm, row, heads, Dh, eps); /* in place, head by head */
        if (o->k_norm) norm_bf16(f32, row + q_width, o->k_norm, row + q_width, kv_heads, Dh, eps);
    }
    tl_rotary_bf16(qkv, qkv_width, cos, sin, M, heads + kv_heads, Dh);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *k = qkv + m * qkv_width + q_width;
        memcpy(k_cache + slots[m] * kv_width, k, (size_t)kv_width * sizeof(uint16_t));
        memcpy(v_cache + slots[m] * kv_width, k + kv_width, (size_t)kv_width * sizeof(uint16_t));
    }
    tl_decode_attention(TL_BFLOAT16, TL_BFLOAT16, qkv, qkv_width, k_cache, v_cache, tables, width, lens, attn, M, heads,
                        kv_heads, Dh, block_size, max_len, scale, o->window);
    tl_linear_bf16_blocked(attn, w_o, proj, M, H, q_width, blocking[2], blocking[3]);
    if (o->post_attn_norm) norm_bf16(f32, proj, o->post_attn_norm, proj, M, H, eps);
    add_bf16(x, proj, M * H);

    norm_bf16(f32, x, ln2, h, M, H, eps);
    tl_linear_bf16_blocked(h, w_gate_up, gate_up, M, 2 * I, H, blocking[4], blocking[5]);
    if (o->gelu)
        tl_gelu_mul_bf16(gate_up, act, M, I);
    else
        tl_silu_mul_bf16(gate_up, act, M, I);
    tl_linear_bf16_blocked(act, w_down, proj, M, H, I, blocking[6], blocking[7]);
    if (o->post_ff_norm) norm_bf16(f32, proj, o->post_ff_norm, proj, M, H, eps);
    add_bf16(x, proj, M * H);
}
