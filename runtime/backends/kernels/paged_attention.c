/*
 * Paged attention on the CPU, reading K/V blocks in place (no gather copy).
 *
 * One call computes one layer's attention for a ragged batch of query tokens. Each token
 * attends to the keys of its own sequence at positions [max(0, pos - window + 1), pos],
 * found through the sequence's block table. The step's own K/V must already be written
 * into the pool (the runtime scatters them before calling).
 *
 * Work is split over (token, kv head) pairs; the query heads sharing a kv head (GQA) are
 * processed together so each K/V block is fetched once per group. Softmax is computed online
 * one block at a time (flash-attention style), in float32. Scores come two query rows x four
 * keys per pass and values are accumulated four keys at a time, so the inner loops carry
 * independent vector FMAs instead of one latency-bound chain per key (1.4-1.9x per layer on
 * AVX2 vs one dot product per key).
 *
 * Quantized pools (engine_format/kv_cache.py) are read at 1 byte per element, a quarter of fp32's
 * memory traffic, which is what bounds attention at large batch x context. int8 (a float32 scale
 * per token and kv head): the same loops read int8 rows in place (attention_ops.h, instantiated per
 * element type), a key's score is scaled by its k scale and its p by its v scale. fp8 E4M3 (one
 * static scale per layer for K and one for V): each chunk of keys is dequantized into an
 * L1-resident float buffer and the float loops run on it.
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
} Args;

static inline int64_t first_key(const Args *a, int64_t pos) {
    return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

#define KV_T float
#define OPS(name) name##_f32
#include "attention_ops.h"
#undef KV_T
#undef OPS
#define KV_T int8_t
#define OPS(name) name##_i8
#include "attention_ops.h"
#undef KV_T
#undef OPS

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

/* Tokens t0..t0+nt-1 (same sequence, increasing positions) x the G query heads of kv head g.
 * Each K/V block is brought into cache once for all nt*G query rows. */
static void attend_tile(const Args *a, int64_t t0, int64_t nt, int64_t g) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, bs = a->bs, R = nt * G;
    const int64_t *table = a->block_tables + a->seq_of_token[t0] * a->M;
    int64_t lo[MAX_ROWS], hi[MAX_ROWS];
    const float *q[MAX_ROWS];
    float m[MAX_ROWS], l[MAX_ROWS], acc[MAX_ROWS][MAX_HEAD_DIM], s[MAX_ROWS][MAX_KEYS];
    float kbuf[MAX_KEYS * MAX_HEAD_DIM], vbuf[MAX_KEYS * MAX_HEAD_DIM]; /* fp8: the chunk as floats */
    float kscale[MAX_KEYS], vscale[MAX_KEYS];                             /* int8: the chunk's row scales */
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = t0 + r / G, h = g * G + r % G;
        hi[r] = a->positions[t];
        lo[r] = first_key(a, hi[r]);
        q[r] = a->q + t * a->Hq * D + h * D;
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
        memset(acc[r], 0, sizeof(float) * D);
    }
    const int64_t last = a->positions[t0 + nt - 1];
    for (int64_t start = first_key(a, a->positions[t0]); start <= last;) {
        const int64_t off = start % bs;
        int64_t n = (bs - off) < (last + 1 - start) ? (bs - off) : (last + 1 - start);
        n = n < MAX_KEYS ? n : MAX_KEYS;
        const int64_t slot = table[start / bs] * bs + off;
        const int64_t row = a->Hkv * D;
        const int8_t *k8 = NULL, *v8 = NULL;
        const float *k = NULL, *v = NULL;
        if (a->kv_kind == KV_INT8) {  /* int8 rows read in place: scores x k scale, p x v scale */
            k8 = (const int8_t *)a->k_cache + slot * row + g * D;
            v8 = (const int8_t *)a->v_cache + slot * row + g * D;
            for (int64_t j = 0; j < n; j++) {
                kscale[j] = a->k_scales[(slot + j) * a->Hkv + g];
                vscale[j] = a->v_scales[(slot + j) * a->Hkv + g];
            }
            score_i8(q, R, k8, row, D, n, s);
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < n; j++) s[r][j] *= kscale[j];
        } else {
            if (a->kv_kind == KV_F32) {
                k = (const float *)a->k_cache + slot * row + g * D;
                v = (const float *)a->v_cache + slot * row + g * D;
            } else {  /* fp8: the chunk dequantized into L1-resident buffers */
                dequantize_fp8(a, a->k_cache, a->k_scale, slot, n, g, kbuf);
                dequantize_fp8(a, a->v_cache, a->v_scale, slot, n, g, vbuf);
                k = kbuf;
                v = vbuf;
            }
            score_f32(q, R, k, a->kv_kind == KV_F32 ? row : D, D, n, s);
        }
        int64_t r;
        for (r = 0; r < R; r++) {  /* mask, then the online-softmax update */
            const int64_t j0 = lo[r] > start ? lo[r] - start : 0;
            const int64_t j1 = hi[r] - start + 1 < n ? hi[r] - start + 1 : n;
            float *sr = s[r];
            for (int64_t j = 0; j < j0; j++) sr[j] = 0.0f;
            for (int64_t j = j1 > j0 ? j1 : j0; j < n; j++) sr[j] = 0.0f;
            if (j0 >= j1) continue;
            float chunk_max = -FLT_MAX;
            for (int64_t j = j0; j < j1; j++) {
                sr[j] *= a->scale;
                chunk_max = sr[j] > chunk_max ? sr[j] : chunk_max;
            }
            const float new_max = chunk_max > m[r] ? chunk_max : m[r];
            const float rescale = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - new_max);
            l[r] *= rescale;
            for (int64_t d = 0; d < D; d++) acc[r][d] *= rescale;
            for (int64_t j = j0; j < j1; j++) {
                sr[j] = expf(sr[j] - new_max);
                l[r] += sr[j];
            }
            m[r] = new_max;
        }
        if (a->kv_kind == KV_INT8) {
            for (r = 0; r < R; r++)
                for (int64_t j = 0; j < n; j++) s[r][j] *= vscale[j];
            accumulate_i8(R, s, v8, row, D, n, acc);
        } else {
            accumulate_f32(R, s, v, a->kv_kind == KV_F32 ? row : D, D, n, acc);
        }
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
    int threads;
    a.kv_kind = KV_F32;
    a.k_scale = a.v_scale = 1.0f;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLfi|iKKff", &q, &k, &v, &out, &tables, &seqs, &positions,
                          &a.T, &a.M, &a.Hq, &a.Hkv, &a.D, &a.bs, &a.window, &a.scale, &threads,
                          &a.kv_kind, &k_scales, &v_scales, &a.k_scale, &a.v_scale))
        return NULL;
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
    const int64_t items = tiles * a.Hkv;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        const int64_t tile_index = i / a.Hkv;
        attend_tile(&a, starts[tile_index], starts[tile_index + 1] - starts[tile_index], i % a.Hkv);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(starts);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"paged_attention", paged_attention, METH_VARARGS,
     "paged_attention(q, k_cache, v_cache, out, block_tables, seq_of_token, positions, T, M, Hq, Hkv, D, "
     "block_size, window, scale, threads[, kv_kind, k_scales, v_scales, k_scale, v_scale]): raw data pointers; "
     "see runtime/backends/cpu_attention.py"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) {
    PyObject *m = PyModule_Create(&module);
    /* The call's interface version (cpu_attention.py refuses an older build of this file). 2: kv_kind + scales. */
    if (m && PyModule_AddIntConstant(m, "ABI", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
