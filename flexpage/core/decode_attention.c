/* Decode attention over KV pages, read in place: float32 or bfloat16 pages, or quantised ones
 * (flexpage.core.quant's layout: int8 or float8 values with a bfloat16 scale per token after them).
 *
 * One decode token's query heads, grouped by KV head, attend that head's keys, which lie in runs
 * of consecutive pool slots. Each key's values are converted to float once for every query head
 * of its group; quantised pages' scales multiply the scores and the probabilities, not the values. Work is split by KV head and key
 * range (flash-decoding); the parts are merged by their running maxima and sums. AVX2 cores
 * take vector code for the conversions and products (AVX-512 cores: 16 values a vector for the
 * conversions, the scores' products and the output's sums), other cores the same loops in plain C.
 * Float32 values are read in place; a bfloat16 query over bfloat16 pages, on AVX512-BF16 cores,
 * takes bfloat16 dot products for its scores and (two keys an instruction) for its output. Int8
 * pages, on AVX512-VNNI cores, take integer products: the query as two int8 steps against 16 keys
 * a vector for the scores, each block's probabilities in 16-bit steps against two keys an
 * instruction for the output (each within about 2^-15 of float arithmetic, where int8 itself
 * rounds by 2^-8).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTORS 1
#if defined(__AVX512F__)
#define WIDE 1  /* 16-value vectors where the head dimension is a multiple of 16 */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOTS 1  /* bfloat16 keys' products 32 values an instruction (vdpbf16ps) */
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_DOTS 1  /* int8 keys' products 64 bytes an instruction (vpdpbusd), 16 keys a vector */
#endif
#endif
#endif

#define BLOCK 32      /* keys converted and scored together */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_DIM 256   /* head dimension */
#define PREFETCH 64   /* keys ahead */

enum format { INT8, FLOAT8, FLOAT32, BFLOAT16 };  /* how a pool stores a token's values */

static inline int64_t row_bytes(int64_t dim, int format) {
    return format == FLOAT32 ? 4 * dim : format == BFLOAT16 ? 2 * dim : dim + 2;
}

static inline float bf16_at(const uint8_t *p) {
    uint16_t half;
    uint32_t bits;
    float value;
    memcpy(&half, p, 2);
    bits = (uint32_t)half << 16;
    memcpy(&value, &bits, 4);
    return value;
}

/* The value of a float8 (e4m3) byte: (8 + mantissa) * 2^(exponent - 10), denormals mantissa * 2^-9
 * (the byte of NaN, never stored, reads as 480, as the vector paths read it). */
static inline float float8_value(uint8_t byte) {
    const uint32_t exponent = (byte >> 3) & 15, mantissa = byte & 7;
    float value;
    if (exponent) {
        const uint32_t bits = (exponent + 120) << 23 | mantissa << 20;
        memcpy(&value, &bits, 4);
    } else {
        value = (float)mantissa * (1.0f / 512);
    }
    return byte & 0x80 ? -value : value;
}

/* Value ``i`` of a stored row, and the row's scale. Float8 values are read as value / 2^8 (the
 * vector paths' half-precision reading, without a multiply) and their scales as scale * 2^8. */
static inline float value_at(const uint8_t *row, int64_t i, int format) {
    switch (format) {
    case INT8: return (float)(int8_t)row[i];
    case FLOAT8: return float8_value(row[i]) * (1.0f / 256);
    case FLOAT32: { float value; memcpy(&value, row + 4 * i, 4); return value; }
    default: return bf16_at(row + 2 * i);
    }
}

static inline float scale_of(const uint8_t *row, int64_t dim, int format) {
    return format == INT8 ? bf16_at(row + dim) : format == FLOAT8 ? bf16_at(row + dim) * 256.0f : 1.0f;
}

/* One KV head's query heads (a multiple of four, rows of ``dim``) as floats (``q``), and in
 * bfloat16 (``bf16``) where a bfloat16 query meets bfloat16 pages, else NULL. */
struct heads {
    const float *q;
    const uint16_t *bf16;
    const struct split *split;
};

#ifdef VECTORS
/* Every cache line of the ``bytes`` at ``row`` into the second-level cache ahead of use (into the
 * first, the keys and values ahead of two streams evicted each other: about 30% slower). */
static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)(row + at), _MM_HINT_T1);
}

/* ``x`` rounded to bfloat16 (to nearest, ties to even), as its bits. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

#ifdef __F16C__
/* float8 (e4m3) bytes, sign-extended to 16 bits, as the half-precision numbers of the same value
 * divided by 2^8 (the exponents' biases differ by 8; denormals too): shifted up by 7, the sign
 * lands in bit 15 and the exponent and mantissa below it; a negative byte's extension also sets
 * bit 14, cleared. */
