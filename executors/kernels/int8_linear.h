/*
 * The cpu-int8 backend's dense layers (executors/int8_ops.py): W8A8 matmuls with int8 weights per output
 * channel and uint8 activations per token, and the glue that quantizes a layer's inputs in one pass.
 *
 * Why: a CPU decode step streams every weight once, and at 16-32 rows fp32 matmuls are also bound by the
 * FMA units; int8 moves a quarter of the bytes and AVX512-VNNI (vpdpbusd) multiplies 64 u8 x s8 pairs per
 * instruction. Activations are quantized per token, asymmetric over [min(x, 0), max(x, 0)] (scale s, zero
 * point z: x ~ s (q - z)); per-tensor activation scales (ONNX Runtime's DynamicQuantizeMatMul) cost
 * SmolLM2 +40% perplexity, per-token +0.2%. So y[t, n] = s_t w_n (sum_k q[t, k] W[k, n] - z_t colsum_n).
 *
 * Packed weights: strips of 16 output columns, each [K/4][16 columns][4 k] int8 (K padded to a multiple of
 * 4 with zeros, N to 16): one 64-byte load feeds a vpdpbusd per row. A strip (9-24 KB for K = 576-1536)
 * stays in L1 while the rows go through it in tiles of 16, 8, 4, 2 and 1 rows, whose accumulators live in
 * registers; threads take strips. The epilogue applies the scales, the zero-point correction, a bias, and
 * adds into `out` for the residual connections. With AVX2 only, the same layout is widened to 16 bits (below);
 * elsewhere it runs as plain loops.
 * Numerics are exact in int32; the float epilogue is the numpy reference's (tests/test_int8_ops.py).
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_VNNI 1
#else
#define INT8_VNNI 0
#endif
#if !INT8_VNNI && defined(__AVX2__)
#define INT8_AVX2 1
#include <immintrin.h>
#else
#define INT8_AVX2 0
#endif

#define INT8_STRIP 16 /* output columns per strip */

/* One row quantized per token: x ~ scale * (q - zp), q in [0, 255]; columns K..Kp (padding) get zp. */
static void quantize_row_u8(const float *x, int64_t K, int64_t Kp, uint8_t *q, float *scale, int32_t *zp) {
    float lo = 0.0f, hi = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    float s = (hi - lo) * (1.0f / 255.0f);
    if (!(s > 0.0f)) s = 1.0f; /* an all-zero row */
    const float inv = 1.0f / s, z = nearbyintf(-lo * inv);
    for (int64_t i = 0; i < K; i++) {
        const float v = nearbyintf(x[i] * inv) + z;
        q[i] = (uint8_t)(v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v);
    }
    for (int64_t i = K; i < Kp; i++) q[i] = (uint8_t)z;
    *scale = s;
    *zp = (int32_t)z;
}

/* Rows of x [T, K] (row stride ldx), each channel times multiplier[k] if given (a smoothing factor that
 * cannot be folded into a producer: the attention output), quantized into q [T, Kp]. */
static void quantize_rows_u8(const float *x, int64_t ldx, int64_t T, int64_t K, int64_t Kp, const float *multiplier,
                             uint8_t *q, float *scale, int32_t *zp) {
#pragma omp parallel for schedule(static) if (T * K >= 262144)
    for (int64_t t = 0; t < T; t++) {
        float scaled[K];
        const float *row = x + t * ldx;
        if (multiplier) {
            for (int64_t i = 0; i < K; i++) scaled[i] = row[i] * multiplier[i];
            row = scaled;
        }
        quantize_row_u8(row, K, Kp, q + t * Kp, scale + t, zp + t);
    }
}

/* HF Llama's RMSNorm in float32 (x * rsqrt(mean(x^2) + eps), then * w), then quantized: qkv's and the MLP's
 * inputs. `normed` [K] is scratch for one row. */
static void rms_norm_quantize_rows(const float *x, const float *w, int64_t T, int64_t K, int64_t Kp, float eps,
                                   uint8_t *q, float *scale, int32_t *zp) {
#pragma omp parallel for schedule(static) if (T * K >= 262144)
    for (int64_t t = 0; t < T; t++) {
        float normed[K];
        const float *xr = x + t * K;
        float squares = 0.0f;
        for (int64_t i = 0; i < K; i++) squares += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(squares / (float)K + eps);
        for (int64_t i = 0; i < K; i++) normed[i] = xr[i] * r * w[i];
        quantize_row_u8(normed, K, Kp, q + t * Kp, scale + t, zp + t);
    }
}

