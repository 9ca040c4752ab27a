/* Decode attention over quantised KV pages (flexpage.core.quant's layout), read in place.
 *
 * One decode token's query heads, grouped by KV head, attend that head's keys: int8 or float8
 * values with a bfloat16 scale per token after them, lying in runs of consecutive pool slots.
 * Each key's values are converted to float once for every query head of its group; the scales
 * multiply the scores and the probabilities, not the values. Work is split by KV head and key
 * range (flash-decoding); the parts are merged by their running maxima and sums. AVX2 cores
 * take vector code for the conversions and products, other cores the same loops in plain C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTORS 1
#endif

#define BLOCK 32      /* keys converted and scored together */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_DIM 256   /* head dimension */

static inline float bf16_at(const int8_t *p) {
    uint16_t half;
    uint32_t bits;
    float value;
    memcpy(&half, p, 2);
    bits = (uint32_t)half << 16;
    memcpy(&value, &bits, 4);
    return value;
}

/* ``n`` rows of ``dim`` stored values at ``slots`` as floats (``lut``: float8 bytes' values). */
static inline void convert_rows(const int8_t *pool, const int64_t *slots, int64_t n, int64_t dim,
                                const float *lut, float (*out)[MAX_DIM], float *scales) {
    for (int64_t j = 0; j < n; j++) {
        const int8_t *src = pool + slots[j] * (dim + 2);
        float *dst = out[j];
        scales[j] = bf16_at(src + dim);
#ifdef VECTORS
        if (dim % 8 == 0) {
            for (int64_t i = 0; i < dim; i += 8) {
                const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
                _mm256_storeu_ps(dst + i, lut ? _mm256_i32gather_ps(lut, _mm256_and_si256(wide, _mm256_set1_epi32(255)), 4)
                                              : _mm256_cvtepi32_ps(wide));
            }
            continue;
        }
#endif
        if (lut) {
            for (int64_t i = 0; i < dim; i++) dst[i] = lut[(uint8_t)src[i]];
        } else {
            for (int64_t i = 0; i < dim; i++) dst[i] = (float)src[i];
        }
    }
}

#ifdef VECTORS
/* The eight sums of eight vectors' lanes, in order. */
static inline __m256 sums8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

/* scores[g][j] = q[g] . keys[j] for the block's ``n`` keys (padded rows give ignored scores). */
static inline void block_scores(const float *q, float (*keys)[MAX_DIM], int64_t n, int64_t dim, int64_t group,
                                float (*scores)[BLOCK]) {
#ifdef VECTORS
    if (dim % 8 == 0) {
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            for (int64_t g = 0; g < group; g++) {
                __m256 partial[8];
                for (int64_t j = 0; j < 8; j++) {
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t i = 0; i < dim; i += 8)
                        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + i), _mm256_loadu_ps(keys[j0 + j] + i), sum);
                    partial[j] = sum;
                }
                _mm256_storeu_ps(scores[g] + j0, sums8(partial));
            }
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < dim; i++) dot += q[g * dim + i] * keys[j][i];
            scores[g][j] = dot;
        }
}

/* acc[g] += sum_j weights[g][j] * values[j] over the block's ``n`` keys. */
static inline void block_accumulate(float *acc, float (*weights)[BLOCK], float (*values)[MAX_DIM], int64_t n,
                                    int64_t dim, int64_t group) {
#ifdef VECTORS
    if (dim % 64 == 0) {  /* eight vectors of the output held in registers over the block */
        for (int64_t g = 0; g < group; g++)
            for (int64_t i0 = 0; i0 < dim; i0 += 64) {
                __m256 out[8];
                for (int64_t c = 0; c < 8; c++) out[c] = _mm256_loadu_ps(acc + g * dim + i0 + 8 * c);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 weight = _mm256_broadcast_ss(&weights[g][j]);
                    for (int64_t c = 0; c < 8; c++)
                        out[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values[j] + i0 + 8 * c), out[c]);
                }
                for (int64_t c = 0; c < 8; c++) _mm256_storeu_ps(acc + g * dim + i0 + 8 * c, out[c]);
            }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += weights[g][j] * values[j][i];
}

/* The slot of key ``index`` (in key order, ascending across calls) of the runs. */
static inline int64_t slot_of(const int64_t *starts, const int64_t *counts, int64_t runs, int64_t index,
                              int64_t *run, int64_t *before) {
    while (*run < runs - 1 && index >= *before + counts[*run]) *before += counts[(*run)++];
    return starts[*run] + index - *before;
}

/* Keys ``lo`` to ``hi`` of one KV head: running max ``m``, sum ``l`` and unnormalised ``acc``
 * for each of the ``group`` query heads ``q`` (scaled by the softmax scale already). */
