/* A bfloat16 linear layer for a few rows: y = x W^T + b, every weight read once per call.
 *
 * A decode step multiplies each weight by one row per sequence, so its time is the time to read
 * the weight. oneDNN's and MKL's bfloat16 GEMMs, blocked for many rows, read a weight for a few
 * rows at about half the speed at which they read a float32 one. Here eight weight rows at a time
 * are streamed once, each 32-value slice multiplied into every input row with the AVX512-BF16
 * pair dot product (float32 sums, as the library GEMMs keep them), output features split over
 * OpenMP threads. Built only where the compiler targets AVX512-BF16.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define WEIGHT_ROWS 8  /* output features per block: eight weight rows streamed together */
#define INPUT_ROWS 2   /* input rows multiplied per pass over a block */

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

/* ``n_out`` (<= WEIGHT_ROWS) features of ``n_in`` (<= INPUT_ROWS) rows starting at ``x``. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t in, int64_t out,
                         int64_t n_in, int64_t n_out, uint16_t *y) {
    __m512 acc[WEIGHT_ROWS][INPUT_ROWS];
    for (int i = 0; i < WEIGHT_ROWS; i++)
        for (int r = 0; r < INPUT_ROWS; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
        const __mmask32 mask = in - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (in - k)) - 1u);
        __m512i xs[INPUT_ROWS];
        for (int r = 0; r < INPUT_ROWS; r++)
            xs[r] = r < n_in ? _mm512_maskz_loadu_epi16(mask, x + r * in + k) : _mm512_setzero_si512();
        for (int i = 0; i < WEIGHT_ROWS; i++) {
            if (i >= n_out)
                break;
            const __m512i ws = _mm512_maskz_loadu_epi16(mask, w + i * in + k);
            for (int r = 0; r < INPUT_ROWS; r++)
                if (r < n_in)
                    acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)ws, (__m512bh)xs[r]);
        }
    }
    for (int i = 0; i < n_out; i++) {
        const float b = bias ? bf16_value(bias[i]) : 0.0f;
        for (int r = 0; r < n_in; r++)
            y[r * out + i] = bf16_round(_mm512_reduce_add_ps(acc[i][r]) + b);
    }
}

int flexpage_bf16_linear_built(void) { return 1; }

/* ``y [rows, out] = x [rows, in] W^T [in, out] + bias [out]`` (``bias`` may be NULL), all
 * row-major bfloat16. Returns 0. */
int flexpage_bf16_linear(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, int64_t rows,
                         int64_t in, int64_t out, uint16_t *y) {
    const int64_t blocks = (out + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * WEIGHT_ROWS;
        const int64_t n_out = out - first < WEIGHT_ROWS ? out - first : WEIGHT_ROWS;
        const uint16_t *w = weight + first * in, *b_ = bias ? bias + first : NULL;
        for (int64_t r = 0; r < rows; r += INPUT_ROWS) {
            const int64_t n_in = rows - r < INPUT_ROWS ? rows - r : INPUT_ROWS;
            if (n_out == WEIGHT_ROWS && n_in == INPUT_ROWS)  /* constants: the accumulators stay in registers */
                block(x + r * in, w, b_, in, out, INPUT_ROWS, WEIGHT_ROWS, y + r * out + first);
            else if (n_out == WEIGHT_ROWS && n_in == 1)  /* a lone row, or an odd count's last */
                block(x + r * in, w, b_, in, out, 1, WEIGHT_ROWS, y + r * out + first);
            else
                block(x + r * in, w, b_, in, out, n_in, n_out, y + r * out + first);
        }
    }
    return 0;
}
#else
int flexpage_bf16_linear_built(void) { return 0; }

int flexpage_bf16_linear(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, int64_t rows,
                         int64_t in, int64_t out, uint16_t *y) {
    (void)x; (void)weight; (void)bias; (void)rows; (void)in; (void)out; (void)y;
    return 1;  /* not built for this CPU: the caller keeps F.linear */
}
#endif