/* The MLP's gating, silu(gate) * up over gate_up rows [T, 2 I] (gate | up), then quantized: down's input. */
static void silu_mul_quantize_rows(const float *gate_up, int64_t T, int64_t I, int64_t Kp, uint8_t *q,
                                   float *scale, int32_t *zp) {
#pragma omp parallel for schedule(static) if (T * I >= 262144)
    for (int64_t t = 0; t < T; t++) {
        float h[I];
        const float *g = gate_up + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        quantize_row_u8(h, I, Kp, q + t * Kp, scale + t, zp + t);
    }
}

/* The vector loops take rows in tiles (largest first: VNNI 16, 8, 4, 2, 1; AVX2 6, 4, 2, 1); `at` holds a tile's
 * codes k-major, at[k * rows + r] = row r's 4 codes at k4 = k (VNNI: the 4 bytes; AVX2: widened to 4 int16), so a
 * tile's broadcasts read one cache line per k. */
#if INT8_AVX2
typedef int64_t int8_codes4;
static int64_t int8_tile_rows(int64_t left) { return left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }
static inline int8_codes4 int8_pack4(const uint8_t *q) {
    return (int64_t)((uint64_t)q[0] | (uint64_t)q[1] << 16 | (uint64_t)q[2] << 32 | (uint64_t)q[3] << 48);
}
#else
typedef int32_t int8_codes4;
static int64_t int8_tile_rows(int64_t left) { return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }
static inline int8_codes4 int8_pack4(const uint8_t *q) {
    int32_t codes;
    memcpy(&codes, q, 4);
    return codes;
}
#endif

static void int8_pack_tiles(const uint8_t *a, int64_t T, int64_t Kp, int8_codes4 *at) {
    const int64_t K4 = Kp / 4;
    for (int64_t m = 0; m < T;) {
        const int64_t rows = int8_tile_rows(T - m);
        for (int64_t k = 0; k < K4; k++)
            for (int64_t r = 0; r < rows; r++) at[m * K4 + k * rows + r] = int8_pack4(a + (m + r) * Kp + 4 * k);
        m += rows;
    }
}

/* The epilogue of one row of one strip: `acc` int32 sums for columns n0..n0+width. */
static inline void int8_epilogue(const int32_t *acc, int64_t n0, int64_t width, float a_scale, int32_t a_zp,
                                 const float *w_scale, const int32_t *colsum, const float *bias, float *out,
                                 int accumulate) {
    for (int64_t c = 0; c < width; c++) {
        float y = (float)(acc[c] - a_zp * colsum[n0 + c]) * (a_scale * w_scale[n0 + c]);
        if (bias) y += bias[n0 + c];
        out[n0 + c] = accumulate ? out[n0 + c] + y : y;
    }
}

#if INT8_VNNI
#define INT8_PREFETCH 1024 /* bytes ahead in the weight stream: strips follow each other in memory */

/* rows x 16 columns over one strip, accumulators in registers (ROWS: a compile-time constant at each use). */
#define INT8_TILE(ROWS)                                                                                         \
    static void int8_tile_##ROWS(const int8_codes4 *at, const int8_t *w, int64_t K4, __m512i *out) {           \
        __m512i acc[ROWS];                                                                                      \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_si512();                                       \
        for (int64_t k = 0; k < K4; k++) {                                                                      \
            const __m512i wv = _mm512_loadu_si512((const void *)(w + k * 64));                                  \
            _mm_prefetch((const char *)(w + k * 64 + INT8_PREFETCH), _MM_HINT_T0);                              \
            for (int r = 0; r < ROWS; r++)                                                                      \
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(at[k * ROWS + r]), wv);                \
        }                                                                                                       \
        for (int r = 0; r < ROWS; r++) out[r] = acc[r];                                                         \
    }
INT8_TILE(16)
INT8_TILE(8)
INT8_TILE(4)
INT8_TILE(2)
INT8_TILE(1)

