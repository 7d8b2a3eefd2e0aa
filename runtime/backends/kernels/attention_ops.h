/*
 * The inner loops of paged_attention.c, for one element type of the K/V rows they read: included
 * once per type with KV_T (float or int8_t) and OPS(name) (the type's function names) defined.
 * Loads convert to float in the loop (int8: one byte per element read from memory).
 */

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