static inline __m128i float8_halves8(__m128i extended) {
    return _mm_and_si128(_mm_slli_epi16(extended, 7), _mm_set1_epi16((short)0xbfff));
}
#endif

/* Values ``i`` to ``i + 7`` of a stored row as floats. */
static inline __m256 load8(const uint8_t *row, int64_t i, int format) {
    switch (format) {
    case INT8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
#ifdef __F16C__
    case FLOAT8: return _mm256_cvtph_ps(float8_halves8(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(row + i)))));
#else
    case FLOAT8: {
        float values[8];
        for (int j = 0; j < 8; j++) values[j] = value_at(row, i + j, FLOAT8);
        return _mm256_loadu_ps(values);
    }
#endif
    case FLOAT32: return _mm256_loadu_ps((const float *)(row + 4 * i));
    default: return _mm256_castsi256_ps(_mm256_slli_epi32(
                 _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
    }
}

#ifdef WIDE
/* Values ``i`` to ``i + 15`` of a stored row as floats. */
static inline __m512 load16(const uint8_t *row, int64_t i, int format) {
    switch (format) {
    case INT8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
    case FLOAT8: {  /* as ``float8_halves8``, sixteen at a time */
        const __m256i extended = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + i)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(extended, 7), _mm256_set1_epi16((short)0xbfff)));
    }
    case FLOAT32: return _mm512_loadu_ps((const float *)(row + 4 * i));
    default: return _mm512_castsi512_ps(_mm512_slli_epi32(
                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * i))), 16));
    }
}

/* The two 8-lane halves of ``v`` added: the same total in half the lanes. */
static inline __m256 halves(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

/* The eight sums of eight vectors' lanes, in order. */
static inline __m256 sums8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* e^x for x <= 0 (below -87: about 1e-38), within a few units in the last place. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  /* x - n ln 2, in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

/* ``cap * tanh(x / cap)``: scores soft-capped at ``cap`` (Gemma 2), tanh from e^-2|x/cap|. */
static inline __m256 softcap8(__m256 x, float cap) {
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(-2.0f / cap)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_or_ps(_mm256_mul_ps(t, _mm256_set1_ps(cap)), sign);
}

/* The largest of the eight lanes of ``v``. */
static inline float max8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}

/* The sum of the eight lanes of ``v``. */
static inline float sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
#endif

/* ``n`` rows of ``dim`` stored values at ``slots`` as floats, and their scales. */
static inline void convert_rows(const uint8_t *pool, const int64_t *slots, int64_t n, int64_t dim, int format,
                                float *out, float *scales) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *src = pool + slots[j] * row_bytes(dim, format);
        scales[j] = scale_of(src, dim, format);
#ifdef WIDE
        if (dim % 16 == 0) {
            for (int64_t i = 0; i < dim; i += 16) _mm512_storeu_ps(out + j * dim + i, load16(src, i, format));
            continue;
        }
#endif
#ifdef VECTORS
        if (dim % 8 == 0) {
            for (int64_t i = 0; i < dim; i += 8) _mm256_storeu_ps(out + j * dim + i, load8(src, i, format));
            continue;
        }
#endif
        for (int64_t i = 0; i < dim; i++) out[j * dim + i] = value_at(src, i, format);
    }
}

#ifdef VECTORS
/* Four query heads of a KV head, as ``heads`` has them from head ``g0`` on, and on AVX-512 cores
 * held in vectors across a block's keys (in registers where the head dimension lets them fit). */
struct held {
    const float *q;
    const uint16_t *bf16;
#ifdef WIDE
    __m512 wide[4][MAX_DIM / 16];
#endif
};

static inline __attribute__((always_inline)) void hold(struct held *held, const struct heads *heads, int64_t g0,
                                                       int64_t dim) {
    held->q = heads->q + g0 * dim;
    held->bf16 = heads->bf16 ? heads->bf16 + g0 * dim : NULL;
#ifdef WIDE
    if (dim % 16 == 0)
        for (int64_t g = 0; g < 4; g++)
            for (int64_t i = 0; i < dim; i += 16) held->wide[g][i / 16] = _mm512_loadu_ps(held->q + g * dim + i);
#endif
}

/* The four held heads' products with one stored key, as four vectors whose lanes sum to the dot
 * products (16 values a vector where the head dimension allows, halved to 8 lanes; bfloat16
 * heads and keys 32 values an instruction). */
