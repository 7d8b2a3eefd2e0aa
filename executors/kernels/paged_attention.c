/*
 * Paged attention on the CPU, reading K/V blocks in place (no gather copy).
 *
 * One call computes one layer's attention for a ragged batch of query tokens. Each token
 * attends to the keys of its own sequence at positions [max(0, pos - window + 1), pos],
 * found through the sequence's block table. The step's own K/V must already be written
 * into the pool (the runtime scatters them before calling).
 *
 * Work is split over tiles of tokens (a decode: one token) and, within a tile, kv heads in turn; the
 * query heads sharing a kv head (GQA) are processed together so each K/V block is fetched once per
 * group. A block's rows hold all kv heads side by side, so a tile's first head reads them whole and
 * the others find them in cache, and for a decode the next block is prefetched meanwhile: a sequence's
 * blocks lie anywhere in the pool (a saturated mixed-traffic step's attention: 16.8 -> 15.7 ms against
 * one item per kv head). Threads take items one at a time (dynamic schedule); with fewer tiles than
 * twice the threads (a lone decode) an item is a tile and one kv head, so every thread has work.
 * Prefill tiles of 4 tokens are small enough not to leave one thread finishing alone. Softmax is computed online
 * one block at a time (flash-attention style), in float32. Scores come two query rows x four
 * keys per pass and values are accumulated four keys at a time, so the inner loops carry
 * independent vector FMAs instead of one latency-bound chain per key (1.4-1.9x per layer on
 * AVX2 vs one dot product per key).
 *
 * Quantized pools (engine_format/kv_cache.py) are read at 1 byte per element, a quarter of fp32's
 * memory traffic, which is what bounds attention at large batch x context. int8 (a float32 scale
 * per token and kv head): the same loops read int8 rows in place (attention_ops.h, instantiated per
 * element type), a key's score is scaled by its k scale and its p by its v scale. fp8 E4M3 (one
 * static scale per layer for K and one for V): in the AVX-512 loops the same, the codes widened to
 * float by bit operations (E4M3 -> fp16 is a shift, fp16 -> float one instruction) and the layer's
 * scales applied to scores and p like int8's row scales; the portable loops read a chunk
 * dequantized into a float buffer.
 *
 * With AMX (attention_amx.h), int8 tiles of several tokens (a verify step's drafts, prefill) are tile
 * products instead, with the query and p split into two int8 parts each: in a saturated step with 3
 * drafts a sequence, attention 35 -> 25 ms; a lone decode token stays on the vector loops below.
 *
 * With AVX-512 and head_dim a multiple of 16 (SmolLM2: 64) the loops are the vector ones of
 * attention_ops.h (KV_SIMD): each key/value row is converted once per group of up to 4 query rows
 * (decode GQA 9/3: the 3 rows of a kv head), the 16 key dot products of a group are reduced
 * together, and p.V keeps 4 rows x 64 values of accumulators in registers. Elsewhere the portable
 * loops run (fp8 via a dequantized float buffer); `simd=0` forces them (tests compare the two).
 *
 * write_kv quantizes a step's new K/V rows into the pool at their slots (int8 codes + row scales,
 * or fp8 bits), bit for bit what executors/kv_quant.py's numpy functions produce.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#define KV_SIMD 1
/* 16 lanes for the softmax loops (the compiler's default on this target is 8): libmvec's 16-wide expf */
#define PRAGMA(text) _Pragma(#text)
#define SIMD16_MAX(x) PRAGMA(omp simd simdlen(16) reduction(max : x))
#define SIMD16_SUM(x) PRAGMA(omp simd simdlen(16) reduction(+ : x))
#else
#define KV_SIMD 0
#define SIMD16_MAX(x)
#define SIMD16_SUM(x)
#endif

#define MAX_TILE 4       /* consecutive query tokens of one sequence processed together */
#define MAX_ROWS 64      /* tile tokens x query heads per kv head */
#define MAX_HEAD_DIM 128
#define MAX_KEYS 128     /* keys per inner chunk (a block, or part of one) */