static inline void attend_part(const float *q, const int8_t *keys, const int8_t *values, int64_t dim,
                               int64_t group, const int64_t *starts, const int64_t *counts, int64_t runs,
                               int64_t lo, int64_t hi, const float *lut, float *m, float *l, float *acc) {
    float converted[BLOCK][MAX_DIM] = {{0}};
    float scores[MAX_GROUP][BLOCK];
    float key_scale[BLOCK], value_scale[BLOCK];
    int64_t slots[BLOCK];
    int64_t run = 0, before = 0;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int64_t first = lo; first < hi; first += BLOCK) {
        const int64_t n = hi - first < BLOCK ? hi - first : BLOCK;
        for (int64_t j = 0; j < n; j++) slots[j] = slot_of(starts, counts, runs, first + j, &run, &before);
        convert_rows(keys, slots, n, dim, lut, converted, key_scale);
        block_scores(q, converted, n, dim, group, scores);
        convert_rows(values, slots, n, dim, lut, converted, value_scale);
        for (int64_t g = 0; g < group; g++) {
            float top = m[g], sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                scores[g][j] *= key_scale[j];
                top = scores[g][j] > top ? scores[g][j] : top;
            }
            const float shrink = expf(m[g] - top);
            for (int64_t j = 0; j < n; j++) {
                scores[g][j] = expf(scores[g][j] - top);
                sum += scores[g][j];
                scores[g][j] *= value_scale[j];
            }
            for (int64_t i = 0; i < dim; i++) acc[g * dim + i] *= shrink;
            l[g] = l[g] * shrink + sum;
            m[g] = top;
        }
        block_accumulate(acc, scores, converted, n, dim, group);
    }
}

/* query [kv_heads, group, dim] float; pools [kv_heads, pool_slots, dim + 2] (int8 or float8 bytes,
 * contiguous); ``runs`` runs of ``counts[r]`` keys from slot ``starts[r]``, ``width`` keys in all;
 * ``lut``: the 256 float values of float8 bytes, or NULL for int8; out [kv_heads, group, dim].
 * Returns 0, or 1 for shapes it does not take, 2 where memory ran out. */
int flexpage_quantised_decode(const float *query, const int8_t *key_pool, const int8_t *value_pool,
                              int64_t kv_heads, int64_t pool_slots, int64_t dim, int64_t group,
                              const int64_t *starts, const int64_t *counts, int64_t runs, int64_t width,
                              float scale, int64_t part_keys, const float *lut, float *out) {
    if (group > MAX_GROUP || dim > MAX_DIM || width <= 0 || part_keys <= 0 || runs <= 0) return 1;
    const int64_t parts = (width + part_keys - 1) / part_keys;
    float *q = malloc(sizeof(float) * kv_heads * group * dim);
    float *m = malloc(sizeof(float) * kv_heads * parts * group);
    float *l = malloc(sizeof(float) * kv_heads * parts * group);
    float *acc = malloc(sizeof(float) * kv_heads * parts * group * dim);
    if (!q || !m || !l || !acc) {
        free(q); free(m); free(l); free(acc);
        return 2;
    }
    for (int64_t i = 0; i < kv_heads * group * dim; i++) q[i] = query[i] * scale;
    const int64_t head_bytes = pool_slots * (dim + 2);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < kv_heads * parts; item++) {
        const int64_t head = item / parts, part = item % parts;
        const int64_t lo = part * part_keys, hi = lo + part_keys < width ? lo + part_keys : width;
#define ATTEND(DIM, LUT) attend_part(q + head * group * dim, key_pool + head * head_bytes,          \
                                    value_pool + head * head_bytes, DIM, group, starts, counts, runs, lo, hi, \
                                    LUT, m + item * group, l + item * group, acc + item * group * dim)
        /* the common head sizes as constants: their loops unrolled whole */
        if (dim == 64 && !lut) ATTEND(64, NULL);
        else if (dim == 64) ATTEND(64, lut);
        else if (dim == 128 && !lut) ATTEND(128, NULL);
        else if (dim == 128) ATTEND(128, lut);
        else ATTEND(dim, lut);
#undef ATTEND
    }
    for (int64_t head = 0; head < kv_heads; head++) {
        for (int64_t g = 0; g < group; g++) {
            float top = -INFINITY, total = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                const float mp = m[(head * parts + part) * group + g];
                top = mp > top ? mp : top;
            }
            float *o = out + (head * group + g) * dim;
            memset(o, 0, sizeof(float) * dim);
            for (int64_t part = 0; part < parts; part++) {
                const int64_t at = (head * parts + part) * group + g;
                const float weight = expf(m[at] - top);
                total += l[at] * weight;
                for (int64_t i = 0; i < dim; i++) o[i] += weight * acc[at * dim + i];
            }
            for (int64_t i = 0; i < dim; i++) o[i] /= total;
        }
    }
    free(q); free(m); free(l); free(acc);
    return 0;
}
