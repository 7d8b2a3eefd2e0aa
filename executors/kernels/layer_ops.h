/*
 * The cpu-bf16 backend's per-layer glue in C (executors/layer_ops.py): RMSNorm over bfloat16 rows,
 * and RoPE + the split of a fused QKV row into float32 q, k, v for the attention kernel and the pool.
 * In torch each was 8-10 small ops per call (casts, pow, mean, rsqrt, cat, copies), ~5 us apiece: with the
 * rest of the glue, 7.8 ms of a 32-decode step through 30 layers (1.6 ms with these two in C). Numerics are torch's: RMSNorm as HF Llama's in bfloat16
 * (normalize in float32, round to bfloat16, scale by the weight, round again), RoPE in float32.
 * Included once by paged_attention.c (one extension module).
 */

static inline float bf16_value(uint16_t bits) {
    const uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_bits(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out[t] = bf16(bf16(x[t] * rsqrt(mean(x[t]^2) + eps)) * w), rows of H; x and out may be the same. */
static void rms_norm_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * H;
        uint16_t *o = out + t * H;
        float squares = 0.0f;
        for (int64_t i = 0; i < H; i++) squares += bf16_value(xr[i]) * bf16_value(xr[i]);
        const float r = 1.0f / sqrtf(squares / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = bf16_bits(bf16_value(bf16_bits(bf16_value(xr[i]) * r)) * bf16_value(w[i]));
    }
}

/* qkv [T, (Hq + 2 Hkv) D] (bfloat16 or float32, read by LOAD) -> q [T, Hq D], k [T, Hkv D] rotated, v [T, Hkv D],
 * float32. cos, sin: [positions, D] tables of the rotate-half form, x * cos + [x2, x1] * sin (sin's first half
 * negated). */
#define ROPE_SPLIT_ROWS(NAME, TYPE, LOAD)                                                                       \
    static void NAME(const TYPE *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos,          \
                     const float *sin, const int64_t *positions, float *q, float *k, float *v) {                \
        const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;                                                 \
        _Pragma("omp parallel for schedule(static) if (T * width >= 65536)") for (int64_t t = 0; t < T; t++) { \
            const TYPE *row = qkv + t * width;                                                                  \
            const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;                               \
            for (int64_t h = 0; h < Hq + Hkv; h++) {                                                            \
                const TYPE *x = row + h * D;                                                                    \
                float *o = h < Hq ? q + (t * Hq + h) * D : k + (t * Hkv + h - Hq) * D;                          \
                for (int64_t i = 0; i < D; i++) {                                                               \
                    const float rotated = LOAD(x[i < half ? i + half : i - half]);                              \
                    o[i] = LOAD(x[i]) * c[i] + rotated * s[i];                                                  \
                }                                                                                               \
            }                                                                                                   \
            for (int64_t i = 0; i < Hkv * D; i++) v[t * Hkv * D + i] = LOAD(row[(Hq + Hkv) * D + i]);            \
        }                                                                                                       \
    }
#define FLOAT_VALUE(x) (x)
ROPE_SPLIT_ROWS(rope_split_rows, uint16_t, bf16_value)
ROPE_SPLIT_ROWS(rope_split_rows_f32, float, FLOAT_VALUE)

static PyObject *rms_norm_bf16(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    int64_t T, H;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKLLf", &x, &w, &out, &T, &H, &eps)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows((const uint16_t *)x, (const uint16_t *)w, (uint16_t *)out, T, H, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rope_split_bf16(PyObject *self, PyObject *args) {
    unsigned long long qkv, cos, sin, positions, q, k, v;
    int64_t T, Hq, Hkv, D;
    if (!PyArg_ParseTuple(args, "KLLLLKKKKKK", &qkv, &T, &Hq, &Hkv, &D, &cos, &sin, &positions, &q, &k, &v))
        return NULL;
    if (D % 2) {
        PyErr_SetString(PyExc_ValueError, "rope_split_bf16: head_dim must be even");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_split_rows((const uint16_t *)qkv, T, Hq, Hkv, D, (const float *)cos, (const float *)sin,
                    (const int64_t *)positions, (float *)q, (float *)k, (float *)v);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}


/* The float32 form takes numpy arrays (buffers, sizes checked): the cpu-int8 backend calls it every layer. */
static PyObject *rope_split_f32(PyObject *self, PyObject *args) {
    Py_buffer qkv, cos, sin, positions, q, k, v;
    int64_t T, Hq, Hkv, D, max_positions;
    if (!PyArg_ParseTuple(args, "y*LLLLy*y*Ly*w*w*w*", &qkv, &T, &Hq, &Hkv, &D, &cos, &sin, &max_positions,
                          &positions, &q, &k, &v))
        return NULL;
    const Py_ssize_t f = 4;
    const int bad = D % 2 || qkv.len < T * (Hq + 2 * Hkv) * D * f || cos.len < max_positions * D * f ||
                    sin.len < max_positions * D * f || positions.len < T * 8 || q.len < T * Hq * D * f ||
                    k.len < T * Hkv * D * f || v.len < T * Hkv * D * f;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        rope_split_rows_f32(qkv.buf, T, Hq, Hkv, D, cos.buf, sin.buf, positions.buf, q.buf, k.buf, v.buf);
        Py_END_ALLOW_THREADS
    }
    Py_buffer *views[] = {&qkv, &cos, &sin, &positions, &q, &k, &v};
    for (size_t i = 0; i < sizeof views / sizeof *views; i++) PyBuffer_Release(views[i]);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rope_split_f32: head_dim must be even and the buffers fit the shapes");
        return NULL;
    }
    Py_RETURN_NONE;
}