enum { KV_F32 = 0, KV_INT8 = 1, KV_FP8 = 2 };

typedef struct {
    const float *q;          /* [T, Hq*D] */
    const void *k_cache;     /* [N, bs, Hkv*D] float32, int8 or fp8 bits (kv_kind) */
    const void *v_cache;     /* [N, bs, Hkv*D] */
    const float *k_scales;   /* int8: [N, bs, Hkv] */
    const float *v_scales;
    float *out;              /* [T, Hq*D] */
    const int64_t *block_tables; /* [B, M] */
    const int64_t *seq_of_token; /* [T] */
    const int64_t *positions;    /* [T] */
    int64_t T, M, Hq, Hkv, D, bs, window;
    float scale;
    int kv_kind;
    float k_scale, v_scale;  /* fp8: the layer's static scales */
    int simd;                /* use the AVX-512 loops (KV_SIMD, D % 16 == 0, not refused by the caller) */
    int amx;                 /* int8 tiles that fit on AMX (attention_amx.h): usable and not refused */
} Args;

static inline int64_t first_key(const Args *a, int64_t pos) {
    return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

#if KV_SIMD
/* The 16-key reduction tree of score16 (attention_ops.h): each step adds two vectors' halves so the
 * result holds both inputs' partial sums side by side; after four steps lane i is key i's sum. */
static inline __m512 sum_pairs_256(__m512 a, __m512 b) { /* [a 8 | b 8] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 sum_pairs_128(__m512 a, __m512 b) { /* 4 keys x 4 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 sum_pairs_64(__m512 a, __m512 b) { /* 128-bit lane L: keys L, L+4 of a, b (2 each) */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
static inline __m512 sum_pairs_last(__m512 a, __m512 b) { /* element 4L + i holds key L + 4i: to key order */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* E4M3 bits -> value x 2^-8: sign to bit 15, exponent and mantissa to bits 13..7 make the fp16 with
 * the same fields (bias 15 vs 7: a factor 2^-8, folded into the layer's scale), subnormals included;
 * the fp16 -> float conversion is exact. */
static inline __m512 load16_fp8(const uint8_t *p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80)),
                                      _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)));
    return _mm512_cvtph_ps(h);
}
#endif
#define FP8_SIMD_FACTOR 256.0f /* load16_fp8 reads value x 2^-8 */

#define KV_T float
#define OPS(name) name##_f32
#define LOAD16 load16_f32
#include "attention_ops.h"
#undef KV_T
#undef OPS
#undef LOAD16
#define KV_T int8_t
#define OPS(name) name##_i8
#define LOAD16 load16_i8
#include "attention_ops.h"
#undef KV_T
#undef OPS
#undef LOAD16
#define KV_T uint8_t
#define OPS(name) name##_fp8
#define LOAD16 load16_fp8
#define KV_SIMD_ONLY
#include "attention_ops.h"
#undef KV_SIMD_ONLY
#undef KV_T
#undef OPS
#undef LOAD16

/* E4M3 (fn) bits -> float, exactly: (implicit bit | mantissa) x 2^(exponent - 10), with normal-float
 * arithmetic only (subnormal fp8 values stay normal floats, safe under flush-to-zero), so it vectorizes.
 * 0x7f / 0xff are NaN; the writer saturates at +-448 and never stores them. */
static inline float fp8_e4m3fn_value(uint32_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    const uint32_t bits = ((e ? e : 1u) + 117u) << 23; /* 2^(max(e, 1) - 10) */
    float pow2;
    memcpy(&pow2, &bits, sizeof pow2);
    const float v = (float)(e ? (m | 8u) : m) * pow2;
    return (b & 0x80u) ? -v : v;
}

/* Rows slot..slot+n-1 of kv head g of an fp8 pool as floats [n, D] in dst (x the layer's scale). */
static void dequantize_fp8(const Args *a, const void *cache, float layer_scale, int64_t slot, int64_t n, int64_t g,
                           float *dst) {
    const int64_t D = a->D, row = a->Hkv * D;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *src = (const uint8_t *)cache + (slot + j) * row + g * D;
        for (int64_t d = 0; d < D; d++) dst[j * D + d] = layer_scale * fp8_e4m3fn_value(src[d]);
    }
}

