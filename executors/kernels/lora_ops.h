/*
 * Multi-LoRA on the CPU (executors/lora/slots.py): each row's low-rank update from its own adapter, in one call
 * per projection and layer for a whole step (Punica's SGMV; the numpy form made ~1,000 small calls a step).
 *
 * For a fused projection (q|k|v, gate|up, or a single one), slot s holds A_s [in, R_s] (its modules' A matrices
 * side by side) and up to LORA_MODULES blocks B_sm [r_m, w_m] (scaled), block m covering columns c_m .. c_m + w_m
 * of the output and rows of A_s after the earlier blocks'. Row t with slot s = slots[t] gets
 * out[t, c_m + j] = sum_r (x_t @ A_s)[r_m0 + r] B_sm[r, j], zero elsewhere; a slot of rank 0 (no update here)
 * or -1 gives a zero row. B is not padded to the fused width: q|k|v's blocks are a third of a padded B_cat.
 * The updates are then added to row out_rows[t] of the output, which may be split by columns into several arrays
 * (`parts`: the `cpu` backend's q, k and v segment outputs), after RoPE at the row's position where the caller
 * asks for it (RoPE is linear: RoPE(q + dq) = RoPE(q) + RoPE(dq)). One call a projection and layer does it all:
 * between the ONNX segments, whose runs evict the caches, each further numpy or C call costs tens of microseconds.
 * x_t is row rows[t] of `x` (the step's activations, read in place), RMS-normalized with `norm` first when one is
 * given (the projection's input is RMSNorm(hidden): the CPU backends keep hidden, not their quantized or fused
 * normalized rows).
 *
 * A decode step is bound by the bytes it reads (~21 ms for SmolLM2's int8 weights here), and adapters add theirs:
 * each slot's A and B are read once per LORA_TILE rows of that slot (rows are taken slot by slot: a prefill
 * chunk's run together), not once a row, and may be stored as float16 (`half`: half the bytes; accumulation stays
 * float32). A decode step has few rows per slot: their tiles keep several vectors of each row in registers, so
 * the multiply-adds do not wait on each other (a 16-row step over 8 adapters: 2.7 ms more than the base model,
 * 9.1 with one vector a row). Tiles go to OpenMP threads (their rows are disjoint) when the step is big enough to
 * pay for waking them. A tile writes its rows' updates to a scratch of its own (rows 0..count), then rotates and
 * adds each to the output.
 */
#ifndef TRTSERVE_LORA_OPS_H
#define TRTSERVE_LORA_OPS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) ||                                    \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
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

/* Rows 0..count) of out [count, width], all of slot s; xs: their inputs [count, in]. Inlined with `count` a constant
 * (lora_tile's switch), so the count x NV accumulators stay in registers: NV vectors of 16 columns per row at a
 * time (4 for up to 4 rows, whose chains of dependent multiply-adds would otherwise leave the FMA units idle). The
 * shrink reads each of A's rows once per NV vectors for every row of the tile, the expand each of B's. */
static inline __attribute__((always_inline)) void lora_tile_rows(const float *xs, int64_t in, const LoraTable *t,
                                                                 int64_t s, const int count,
                                                                 float *out, int64_t width) {
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
                float *dst = out + j * width + col + c;
                for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(dst + 16 * v, lora_mask(c + 16 * v, w), acc[j][v]);
            }
        }
        first += rm;
    }
}

