/* Linear layers for a few rows: y = x W^T + b, every weight read once per call, in float32 or
 * bfloat16.
 *
 * A decode step multiplies each weight by one row per sequence, so its time is the time to read
 * the weight. The library GEMMs, blocked for many rows, read a weight for one or two rows well
 * below the speed at which the CPU reads memory (MKL's float32 product at about a third of it on
 * some AVX-512 cores, oneDNN's and MKL's bfloat16 ones at about half). Here each weight row is read
 * once from start to end, a contiguous stream the CPU's prefetchers follow (rows read side by side,
 * a row's length apart, they follow less well), and multiplied into up to four input rows as it
 * passes (float32: fused multiply-adds, 16 or 8 values a vector; bfloat16 on AVX512-BF16 cores:
 * the pair dot product into float32 sums, as the library GEMMs keep them, rounded once; bfloat16
 * elsewhere: each weight value widened to float32 in registers, a shift, and the float32 products,
 * so the weight is read at half float32's bytes). Output features are split over OpenMP threads in
 * blocks. Built for AVX2 and AVX-512 cores (``flexpage_row_linear_formats``).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define WEIGHT_ROWS 16  /* output features per block (a thread's unit of work) */
#define INPUT_ROWS 4    /* input rows multiplied per pass over a weight row (further ones read it again, from cache) */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
#define CHAINS 4        /* independent sums per weight row (an input row's partial sums, or the rows') */

#define FLOAT32 1   /* the formats, and their bits in ``flexpage_row_linear_formats`` */
#define BFLOAT16 2
#define WIDENED 4   /* float32 rows, bfloat16 weight and output: bfloat16 where the CPU has no dot products */

#if defined(__AVX512F__)
#define F32_BUILT FLOAT32
#define LANES 16  /* float32 values a vector */
typedef __m512 vector;
static inline vector zeros(void) { return _mm512_setzero_ps(); }
static inline vector load(const float *p) { return _mm512_loadu_ps(p); }
static inline vector multiply_add(vector a, vector b, vector c) { return _mm512_fmadd_ps(a, b, c); }
static inline vector add(vector a, vector b) { return _mm512_add_ps(a, b); }
static inline float total(vector v) { return _mm512_reduce_add_ps(v); }
static inline vector load_bf16(const uint16_t *p) {  /* 16 bfloat16 values as float32: their bits shifted up */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_BUILT FLOAT32
#define LANES 8
typedef __m256 vector;
static inline vector zeros(void) { return _mm256_setzero_ps(); }
static inline vector load(const float *p) { return _mm256_loadu_ps(p); }
static inline vector multiply_add(vector a, vector b, vector c) { return _mm256_fmadd_ps(a, b, c); }
static inline vector add(vector a, vector b) { return _mm256_add_ps(a, b); }
static inline float total(vector v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
static inline vector load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define F32_BUILT 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_BUILT BFLOAT16
#else
#define BF16_BUILT 0
#endif

/* bfloat16 is offered wherever float32 is: by dot products, else widened */
int flexpage_row_linear_formats(void) { return F32_BUILT | (BF16_BUILT || F32_BUILT ? BFLOAT16 : 0); }

static inline float bf16_value(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint16_t bf16_round(float value) {  /* to nearest, ties to even (NaN stays NaN) */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if F32_BUILT
/* ``n_out`` features of ``n_in`` (<= INPUT_ROWS) float32 rows starting at ``x``, one weight row
 * at a time; a tail of inputs past the last whole vector summed one by one. Each input row keeps
 * ``CHAINS / n_in`` partial sums (at least one) over alternate vectors, so that fewer rows still
 * keep several multiply-adds in flight (one sum would wait on each one's latency). ``format``:
 * FLOAT32 (weight, bias and output float32) or WIDENED (bfloat16, the output rounded once). */
static inline __attribute__((always_inline)) void f32_block(int format, const float *x, const void *w,
                                                            const void *bias, int64_t in, int64_t out, int64_t n_in,
                                                            int64_t n_out, void *y) {
    const int64_t chains = n_in >= CHAINS ? 1 : CHAINS / n_in;
    const int64_t step = chains * LANES;
    const int64_t whole = in / LANES * LANES, unrolled = in / step * step;
    const int wide = format == WIDENED;
    for (int64_t i = 0; i < n_out; i++) {
        const float *row = wide ? NULL : (const float *)w + i * in;
        const uint16_t *half_row = wide ? (const uint16_t *)w + i * in : NULL;
        vector acc[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = zeros();
        for (int64_t k = 0; k < unrolled; k += step)
            for (int64_t c = 0; c < chains; c++) {
                const char *at = wide ? (const char *)(half_row + k + c * LANES) : (const char *)(row + k + c * LANES);
                __builtin_prefetch(at + PREFETCH_BYTES, 0, 0);
                const vector ws = wide ? load_bf16(half_row + k + c * LANES) : load(row + k + c * LANES);
                for (int r = 0; r < n_in; r++)
                    acc[r * chains + c] = multiply_add(ws, load(x + r * in + k + c * LANES), acc[r * chains + c]);
            }
        for (int64_t k = unrolled; k < whole; k += LANES) {
            const vector ws = wide ? load_bf16(half_row + k) : load(row + k);
            for (int r = 0; r < n_in; r++) acc[r * chains] = multiply_add(ws, load(x + r * in + k), acc[r * chains]);
        }
        const float b = !bias ? 0.0f : wide ? bf16_value(((const uint16_t *)bias)[i]) : ((const float *)bias)[i];
        for (int r = 0; r < n_in; r++) {
            for (int64_t c = 1; c < chains; c++) acc[r * chains] = add(acc[r * chains], acc[r * chains + c]);
            float sum = total(acc[r * chains]);
            for (int64_t k = whole; k < in; k++) sum += (wide ? bf16_value(half_row[k]) : row[k]) * x[r * in + k];
            if (wide)
                ((uint16_t *)y)[r * out + i] = bf16_round(sum + b);
            else
                ((float *)y)[r * out + i] = sum + b;
        }
    }
}
#endif

#if BF16_BUILT
/* As ``f32_block`` for bfloat16 rows, 32 values a pair dot product (a masked tail). */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                                             int64_t in, int64_t out, int64_t n_in, int64_t n_out,
                                                             uint16_t *y) {
    for (int64_t i = 0; i < n_out; i++) {
        const uint16_t *row = w + i * in;
        __m512 acc[INPUT_ROWS];
        for (int r = 0; r < INPUT_ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 32) {
            const __mmask32 mask = in - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (in - k)) - 1u);
            const __m512i ws = _mm512_maskz_loadu_epi16(mask, row + k);
            for (int r = 0; r < INPUT_ROWS && r < n_in; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)ws, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * in + k));
        }
        const float b = bias ? bf16_value(bias[i]) : 0.0f;
        for (int r = 0; r < n_in; r++) y[r * out + i] = bf16_round(_mm512_reduce_add_ps(acc[r]) + b);
    }
}
#endif

