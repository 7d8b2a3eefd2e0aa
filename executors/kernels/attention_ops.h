/*
 * The inner loops of paged_attention.c, for one element type of the K/V rows they read: included
 * once per type with KV_T (float, int8_t or uint8_t fp8 bits), OPS(name) (the type's function
 * names) and, for the AVX-512 loops, LOAD16 defined. Loads convert to float in the loop (int8: one
 * byte per element read from memory). KV_SIMD_ONLY: only the AVX-512 loops (fp8, whose portable
 * path dequantizes into a float buffer and runs the float loops).
 */

#ifndef KV_SIMD_ONLY

static inline float OPS(dot)(const float *x, const KV_T *y, int64_t n) {
    float acc = 0.0f;
    for (int64_t d = 0; d < n; d++) acc += x[d] * y[d];
    return acc;
}

/* x against 4 rows of y (`stride` apart) at once: four independent vector accumulators
 * instead of one FMA dependency chain per key (a lone dot of 64 floats is latency-bound). */
static inline void OPS(dot4)(const float *x, const KV_T *y, int64_t stride, int64_t n, float *out) {
    const KV_T *y0 = y, *y1 = y + stride, *y2 = y + 2 * stride, *y3 = y + 3 * stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float xd = x[d];
        s0 += xd * y0[d];
        s1 += xd * y1[d];
        s2 += xd * y2[d];
        s3 += xd * y3[d];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

/* Two rows of x against 4 rows of y: 8 accumulators, each y row loaded once for both. */
static inline void OPS(dot2x4)(const float *x0, const float *x1, const KV_T *y, int64_t stride, int64_t n,
                          float *out0, float *out1) {
    const KV_T *y0 = y, *y1 = y + stride, *y2 = y + 2 * stride, *y3 = y + 3 * stride;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float u = x0[d], w = x1[d];
        a0 += u * y0[d]; a1 += u * y1[d]; a2 += u * y2[d]; a3 += u * y3[d];
        b0 += w * y0[d]; b1 += w * y1[d]; b2 += w * y2[d]; b3 += w * y3[d];
    }
    out0[0] = a0; out0[1] = a1; out0[2] = a2; out0[3] = a3;
    out1[0] = b0; out1[1] = b1; out1[2] = b2; out1[3] = b3;
}

/* Raw scores of rows q[0..R) against the chunk's n keys (`row` elements apart) into s. Keys a row
 * must not see (causal within a prefill tile, sliding window) are still written K rows of this
 * sequence, so scoring them is harmless; they get p = 0 later (no infinities: built with -ffast-math). */
static void OPS(score)(const float *const *q, int64_t R, const KV_T *k, int64_t row, int64_t D, int64_t n,
                       float (*s)[MAX_KEYS]) {
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) OPS(dot2x4)(q[r], q[r + 1], k + j * row, row, D, s[r] + j, s[r + 1] + j);
        for (; j < n; j++) {
            s[r][j] = OPS(dot)(q[r], k + j * row, D);
            s[r + 1][j] = OPS(dot)(q[r + 1], k + j * row, D);
        }
    }
    for (; r < R; r++) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) OPS(dot4)(q[r], k + j * row, row, D, s[r] + j);
        for (; j < n; j++) s[r][j] = OPS(dot)(q[r], k + j * row, D);
    }
}

/* acc[r] += sum_j p[r][j] * v_j, four keys at a time (keys with p = 0 skipped). */
static void OPS(accumulate)(int64_t R, float (*s)[MAX_KEYS], const KV_T *v, int64_t row, int64_t D, int64_t n,
                            float (*acc)[MAX_HEAD_DIM]) {
    for (int64_t r = 0; r < R; r++) {
        const float *p = s[r];
        float *out = acc[r];
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            if (p[j] == 0.0f && p[j + 1] == 0.0f && p[j + 2] == 0.0f && p[j + 3] == 0.0f) continue;
            const KV_T *v0 = v + j * row, *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
            for (int64_t d = 0; d < D; d++)
                out[d] += p[j] * v0[d] + p[j + 1] * v1[d] + p[j + 2] * v2[d] + p[j + 3] * v3[d];
        }
        for (; j < n; j++) {
            if (p[j] == 0.0f) continue;
            const KV_T *vj = v + j * row;
            for (int64_t d = 0; d < D; d++) out[d] += p[j] * vj[d];
        }
    }
}