static void lora_tile(const float *xs, int64_t in, const LoraTable *t, int64_t s, int count,
                      float *out, int64_t width) {
    switch (count) {
#define LORA_TILE_OF(n)                                                                                               \
    case n:                                                                                                           \
        lora_tile_rows(xs, in, t, s, n, out, width);                                                                  \
        break;
        LORA_TILE_OF(1) LORA_TILE_OF(2) LORA_TILE_OF(3) LORA_TILE_OF(4) LORA_TILE_OF(5) LORA_TILE_OF(6)
        LORA_TILE_OF(7) LORA_TILE_OF(8) LORA_TILE_OF(9) LORA_TILE_OF(10) LORA_TILE_OF(11) LORA_TILE_OF(12)
        LORA_TILE_OF(13) LORA_TILE_OF(14) LORA_TILE_OF(15) LORA_TILE_OF(16)
#undef LORA_TILE_OF
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2's 16 registers: tiles of at most LORA_ROWS8 rows, each row's NV vectors of 8 columns in registers (its
 * accumulators, plus one broadcast of its input; the weights are read by the multiply-adds themselves). A tile
 * of more rows goes through in groups of LORA_ROWS8, each reading the slot's matrices again (from the L2 cache,
 * where a group's A [in, r] fits). */
#define LORA_ROWS8 4

static inline __m256i lora_mask8(int64_t i, int64_t n) {
    const int64_t k = n - i < 0 ? 0 : n - i > 8 ? 8 : n - i;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 weights from w + i (float32 or float16), the columns past n zero (none read) */
static inline __m256 lora_load8(const void *w, int64_t i, int64_t n, int half) {
    if (n - i >= 8)
        return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)))
                    : _mm256_loadu_ps((const float *)w + i);
    if (!half) return _mm256_maskload_ps((const float *)w + i, lora_mask8(i, n));
    uint16_t part[8] = {0};
    for (int64_t k = 0; k < n - i; k++) part[k] = ((const uint16_t *)w)[i + k];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)part));
}

/* The shrink of rows 0..count) of xs [count, in] by A [in, rank]: columns c .. c + 8 nv of tmp. count and nv are
 * constants once inlined (LORA_COUNT_CASES' switch), so the count x nv accumulators stay in registers. */
static inline __attribute__((always_inline)) void lora_shrink(const float *xs, int64_t in, const char *a, int64_t rank,
                                                              int half, int64_t c, const int count, const int nv,
                                                              float tmp[][LORA_MAX_RANK]) {
    const int64_t elem = half ? 2 : 4;
    __m256 acc[LORA_ROWS8][6];
    for (int j = 0; j < count; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i++) {
        const char *row = a + i * rank * elem;
        for (int v = 0; v < nv; v++) {
            const __m256 w = lora_load8(row, c + 8 * v, rank, half);
            for (int j = 0; j < count; j++)
                acc[j][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + j * in + i), w, acc[j][v]);
        }
    }
    for (int j = 0; j < count; j++)
        for (int v = 0; v < nv; v++) _mm256_maskstore_ps(tmp[j] + c + 8 * v, lora_mask8(c + 8 * v, rank), acc[j][v]);
}

/* The expand of tmp's rows first .. first + rm by B [rm, w] into columns c .. c + 8 nv of the block: rows
 * 0..count) of out [count, width], from column col. */
static inline __attribute__((always_inline)) void lora_expand(float tmp[][LORA_MAX_RANK], int64_t first, const char *b,
                                                              int64_t rm, int64_t w, int half, int64_t c,
                                                              const int count, const int nv, float *out,
                                                              int64_t width, int64_t col) {
    const int64_t elem = half ? 2 : 4;
    __m256 acc[LORA_ROWS8][6];
    for (int j = 0; j < count; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rm; r++) {
        const char *row = b + r * w * elem;
        for (int v = 0; v < nv; v++) {
            const __m256 bv = lora_load8(row, c + 8 * v, w, half);
            for (int j = 0; j < count; j++)
                acc[j][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(tmp[j] + first + r), bv, acc[j][v]);
        }
    }
    for (int j = 0; j < count; j++) {
        float *dst = out + j * width + col + c;
        for (int v = 0; v < nv; v++) _mm256_maskstore_ps(dst + 8 * v, lora_mask8(c + 8 * v, w), acc[j][v]);
    }
}

/* Vectors a row per pass: as many as the row's registers allow (count x nv accumulators and count broadcasts
 * within 16), fewer where the columns left need fewer. */
static inline int lora_vectors(int count, int64_t columns_left) {
    const int most = count <= 2 ? 6 : count == 3 ? 4 : 3;
    const int64_t need = (columns_left + 7) / 8;
    return need < most ? (int)need : most;
}

#define LORA_NV_CASES(call, count)                                                                                    \
    switch (nv) {                                                                                                     \
    case 1: call(count, 1); break;                                                                                    \
    case 2: call(count, 2); break;                                                                                    \
    case 3: call(count, 3); break;                                                                                    \
    case 4: call(count, 4); break;                                                                                    \
    case 5: call(count, 5); break;                                                                                    \
    default: call(count, 6); break;                                                                                   \
    }
