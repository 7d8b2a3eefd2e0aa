/*
 * Multi-LoRA on the CPU (executors/lora/slots.py): each row's low-rank update from its own adapter, in one call
 * per projection and layer for a whole step (Punica's SGMV; the numpy form made ~1,000 small calls a step).
 *
 * For a fused projection (q|k|v, gate|up, or a single one), slot s holds A_s [in, R_s] (its modules' A matrices
 * side by side) and up to LORA_MODULES blocks B_sm [r_m, w_m] (scaled), block m covering columns c_m .. c_m + w_m
 * of the output and rows of A_s after the earlier blocks'. Row t with slot s = slots[t] gets
 * out[t, c_m + j] = sum_r (x_t @ A_s)[r_m0 + r] B_sm[r, j], zero elsewhere; a slot of rank 0 (no update here)
 * or -1 gives a zero row. With `out_rows`, the update is added to row out_rows[t] of `out` instead (the
 * projection's own output, or the residual stream: no delta array, no scatter-add after the call). B is not padded to the fused width: q|k|v's blocks are a third of a padded B_cat.
 * x_t is row rows[t] of `x` (the step's activations, read in place), RMS-normalized with `norm` first when one is
 * given (the projection's input is RMSNorm(hidden): the CPU backends keep hidden, not their quantized or fused
 * normalized rows).
 *
 * A decode step is bound by the bytes it reads (~21 ms for SmolLM2's int8 weights here), and adapters add theirs:
 * each slot's A and B are read once per LORA_TILE rows of that slot (rows are taken slot by slot: a prefill
 * chunk's run together), not once a row, and may be stored as float16 (`half`: half the bytes; accumulation stays
 * float32). A decode step has few rows per slot: their tiles keep several vectors of each row in registers, so
 * the multiply-adds do not wait on each other (a 16-row step over 8 adapters: 2.7 ms more than the base model,
 * 9.1 with one vector a row and the updates scattered from a delta array). Tiles go to OpenMP threads (their
 * rows are disjoint) when the step is big enough to pay for waking them.
 */
#ifndef TRTSERVE_LORA_OPS_H
#define TRTSERVE_LORA_OPS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

#define LORA_MAX_RANK 1024 /* a fused group's summed rank: 3 x 64 for q|k|v at the default limit */
#define LORA_MAX_IN 16384  /* the widest projection input (an intermediate size) */
#define LORA_MODULES 3     /* blocks per fused projection: q, k, v */
#define LORA_TILE 16       /* rows of one slot sharing each read of its matrices: 16 accumulators + 1 weight vector fit
                              AVX-512's 32 registers */

typedef struct {
    const int64_t *a_ptrs, *ranks;                       /* [S] */
    const int64_t *b_ptrs, *b_ranks, *b_cols, *b_widths; /* [S, LORA_MODULES] */
    int half;                                            /* matrices stored as float16 */
} LoraTable;

static inline float lora_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man x 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __mmask16 lora_mask(int64_t i, int64_t n) {
    return n - i >= 16 ? (__mmask16)0xffff : n <= i ? (__mmask16)0 : (__mmask16)((1u << (n - i)) - 1);
}