#endif /* KV_SIMD_ONLY */

#if KV_SIMD
#ifndef UNROLL /* the loops over rows (RB), keys of a pair etc. have constant trip counts once inlined:
                * unrolled, their vectors are registers rather than stack arrays */
#define UNROLL _Pragma("GCC unroll 16")
#endif
/*
 * AVX-512 versions (head_dim a multiple of 16; the caller checks). LOAD16(p) reads 16 elements of
 * the row type as floats (int8: sign-extend + convert; fp8: bits -> fp16 -> float, x 2^-8). Each
 * key row is loaded and converted once per group of up to 4 query rows (a GQA group of a decode is
 * one group), instead of once per row or row pair as above.
 */

/* Rows q[0..RB) against keys k[0..16) of the chunk (`n` valid; the others repeat the last valid
 * key, their lanes are masked later): s[r][j0 + i] = q[r] . key i. Per key and row the 16-lane
 * products stay a vector; the 16 keys' vectors are then summed in one transposing tree (15 adds,
 * 30 shuffles per row) instead of 16 separate horizontal sums. */
static inline __attribute__((always_inline)) void OPS(score16)(const float *const *q, const int RB, const KV_T *k,
                                                                int64_t row, const int64_t nd, int64_t n, int64_t j0,
                                                                float (*s)[MAX_KEYS]) {
    __m512 l3[4][2];
    UNROLL
    for (int half = 0; half < 2; half++) {
        __m512 l2[4][2];
        UNROLL
        for (int quad = 0; quad < 2; quad++) {
            __m512 l1[4][2];
            UNROLL
            for (int pair = 0; pair < 2; pair++) {
                __m512 p[4][2];
                UNROLL
                for (int e = 0; e < 2; e++) {
                    int64_t key = j0 + half * 8 + quad * 4 + pair * 2 + e;
                    const KV_T *kr = k + (key < n ? key : n - 1) * row;
                    UNROLL
                    for (int r = 0; r < RB; r++) p[r][e] = _mm512_setzero_ps();
                    UNROLL
                    for (int64_t dv = 0; dv < nd; dv++) {
                        const __m512 kv = LOAD16(kr + 16 * dv);
                        UNROLL
                        for (int r = 0; r < RB; r++) p[r][e] = _mm512_fmadd_ps(_mm512_loadu_ps(q[r] + 16 * dv), kv, p[r][e]);
                    }
                }
                UNROLL
                for (int r = 0; r < RB; r++) l1[r][pair] = sum_pairs_256(p[r][0], p[r][1]);
            }
            UNROLL
            for (int r = 0; r < RB; r++) l2[r][quad] = sum_pairs_128(l1[r][0], l1[r][1]);
        }
        UNROLL
        for (int r = 0; r < RB; r++) l3[r][half] = sum_pairs_64(l2[r][0], l2[r][1]);
    }
    UNROLL
    for (int r = 0; r < RB; r++) _mm512_storeu_ps(s[r] + j0, sum_pairs_last(l3[r][0], l3[r][1]));
}