#define LORA_COUNT_CASES(call)                                                                                        \
    switch (count) {                                                                                                  \
    case 1: LORA_NV_CASES(call, 1) break;                                                                             \
    case 2: LORA_NV_CASES(call, 2) break;                                                                             \
    case 3: LORA_NV_CASES(call, 3) break;                                                                             \
    default: LORA_NV_CASES(call, 4) break;                                                                            \
    }

/* Rows 0..count) of out [count, width] (count <= LORA_ROWS8), all of slot s; xs: their inputs [count, in]. */
static void lora_tile_rows(const float *xs, int64_t in, const LoraTable *t, int64_t s, int count,
                           float *out, int64_t width) {
    static __thread float tmp[LORA_ROWS8][LORA_MAX_RANK];
    const int64_t rank = t->ranks[s];
    const char *a = (const char *)(intptr_t)t->a_ptrs[s];
    for (int64_t c = 0; c < rank;) {
        const int nv = lora_vectors(count, rank - c);
#define LORA_SHRINK(n, v) lora_shrink(xs, in, a, rank, t->half, c, n, v, tmp)
        LORA_COUNT_CASES(LORA_SHRINK)
#undef LORA_SHRINK
        c += 8 * nv;
    }
    int64_t first = 0; /* the block's first row of A (and of tmp) */
    for (int m = 0; m < LORA_MODULES; m++) {
        const int64_t k = s * LORA_MODULES + m, rm = t->b_ranks[k], col = t->b_cols[k], w = t->b_widths[k];
        if (rm == 0) continue;
        const char *b = (const char *)(intptr_t)t->b_ptrs[k];
        for (int64_t c = 0; c < w;) {
            const int nv = lora_vectors(count, w - c);
#define LORA_EXPAND(n, v) lora_expand(tmp, first, b, rm, w, t->half, c, n, v, out, width, col)
            LORA_COUNT_CASES(LORA_EXPAND)
#undef LORA_EXPAND
            c += 8 * nv;
        }
        first += rm;
    }
}