/* A block's K and V rows, all kv heads (contiguous), and int8 row scales, into cache: a sequence's
 * blocks lie anywhere in the pool, where the hardware prefetcher cannot follow. */
static void prefetch_rows(const Args *a, int64_t first_slot, size_t elem) {
    const int64_t bytes = a->bs * a->Hkv * a->D * (int64_t)elem;
    const char *k = (const char *)a->k_cache + first_slot * a->Hkv * a->D * elem;
    const char *v = (const char *)a->v_cache + first_slot * a->Hkv * a->D * elem;
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b, 0, 3);
        __builtin_prefetch(v + b, 0, 3);
    }
    if (a->kv_kind == KV_INT8)
        for (int64_t j = 0; j < a->bs * a->Hkv; j += 16) {
            __builtin_prefetch(a->k_scales + first_slot * a->Hkv + j, 0, 3);
            __builtin_prefetch(a->v_scales + first_slot * a->Hkv + j, 0, 3);
        }
}

#include "attention_amx.h"

/* Tokens t0..t0+nt-1 (same sequence, increasing positions) x the G query heads of kv head g.
 * Each K/V block is brought into cache once for all nt*G query rows. `prefetch`: bring each next
 * block's rows (all kv heads) into cache while this one is computed. */
static void attend_tile(const Args *a, int64_t t0, int64_t nt, int64_t g, int prefetch) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, bs = a->bs, R = nt * G, row = a->Hkv * D;
    const int64_t *table = a->block_tables + a->seq_of_token[t0] * a->M;
    int64_t lo[MAX_ROWS], hi[MAX_ROWS];
    const float *q[MAX_ROWS];
    float m[MAX_ROWS], l[MAX_ROWS], acc[MAX_ROWS][MAX_HEAD_DIM], s[MAX_ROWS][MAX_KEYS];
    float kmul[MAX_KEYS], vmul[MAX_KEYS]; /* per key of the chunk: score and p factors (scales) */
    float kbuf[MAX_KEYS * MAX_HEAD_DIM], vbuf[MAX_KEYS * MAX_HEAD_DIM]; /* portable fp8: the chunk as floats */
    const int fp8_buffered = a->kv_kind == KV_FP8 && !a->simd;
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = t0 + r / G, h = g * G + r % G;
        hi[r] = a->positions[t];
        lo[r] = first_key(a, hi[r]);
        q[r] = a->q + t * a->Hq * D + h * D;
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
        memset(acc[r], 0, sizeof(float) * D);
    }
    /* Factors of every key: 1/sqrt(D), and in the vector loops fp8's layer scales (x 2^8: load16_fp8
     * reads value x 2^-8); the portable fp8 loops read a buffer already scaled. */
    const int fp8_simd = a->kv_kind == KV_FP8 && a->simd;
    const float k_const = a->scale * (fp8_simd ? a->k_scale * FP8_SIMD_FACTOR : 1.0f);
    const float v_const = fp8_simd ? a->v_scale * FP8_SIMD_FACTOR : 1.0f;
    const int64_t last = a->positions[t0 + nt - 1];
    for (int64_t start = first_key(a, a->positions[t0]); start <= last;) {
        const int64_t off = start % bs;
        int64_t n = (bs - off) < (last + 1 - start) ? (bs - off) : (last + 1 - start);
        n = n < MAX_KEYS ? n : MAX_KEYS;
        const int64_t slot = table[start / bs] * bs + off;
        const size_t elem = a->kv_kind == KV_F32 ? sizeof(float) : 1;
        const void *k = (const char *)a->k_cache + (size_t)(slot * row + g * D) * elem;
        const void *v = (const char *)a->v_cache + (size_t)(slot * row + g * D) * elem;
        if (prefetch && start + n <= last) prefetch_rows(a, table[(start + n) / bs] * bs, elem);
        if (a->kv_kind == KV_INT8) {  /* the rows' own scales */
            for (int64_t j = 0; j < n; j++) {
                kmul[j] = k_const * a->k_scales[(slot + j) * a->Hkv + g];
                vmul[j] = a->v_scales[(slot + j) * a->Hkv + g];
            }
        } else {
            for (int64_t j = 0; j < n; j++) {
                kmul[j] = k_const;
                vmul[j] = v_const;
            }
        }
        int64_t stride = row;  /* elements between consecutive keys' rows as the loops read them */
        if (fp8_buffered) {   /* portable fp8: the chunk dequantized into L1-resident float buffers */
            dequantize_fp8(a, a->k_cache, a->k_scale, slot, n, g, kbuf);
            dequantize_fp8(a, a->v_cache, a->v_scale, slot, n, g, vbuf);
            k = kbuf;
            v = vbuf;
            stride = D;
        }
        /* raw scores q . k (codes: before the row / layer scale) */
#if KV_SIMD
        if (a->simd) {
            if (a->kv_kind == KV_F32) score_simd_f32(q, R, k, stride, D, n, s);
            else if (a->kv_kind == KV_INT8) score_simd_i8(q, R, k, stride, D, n, s);
            else score_simd_fp8(q, R, k, stride, D, n, s);
        } else
#endif
        if (a->kv_kind == KV_INT8) score_i8(q, R, k, stride, D, n, s);
        else score_f32(q, R, k, stride, D, n, s);
        int64_t jlo[MAX_ROWS / 4], jhi[MAX_ROWS / 4];  /* keys any row of each group of 4 sees */
        for (int64_t r = 0; r < R; r++) {  /* mask, then the online-softmax update */
            const int64_t j0 = lo[r] > start ? lo[r] - start : 0;
            const int64_t j1 = hi[r] - start + 1 < n ? hi[r] - start + 1 : n;
            if (r % 4 == 0) {
                jlo[r / 4] = n;
                jhi[r / 4] = 0;
            }
            float *sr = s[r];
            for (int64_t j = 0; j < j0; j++) sr[j] = 0.0f;
            for (int64_t j = j1 > j0 ? j1 : j0; j < n; j++) sr[j] = 0.0f;
            if (j0 >= j1) continue;
            jlo[r / 4] = j0 < jlo[r / 4] ? j0 : jlo[r / 4];
            jhi[r / 4] = j1 > jhi[r / 4] ? j1 : jhi[r / 4];
            float chunk_max = -FLT_MAX;
            SIMD16_MAX(chunk_max)
            for (int64_t j = j0; j < j1; j++) {
                sr[j] *= kmul[j];
                chunk_max = sr[j] > chunk_max ? sr[j] : chunk_max;
            }
            const float new_max = chunk_max > m[r] ? chunk_max : m[r];
            if (new_max != m[r]) {  /* a new maximum: rescale what was summed so far */
                const float rescale = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - new_max);
                l[r] *= rescale;
                for (int64_t d = 0; d < D; d++) acc[r][d] *= rescale;
            }
            float sum = 0.0f;
            SIMD16_SUM(sum)
            for (int64_t j = j0; j < j1; j++) {
                const float p = expf(sr[j] - new_max);
                sum += p;
                sr[j] = p * vmul[j];  /* p x the value's scale: acc sums p x code */
            }
            l[r] += sum;
            m[r] = new_max;
        }