static inline __attribute__((always_inline)) void key_dots(const struct held *held, const uint8_t *key, int64_t dim,
                                                           int format, __m256 *sums) {
#ifdef BF16_DOTS
    if (format == BFLOAT16 && held->bf16) {
        __m512 wide[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 32) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(key + 2 * i);
            for (int64_t g = 0; g < 4; g++)
                wide[g] = _mm512_dpbf16_ps(wide[g], (__m512bh)_mm512_loadu_si512(held->bf16 + g * dim + i), k);
        }
        for (int64_t g = 0; g < 4; g++) sums[g] = halves(wide[g]);
        return;
    }
#endif
#ifdef WIDE
    if (dim % 16 == 0) {
        __m512 wide[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 k = load16(key, i, format);
            for (int64_t g = 0; g < 4; g++) wide[g] = _mm512_fmadd_ps(held->wide[g][i / 16], k, wide[g]);
        }
        for (int64_t g = 0; g < 4; g++) sums[g] = halves(wide[g]);
        return;
    }
#endif
    for (int64_t g = 0; g < 4; g++) sums[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
        const __m256 k = load8(key, i, format);
        for (int64_t g = 0; g < 4; g++) sums[g] = _mm256_fmadd_ps(_mm256_loadu_ps(held->q + g * dim + i), k, sums[g]);
    }
}
#endif

/* The block's ``n`` value rows (``rows``) and their scales: read in place where the output's sums
 * convert them in registers (``accumulate_heads``), and bfloat16 ones where ``in_place``; others
 * converted to floats in ``converted``. */
static inline void value_rows(const uint8_t *pool, const int64_t *slots, int64_t n, int64_t dim, int format,
                              float *converted, const void **rows, float *scales, int in_place) {
    int raw = format == FLOAT32 || in_place;
#ifdef WIDE
    raw = raw || dim % 64 == 0;
#endif
    if (raw) {
        for (int64_t j = 0; j < n; j++) {
            rows[j] = pool + slots[j] * row_bytes(dim, format);
            scales[j] = scale_of(rows[j], dim, format);
        }
        return;
    }
    convert_rows(pool, slots, n, dim, format, converted, scales);
    for (int64_t j = 0; j < n; j++) rows[j] = converted + j * dim;
}

#ifdef INT8_DOTS
/* A KV head's query heads, each as two int8 vectors ``q = s (hi + lo / 256)`` (``s``: the head's
 * largest magnitude / 127; ``lo`` the rounding left by ``hi``, within s / 512), so that int8 keys take
 * integer products (``vpdpbusd``: unsigned by signed bytes; keys offset by 128, then ``fix``
 * takes the offset's products off) with about 2^-15 of the head's scale in error. */
struct split {
    int32_t words[MAX_GROUP][2][MAX_DIM / 4];  /* hi and lo, four bytes a word */
    int32_t fix[MAX_GROUP][2];                 /* 128 * the sum of hi, of lo */
    float scale[MAX_GROUP];                    /* s / 256 */
};

static void split_query(const float *q, int64_t heads, int64_t dim, struct split *split) {
    for (int64_t g = 0; g < heads; g++) {
        float most = 0.0f;
        for (int64_t i = 0; i < dim; i++) most = fabsf(q[g * dim + i]) > most ? fabsf(q[g * dim + i]) : most;
        const float s = most / 127.0f, inverse = most > 0.0f ? 127.0f / most : 0.0f;
        int8_t *hi = (int8_t *)split->words[g][0], *lo = (int8_t *)split->words[g][1];
        int32_t sums[2] = {0, 0};
        for (int64_t i = 0; i < dim; i++) {
            const float x = q[g * dim + i] * inverse, high = rintf(x);
            const float low = rintf((x - high) * 256.0f);
            hi[i] = (int8_t)high;
            lo[i] = (int8_t)(low > 127.0f ? 127.0f : low < -127.0f ? -127.0f : low);
            sums[0] += hi[i];
            sums[1] += lo[i];
        }
        split->fix[g][0] = 128 * sums[0];
        split->fix[g][1] = 128 * sums[1];
        split->scale[g] = s / 256.0f;
    }
}

/* Sixteen vectors of sixteen 32-bit words transposed: word i of vector j to word j of vector i. */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* ``block_scores`` for int8 keys, 16 keys a vector: each 64 bytes of 16 key rows, offset to
 * unsigned bytes and transposed so that a lane holds one key's four bytes, are multiplied by
 * every head's four query bytes at once, with no sums across lanes. */