/* int8_epilogue for a whole strip row in one vector pass (`mask`: the strip's real columns). */
static inline void int8_epilogue16(__m512i acc, int64_t n0, __mmask16 mask, float a_scale, int32_t a_zp,
                                   const float *w_scale, const int32_t *colsum, const float *bias, float *out,
                                   int accumulate) {
    const __m512i corr = _mm512_mullo_epi32(_mm512_set1_epi32(a_zp), _mm512_maskz_loadu_epi32(mask, colsum + n0));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(a_scale), _mm512_maskz_loadu_ps(mask, w_scale + n0));
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr)), scale);
    if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + n0));
    if (accumulate) y = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out + n0), y);
    _mm512_mask_storeu_ps(out + n0, mask, y);
}
#endif

#if INT8_AVX2
/* AVX2 without VNNI: vpmaddubsw's u8 x s8 pair sums saturate at 16 bits (255 x 127 x 2 > 32767), so codes are
 * widened to 16 bits and multiplied by vpmaddwd, exact as vpdpbusd is (same layout, same results; on Zen 3
 * vpmaddwd issues twice a cycle, 32 multiply-adds against float32 FMA's 16). A tile's codes come pre-widened
 * (int8_pack_tiles: one 64-bit broadcast per row and k4); each half strip (8 columns
 * x 4 k = 32 bytes) widens to two vectors of 4 columns x 4 k, whose madds leave each column's sum in two
 * adjacent lanes, added at the end. Tiles of 6 rows: 12 accumulators + 2 weight vectors + a broadcast in 16
 * registers, each accumulator pinned to its register (an empty asm: GCC otherwise spills one, and its
 * store-to-load round trip each k doubled a tile's time). ~24 multiply-adds a cycle, where vpmaddwd + vpaddd
 * peak on Zen 3; float32's FMA peak is 16. */
/* rows x 8 columns (half `h` of a strip) -> sums[r][8 h + c]. */
#define INT8_AVX2_TILE(ROWS)                                                                                    \
    static void int8_avx2_tile_##ROWS(const int8_codes4 *at, const int8_t *w, int64_t K4, int h, int32_t *sums) {\
        __m256i lo[ROWS], hi[ROWS];                                                                             \
        for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = _mm256_setzero_si256();                                 \
        for (int64_t k = 0; k < K4; k++) {                                                                      \
            const int8_t *wk = w + k * 64 + h * 32;                                                             \
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wk));                     \
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16)));               \
            for (int r = 0; r < ROWS; r++) {                                                                    \
                const __m256i a = _mm256_set1_epi64x(at[k * ROWS + r]);                                         \
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(a, w0));                                      \
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(a, w1));                                      \
                __asm__("" : "+x"(lo[r]), "+x"(hi[r]));                                                         \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < ROWS; r++) { /* lanes (c0 c0 c1 c1 | c2 c2 c3 c3), hadd -> (c0 c1 c4 c5 | c2 c3 c6 c7) */ \
            const __m256i s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[r], hi[r]), _MM_SHUFFLE(3, 1, 2, 0)); \
            _mm256_storeu_si256((__m256i *)(sums + r * INT8_STRIP + h * 8), s);                                \
        }                                                                                                       \
    }
INT8_AVX2_TILE(6)
INT8_AVX2_TILE(4)
INT8_AVX2_TILE(2)
INT8_AVX2_TILE(1)
#endif

