/*
 * attend_tile on AMX for int8 pools (head_dim 64, block_size a multiple of 16, at most 16 query rows
 * a tile), included by paged_attention.c.
 *
 * The vector loops pay ~7 core-ns per (query row, key): a verify step's 4-token tiles (12 rows a kv
 * head) made a saturated step's attention 2.3x a decode step's. Here most of a key's cost is the same
 * for 1 row or 16: scores and p.V are int8 tile products (TDPBSSD) with exact int32 sums, and the
 * softmax runs with the tile's rows in the vector lanes, one vector per key.
 *  - The query is split per row into two int8 parts, q = s (hi + lo / 254), s = max|q| / 127: ~16 bits
 *    (|error| <= max|q| / 64516). The keys are the pool's codes, read in place as the A tile, so the
 *    scores come out keys x rows.
 *  - p x the value's row scale is split the same way per row and 64-key chunk, transposed to rows x
 *    keys, and multiplies the values interleaved four keys at a time (the B tile's layout).
 * Integer products are exact and every row takes the same path, so a row's result does not depend on
 * which rows share its tile, the work split or the threads: a verify row computes what a decode row does.
 *
 * Tiles (all 16 rows x 64 bytes): 1-2 the query hi/lo (B); scores of even 16-key groups from A 0 into
 * 3-4, odd ones from A 7 into 5-6; then p hi/lo (A) in 5-6 and values (B) in 0 / 7, products into
 * 3-4 / 1-2 (the query is reloaded for the next chunk).
 */
#if KV_SIMD && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16  /* query rows of a tile (tokens x the query heads of one kv head) */
#define AMX_CHUNK 64 /* keys per chunk: one p.V product (the A tile's 64 bytes of p) */
#define ARCH_REQ_XCOMP_PERM 0x1023
__m512 _ZGVeN16v_expf(__m512); /* glibc's libmvec: the 16-lane expf the vector loops' `omp simd` calls */
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use the tiles (Linux asks each process to request the state once). */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return usable;
}

static void amx_configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* Tiles C_HI = A_HI x B_HI and C_LO = A_LO x B_LO (int8 products, int32 sums), stored 64 bytes a row to
 * DST_HI / DST_LO. A macro: tile numbers must be immediates. */
#define HI_LO_PRODUCTS(C_HI, C_LO, A_HI, B_HI, A_LO, B_LO, DST_HI, DST_LO) \
    do {                                                                 \
        _tile_zero(C_HI);                                                \
        _tile_zero(C_LO);                                                \
        _tile_dpbssd(C_HI, A_HI, B_HI);                                  \
        _tile_dpbssd(C_LO, A_LO, B_LO);                                  \
        _tile_stored(C_HI, DST_HI, 64);                                  \
        _tile_stored(C_LO, DST_LO, 64);                                  \
    } while (0)