/* 16 weights from w + i (float32 or float16), the columns past n zero (none read) */
static inline __m512 lora_load16(const void *w, int64_t i, int64_t n, int half) {
    const __mmask16 m = lora_mask(i, n);
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* Rows idx[0..count) of the output, all of slot s; xs: their inputs [count, in]. Inlined with `count` a constant
 * (lora_tile's switch), so the count x NV accumulators stay in registers: NV vectors of 16 columns per row at a
 * time (4 for up to 4 rows, whose chains of dependent multiply-adds would otherwise leave the FMA units idle). The
 * shrink reads each of A's rows once per NV vectors for every row of the tile, the expand each of B's. */
static inline __attribute__((always_inline)) void lora_tile_rows(const float *xs, int64_t in, const LoraTable *t,
                                                                 int64_t s, const int64_t *idx, const int count,
                                                                 float *out, const int64_t *out_rows, int64_t width) {
    enum { NV_MAX = 4 };
    const int nv = count <= 4 ? 4 : count <= 8 ? 2 : 1;
    static __thread float tmp[LORA_TILE][LORA_MAX_RANK]; /* 64 KiB: off the (OpenMP workers') stacks */
    const int64_t rank = t->ranks[s], elem = t->half ? 2 : 4;
    const char *a = (const char *)(intptr_t)t->a_ptrs[s];
    for (int64_t c = 0; c < rank; c += 16 * nv) {
        __m512 acc[LORA_TILE][NV_MAX];
        for (int j = 0; j < count; j++)
            for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
        for (int64_t i = 0; i < in; i++) {
            __m512 w[NV_MAX];
            for (int v = 0; v < nv; v++) w[v] = lora_load16(a + i * rank * elem, c + 16 * v, rank, t->half);
            for (int j = 0; j < count; j++) {
                const __m512 xj = _mm512_set1_ps(xs[j * in + i]);
                for (int v = 0; v < nv; v++) acc[j][v] = _mm512_fmadd_ps(xj, w[v], acc[j][v]);
            }
        }
        for (int j = 0; j < count; j++)
            for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(tmp[j] + c + 16 * v, lora_mask(c + 16 * v, rank), acc[j][v]);
    }
    int64_t first = 0; /* the block's first row of A (and of tmp) */
    for (int m = 0; m < LORA_MODULES; m++) {
        const int64_t k = s * LORA_MODULES + m, rm = t->b_ranks[k], col = t->b_cols[k], w = t->b_widths[k];
        if (rm == 0) continue;
        const char *b = (const char *)(intptr_t)t->b_ptrs[k];
        for (int64_t c = 0; c < w; c += 16 * nv) {
            __m512 acc[LORA_TILE][NV_MAX];
            for (int j = 0; j < count; j++)
                for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
            for (int64_t r = 0; r < rm; r++) {
                __m512 bv[NV_MAX];
                for (int v = 0; v < nv; v++) bv[v] = lora_load16(b + r * w * elem, c + 16 * v, w, t->half);
                for (int j = 0; j < count; j++) {
                    const __m512 h = _mm512_set1_ps(tmp[j][first + r]);
                    for (int v = 0; v < nv; v++) acc[j][v] = _mm512_fmadd_ps(h, bv[v], acc[j][v]);
                }
            }
            for (int j = 0; j < count; j++) {
                float *dst = out + (out_rows ? out_rows[idx[j]] : idx[j]) * width + col + c;
                for (int v = 0; v < nv; v++) {
                    const __mmask16 mask = lora_mask(c + 16 * v, w);
                    __m512 sum = acc[j][v];
                    if (out_rows) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, dst + 16 * v));
                    _mm512_mask_storeu_ps(dst + 16 * v, mask, sum);
                }
            }
        }
        first += rm;
    }
}