static inline void int8_scores(const struct split *split, const uint8_t *pool, const uint8_t *values,
                               const int64_t *slots, int64_t n, int64_t dim, int64_t group,
                               float (*scores)[BLOCK], float *scales) {
    const int64_t bytes = row_bytes(dim, INT8);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const uint8_t *rows[16];
        for (int64_t j = 0; j < 16; j++) {
            const int64_t slot = slots[j0 + j < n ? j0 + j : j0];  /* keys past n: scores ignored */
            rows[j] = pool + slot * bytes;
            prefetch_row(rows[j] + PREFETCH * bytes, bytes);  /* the run's later keys */
            prefetch_row(values + (slot + PREFETCH) * bytes, bytes);
            scales[j0 + j] = scale_of(rows[j], dim, INT8);
        }
        __m512i words[MAX_DIM / 4];
        for (int64_t c = 0; c < dim; c += 64) {
            __m512i *chunk = words + c / 4;
            for (int64_t j = 0; j < 16; j++) chunk[j] = _mm512_xor_si512(_mm512_loadu_si512(rows[j] + c), flip);
            transpose16(chunk);
        }
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            __m512i hi[4], lo[4];
            for (int64_t g = 0; g < 4; g++) hi[g] = lo[g] = _mm512_setzero_si512();
            for (int64_t i = 0; i < dim / 4; i++)
                for (int64_t g = 0; g < 4; g++) {
                    hi[g] = _mm512_dpbusd_epi32(hi[g], words[i], _mm512_set1_epi32(split->words[g0 + g][0][i]));
                    lo[g] = _mm512_dpbusd_epi32(lo[g], words[i], _mm512_set1_epi32(split->words[g0 + g][1][i]));
                }
            for (int64_t g = 0; g < 4 && g0 + g < group; g++) {
                const __m512i total = _mm512_add_epi32(
                    _mm512_slli_epi32(_mm512_sub_epi32(hi[g], _mm512_set1_epi32(split->fix[g0 + g][0])), 8),
                    _mm512_sub_epi32(lo[g], _mm512_set1_epi32(split->fix[g0 + g][1])));
                _mm512_storeu_ps(scores[g0 + g] + j0,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(split->scale[g0 + g])));
            }
        }
    }
}
#endif

/* scores[g][j] = q[g] . key j for the block's ``n`` keys at ``slots``, and each key's scale;
 * the vector path converts each key into registers and uses it for every query head at once. */
static inline void block_scores(const struct heads *heads, const uint8_t *pool, const uint8_t *values, const int64_t *slots,
                                int64_t n, int64_t dim, int64_t group, int format,
                                float *converted,
                                float (*scores)[BLOCK], float *scales) {
#ifdef INT8_DOTS
    if (heads->split) {
        int8_scores(heads->split, pool, values, slots, n, dim, group, scores, scales);
        return;
    }
#endif
#ifdef VECTORS
    if (dim % 8 == 0) {  /* query heads four at a time (``q`` holds a multiple of four) */
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            struct held held;
            hold(&held, heads, g0, dim);
            for (int64_t j0 = 0; j0 < n; j0 += 8) {
                __m256 partial[4][8];
                for (int64_t j = 0; j < 8; j++) {
                    const int64_t slot = slots[j0 + j < n ? j0 + j : j0], bytes = row_bytes(dim, format);
                    const uint8_t *key = pool + slot * bytes;  /* keys past n: scores ignored */
                    prefetch_row(key + PREFETCH * bytes, bytes);  /* the run's later keys */
                    prefetch_row(values + (slot + PREFETCH) * bytes, bytes);
                    __m256 sums[4];
                    key_dots(&held, key, dim, format, sums);
                    for (int64_t g = 0; g < 4; g++) partial[g][j] = sums[g];
                    scales[j0 + j] = scale_of(key, dim, format);
                }
                for (int64_t g = 0; g < 4 && g0 + g < group; g++) _mm256_storeu_ps(scores[g0 + g] + j0, sums8(partial[g]));
            }
        }
        return;
    }
#endif
    convert_rows(pool, slots, n, dim, format, converted, scales);
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < dim; i++) dot += heads->q[g * dim + i] * converted[j * dim + i];
            scores[g][j] = dot;
        }
}

/* acc[g] += sum_j weights[g][j] * values[j] over the block's ``n`` keys. */
#ifdef BF16_DOTS
/* acc[g] += sum_j weights[g][j] * values[j] for bfloat16 value rows read in place, two keys an
 * instruction: each lane pairs key j's value with key j + 1's (interleaved within 128-bit lanes,
 * so each 32 outputs are held in that order: ``unpair``) and weighs them by their probabilities
 * rounded to bfloat16, as SDPA's bfloat16 kernel rounds them. ``weights`` has room past ``n``. */