/* One strip over every row tile: the tile kernels and the vector epilogue, or plain loops. */
static void int8_strip(const int8_codes4 *at, const uint8_t *a, int64_t T, int64_t Kp, const int8_t *w, int64_t n0,
                       int64_t width, const float *a_scale, const int32_t *a_zp, const float *w_scale,
                       const int32_t *colsum, const float *bias, float *out, int64_t ldo, int accumulate, int simd) {
    const int64_t K4 = Kp / 4;
#if INT8_VNNI
    if (simd) {
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        __m512i acc[16];
        for (int64_t m = 0; m < T;) {
            const int64_t rows = int8_tile_rows(T - m);
            const int8_codes4 *tile = at + m * K4;
            switch (rows) {
            case 16: int8_tile_16(tile, w, K4, acc); break;
            case 8: int8_tile_8(tile, w, K4, acc); break;
            case 4: int8_tile_4(tile, w, K4, acc); break;
            case 2: int8_tile_2(tile, w, K4, acc); break;
            default: int8_tile_1(tile, w, K4, acc); break;
            }
            for (int64_t r = 0; r < rows; r++)
                int8_epilogue16(acc[r], n0, mask, a_scale[m + r], a_zp[m + r], w_scale, colsum, bias,
                                out + (m + r) * ldo, accumulate);
            m += rows;
        }
        return;
    }
#endif
#if INT8_AVX2
    if (simd) {
        int32_t sums[6 * INT8_STRIP];
        for (int64_t m = 0; m < T;) {
            const int64_t rows = int8_tile_rows(T - m);
            const int8_codes4 *tile = at + m * K4;
            for (int h = 0; h < 2; h++) switch (rows) {
                case 6: int8_avx2_tile_6(tile, w, K4, h, sums); break;
                case 4: int8_avx2_tile_4(tile, w, K4, h, sums); break;
                case 2: int8_avx2_tile_2(tile, w, K4, h, sums); break;
                default: int8_avx2_tile_1(tile, w, K4, h, sums); break;
                }
            for (int64_t r = 0; r < rows; r++)
                int8_epilogue(sums + r * INT8_STRIP, n0, width, a_scale[m + r], a_zp[m + r], w_scale, colsum, bias,
                              out + (m + r) * ldo, accumulate);
            m += rows;
        }
        return;
    }
#endif
    (void)at;
    (void)simd;
    int32_t acc[INT8_STRIP];
    for (int64_t m = 0; m < T; m++) {
        for (int c = 0; c < INT8_STRIP; c++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K4; k++)
                for (int j = 0; j < 4; j++) sum += (int32_t)a[m * Kp + 4 * k + j] * (int32_t)w[k * 64 + c * 4 + j];
            acc[c] = sum;
        }
        int8_epilogue(acc, n0, width, a_scale[m], a_zp[m], w_scale, colsum, bias, out + m * ldo, accumulate);
    }
}

/* out[T, N] (row stride ldo) = (or +=) the W8A8 product of quantized rows a [T, Kp] and packed weights.
 * Returns -1 when the tile buffer cannot be allocated. */
static int int8_linear_rows(const uint8_t *a, int64_t T, int64_t Kp, const float *a_scale, const int32_t *a_zp,
                            const int8_t *w, int64_t N, const float *w_scale, const int32_t *colsum,
                            const float *bias, float *out, int64_t ldo, int accumulate, int threads, int simd) {
    const int64_t K4 = Kp / 4, strips = (N + INT8_STRIP - 1) / INT8_STRIP;
    int8_codes4 *at = NULL;
    if ((INT8_VNNI || INT8_AVX2) && simd) {
        at = malloc((size_t)(T * K4) * sizeof *at);
        if (!at) return -1;
        int8_pack_tiles(a, T, Kp, at);
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N * Kp >= 131072)
    for (int64_t s = 0; s < strips; s++) {
        const int64_t n0 = s * INT8_STRIP, width = N - n0 < INT8_STRIP ? N - n0 : INT8_STRIP;
        int8_strip(at, a, T, Kp, w + s * K4 * 64, n0, width, a_scale, a_zp, w_scale, colsum, bias, out, ldo,
                   accumulate, simd);
    }
    free(at);
    return 0;
}

/* The entry points take numpy arrays through the buffer protocol (a raw pointer from numpy costs ~2 us in
 * Python, and a step makes hundreds of these calls) and check every buffer's size against the shapes. */
static int int8_check(const Py_buffer *view, Py_ssize_t need, const char *name) {
    if (view->len >= need) return 0;
    PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, the shapes need %zd", name, view->len, need);
    return -1;
}

#define INT8_RELEASE(...)                                                                                       \
    do {                                                                                                        \
        Py_buffer *views_[] = {__VA_ARGS__};                                                                    \
        for (size_t i_ = 0; i_ < sizeof views_ / sizeof *views_; i_++) PyBuffer_Release(views_[i_]);           \
    } while (0)

static int int8_check_rows(const Py_buffer *q, const Py_buffer *scale, const Py_buffer *zp, int64_t T, int64_t Kp) {
    return int8_check(q, T * Kp, "codes") || int8_check(scale, T * 4, "scale") || int8_check(zp, T * 4, "zero_point");
}