static void lora_tile(const float *xs, int64_t in, const LoraTable *t, int64_t s, const int64_t *idx, int count,
                      float *out, const int64_t *out_rows, int64_t width) {
    switch (count) {
#define LORA_TILE_OF(n)                                                                                               \
    case n:                                                                                                           \
        lora_tile_rows(xs, in, t, s, idx, n, out, out_rows, width);                                                   \
        break;
        LORA_TILE_OF(1) LORA_TILE_OF(2) LORA_TILE_OF(3) LORA_TILE_OF(4) LORA_TILE_OF(5) LORA_TILE_OF(6)
        LORA_TILE_OF(7) LORA_TILE_OF(8) LORA_TILE_OF(9) LORA_TILE_OF(10) LORA_TILE_OF(11) LORA_TILE_OF(12)
        LORA_TILE_OF(13) LORA_TILE_OF(14) LORA_TILE_OF(15) LORA_TILE_OF(16)
#undef LORA_TILE_OF
    }
}
#else /* without AVX-512 (BW, VL) */
static inline float lora_weight(const void *w, int64_t i, int half) {
    return half ? lora_half_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* The portable loops: the same sums, row by row of A and B. */
static void lora_tile(const float *xs, int64_t in, const LoraTable *t, int64_t s, const int64_t *idx, int count,
                      float *out, const int64_t *out_rows, int64_t width) {
    float tmp[LORA_TILE][LORA_MAX_RANK];
    const int64_t rank = t->ranks[s], elem = t->half ? 2 : 4;
    const char *a = (const char *)(intptr_t)t->a_ptrs[s];
    for (int j = 0; j < count; j++) memset(tmp[j], 0, (size_t)rank * sizeof(float));
    for (int64_t i = 0; i < in; i++)
        for (int j = 0; j < count; j++)
            for (int64_t r = 0; r < rank; r++) tmp[j][r] += xs[j * in + i] * lora_weight(a + i * rank * elem, r, t->half);
    int64_t first = 0;
    for (int m = 0; m < LORA_MODULES; m++) {
        const int64_t k = s * LORA_MODULES + m, rm = t->b_ranks[k], col = t->b_cols[k], w = t->b_widths[k];
        if (rm == 0) continue;
        const char *b = (const char *)(intptr_t)t->b_ptrs[k];
        for (int64_t r = 0; r < rm; r++)
            for (int j = 0; j < count; j++)
                for (int64_t q = 0; q < w; q++)
                    out[(out_rows ? out_rows[idx[j]] : idx[j]) * width + col + q] += tmp[j][first + r] * lora_weight(b + r * w * elem, q, t->half);
        first += rm;
    }
}
#endif

/* Row x[row] into dst, RMS-normalized and scaled by norm[] when norm is given (HF's RMSNorm, in float32). */
static void lora_input(const float *x, int64_t stride, int64_t row, int64_t in, const float *norm, float eps,
                       float *dst) {
    const float *src = x + row * stride;
    if (!norm) {
        memcpy(dst, src, (size_t)in * sizeof(float));
        return;
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < in; i++) sum += src[i] * src[i];
    const float scale = 1.0f / sqrtf(sum / (float)in + eps);
    for (int64_t i = 0; i < in; i++) dst[i] = src[i] * scale * norm[i];
}

/* A tile of work: up to LORA_TILE rows (indices into the call's rows) of one slot. */
typedef struct {
    int64_t slot;
    int count;
    int64_t idx[LORA_TILE];
} LoraWork;

/* The call's rows in tiles, slot by slot (row order within a slot); how many tiles. `tiles` holds n at least. */
static int64_t lora_plan(const int32_t *slots, int64_t n, int64_t num_slots, const LoraTable *t, LoraWork *tiles) {
    int64_t ntiles = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        if (t->ranks[s] == 0) continue;
        LoraWork *tile = NULL;
        for (int64_t row = 0; row < n; row++) {
            if (slots[row] != s) continue;
            if (!tile || tile->count == LORA_TILE) {
                tile = &tiles[ntiles++];
                tile->slot = s;
                tile->count = 0;
            }
            tile->idx[tile->count++] = row;
        }
    }
    return ntiles;
}

/* 0, or -1 when memory ran out. Tiles go to the OpenMP threads (a prefill chunk of one adapter is several). */
static int lora_sgmv_rows(const float *x, int64_t stride, const int64_t *rows, int64_t n, int64_t in,
                          const int32_t *slots, const float *norm, float eps, int64_t num_slots, const LoraTable *t,
                          float *out, const int64_t *out_rows, int64_t width, int threads) {
    if (!out_rows) memset(out, 0, (size_t)(n * width) * sizeof(float));
    LoraWork *tiles = malloc(sizeof(LoraWork) * (size_t)(n > 0 ? n : 1));
    if (!tiles) return -1;
    const int64_t ntiles = lora_plan(slots, n, num_slots, t, tiles);
    int failed = 0;
    /* ~64K multiply-adds a row: below ~8 rows one thread does it faster than waking the others */
#pragma omp parallel num_threads(threads) if (n >= 8 && ntiles > 1 && threads > 1)
    {
        float *xs = malloc((size_t)(LORA_TILE * in) * sizeof(float));
        if (!xs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t k = 0; k < ntiles; k++) {
            if (!xs) continue;
            const LoraWork *tile = &tiles[k];
            for (int j = 0; j < tile->count; j++) lora_input(x, stride, rows[tile->idx[j]], in, norm, eps, xs + j * in);
            lora_tile(xs, in, t, tile->slot, tile->idx, tile->count, out, out_rows, width);
        }
        free(xs);
    }
    free(tiles);
    return failed ? -1 : 0;
}