#if KV_SIMD
        if (a->simd) {
            if (a->kv_kind == KV_F32) accumulate_simd_f32(R, s, v, stride, D, jlo, jhi, acc);
            else if (a->kv_kind == KV_INT8) accumulate_simd_i8(R, s, v, stride, D, jlo, jhi, acc);
            else accumulate_simd_fp8(R, s, v, stride, D, jlo, jhi, acc);
        } else
#endif
        if (a->kv_kind == KV_INT8) accumulate_i8(R, s, v, stride, D, n, acc);
        else accumulate_f32(R, s, v, stride, D, n, acc);
        start += n;
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = t0 + r / G, h = g * G + r % G;
        float *out = a->out + t * a->Hq * D + h * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) out[d] = acc[r][d] * inv;
    }
}

static PyObject *paged_attention(PyObject *self, PyObject *args) {
    Args a;
    unsigned long long q, k, v, out, tables, seqs, positions, k_scales = 0, v_scales = 0;
    int threads, simd = 1, amx = 1;
    a.kv_kind = KV_F32;
    a.k_scale = a.v_scale = 1.0f;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLfi|iKKffpp", &q, &k, &v, &out, &tables, &seqs, &positions,
                          &a.T, &a.M, &a.Hq, &a.Hkv, &a.D, &a.bs, &a.window, &a.scale, &threads,
                          &a.kv_kind, &k_scales, &v_scales, &a.k_scale, &a.v_scale, &simd, &amx))
        return NULL;
    a.simd = KV_SIMD && simd && a.D % 16 == 0;
    a.amx = a.simd && amx && amx_usable();
    if (a.Hkv <= 0 || a.Hq % a.Hkv || a.Hq / a.Hkv > MAX_ROWS || a.D > MAX_HEAD_DIM) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: unsupported head/group/block size");
        return NULL;
    }
    if (a.kv_kind < KV_F32 || a.kv_kind > KV_FP8 || (a.kv_kind == KV_INT8 && (!k_scales || !v_scales))) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: kv_kind must be 0 (float32), 1 (int8 + row scales) or 2 (fp8)");
        return NULL;
    }
    a.q = (const float *)q;
    a.k_cache = (const void *)k;
    a.v_cache = (const void *)v;
    a.k_scales = (const float *)k_scales;
    a.v_scales = (const float *)v_scales;
    a.out = (float *)out;
    a.block_tables = (const int64_t *)tables;
    a.seq_of_token = (const int64_t *)seqs;
    a.positions = (const int64_t *)positions;
    /* Tiles: runs of up to `tile` consecutive tokens of one sequence (decodes: one each). */
    const int64_t group = a.Hq / a.Hkv;
    const int64_t tile = group * MAX_TILE <= MAX_ROWS ? MAX_TILE : MAX_ROWS / group;
    int64_t *starts = PyMem_Malloc(sizeof(int64_t) * (a.T + 1));
    if (!starts) return PyErr_NoMemory();
    int64_t tiles = 0;
    for (int64_t t = 0; t < a.T; t++)
        if (t == 0 || a.seq_of_token[t] != a.seq_of_token[t - 1] || t - starts[tiles - 1] == tile)
            starts[tiles++] = t;
    starts[tiles] = a.T;
    /* Work items: a tile with all its kv heads in turn, which reads each block's rows whole (the heads
     * lie side by side) and the later heads from cache; or, with too few tiles to keep every thread
     * busy (a lone decode), a tile and one kv head. */
    const int64_t heads = tiles >= 2 * threads ? a.Hkv : 1, items = tiles * (a.Hkv / heads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        const int64_t tile_index = i / (a.Hkv / heads), first = i % (a.Hkv / heads) * heads;
        const int64_t t0 = starts[tile_index], t1 = starts[tile_index + 1];
        /* a sequence's only tile (a decode): its blocks are in no cache yet; a prefill's tiles share theirs */
        const int alone = (t0 == 0 || a.seq_of_token[t0 - 1] != a.seq_of_token[t0]) &&
                          (t1 == a.T || a.seq_of_token[t1] != a.seq_of_token[t0]);
        const int on_amx = amx_fits(&a, t1 - t0);
        for (int64_t g = first; g < first + heads; g++) {
            const int prefetch = alone && heads > 1 && g == first;
            if (on_amx) attend_tile_amx(&a, t0, t1 - t0, g, prefetch);
            else attend_tile(&a, t0, t1 - t0, g, prefetch);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(starts);
    Py_RETURN_NONE;
}

/*
 * The quantizing KV write: rows [T, Hkv*D] float32 into pool rows `slots` [T] (slot = block x
 * block_size + offset) as int8 codes + a float32 scale per (row, kv head), or fp8 E4M3 bits.
 * Must equal executors/kv_quant.py's quantize_int8 / encode_fp8 bit for bit, so it is
 * compiled without -ffast-math's licences (x / 127 must not become x * (1 / 127)); rounding is
 * numpy's rint, half to even (nearbyintf in the default rounding mode).
 */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

static void write_int8_rows(const float *src, int64_t T, int64_t Hkv, int64_t D, const int64_t *slots,
                            int8_t *codes, float *scales) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const float *x = src + (t * Hkv + h) * D;
            int8_t *c = codes + (slots[t] * Hkv + h) * D;
            float absmax = 0.0f;
            /* max is exact in any order: vectorized (without this, strict IEEE code keeps one serial chain) */
#pragma omp simd reduction(max : absmax)
            for (int64_t d = 0; d < D; d++) absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
            scales[slots[t] * Hkv + h] = absmax / 127.0f;
            const float inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f; /* an all-zero row: codes 0 */
            for (int64_t d = 0; d < D; d++) {
                float r = nearbyintf(x[d] * inverse);
                r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
                c[d] = (int8_t)r;
            }
        }
    }
}