static inline void pair_accumulate(float *acc, float (*weights)[BLOCK], const uint8_t *const *values, int64_t n,
                                   int64_t dim, int64_t group) {
    static const uint16_t zeros[MAX_DIM];
    uint32_t pairs[4][BLOCK / 2];
    if (n % 2)
        for (int64_t g = 0; g < group; g++) weights[g][n] = 0.0f;  /* the last key's partner: a zero row */
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        for (int64_t g = 0; g < 4; g++)
            for (int64_t j = 0; j < n; j += 32) {  /* 32 weights rounded: 16 pairs, in order */
                const __m512i rounded = g0 + g < group ? (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(weights[g0 + g] + j + 16), _mm512_loadu_ps(weights[g0 + g] + j)) : _mm512_setzero_si512();
                _mm512_storeu_si512(pairs[g] + j / 2, rounded);
            }
        for (int64_t i0 = 0; i0 < dim; i0 += 32) {
            __m512 low[4], high[4];
            for (int64_t g = 0; g < 4; g++) {
                low[g] = g0 + g < group ? _mm512_loadu_ps(acc + (g0 + g) * dim + i0) : _mm512_setzero_ps();
                high[g] = g0 + g < group ? _mm512_loadu_ps(acc + (g0 + g) * dim + i0 + 16) : _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < n; j += 2) {
                const __m512i a = _mm512_loadu_si512(values[j] + 2 * i0);
                const __m512i b = j + 1 < n ? _mm512_loadu_si512(values[j + 1] + 2 * i0) : _mm512_loadu_si512(zeros);
                const __m512bh first = (__m512bh)_mm512_unpacklo_epi16(a, b), last = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int64_t g = 0; g < 4; g++) {
                    const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)pairs[g][j / 2]);
                    low[g] = _mm512_dpbf16_ps(low[g], first, weight);
                    high[g] = _mm512_dpbf16_ps(high[g], last, weight);
                }
            }
            for (int64_t g = 0; g < 4 && g0 + g < group; g++) {
                _mm512_storeu_ps(acc + (g0 + g) * dim + i0, low[g]);
                _mm512_storeu_ps(acc + (g0 + g) * dim + i0 + 16, high[g]);
            }
        }
    }
}
#endif

#if defined(BF16_DOTS) || defined(INT8_DOTS)
/* Paired outputs (``pair_accumulate``'s, ``int8_accumulate``'s) in order: each 128-bit lane's
 * first four values then its last four. */
static inline void unpair(float *acc, int64_t count) {
    for (int64_t i0 = 0; i0 < count; i0 += 32) {
        float held[32];
        memcpy(held, acc + i0, sizeof(held));
        for (int64_t lane = 0; lane < 4; lane++)
            for (int64_t p = 0; p < 4; p++) {
                acc[i0 + 8 * lane + p] = held[4 * lane + p];
                acc[i0 + 8 * lane + 4 + p] = held[16 + 4 * lane + p];
            }
    }
}
#endif

#ifdef INT8_DOTS
/* acc[g] += sum_j weights[g][j] * values[j] for int8 value rows read in place, two keys an
 * instruction (``vpdpwssd``): each head's weights in the block as 16-bit integers of its largest
 * weight / 32767, each lane pairing key j's value with key j + 1's (so outputs are held in
 * ``unpair``'s order). Integer sums over a block, then one float multiply-add per output. */
static inline void int8_accumulate(float *acc, float (*weights)[BLOCK], const uint8_t *const *values, int64_t n,
                                   int64_t dim, int64_t group) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t heads = group - g0 < 4 ? group - g0 : 4;
        int32_t pairs[4][BLOCK / 2];  /* each two 16-bit weights, key j's in the low half */
        float unit[4];
        const __mmask16 first = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        const __mmask16 second = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
        for (int64_t g = 0; g < heads; g++) {
            const __m512 a = _mm512_maskz_loadu_ps(first, weights[g0 + g]);
            const __m512 b = _mm512_maskz_loadu_ps(second, weights[g0 + g] + 16);
            const float most = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
            const __m512 step = _mm512_set1_ps(most > 0.0f ? 32767.0f / most : 0.0f);
            unit[g] = most / 32767.0f;
            _mm256_storeu_si256((__m256i *)pairs[g], _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, step))));
            _mm256_storeu_si256((__m256i *)(pairs[g] + 8), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, step))));
        }
        for (int64_t i0 = 0; i0 < dim; i0 += 64) {
            __m512i out[4][4];
            for (int64_t g = 0; g < 4; g++)
                for (int64_t c = 0; c < 4; c++) out[g][c] = _mm512_setzero_si512();
            for (int64_t j = 0; j < n; j += 2) {
                const uint8_t *a = values[j] + i0, *b = values[j + 1 < n ? j + 1 : j] + i0;  /* past n: weight 0 */
                __m512i v[4];
                for (int64_t h = 0; h < 2; h++) {
                    const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(a + 32 * h)));
                    const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 * h)));
                    v[2 * h] = _mm512_unpacklo_epi16(x, y);
                    v[2 * h + 1] = _mm512_unpackhi_epi16(x, y);
                }
                for (int64_t g = 0; g < heads; g++) {
                    const __m512i w = _mm512_set1_epi32(pairs[g][j / 2]);
                    for (int64_t c = 0; c < 4; c++) out[g][c] = _mm512_dpwssd_epi32(out[g][c], v[c], w);
                }
            }
            for (int64_t g = 0; g < heads; g++)
                for (int64_t c = 0; c < 4; c++) {
                    float *o = acc + (g0 + g) * dim + i0 + 16 * c;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(out[g][c]), _mm512_set1_ps(unit[g]),
                                                        _mm512_loadu_ps(o)));
                }
        }
    }
}
#endif