/* out[L] = [x0.L, x1.L, x2.L, x3.L]: a 4 x 4 transpose of 128-bit lanes. */
static inline void transpose_lanes(const __m512i x[4], __m512i out[4]) {
    const __m512i y0 = _mm512_shuffle_i32x4(x[0], x[1], 0x44), y1 = _mm512_shuffle_i32x4(x[2], x[3], 0x44);
    const __m512i y2 = _mm512_shuffle_i32x4(x[0], x[1], 0xEE), y3 = _mm512_shuffle_i32x4(x[2], x[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(y0, y1, 0x88);
    out[1] = _mm512_shuffle_i32x4(y0, y1, 0xDD);
    out[2] = _mm512_shuffle_i32x4(y2, y3, 0x88);
    out[3] = _mm512_shuffle_i32x4(y2, y3, 0xDD);
}

/* dst[i] = dword i of src rows 0..15 (rows `stride` bytes apart): a 16 x 16 dword transpose. */
static inline void transpose_dwords(const void *src, int64_t stride, int8_t dst[16][64]) {
    __m512i r[16], t[16];
    for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512((const char *)src + n * stride);
    for (int n = 0; n < 16; n += 2) {
        t[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
        t[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
    }
    for (int n = 0; n < 16; n += 4) { /* r[n + c], lane L: dword 4L + c of rows n..n+3 */
        r[n] = _mm512_unpacklo_epi64(t[n], t[n + 2]);
        r[n + 1] = _mm512_unpackhi_epi64(t[n], t[n + 2]);
        r[n + 2] = _mm512_unpacklo_epi64(t[n + 1], t[n + 3]);
        r[n + 3] = _mm512_unpackhi_epi64(t[n + 1], t[n + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x[4] = {r[c], r[4 + c], r[8 + c], r[12 + c]};
        __m512i out[4];
        transpose_lanes(x, out);
        for (int L = 0; L < 4; L++) _mm512_storeu_si512(dst[4 * L + c], out[L]);
    }
}

/* Byte i of the four 64-byte rows side by side: [r0[i], r1[i], r2[i], r3[i]] for each i, in 128-bit
 * lane order: lane L of x[w] holds bytes 16L + 4w .. 16L + 4w + 3 of each row. */
static inline void interleave4(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i x[4]) {
    const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
    const __m512i c = _mm512_unpacklo_epi8(r2, r3), e = _mm512_unpackhi_epi8(r2, r3);
    x[0] = _mm512_unpacklo_epi16(a, c);
    x[1] = _mm512_unpackhi_epi16(a, c);
    x[2] = _mm512_unpacklo_epi16(b, e);
    x[3] = _mm512_unpackhi_epi16(b, e);
}

/* Keys 4i..4i+3's 64 values (rows `stride` bytes apart) as row i of the four B tiles of p.V (one per
 * 16 values): value d of the four keys side by side. */
static inline void values_as_b(const int8_t *v, int64_t stride, int64_t i, int8_t dst[4][16][64]) {
    __m512i x[4], out[4];
    interleave4(_mm512_loadu_si512(v), _mm512_loadu_si512(v + stride), _mm512_loadu_si512(v + 2 * stride),
                _mm512_loadu_si512(v + 3 * stride), x);
    transpose_lanes(x, out);
    for (int s = 0; s < 4; s++) _mm512_storeu_si512(dst[s][i], out[s]);
}

/* p^T [64 keys][16 rows] int8 -> p [16 rows][64 keys] (the A tile of p.V): four keys' bytes side by side
 * per row (a dword), then a dword transpose. */
static inline void rows_of_keys(const int8_t pt[AMX_CHUNK][16], int8_t dst[16][64]) {
    int8_t quads[16][64]; /* quads[i]: dword n = row n's keys 4i..4i+3 */
    for (int i = 0; i < 16; i++) {
        const __m128i k0 = _mm_loadu_si128((const __m128i *)pt[4 * i]), k1 = _mm_loadu_si128((const __m128i *)pt[4 * i + 1]);
        const __m128i k2 = _mm_loadu_si128((const __m128i *)pt[4 * i + 2]), k3 = _mm_loadu_si128((const __m128i *)pt[4 * i + 3]);
        const __m128i a = _mm_unpacklo_epi8(k0, k1), b = _mm_unpackhi_epi8(k0, k1);
        const __m128i c = _mm_unpacklo_epi8(k2, k3), e = _mm_unpackhi_epi8(k2, k3);
        _mm_storeu_si128((__m128i *)&quads[i][0], _mm_unpacklo_epi16(a, c));
        _mm_storeu_si128((__m128i *)&quads[i][16], _mm_unpackhi_epi16(a, c));
        _mm_storeu_si128((__m128i *)&quads[i][32], _mm_unpacklo_epi16(b, e));
        _mm_storeu_si128((__m128i *)&quads[i][48], _mm_unpackhi_epi16(b, e));
    }
    transpose_dwords(quads, 64, dst);
}

/* attend_tile (paged_attention.c) for an int8 pool on AMX; the caller checks amx_fits. */
static void attend_tile_amx(const Args *a, int64_t t0, int64_t nt, int64_t g, int prefetch) {
    const int64_t G = a->Hq / a->Hkv, D = 64, bs = a->bs, R = nt * G, row = a->Hkv * D;
    const int64_t *table = a->block_tables + a->seq_of_token[t0] * a->M;
    const int8_t *k_pool = (const int8_t *)a->k_cache + g * D, *v_pool = (const int8_t *)a->v_cache + g * D;
    int8_t q_rows[2][16][64], q_t[2][16][64], p_rows[2][16][64], values[4][16][64];
    int8_t pt[2][AMX_CHUNK][16];                         /* p hi / lo, keys x rows */
    int32_t s_t[2][AMX_CHUNK][16], o[2][16][16];          /* scores (keys x rows), p.V of 16 values */
    float score[AMX_CHUNK][16], kmul[AMX_CHUNK], vmul[AMX_CHUNK], acc[16][64];
    float q_scale[16], m[16], l[16], rescale[16], p_scale[16];
    int32_t lo[16], hi[16];
    memset(q_rows, 0, sizeof q_rows);
    memset(acc, 0, sizeof acc);
    for (int64_t r = 0; r < 16; r++) {
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
        q_scale[r] = 0.0f;
        lo[r] = 1;  /* rows past R see no key */
        hi[r] = 0;
    }
    for (int64_t r = 0; r < R; r++) { /* q = s (hi + lo / 254), split per row */
        const int64_t t = t0 + r / G, h = g * G + r % G;
        const float *q = a->q + t * a->Hq * D + h * D;
        float amax = 0.0f;
        for (int64_t d = 0; d < D; d++) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float y = q[d] * inv, yh = nearbyintf(y);
            q_rows[0][r][d] = (int8_t)yh;
            q_rows[1][r][d] = (int8_t)nearbyintf((y - yh) * 254.0f);
        }
        q_scale[r] = amax / 127.0f * a->scale;
        hi[r] = (int32_t)a->positions[t];
        lo[r] = (int32_t)first_key(a, hi[r]);
    }
    transpose_dwords(q_rows[0], 64, q_t[0]); /* B tiles: dword i of every row */
    transpose_dwords(q_rows[1], 64, q_t[1]);
    amx_configure();
    const int64_t last = a->positions[t0 + nt - 1];
    for (int64_t c0 = first_key(a, a->positions[t0]) & ~(int64_t)15; c0 <= last; c0 += AMX_CHUNK) {
        /* the chunk's 16-key groups that hold a key <= last (each within one block: bs % 16 == 0) */
        const int64_t groups = (last - c0) / 16 + 1 < AMX_CHUNK / 16 ? (last - c0) / 16 + 1 : AMX_CHUNK / 16;
        const int64_t keys = 16 * groups;
        _tile_loadd(1, q_t[0], 64);
        _tile_loadd(2, q_t[1], 64);
        for (int64_t grp = 0; grp < groups; grp++) {
            const int64_t pos = c0 + 16 * grp, slot = table[pos / bs] * bs + pos % bs;
            if (prefetch && pos % bs == 0 && pos + bs <= last) prefetch_rows(a, table[pos / bs + 1] * bs, 1);
            const int8_t *k = k_pool + slot * row;
            if (grp % 2 == 0) {
                _tile_loadd(0, k, row);
                HI_LO_PRODUCTS(3, 4, 0, 1, 0, 2, s_t[0][16 * grp], s_t[1][16 * grp]);
            } else {
                _tile_loadd(7, k, row);
                HI_LO_PRODUCTS(5, 6, 7, 1, 7, 2, s_t[0][16 * grp], s_t[1][16 * grp]);
            }
            for (int64_t i = 0; i < 4; i++) values_as_b(v_pool + (slot + 4 * i) * row, row, 4 * grp + i, values);
            for (int64_t j = 0; j < 16; j++) {
                kmul[16 * grp + j] = a->k_scales[(slot + j) * a->Hkv + g];
                vmul[16 * grp + j] = a->v_scales[(slot + j) * a->Hkv + g];
            }
        }
        /* Online softmax, rows in lanes. Keys a row does not see (outside [lo, hi], past the last key,
         * rows past R) get p = 0 by masks, not by arithmetic: their scales may be stale. */
        const __m512 minus_max = _mm512_set1_ps(-FLT_MAX), inv254 = _mm512_set1_ps(1.0f / 254.0f);
        const __m512 q_scales = _mm512_loadu_ps(q_scale), m_old = _mm512_loadu_ps(m);
        const __m512i lo_v = _mm512_loadu_si512(lo), hi_v = _mm512_loadu_si512(hi);
        __mmask16 seen[AMX_CHUNK];
        __m512 chunk_max = minus_max;
        for (int64_t j = 0; j < keys; j++) {
            const __m512i position = _mm512_set1_epi32((int32_t)(c0 + j));
            seen[j] = _mm512_cmpge_epi32_mask(position, lo_v) & _mm512_cmple_epi32_mask(position, hi_v);
            const __m512 raw = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(s_t[1][j])), inv254,
                                               _mm512_cvtepi32_ps(_mm512_loadu_si512(s_t[0][j])));
            const __m512 s = _mm512_mul_ps(_mm512_mul_ps(raw, q_scales), _mm512_set1_ps(kmul[j]));
            _mm512_storeu_ps(score[j], s);
            chunk_max = _mm512_mask_max_ps(chunk_max, seen[j], chunk_max, s);
        }
        const __m512 new_max = _mm512_max_ps(chunk_max, m_old);
        const __mmask16 had = _mm512_cmp_ps_mask(m_old, minus_max, _CMP_NEQ_OQ); /* rows with keys before */
        _mm512_storeu_ps(rescale, _mm512_maskz_mov_ps(had, _ZGVeN16v_expf(_mm512_maskz_sub_ps(had, m_old, new_max))));
        _mm512_storeu_ps(m, new_max);
        __m512 sum = _mm512_setzero_ps(), w_max = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            /* unseen lanes: exp(0), masked out after (a huge argument would take libmvec's slow path) */
            const __m512 e = _ZGVeN16v_expf(_mm512_maskz_sub_ps(seen[j], _mm512_loadu_ps(score[j]), new_max));
            const __m512 p = _mm512_maskz_mov_ps(seen[j], e);
            sum = _mm512_add_ps(sum, p);
            const __m512 w = _mm512_maskz_mul_ps(seen[j], p, _mm512_set1_ps(vmul[j])); /* p x the value's row scale */
            _mm512_storeu_ps(score[j], w);
            w_max = _mm512_max_ps(w_max, w);
        }
        _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_loadu_ps(rescale), sum));
        _mm512_storeu_ps(p_scale, _mm512_mul_ps(w_max, _mm512_set1_ps(1.0f / 127.0f)));
        const __mmask16 positive = _mm512_cmp_ps_mask(w_max, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 w_inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), w_max);
        for (int64_t j = 0; j < keys; j++) { /* w = p_scale (hi + lo / 254) */
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(score[j]), w_inv);
            const __m512 yh = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 yl = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(y, yh), _mm512_set1_ps(254.0f)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)pt[0][j], _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(yh)));
            _mm_storeu_si128((__m128i *)pt[1][j], _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(yl)));
        }
        if (keys < AMX_CHUNK) { /* past the last key: p is 0, the values only need to be numbers */
            memset(pt[0][keys], 0, (size_t)(AMX_CHUNK - keys) * 16);
            memset(pt[1][keys], 0, (size_t)(AMX_CHUNK - keys) * 16);
            for (int s = 0; s < 4; s++) memset(values[s][keys / 4], 0, (size_t)(AMX_CHUNK - keys) / 4 * 64);
        }
        rows_of_keys((const int8_t(*)[16])pt[0], p_rows[0]);
        rows_of_keys((const int8_t(*)[16])pt[1], p_rows[1]);
        _tile_loadd(5, p_rows[0], 64);
        _tile_loadd(6, p_rows[1], 64);
        for (int s = 0; s < 4; s++) { /* p.V, 16 values at a time */
            if (s % 2 == 0) {
                _tile_loadd(0, values[s], 64);
                HI_LO_PRODUCTS(3, 4, 5, 0, 6, 0, o[0], o[1]);
            } else {
                _tile_loadd(7, values[s], 64);
                HI_LO_PRODUCTS(1, 2, 5, 7, 6, 7, o[0], o[1]);
            }
            for (int64_t r = 0; r < R; r++) {
                const __m512 pv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(o[1][r])),
                                                  _mm512_set1_ps(1.0f / 254.0f),
                                                  _mm512_cvtepi32_ps(_mm512_loadu_si512(o[0][r])));
                float *out = acc[r] + 16 * s;
                _mm512_storeu_ps(out, _mm512_fmadd_ps(pv, _mm512_set1_ps(p_scale[r]),
                                                      _mm512_mul_ps(_mm512_loadu_ps(out), _mm512_set1_ps(rescale[r]))));
            }
        }
    }
    _tile_release();
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = t0 + r / G, h = g * G + r % G;
        float *out = a->out + t * a->Hq * D + h * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) out[d] = acc[r][d] * inv;
    }
}

/* Whether a tile of nt tokens runs on AMX (a->amx: usable and not refused by the caller). A lone token
 * (a decode: 3 of the 16 rows for SmolLM2) costs more here than in the vector loops (0.63 vs 0.45 ms a
 * layer for 32 decodes), so only tiles of several tokens (verify rows, prefill) come here. */
static inline int amx_fits(const Args *a, int64_t nt) {
    return a->amx && nt > 1 && a->kv_kind == KV_INT8 && a->D == 64 && a->bs % 16 == 0 &&
           nt * (a->Hq / a->Hkv) <= AMX_ROWS;
}
#else
#define KV_AMX 0
static inline int amx_usable(void) { return 0; }
static inline int amx_fits(const Args *a, int64_t nt) { return 0; }
static void attend_tile_amx(const Args *a, int64_t t0, int64_t nt, int64_t g, int prefetch) {}
#endif