/* float -> E4M3 (fn) bits, round to nearest even, |x| clipped to 448 first (ml_dtypes' cast).
 * Branch-free (both cases computed, one selected) so the row loop vectorizes. */
static inline uint8_t fp8_e4m3fn_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const float ax = fabsf(x) > 448.0f ? 448.0f : fabsf(x);
    memcpy(&bits, &ax, sizeof bits);
    /* normal: keep 3 of 23 mantissa bits, half to even (a carry rounds into the exponent), then
     * rebias the exponent 127 -> 7 */
    const uint32_t normal = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
    /* below 2^-6: subnormal steps of 2^-9 (8 steps = the smallest normal, code 8) */
    const uint32_t subnormal = (uint32_t)(int32_t)nearbyintf(ax * 512.0f);
    return (uint8_t)(sign | (ax < 0.015625f ? subnormal : normal));
}

static void write_fp8_rows(const float *src, int64_t T, int64_t width, const int64_t *slots, uint8_t *codes,
                           float scale) {
    for (int64_t t = 0; t < T; t++) {
        uint8_t *dst = codes + slots[t] * width;
        const float *x = src + t * width;
#pragma omp simd
        for (int64_t d = 0; d < width; d++) dst[d] = fp8_e4m3fn_bits(x[d] / scale);
    }
}