#ifdef WIDE
/* ``heads`` (1 to 4, a constant where inlined) query heads' acc += sum_j weights[g][j] * values[j]
 * over stored value rows, 64 outputs of each in registers at a time, each row loaded and converted
 * once for all the heads. */
static inline __attribute__((always_inline)) void accumulate_heads(float *acc, float (*weights)[BLOCK],
                                                                   const uint8_t *const *values, int64_t n,
                                                                   int64_t dim, int format, int64_t heads) {
    for (int64_t i0 = 0; i0 < dim; i0 += 64) {
        __m512 out[4][4];
        for (int64_t g = 0; g < heads; g++)
            for (int64_t c = 0; c < 4; c++) out[g][c] = _mm512_loadu_ps(acc + g * dim + i0 + 16 * c);
        for (int64_t j = 0; j < n; j++) {
            __m512 row[4];
            for (int64_t c = 0; c < 4; c++) row[c] = load16(values[j], i0 + 16 * c, format);
            for (int64_t g = 0; g < heads; g++) {
                const __m512 weight = _mm512_set1_ps(weights[g][j]);
                for (int64_t c = 0; c < 4; c++) out[g][c] = _mm512_fmadd_ps(weight, row[c], out[g][c]);
            }
        }
        for (int64_t g = 0; g < heads; g++)
            for (int64_t c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * dim + i0 + 16 * c, out[g][c]);
    }
}
#endif

/* acc[g] += sum_j weights[g][j] * values[j] over the block's ``n`` value rows (``value_rows``'s). */
static inline void block_accumulate(float *acc, float (*weights)[BLOCK], const void *const *rows, int64_t n,
                                    int64_t dim, int64_t group, int format) {
#ifdef WIDE
    if (dim % 64 == 0) {  /* rows as stored */
        const uint8_t *const *values = (const uint8_t *const *)rows;
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            switch (group - g0) {
            case 1: accumulate_heads(acc + g0 * dim, weights + g0, values, n, dim, format, 1); break;
            case 2: accumulate_heads(acc + g0 * dim, weights + g0, values, n, dim, format, 2); break;
            case 3: accumulate_heads(acc + g0 * dim, weights + g0, values, n, dim, format, 3); break;
            default: accumulate_heads(acc + g0 * dim, weights + g0, values, n, dim, format, 4);
            }
        }
        return;
    }
#endif
    const float *const *values = (const float *const *)rows;  /* rows of floats */
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

/* One query head's block of ``n`` scores: scaled by their keys' scales (and soft-capped at ``cap``
 * where it is positive), then turned into probabilities against the new running max ``m`` (and
 * weighed by the values' scales); the sum ``l`` updated. Returns the factor the head's earlier
 * output shrinks by. */
static inline float block_softmax(float *row, int64_t n, const float *key_scale, const float *value_scale,
                                  float cap, float *m, float *l) {
    float top = *m, sum = 0.0f;
#ifdef VECTORS
    if (n % 8 == 0) {
        __m256 most = _mm256_set1_ps(top), total = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            __m256 score = _mm256_mul_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(key_scale + j));
            if (cap > 0.0f) score = softcap8(score, cap);
            _mm256_storeu_ps(row + j, score);
            most = _mm256_max_ps(most, score);
        }
        top = max8(most);
        for (int64_t j = 0; j < n; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(top)));
            total = _mm256_add_ps(total, p);
            _mm256_storeu_ps(row + j, _mm256_mul_ps(p, _mm256_loadu_ps(value_scale + j)));
        }
        sum = sum8(total);
    } else
#endif
    {
        for (int64_t j = 0; j < n; j++) {
            row[j] *= key_scale[j];
            if (cap > 0.0f) row[j] = cap * tanhf(row[j] / cap);
            top = row[j] > top ? row[j] : top;
        }
        for (int64_t j = 0; j < n; j++) {
            row[j] = expf(row[j] - top);
            sum += row[j];
            row[j] *= value_scale[j];
        }
    }
    const float shrink = top > *m ? expf(*m - top) : 1.0f;  /* past the first blocks the max seldom grows */
    *l = *l * shrink + sum;
    *m = top;
    return shrink;
}

