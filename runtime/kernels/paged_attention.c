/*
 * Paged attention on the CPU, reading K/V blocks in place (no gather copy).
 *
 * One call computes one layer's attention for a ragged batch of query tokens. Each token
 * attends to the keys of its own sequence at positions [max(0, pos - window + 1), pos],
 * found through the sequence's block table. The step's own K/V must already be written
 * into the pool (the runtime scatters them before calling).
 *
 * Work is split over (token, kv head) pairs; the query heads sharing a kv head (GQA) are
 * processed together so each K/V row is read once per group. Softmax is computed online
 * one block at a time (flash-attention style), in float32.
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

/* Tokens t0..t0+nt-1 (same sequence, increasing positions) x the G query heads of kv head g.
 * Each K/V row is loaded once for all nt*G query rows. */
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
        /* Scores and probabilities of the keys each row may see in this chunk; masked keys
         * get p = 0 (no infinities: this file is built with -ffast-math). */
        for (int64_t r = 0; r < R; r++) {
            const int64_t j0 = lo[r] > start ? lo[r] - start : 0;
            const int64_t j1 = hi[r] - start + 1 < n ? hi[r] - start + 1 : n;
            float *sr = s[r];
            for (int64_t j = 0; j < n; j++) sr[j] = 0.0f;
            if (j0 >= j1) continue;
            float chunk_max = -FLT_MAX;
            for (int64_t j = j0; j < j1; j++) {
                const float *kj = k + j * row;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += q[r][d] * kj[d];
                sr[j] = dot * a->scale;
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
        for (int64_t j = 0; j < n; j++) {
            const float *vj = v + j * row;
            for (int64_t r = 0; r < R; r++) {
                const float p = s[r][j];
                if (p == 0.0f) continue;
                for (int64_t d = 0; d < D; d++) acc[r][d] += p * vj[d];
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