static void OPS(score_simd)(const float *const *q, int64_t R, const KV_T *k, int64_t row, int64_t D, int64_t n,
                            float (*s)[MAX_KEYS]) {
    const int64_t nd = D / 16;
    for (int64_t r = 0; r < R; r += 4) {
        const int64_t rows = R - r < 4 ? R - r : 4;
        for (int64_t j = 0; j < n; j += 16) {
            /* constant row counts (and head_dim 64: SmolLM2, Llama-3.2-1B): the accumulators stay in
             * registers, the loops unroll */
#define SCORE_CASES(ND)                                                   \
    switch (rows) {                                                       \
    case 1: OPS(score16)(q + r, 1, k, row, ND, n, j, s + r); break;       \
    case 2: OPS(score16)(q + r, 2, k, row, ND, n, j, s + r); break;       \
    case 3: OPS(score16)(q + r, 3, k, row, ND, n, j, s + r); break;       \
    default: OPS(score16)(q + r, 4, k, row, ND, n, j, s + r); break;      \
    }
            if (nd == 4) SCORE_CASES(4)
            else SCORE_CASES(nd)
#undef SCORE_CASES
        }
    }
}

/* acc[r][d0 .. d0 + 16W) += sum_{j in [j0, j1)} p[r][j] * v_j for RB rows: each 16 values of a V row
 * are converted once for all RB rows; RB x W independent FMA chains. */
static inline __attribute__((always_inline)) void OPS(accumulate16)(float (*p)[MAX_KEYS], const int RB, const KV_T *v,
                                                                     int64_t row, int64_t j0, int64_t j1,
                                                                     float (*acc)[MAX_HEAD_DIM], int64_t d0, const int W) {
    __m512 a[4][4];
    UNROLL
    for (int r = 0; r < RB; r++) {
        UNROLL
        for (int w = 0; w < W; w++) a[r][w] = _mm512_loadu_ps(acc[r] + d0 + 16 * w);
    }
    for (int64_t j = j0; j < j1; j++) {
        const KV_T *vr = v + j * row + d0;
        __m512 pj[4];
        UNROLL
        for (int r = 0; r < RB; r++) pj[r] = _mm512_set1_ps(p[r][j]);
        UNROLL
        for (int w = 0; w < W; w++) {
            const __m512 vv = LOAD16(vr + 16 * w);
            UNROLL
            for (int r = 0; r < RB; r++) a[r][w] = _mm512_fmadd_ps(pj[r], vv, a[r][w]);
        }
    }
    UNROLL
    for (int r = 0; r < RB; r++) {
        UNROLL
        for (int w = 0; w < W; w++) _mm512_storeu_ps(acc[r] + d0 + 16 * w, a[r][w]);
    }
}

/* acc[r] += p[r] . V over the keys [jlo, jhi) any row of r's group of 4 sees (p is 0 outside each
 * row's own keys). */
static void OPS(accumulate_simd)(int64_t R, float (*s)[MAX_KEYS], const KV_T *v, int64_t row, int64_t D,
                                 const int64_t *jlo, const int64_t *jhi, float (*acc)[MAX_HEAD_DIM]) {
    for (int64_t r = 0; r < R; r += 4) {
        const int64_t rows = R - r < 4 ? R - r : 4, j0 = jlo[r / 4], j1 = jhi[r / 4];
        if (j0 >= j1) continue;
        for (int64_t d0 = 0; d0 < D;) {
            const int W = D - d0 >= 64 ? 4 : 1;
#define ACC_CASE(RB, WW) OPS(accumulate16)(s + r, RB, v, row, j0, j1, acc + r, d0, WW)
            if (W == 4) {
                switch (rows) {
                case 1: ACC_CASE(1, 4); break;
                case 2: ACC_CASE(2, 4); break;
                case 3: ACC_CASE(3, 4); break;
                default: ACC_CASE(4, 4); break;
                }
            } else {
                switch (rows) {
                case 1: ACC_CASE(1, 1); break;
                case 2: ACC_CASE(2, 1); break;
                case 3: ACC_CASE(3, 1); break;
                default: ACC_CASE(4, 1); break;
                }
            }
#undef ACC_CASE
            d0 += 16 * W;
        }
    }
}
#endif /* KV_SIMD */