/* The features from ``first`` of input rows from ``row`` (``n_out`` and ``n_in`` of them). */
static inline __attribute__((always_inline)) void block(int format, const void *x, const void *weight,
                                                        const void *bias, int64_t in, int64_t out, int64_t row,
                                                        int64_t first, int64_t n_in, int64_t n_out, void *y) {
#if F32_BUILT
    if (format == FLOAT32)
        f32_block(FLOAT32, (const float *)x + row * in, (const float *)weight + first * in,
                  bias ? (const float *)bias + first : NULL, in, out, n_in, n_out, (float *)y + row * out + first);
    if (format == WIDENED)
        f32_block(WIDENED, (const float *)x + row * in, (const uint16_t *)weight + first * in,
                  bias ? (const uint16_t *)bias + first : NULL, in, out, n_in, n_out,
                  (uint16_t *)y + row * out + first);
#endif
#if BF16_BUILT
    if (format == BFLOAT16)
        bf16_block((const uint16_t *)x + row * in, (const uint16_t *)weight + first * in,
                   bias ? (const uint16_t *)bias + first : NULL, in, out, n_in, n_out,
                   (uint16_t *)y + row * out + first);
#endif
}

/* ``y [rows, out] = x [rows, in] W^T [in, out] + bias [out]`` (``bias`` may be NULL), all
 * row-major, of ``format``. Returns 0, or 1 where this CPU's build lacks the format. */
static inline __attribute__((always_inline)) int row_linear(int format, const void *x, const void *weight,
                                                            const void *bias, int64_t rows, int64_t in, int64_t out,
                                                            void *y) {
    if (!(flexpage_row_linear_formats() & (format == WIDENED ? BFLOAT16 : format)))
        return 1;
    const int64_t blocks = (out + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * WEIGHT_ROWS;
        const int64_t n_out = out - first < WEIGHT_ROWS ? out - first : WEIGHT_ROWS;
        for (int64_t r = 0; r < rows; r += INPUT_ROWS) {
            switch (rows - r < INPUT_ROWS ? rows - r : INPUT_ROWS) {  /* constants: the accumulators stay in registers */
            case 1: block(format, x, weight, bias, in, out, r, first, 1, n_out, y); break;
            case 2: block(format, x, weight, bias, in, out, r, first, 2, n_out, y); break;
            case 3: block(format, x, weight, bias, in, out, r, first, 3, n_out, y); break;
            default: block(format, x, weight, bias, in, out, r, first, INPUT_ROWS, n_out, y);
            }
        }
    }
    return 0;
}

int flexpage_f32_linear(const float *x, const float *weight, const float *bias, int64_t rows, int64_t in,
                        int64_t out, float *y) {
    return row_linear(FLOAT32, x, weight, bias, rows, in, out, y);
}

/* bfloat16 by dot products where built, else with the rows widened to float32 once up front and
 * the weight widened in registers (``WIDENED``). Returns 2 where the rows' copy cannot be allocated. */
int flexpage_bf16_linear(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, int64_t rows, int64_t in,
                         int64_t out, uint16_t *y) {
#if BF16_BUILT
    return row_linear(BFLOAT16, x, weight, bias, rows, in, out, y);
#else
    float *wide = malloc((size_t)(rows * in) * sizeof(float) + 1);
    if (!wide)
        return 2;
    for (int64_t k = 0; k < rows * in; k++) wide[k] = bf16_value(x[k]);
    const int status = row_linear(WIDENED, wide, weight, bias, rows, in, out, y);
    free(wide);
    return status;
#endif
}
