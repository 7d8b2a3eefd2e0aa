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

typedef struct {
    const float *q;          /* [T, Hq*D] */
    const float *k_cache;    /* [N, bs, Hkv*D] */
    const float *v_cache;    /* [N, bs, Hkv*D] */
    float *out;              /* [T, Hq*D] */
    const int64_t *block_tables; /* [B, M] */
    const int64_t *seq_of_token; /* [T] */
    const int64_t *positions;    /* [T] */
    int64_t T, M, Hq, Hkv, D, bs, window;
    float scale;
} Args;

static inline int64_t first_key(const Args *a, int64_t pos) {
    return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

static inline float dot(const float *x, const float *y, int64_t n) {
    float acc = 0.0f;
    for (int64_t d = 0; d < n; d++) acc += x[d] * y[d];
    return acc;
}

/* x against 4 rows of y (`stride` apart) at once: four independent vector accumulators
 * instead of one FMA dependency chain per key (a lone dot of 64 floats is latency-bound). */
static inline void dot4(const float *x, const float *y, int64_t stride, int64_t n, float *out) {
    const float *y0 = y, *y1 = y + stride, *y2 = y + 2 * stride, *y3 = y + 3 * stride;
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
static inline void dot2x4(const float *x0, const float *x1, const float *y, int64_t stride, int64_t n,
                          float *out0, float *out1) {
    const float *y0 = y, *y1 = y + stride, *y2 = y + 2 * stride, *y3 = y + 3 * stride;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float u = x0[d], w = x1[d];
        a0 += u * y0[d]; a1 += u * y1[d]; a2 += u * y2[d]; a3 += u * y3[d];
        b0 += w * y0[d]; b1 += w * y1[d]; b2 += w * y2[d]; b3 += w * y3[d];
    }
    out0[0] = a0; out0[1] = a1; out0[2] = a2; out0[3] = a3;
    out1[0] = b0; out1[1] = b1; out1[2] = b2; out1[3] = b3;
}

/* Tokens t0..t0+nt-1 (same sequence, increasing positions) x the G query heads of kv head g.
 * Each K/V block is brought into cache once for all nt*G query rows. */
static void attend_tile(const Args *a, int64_t t0, int64_t nt, int64_t g) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, bs = a->bs, row = a->Hkv * D, R = nt * G;
    const int64_t *table = a->block_tables + a->seq_of_token[t0] * a->M;
    int64_t lo[MAX_ROWS], hi[MAX_ROWS];
    const float *q[MAX_ROWS];
    float m[MAX_ROWS], l[MAX_ROWS], acc[MAX_ROWS][MAX_HEAD_DIM], s[MAX_ROWS][MAX_KEYS];
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
        const int64_t block = table[start / bs];
        const float *k = a->k_cache + (block * bs + off) * row + g * D;
        const float *v = a->v_cache + (block * bs + off) * row + g * D;
        /* Raw scores of every row against every key of the chunk. Keys a row must not see
         * (causal within a prefill tile, sliding window) are still written K rows of this
         * sequence, so scoring them is harmless; they get p = 0 below (no infinities: this
         * file is built with -ffast-math). */
        int64_t r = 0;
        for (; r + 2 <= R; r += 2) {
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) dot2x4(q[r], q[r + 1], k + j * row, row, D, s[r] + j, s[r + 1] + j);
            for (; j < n; j++) {
                s[r][j] = dot(q[r], k + j * row, D);
                s[r + 1][j] = dot(q[r + 1], k + j * row, D);
            }
        }
        for (; r < R; r++) {
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) dot4(q[r], k + j * row, row, D, s[r] + j);
            for (; j < n; j++) s[r][j] = dot(q[r], k + j * row, D);
        }
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
        for (int64_t r = 0; r < R; r++) {
            const float *p = s[r];
            float *out = acc[r];
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) {
                if (p[j] == 0.0f && p[j + 1] == 0.0f && p[j + 2] == 0.0f && p[j + 3] == 0.0f) continue;
                const float *v0 = v + j * row, *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
                for (int64_t d = 0; d < D; d++)
                    out[d] += p[j] * v0[d] + p[j + 1] * v1[d] + p[j + 2] * v2[d] + p[j + 3] * v3[d];
            }
            for (; j < n; j++) {
                if (p[j] == 0.0f) continue;
                const float *vj = v + j * row;
                for (int64_t d = 0; d < D; d++) out[d] += p[j] * vj[d];
            }
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
    unsigned long long q, k, v, out, tables, seqs, positions;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLfi", &q, &k, &v, &out, &tables, &seqs, &positions,
                          &a.T, &a.M, &a.Hq, &a.Hkv, &a.D, &a.bs, &a.window, &a.scale, &threads))
        return NULL;
    if (a.Hkv <= 0 || a.Hq % a.Hkv || a.Hq / a.Hkv > MAX_ROWS || a.D > MAX_HEAD_DIM) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: unsupported head/group/block size");
        return NULL;
    }
    a.q = (const float *)q;
    a.k_cache = (const float *)k;
    a.v_cache = (const float *)v;
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
     "block_size, window, scale, threads): raw data pointers; see runtime/paged_attention.py"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