static PyObject *quantize_rows(PyObject *self, PyObject *args) {
    Py_buffer x, q, scale, zp, multiplier = {0};
    PyObject *multiplier_obj;
    int64_t ldx, T, K, Kp;
    if (!PyArg_ParseTuple(args, "y*LLLLOw*w*w*", &x, &ldx, &T, &K, &Kp, &multiplier_obj, &q, &scale, &zp))
        return NULL;
    int bad = multiplier_obj != Py_None && PyObject_GetBuffer(multiplier_obj, &multiplier, PyBUF_SIMPLE) < 0;
    bad = bad || K > ldx || Kp < K || int8_check(&x, (T ? (T - 1) * ldx + K : 0) * 4, "x") ||
          (multiplier.buf && int8_check(&multiplier, K * 4, "multiplier")) || int8_check_rows(&q, &scale, &zp, T, Kp);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        quantize_rows_u8(x.buf, ldx, T, K, Kp, multiplier.buf, q.buf, scale.buf, zp.buf);
        Py_END_ALLOW_THREADS
    }
    if (multiplier.buf) PyBuffer_Release(&multiplier);
    INT8_RELEASE(&x, &q, &scale, &zp);
    if (bad && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "quantize_rows: bad shapes");
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *rms_norm_quantize(PyObject *self, PyObject *args) {
    Py_buffer x, w, q, scale, zp;
    int64_t T, K, Kp;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*LLLfw*w*w*", &x, &w, &T, &K, &Kp, &eps, &q, &scale, &zp)) return NULL;
    int bad = Kp < K || int8_check(&x, T * K * 4, "x") || int8_check(&w, K * 4, "weight") ||
              int8_check_rows(&q, &scale, &zp, T, Kp);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        rms_norm_quantize_rows(x.buf, w.buf, T, K, Kp, eps, q.buf, scale.buf, zp.buf);
        Py_END_ALLOW_THREADS
    }
    INT8_RELEASE(&x, &w, &q, &scale, &zp);
    if (bad && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "rms_norm_quantize: bad shapes");
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *silu_mul_quantize(PyObject *self, PyObject *args) {
    Py_buffer gate_up, q, scale, zp;
    int64_t T, I, Kp;
    if (!PyArg_ParseTuple(args, "y*LLLw*w*w*", &gate_up, &T, &I, &Kp, &q, &scale, &zp)) return NULL;
    int bad = Kp < I || int8_check(&gate_up, T * 2 * I * 4, "gate_up") || int8_check_rows(&q, &scale, &zp, T, Kp);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        silu_mul_quantize_rows(gate_up.buf, T, I, Kp, q.buf, scale.buf, zp.buf);
        Py_END_ALLOW_THREADS
    }
    INT8_RELEASE(&gate_up, &q, &scale, &zp);
    if (bad && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "silu_mul_quantize: bad shapes");
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *int8_linear(PyObject *self, PyObject *args) {
    Py_buffer a, a_scale, a_zp, w, w_scale, colsum, out, bias = {0};
    PyObject *bias_obj;
    int64_t T, Kp, N, ldo;
    int accumulate, threads, simd;
    if (!PyArg_ParseTuple(args, "y*LLy*y*y*Ly*y*Ow*Lpip", &a, &T, &Kp, &a_scale, &a_zp, &w, &N, &w_scale, &colsum,
                          &bias_obj, &out, &ldo, &accumulate, &threads, &simd))
        return NULL;
    const int64_t strips = (N + INT8_STRIP - 1) / INT8_STRIP;
    int bad = Kp % 4 || ldo < N || (bias_obj != Py_None && PyObject_GetBuffer(bias_obj, &bias, PyBUF_SIMPLE) < 0);
    bad = bad || int8_check_rows(&a, &a_scale, &a_zp, T, Kp) || int8_check(&w, strips * INT8_STRIP * Kp, "weight") ||
          int8_check(&w_scale, N * 4, "w_scale") || int8_check(&colsum, N * 4, "colsum") ||
          (bias.buf && int8_check(&bias, N * 4, "bias")) || int8_check(&out, (T ? (T - 1) * ldo + N : 0) * 4, "out");
    int status = 0;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        status = int8_linear_rows(a.buf, T, Kp, a_scale.buf, a_zp.buf, w.buf, N, w_scale.buf, colsum.buf, bias.buf,
                                  out.buf, ldo, accumulate, threads, simd);
        Py_END_ALLOW_THREADS
    }
    INT8_RELEASE(&a, &a_scale, &a_zp, &w, &w_scale, &colsum, &out);
    if (bias.buf) PyBuffer_Release(&bias);
    if (bad && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "int8_linear: Kp must be a multiple of 4, ldo >= N");
    if (bad) return NULL;
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *int8_simd(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(INT8_VNNI ? "avx512-vnni" : INT8_AVX2 ? "avx2" : "");
}