static void lora_tile(const float *xs, int64_t in, const LoraTable *t, int64_t s, int count,
                      float *out, int64_t width) {
    for (int j = 0; j < count; j += LORA_ROWS8) {
        const int rows = count - j < LORA_ROWS8 ? count - j : LORA_ROWS8;
        lora_tile_rows(xs + j * in, in, t, s, rows, out + j * width, width);
    }
}
#else /* without AVX-512 (BW, VL) or AVX2 (FMA, F16C) */
static inline float lora_weight(const void *w, int64_t i, int half) {
    return half ? lora_half_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* The portable loops: the same sums, row by row of A and B (out's rows zero on the way in). */
static void lora_tile(const float *xs, int64_t in, const LoraTable *t, int64_t s, int count,
                      float *out, int64_t width) {
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
                    out[j * width + col + q] += tmp[j][first + r] * lora_weight(b + r * w * elem, q, t->half);
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

/* Where the updates go: row out_rows[t] of the fused output, whose columns are split over `count` arrays (part
 * p: columns col[p] .. col[p] + width[p], rows of width[p] floats), after RoPE where `positions` is given: the
 * first `rotated` columns, head by head of head_dim, at position positions[rows[t]] of the cos and sin tables
 * [*, head_dim] (the rotate-half form: x * cos + [x2, x1] * sin, sin's first half negated). */
typedef struct {
    int count;
    float *ptr[LORA_MODULES];
    int64_t col[LORA_MODULES], width[LORA_MODULES];
    const int64_t *out_rows;
    const int64_t *positions;
    const float *cos, *sin;
    int64_t head_dim, rotated;
} LoraOut;

/* Row t's update (delta [width], rotated in place first) added to the output; x_row: its row of x. */
static void lora_store(float *delta, int64_t t, int64_t x_row, const LoraOut *o) {
    if (o->positions) {
        const int64_t d = o->head_dim, half = d / 2;
        const float *c = o->cos + o->positions[x_row] * d, *s = o->sin + o->positions[x_row] * d;
        for (int64_t h = 0; h < o->rotated; h += d) {
            float *x = delta + h;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] + x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
    for (int p = 0; p < o->count; p++) {
        float *dst = o->ptr[p] + o->out_rows[t] * o->width[p];
        const float *src = delta + o->col[p];
        for (int64_t i = 0; i < o->width[p]; i++) dst[i] += src[i];
    }
}

/* At least `bytes` at *buf, kept by the calling thread between calls (*buf and *size: its thread-local record):
 * memory allocated and freed each call came back page-faulted and cleared by the OS on every call. NULL when
 * memory ran out. */
static void *lora_scratch(void **buf, size_t *size, size_t bytes) {
    if (bytes > *size) {
        free(*buf);
        *buf = malloc(bytes);
        *size = *buf ? bytes : 0;
    }
    return *buf;
}

/* 0, or -1 when memory ran out. Tiles go to the OpenMP threads (a prefill chunk of one adapter is several). */
static int lora_sgmv_rows(const float *x, int64_t stride, const int64_t *rows, int64_t n, int64_t in,
                          const int32_t *slots, const float *norm, float eps, int64_t num_slots, const LoraTable *t,
                          int64_t width, const LoraOut *out, int threads) {
    static __thread void *tiles_buf;
    static __thread size_t tiles_size;
    LoraWork *tiles = lora_scratch(&tiles_buf, &tiles_size, sizeof(LoraWork) * (size_t)(n + 1));
    if (!tiles) return -1;
    const int64_t ntiles = lora_plan(slots, n, num_slots, t, tiles);
    int failed = 0;
    /* ~64K multiply-adds a row: a decode step's rows take one thread less time than waking the others between the
     * segments (a 16-row step over 8 adapters, SmolLM2's `cpu` backend on 2 AVX2 cores: 62-66 ms with one
     * thread, 66-69 with two); a prefill chunk's take two. */
#pragma omp parallel num_threads(threads) if (n >= 64 && ntiles > 1 && threads > 1)
    {
        static __thread void *xs_buf, *delta_buf;
        static __thread size_t xs_size, delta_size;
        float *xs = lora_scratch(&xs_buf, &xs_size, (size_t)(LORA_TILE * in) * sizeof(float));
        float *delta = lora_scratch(&delta_buf, &delta_size, (size_t)(LORA_TILE * width) * sizeof(float));
        if (!xs || !delta) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t k = 0; k < ntiles; k++) {
            if (!xs || !delta) continue;
            const LoraWork *tile = &tiles[k];
            for (int j = 0; j < tile->count; j++) lora_input(x, stride, rows[tile->idx[j]], in, norm, eps, xs + j * in);
            memset(delta, 0, (size_t)(tile->count * width) * sizeof(float)); /* columns of modules it lacks */
            lora_tile(xs, in, t, tile->slot, tile->count, delta, width);
            for (int j = 0; j < tile->count; j++)
                lora_store(delta + j * width, tile->idx[j], rows[tile->idx[j]], out);
        }
    }
    return failed ? -1 : 0;
}

/* The output's parts (a tuple of 1-LORA_MODULES writable C-contiguous float32 arrays [*, w_p], side by side in
 * column order) into o and views; 0, or -1 with an error set (and no view held). */
static int lora_parts(PyObject *parts, Py_buffer *views, LoraOut *o) {
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) < 1 || PyTuple_GET_SIZE(parts) > LORA_MODULES) {
        PyErr_SetString(PyExc_ValueError, "lora_sgmv: parts must be a tuple of 1-3 arrays");
        return -1;
    }
    int64_t col = 0;
    for (o->count = 0; o->count < PyTuple_GET_SIZE(parts); o->count++) {
        Py_buffer *v = &views[o->count];
        int failed = PyObject_GetBuffer(PyTuple_GET_ITEM(parts, o->count), v,
                                        PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0;
        if (!failed && (v->ndim != 2 || v->itemsize != 4 || strcmp(v->format, "f") || v->shape[1] < 1)) {
            PyBuffer_Release(v);
            PyErr_SetString(PyExc_ValueError, "lora_sgmv: each part must be a C-contiguous float32 [rows, columns]");
            failed = 1;
        }
        if (failed) {
            while (o->count--) PyBuffer_Release(&views[o->count]);
            return -1;
        }
        o->ptr[o->count] = v->buf;
        o->col[o->count] = col;
        o->width[o->count] = v->shape[1];
        col += v->shape[1];
    }
    return 0;
}

static PyObject *lora_sgmv(PyObject *self, PyObject *args) {
    Py_buffer x, rows, slots, norm, a_ptrs, ranks, b_ptrs, b_ranks, b_cols, b_widths, out_rows, positions, cos, sin;
    Py_buffer part_views[LORA_MODULES];
    PyObject *parts;
    int64_t stride, in, width, head_dim, rotated;
    float eps;
    int threads, half;
    if (!PyArg_ParseTuple(args, "y*LLy*y*y*fy*y*y*y*y*y*LiiOy*y*y*y*LL", &x, &stride, &in, &rows, &slots, &norm, &eps,
                          &a_ptrs, &ranks, &b_ptrs, &b_ranks, &b_cols, &b_widths, &width, &threads, &half, &parts,
                          &out_rows, &positions, &cos, &sin, &head_dim, &rotated))
        return NULL;
    Py_buffer *views[] = {&x,      &rows,    &slots,    &norm,     &a_ptrs,    &ranks, &b_ptrs,
                          &b_ranks, &b_cols, &b_widths, &out_rows, &positions, &cos,   &sin};
    LoraOut o = {0};
    if (lora_parts(parts, part_views, &o)) {
        for (size_t i = 0; i < sizeof views / sizeof *views; i++) PyBuffer_Release(views[i]);
        return NULL;
    }
    const int64_t n = rows.len / 8, num_slots = ranks.len / 8, blocks = num_slots * LORA_MODULES;
    const int64_t x_rows = stride > 0 ? x.len / 4 / stride : 0;
    const LoraTable t = {a_ptrs.buf, ranks.buf, b_ptrs.buf, b_ranks.buf, b_cols.buf, b_widths.buf, half};
    o.out_rows = out_rows.buf;
    int bad = in <= 0 || in > LORA_MAX_IN || stride < in || width <= 0 || slots.len != n * 4 ||
              out_rows.len != n * 8 || (norm.len && norm.len != in * 4) || a_ptrs.len != ranks.len ||
              b_ptrs.len != blocks * 8 || b_ranks.len != blocks * 8 || b_cols.len != blocks * 8 ||
              b_widths.len != blocks * 8 || o.col[o.count - 1] + o.width[o.count - 1] != width;
    if (positions.len) { /* RoPE over whole heads of the first `rotated` columns, a position for each row of x */
        o.positions = positions.buf;
        o.cos = cos.buf;
        o.sin = sin.buf;
        o.head_dim = head_dim;
        o.rotated = rotated;
        bad |= head_dim <= 0 || head_dim % 2 || rotated < 0 || rotated % head_dim || rotated > width ||
               positions.len != x_rows * 8 || cos.len != sin.len || cos.len % (head_dim * 4);
        const int64_t max_positions = head_dim > 0 ? cos.len / 4 / head_dim : 0;
        for (int64_t i = 0; !bad && i < x_rows; i++) bad = o.positions[i] < 0 || o.positions[i] >= max_positions;
    }
    for (int64_t i = 0; !bad && i < n; i++)
        bad = ((const int64_t *)rows.buf)[i] < 0 || ((const int64_t *)rows.buf)[i] >= x_rows;
    for (int p = 0; p < o.count; p++)
        for (int64_t i = 0; !bad && i < n; i++) bad = o.out_rows[i] < 0 || o.out_rows[i] >= part_views[p].shape[0];
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
        oom = lora_sgmv_rows(x.buf, stride, rows.buf, n, in, slots.buf, norm.len ? norm.buf : NULL, eps, num_slots, &t,
                             width, &o, threads) != 0;
        Py_END_ALLOW_THREADS
    }
    for (size_t i = 0; i < sizeof views / sizeof *views; i++) PyBuffer_Release(views[i]);
    for (int p = 0; p < o.count; p++) PyBuffer_Release(&part_views[p]);
    if (oom) return PyErr_NoMemory();
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "lora_sgmv: rows within x, out_rows within every part, parts as wide as the projection, "
                        "buffers that fit the shapes, RoPE over whole even heads with a position in the tables for "
                        "each row of x; ranks 0-1024, each the sum of its blocks', blocks within the width, with "
                        "their pointers");
        return NULL;
    }
    Py_RETURN_NONE;
}

#endif