#pragma GCC pop_options

static PyObject *write_kv(PyObject *self, PyObject *args) {
    unsigned long long k, v, slots_p, k_pool, v_pool, k_scales = 0, v_scales = 0;
    int64_t T, Hkv, D, num_slots;
    int kind;
    float k_scale = 1.0f, v_scale = 1.0f;
    if (!PyArg_ParseTuple(args, "KKKLLLKKLi|KKff", &k, &v, &slots_p, &T, &Hkv, &D, &k_pool, &v_pool, &num_slots,
                          &kind, &k_scales, &v_scales, &k_scale, &v_scale))
        return NULL;
    if ((kind != KV_INT8 && kind != KV_FP8) || (kind == KV_INT8 && (!k_scales || !v_scales)) ||
        (kind == KV_FP8 && !(k_scale > 0.0f && v_scale > 0.0f))) {
        PyErr_SetString(PyExc_ValueError, "write_kv: kind must be 1 (int8, with scale pools) or 2 (fp8, positive scales)");
        return NULL;
    }
    const int64_t *slots = (const int64_t *)slots_p;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "write_kv: slot %lld outside the pool (%lld slots)", (long long)slots[t],
                         (long long)num_slots);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    if (kind == KV_INT8) {
        write_int8_rows((const float *)k, T, Hkv, D, slots, (int8_t *)k_pool, (float *)k_scales);
        write_int8_rows((const float *)v, T, Hkv, D, slots, (int8_t *)v_pool, (float *)v_scales);
    } else {
        write_fp8_rows((const float *)k, T, Hkv * D, slots, (uint8_t *)k_pool, k_scale);
        write_fp8_rows((const float *)v, T, Hkv * D, slots, (uint8_t *)v_pool, v_scale);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#include "layer_ops.h"
#include "int8_linear.h"
#include "lora_ops.h"

static PyObject *amx_available(PyObject *self, PyObject *unused) { return PyBool_FromLong(KV_AMX && amx_usable()); }

static PyMethodDef methods[] = {
    {"paged_attention", paged_attention, METH_VARARGS,
     "paged_attention(q, k_cache, v_cache, out, block_tables, seq_of_token, positions, T, M, Hq, Hkv, D, "
     "block_size, window, scale, threads[, kv_kind, k_scales, v_scales, k_scale, v_scale, simd, amx]): raw data "
     "pointers; see executors/cpu_attention.py"},
    {"amx_available", amx_available, METH_NOARGS, "amx_available(): whether int8 tiles run on AMX here"},
    {"write_kv", write_kv, METH_VARARGS,
     "write_kv(k, v, slots, T, kv_heads, head_dim, k_pool, v_pool, num_slots, kind[, k_scales, v_scales, k_scale, "
     "v_scale]): quantize rows into the pool in place; see executors/cpu_attention.py"},
    {"rms_norm_bf16", rms_norm_bf16, METH_VARARGS,
     "rms_norm_bf16(x, weight, out, T, H, eps): bfloat16 rows; see executors/layer_ops.py"},
    {"rope_split_bf16", rope_split_bf16, METH_VARARGS,
     "rope_split_bf16(qkv, T, Hq, Hkv, D, cos, sin, positions, q, k, v); see executors/layer_ops.py"},
    {"rope_split_f32", rope_split_f32, METH_VARARGS,
     "rope_split_f32(qkv, T, Hq, Hkv, D, cos, sin, positions, q, k, v): float32 rows; see executors/int8_ops.py"},
    {"quantize_rows", quantize_rows, METH_VARARGS,
     "quantize_rows(x, ldx, T, K, Kp, multiplier, q, scale, zp): per-token uint8; see executors/int8_ops.py"},
    {"rms_norm_quantize", rms_norm_quantize, METH_VARARGS,
     "rms_norm_quantize(x, weight, T, K, Kp, eps, q, scale, zp); see executors/int8_ops.py"},
    {"silu_mul_quantize", silu_mul_quantize, METH_VARARGS,
     "silu_mul_quantize(gate_up, T, I, Kp, q, scale, zp); see executors/int8_ops.py"},
    {"int8_linear", int8_linear, METH_VARARGS,
     "int8_linear(a, T, Kp, a_scale, a_zp, w, N, w_scale, colsum, bias, out, ldo, accumulate, threads, simd); "
     "see executors/int8_ops.py"},
    {"int8_simd", int8_simd, METH_NOARGS, "int8_simd(): the vector loops int8_linear runs here ('avx512-vnni', 'avx2', '')"},
    {"lora_sgmv", lora_sgmv, METH_VARARGS,
     "lora_sgmv(x, stride, in, rows, slots, norm, eps, a_ptrs, ranks, b_ptrs, b_ranks, b_cols, b_widths, width, "
     "threads, half, parts, out_rows, positions, cos, sin, head_dim, rotated): see executors/lora/slots.py"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) {
    PyObject *m = PyModule_Create(&module);
    /* The call's interface version (cpu_attention.py refuses an older build of this file). 2: kv_kind + scales;
     * 3: simd flag, write_kv; 4: rms_norm_bf16, rope_split_bf16; 5: amx flag, amx_available; 6: the int8
     * dense layers (int8_linear.h) and rope_split_f32; 7: lora_sgmv (lora_ops.h); 8: its out_rows; 9: its
     * output parts and RoPE. */
    if (m && PyModule_AddIntConstant(m, "ABI", 9) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