static PyObject *lora_sgmv(PyObject *self, PyObject *args) {
    Py_buffer x, rows, slots, norm, a_ptrs, ranks, b_ptrs, b_ranks, b_cols, b_widths, out, out_rows;
    int64_t stride, in, width;
    float eps;
    int threads, half;
    if (!PyArg_ParseTuple(args, "y*LLy*y*y*fy*y*y*y*y*y*w*y*Lii", &x, &stride, &in, &rows, &slots, &norm, &eps,
                          &a_ptrs, &ranks, &b_ptrs, &b_ranks, &b_cols, &b_widths, &out, &out_rows, &width, &threads,
                          &half))
        return NULL;
    const int64_t n = rows.len / 8, num_slots = ranks.len / 8, blocks = num_slots * LORA_MODULES;
    const int64_t x_rows = stride > 0 ? x.len / 4 / stride : 0;
    const LoraTable t = {a_ptrs.buf, ranks.buf, b_ptrs.buf, b_ranks.buf, b_cols.buf, b_widths.buf, half};
    int bad = in <= 0 || in > LORA_MAX_IN || stride < in || width <= 0 || slots.len != n * 4 ||
              (out_rows.len ? out_rows.len != n * 8 : out.len < n * width * 4) || (norm.len && norm.len != in * 4) || a_ptrs.len != ranks.len ||
              b_ptrs.len != blocks * 8 || b_ranks.len != blocks * 8 || b_cols.len != blocks * 8 ||
              b_widths.len != blocks * 8;
    const int64_t out_len = width > 0 ? out.len / 4 / width : 0;
    for (int64_t i = 0; !bad && i < n; i++) bad = ((const int64_t *)rows.buf)[i] < 0 || ((const int64_t *)rows.buf)[i] >= x_rows;
    for (int64_t i = 0; !bad && i < n && out_rows.len; i++)
        bad = ((const int64_t *)out_rows.buf)[i] < 0 || ((const int64_t *)out_rows.buf)[i] >= out_len;
    for (int64_t s = 0; !bad && s < num_slots; s++) {
        int64_t sum = 0;
        for (int m = 0; m < LORA_MODULES; m++) {
            const int64_t k = s * LORA_MODULES + m;
            sum += t.b_ranks[k];
            bad |= t.b_ranks[k] < 0 || (t.b_ranks[k] && (!t.b_ptrs[k] || t.b_cols[k] < 0 || t.b_widths[k] <= 0 ||
                                                         t.b_cols[k] + t.b_widths[k] > width));
        }
        bad |= t.ranks[s] < 0 || t.ranks[s] > LORA_MAX_RANK || sum != t.ranks[s] || (t.ranks[s] && !t.a_ptrs[s]);
    }
    int oom = 0;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        oom = lora_sgmv_rows(x.buf, stride, rows.buf, n, in, slots.buf, norm.len ? norm.buf : NULL, eps, num_slots,
                             &t, out.buf, out_rows.len ? out_rows.buf : NULL, width, threads) != 0;
        Py_END_ALLOW_THREADS
    }
    Py_buffer *views[] = {&x, &rows, &slots, &norm, &a_ptrs, &ranks, &b_ptrs, &b_ranks, &b_cols, &b_widths, &out,
                          &out_rows};
    for (size_t i = 0; i < sizeof views / sizeof *views; i++) PyBuffer_Release(views[i]);
    if (oom) return PyErr_NoMemory();
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "lora_sgmv: rows within x (and out_rows within out) and buffers that fit the shapes; ranks 0-1024, each the sum of "
                        "its blocks', blocks within the width, with their pointers");
        return NULL;
    }
    Py_RETURN_NONE;
}

#endif