/* The slot of key ``index`` (in key order, ascending across calls) of the runs. */
static inline int64_t slot_of(const int64_t *starts, const int64_t *counts, int64_t runs, int64_t index,
                              int64_t *run, int64_t *before) {
    while (*run < runs - 1 && index >= *before + counts[*run]) *before += counts[(*run)++];
    return starts[*run] + index - *before;
}

/* Keys ``lo`` to ``hi`` of one KV head: running max ``m``, sum ``l`` and unnormalised ``acc``
 * for each of the ``group`` query heads ``q`` (scaled by the softmax scale already). */
static inline void attend_part(const float *q, const uint8_t *keys, const uint8_t *values, int64_t dim,
                               int64_t group, const int64_t *starts, const int64_t *counts, int64_t runs,
                               int64_t lo, int64_t hi, int format, float scale, float cap,
                               int bf16_query, float *m, float *l, float *acc) {
    float converted[BLOCK * MAX_DIM];  /* rows of ``dim`` floats, packed: no cache-set conflicts */
    float scores[MAX_GROUP][BLOCK];
    float key_scale[BLOCK + 8], value_scale[BLOCK];
    const void *rows[BLOCK];
    int64_t slots[BLOCK];
    int64_t run = 0, before = 0;
    struct heads heads = {q, NULL, NULL};
#ifdef INT8_DOTS
    struct split split;
    if (format == INT8 && dim % 64 == 0) {
        split_query(q, (group + 3) / 4 * 4, dim, &split);
        heads.split = &split;
    }
#endif
#ifdef BF16_DOTS
    uint16_t rounded[MAX_GROUP * MAX_DIM];
    if (format == BFLOAT16 && bf16_query && dim % 32 == 0) {  /* bfloat16 holds the query exactly */
        for (int64_t i = 0; i < (group + 3) / 4 * 4 * dim; i++) rounded[i] = to_bf16(q[i]);
        heads.bf16 = rounded;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int64_t first = lo; first < hi; first += BLOCK) {
        const int64_t n = hi - first < BLOCK ? hi - first : BLOCK;
        for (int64_t j = 0; j < n; j++) slots[j] = slot_of(starts, counts, runs, first + j, &run, &before);
        block_scores(&heads, keys, values, slots, n, dim, group, format, converted, scores, key_scale);
        for (int64_t j = 0; j < n; j++) key_scale[j] *= scale;
        value_rows(values, slots, n, dim, format, converted, rows, value_scale, heads.bf16 != NULL);
        for (int64_t g = 0; g < group; g++) {
            const float shrink = block_softmax(scores[g], n, key_scale, value_scale, cap, m + g, l + g);
            if (shrink != 1.0f)
                for (int64_t i = 0; i < dim; i++) acc[g * dim + i] *= shrink;
        }
#ifdef BF16_DOTS
        if (heads.bf16) {
            pair_accumulate(acc, scores, (const uint8_t *const *)rows, n, dim, group);
            continue;
        }
#endif
#ifdef INT8_DOTS
        if (heads.split) {
            int8_accumulate(acc, scores, (const uint8_t *const *)rows, n, dim, group);
            continue;
        }
#endif
        block_accumulate(acc, scores, rows, n, dim, group, format);
    }
#if defined(BF16_DOTS) || defined(INT8_DOTS)
    if (heads.bf16 || heads.split) unpair(acc, group * dim);
#endif
}

/* The decode tokens of ``rows`` sequences. query [rows, kv_heads, group, dim] float; pools
 * [kv_heads, pool_slots, row] contiguous, each row a token's values stored as ``format``
 * (quantised: then its bfloat16 scale); sequence ``r``'s keys lie in runs ``first_run[r]`` to
 * ``first_run[r + 1]``, run ``i`` holding ``counts[i]`` keys from slot ``starts[i]``;
 * ``bf16_query``: nonzero where the query came in bfloat16 (its values exact in bfloat16, its
 * output rounded to it), so that bfloat16 pages
 * take bfloat16 products: the query's and the probabilities' (rounded to bfloat16, as SDPA's
 * bfloat16 kernel rounds them); ``cap``: scores soft-capped, ``cap * tanh(score / cap)``, where it is
 * positive; out [rows, kv_heads, group, dim].
 * Returns 0, or 1 for shapes it does not take, 2 where memory ran out. */
int flexpage_decode_attention(const float *query, const uint8_t *key_pool, const uint8_t *value_pool,
                              int64_t rows, int64_t kv_heads, int64_t pool_slots, int64_t dim, int64_t group,
                              const int64_t *first_run, const int64_t *starts, const int64_t *counts,
                              float scale, float cap, int64_t part_keys, int format, int bf16_query, float *out) {
    if (group > MAX_GROUP || dim > MAX_DIM || rows <= 0 || part_keys <= 0 || format < INT8 || format > BFLOAT16)
        return 1;
    /* work items: (sequence, KV head, part of its keys), sequence by sequence */
    int64_t items = 0;
    int64_t *first_item = malloc(sizeof(int64_t) * (rows + 1)), *widths = malloc(sizeof(int64_t) * rows);
    if (!first_item || !widths) {
        free(first_item); free(widths);
        return 2;
    }
    for (int64_t r = 0; r < rows; r++) {
        widths[r] = 0;
        for (int64_t i = first_run[r]; i < first_run[r + 1]; i++) widths[r] += counts[i];
        first_item[r] = items;
        items += kv_heads * ((widths[r] + part_keys - 1) / part_keys);
        if (widths[r] <= 0) {
            free(first_item); free(widths);
            return 1;
        }
    }
    first_item[rows] = items;
    const int64_t padded = (group + 3) / 4 * 4;  /* query heads per KV head, padded with zeros */
    float *q = calloc(rows * kv_heads * padded * dim, sizeof(float));
    float *m = malloc(sizeof(float) * items * group);
    float *l = malloc(sizeof(float) * items * group);
    float *acc = malloc(sizeof(float) * items * group * dim);
    if (!q || !m || !l || !acc) {
        free(first_item); free(widths); free(q); free(m); free(l); free(acc);
        return 2;
    }
    for (int64_t head = 0; head < rows * kv_heads; head++)
        for (int64_t i = 0; i < group * dim; i++) q[head * padded * dim + i] = query[head * group * dim + i];
    const int64_t head_bytes = pool_slots * row_bytes(dim, format);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        int64_t r = 0;
        while (item >= first_item[r + 1]) r++;
        const int64_t parts = (first_item[r + 1] - first_item[r]) / kv_heads;
        const int64_t head = (item - first_item[r]) / parts, part = (item - first_item[r]) % parts;
        const int64_t lo = part * part_keys, hi = lo + part_keys < widths[r] ? lo + part_keys : widths[r];
        const int64_t *run_starts = starts + first_run[r], *run_counts = counts + first_run[r];
        const int64_t runs = first_run[r + 1] - first_run[r];
#define ATTEND(DIM, FORMAT) attend_part(q + (r * kv_heads + head) * padded * dim, key_pool + head * head_bytes,    \
                                        value_pool + head * head_bytes, DIM, group, run_starts, run_counts, runs, \
                                        lo, hi, FORMAT, scale, cap, bf16_query, m + item * group,                 \
                                        l + item * group, acc + item * group * dim)
#define FORMATS(DIM) switch (format) {                                                    \
        case INT8: ATTEND(DIM, INT8); break;                                              \
        case FLOAT8: ATTEND(DIM, FLOAT8); break;                                          \
        case FLOAT32: ATTEND(DIM, FLOAT32); break;                                        \
        default: ATTEND(DIM, BFLOAT16);                                                   \
        }
        /* formats and the common head sizes as constants: their loops specialised whole */
        if (dim == 64) FORMATS(64)
        else if (dim == 128) FORMATS(128)
        else FORMATS(dim)
#undef FORMATS
#undef ATTEND
    }
    /* each (sequence, KV head, query head): its parts merged by their maxima and sums */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t parts = (first_item[r + 1] - first_item[r]) / kv_heads;
        for (int64_t head = 0; head < kv_heads; head++) {
            const int64_t first = first_item[r] + head * parts;
            for (int64_t g = 0; g < group; g++) {
                float top = -FLT_MAX, total = 0.0f;
                for (int64_t part = 0; part < parts; part++) {
                    const float mp = m[(first + part) * group + g];
                    top = mp > top ? mp : top;
                }
                float *o = out + ((r * kv_heads + head) * group + g) * dim;
                memset(o, 0, sizeof(float) * dim);
                for (int64_t part = 0; part < parts; part++) {
                    const int64_t at = (first + part) * group + g;
                    const float weight = expf(m[at] - top);
                    total += l[at] * weight;
                    for (int64_t i = 0; i < dim; i++) o[i] += weight * acc[at * dim + i];
                }
                for (int64_t i = 0; i < dim; i++) o[i] /= total;
            }
        }
    }
    free(first_item); free(widths); free(q); free(m); free(l); free(acc);
    return 0;
}
