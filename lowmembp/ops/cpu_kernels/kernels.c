/* The CPU fast path's one-pass kernels (lowmembp.ops.cpu_kernels compiles this file on first use and loads it with
 * ctypes). Plain C on float / uint16 / uint8 pointers, no Python or torch headers.
 *
 * Each kernel reproduces the PyTorch reference's arithmetic bit for bit: IEEE fp32 operations one at a time (the
 * build passes -ffp-contract=off, so no multiply-add is fused, and never -ffast-math), fp16 / bf16 converted to fp32
 * exactly and rounded back to nearest-even. NaN outputs are the one place where libraries differ (which operand's
 * payload, which NaN a conversion writes): the kernels report them and the caller recomputes such a tensor with
 * ATen's own ops.
 *
 * Threads: an OpenMP team of `threads` (the caller passes torch.get_num_threads()), each thread one contiguous range
 * of whole 1024-element chunks (whole code bytes and cache lines per thread).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD == 1 || FLT_EVAL_METHOD == 2 || FLT_EVAL_METHOD < 0
#error "fp32 expressions must be evaluated in fp32 (FLT_EVAL_METHOD 0 or 16) for bit-exact results"
#endif

#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define CHUNK 1024

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* fp16 -> fp32, exact (every fp16 value is an fp32 value; NaN payloads kept). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = bits_f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t r = two_w < (1u << 27) ? f_bits(denormalized) : f_bits(normalized);
    return bits_f(sign | r);
}

/* fp32 -> fp16, round to nearest even, overflow to ±inf (NaN: the caller recomputes). */
static inline uint16_t f32_to_f16(float f) {
    float base = (bits_f(f_bits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f_bits(f);
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = bits_f((bias >> 1) + 0x07800000u) + base;
    uint32_t b = f_bits(base);
    uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float bf16_to_f32(uint16_t h) { return bits_f((uint32_t)h << 16); }

/* fp32 -> bf16, round to nearest even, overflow to ±inf (NaN: the caller recomputes). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_V8 1 /* AVX2 registers of 8 fp32 lanes, FMA and the F16C conversions */
/* elements [i, i + 8) of x (of dtype dt, a constant where inlined) as fp32, exactly (an fp16 NaN's payload aside) */
static inline __attribute__((always_inline)) __m256 load8_f32(const void *x, int64_t i, const int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
#endif

/* element i of x (of dtype dt, a constant where inlined) as fp32, exactly */
static inline __attribute__((always_inline)) float load_f32(const void *x, int64_t i, const int dt) {
    if (dt == DT_F32) return ((const float *)x)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)x)[i]);
    return f16_to_f32(((const uint16_t *)x)[i]);
}

/* the thread's range [lo, hi) of n elements: whole chunks, the last thread takes the rest */
static inline void thread_range(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    int64_t per = (chunks + nt - 1) / nt;
    *lo = t * per * CHUNK;
    *hi = (t + 1) * per * CHUNK;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* This OpenMP thread's number t of a team of nt (0 of 1 outside a parallel region or without OpenMP). */
static inline void team_member(int *t, int *nt) {
    *t = 0;
    *nt = 1;
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *nt = omp_get_num_threads();
#endif
}

/* This OpenMP thread's range of n elements (the whole of it outside a parallel region or without OpenMP). */
static inline void team_range(int64_t n, int64_t *lo, int64_t *hi) {
    int t, nt;
    team_member(&t, &nt);
    thread_range(n, t, nt, lo, hi);
}

/* This OpenMP thread's share [r0, r1) of `rows` whole rows (all of them outside a parallel region). */
static inline void team_rows(int64_t rows, int64_t *r0, int64_t *r1) {
    int t, nt;
    team_member(&t, &nt);
    int64_t per = (rows + nt - 1) / nt;
    *r0 = t * per < rows ? t * per : rows;
    *r1 = *r0 + per < rows ? *r0 + per : rows;
}

/* The body of an entry point over n elements: the OR of CALL (an expression of lo and hi, the bits it reports)
 * over one OpenMP team of `threads` (the entry point's argument) each on its own range, or over [0, n) on the
 * caller's thread when threads <= 1; returned as int. */
#define RETURN_OR_OVER_THREADS(n, CALL)                                                                                \
    uint32_t acc = 0;                                                                                                  \
    if (threads <= 1) {                                                                                                \
        int64_t lo = 0, hi = (n);                                                                                      \
        acc = (CALL);                                                                                                  \
    } else {                                                                                                           \
        _Pragma("omp parallel num_threads(threads) reduction(| : acc)")                                                \
        {                                                                                                              \
            int64_t lo, hi;                                                                                            \
            team_range((n), &lo, &hi);                                                                                 \
            if (lo < hi) acc |= (CALL);                                                                                \
        }                                                                                                              \
    }                                                                                                                  \
    return (int)acc

/* ---------------------------------------------------------------------------------------------- 2-bit codes */
/* one function per input type (a loop with a type switch inside does not vectorise) */
#define CODE(v) ((uint32_t)((v) > t0) + (uint32_t)((v) > t1) + (uint32_t)((v) > t2))
#define DEFINE_CODES2(NAME, T, LOAD, CHECK)                                                                            \
    static uint32_t NAME(const T *x, int64_t lo, int64_t hi, float t0, float t1, float t2, uint8_t *out) {             \
        uint32_t bad = 0;                                                                                              \
        int64_t full = lo + ((hi - lo) & ~(int64_t)3);                                                                 \
        int64_t j;                                                                                                     \
        _Pragma("omp simd reduction(| : bad)")                                                                         \
        for (j = lo / 4; j < full / 4; j++) {                                                                          \
            T a = x[4 * j], b = x[4 * j + 1], c = x[4 * j + 2], d = x[4 * j + 3];                                      \
            bad |= CHECK(a) | CHECK(b) | CHECK(c) | CHECK(d);                                                          \
            out[j] = (uint8_t)(CODE(LOAD(a)) | CODE(LOAD(b)) << 2 | CODE(LOAD(c)) << 4 | CODE(LOAD(d)) << 6);          \
        }                                                                                                              \
        if (full < hi) { /* the ragged end: missing elements are code 0 */                                             \
            uint32_t byte = 0;                                                                                         \
            for (int64_t i = full; i < hi; i++) {                                                                      \
                bad |= CHECK(x[i]);                                                                                    \
                byte |= CODE(LOAD(x[i])) << (2 * (i - full));                                                          \
            }                                                                                                          \
            out[full / 4] = (uint8_t)byte;                                                                             \
        }                                                                                                              \
        return bad;                                                                                                    \
    }

/* What the caller checks about the input, as bits: 1 = some element is NaN or ±inf; 2 = some bf16 element is
 * nonzero and below 2^-124 in magnitude (native bf16 kernels may flush an activation's result there: the caller then
 * computes it in fp32). */
static inline float id_f32(float v) { return v; }
static inline uint32_t check_f32(float v) { return (f_bits(v) & 0x7F800000u) == 0x7F800000u; }
static inline uint32_t check_bf16(uint16_t h) {
    return (uint32_t)((h & 0x7F80u) == 0x7F80u) | (uint32_t)((h & 0x7F80u) <= (2u << 7) && (h & 0x7FFFu) != 0) << 1;
}
static inline uint32_t check_f16(uint16_t h) { return (h & 0x7C00u) == 0x7C00u; }
DEFINE_CODES2(codes2_f32, float, id_f32, check_f32)
DEFINE_CODES2(codes2_bf16, uint16_t, bf16_to_f32, check_bf16)
DEFINE_CODES2(codes2_f16, uint16_t, f16_to_f32, check_f16)

#if defined(__AVX512F__)
/* AVX-512: 16 elements per step. The codes are a thermometer (x > t2 implies x > t1 implies x > t0; NaN fails all),
 * so code bit 1 is [x > t1] and code bit 0 the parity [x > t0] ^ [x > t1] ^ [x > t2]: three compare masks give the
 * two bit planes of 16 codes, which interleave into their 32-bit word of four code bytes. */
static inline uint32_t spread16(uint32_t v) { /* bit k -> bit 2k */
#if defined(__BMI2__)
    return _pdep_u32(v, 0x55555555u);
#endif
    v = (v | v << 8) & 0x00FF00FFu;
    v = (v | v << 4) & 0x0F0F0F0Fu;
    v = (v | v << 2) & 0x33333333u;
    return (v | v << 1) & 0x55555555u;
}

static inline uint32_t codes16(__m512 v, __m512 t0, __m512 t1, __m512 t2, __mmask16 *nonfinite) {
    __mmask16 m0 = _mm512_cmp_ps_mask(v, t0, _CMP_GT_OQ);
    __mmask16 m1 = _mm512_cmp_ps_mask(v, t1, _CMP_GT_OQ);
    __mmask16 m2 = _mm512_cmp_ps_mask(v, t2, _CMP_GT_OQ);
    /* |v| > FLT_MAX or unordered: ±inf and NaN */
    *nonfinite |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
    return spread16((uint32_t)(m0 ^ m1 ^ m2)) | spread16((uint32_t)m1) << 1;
}

static uint32_t codes2_avx512(const void *x, int dtype, int64_t lo, int64_t hi, float t0, float t1, float t2,
                              uint8_t *out, int64_t *done) {
    __m512 v0 = _mm512_set1_ps(t0), v1 = _mm512_set1_ps(t1), v2 = _mm512_set1_ps(t2);
    __mmask16 nonfinite = 0, tiny = 0;
    int64_t full = lo + ((hi - lo) & ~(int64_t)15), i;
    for (i = lo; i < full; i += 16) {
        __m512 v;
        _mm_prefetch((const char *)x + (i + 512) * (dtype == DT_F32 ? 4 : 2), _MM_HINT_T0);
        if (dtype == DT_F32) {
            v = _mm512_loadu_ps((const float *)x + i);
        } else {
            __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)));
            if (dtype == DT_BF16) {
                v = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
                /* 1 <= (h & 0x7FFF) <= 0x17F: nonzero and below 2^-124 */
                __m512i mag = _mm512_sub_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x7FFF)), _mm512_set1_epi32(1));
                tiny |= _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x17F));
            } else {
                v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)));
            }
        }
        uint32_t word = codes16(v, v0, v1, v2, &nonfinite);
        memcpy(out + i / 4, &word, 4);
    }
    *done = full;
    return (uint32_t)(nonfinite != 0) | (uint32_t)(tiny != 0) << 1;
}
#endif

static uint32_t codes2_range(const void *x, int dtype, int64_t lo, int64_t hi, float t0, float t1, float t2,
                             uint8_t *out) {
    uint32_t bad = 0;
#if defined(__AVX512F__)
    bad = codes2_avx512(x, dtype, lo, hi, t0, t1, t2, out, &lo); /* the rest (under 16 elements) below */
    if (lo == hi) return bad;
#endif
    if (dtype == DT_F32) return bad | codes2_f32((const float *)x, lo, hi, t0, t1, t2, out);
    if (dtype == DT_BF16) return bad | codes2_bf16((const uint16_t *)x, lo, hi, t0, t1, t2, out);
    return bad | codes2_f16((const uint16_t *)x, lo, hi, t0, t1, t2, out);
}

/* the check bits of x alone (no codes) */
#define DEFINE_CHECK(NAME, T, CHECK)                                                                                   \
    static uint32_t NAME(const T *x, int64_t lo, int64_t hi) {                                                         \
        uint32_t bad = 0;                                                                                              \
        _Pragma("omp simd reduction(| : bad)")                                                                         \
        for (int64_t i = lo; i < hi; i++) bad |= CHECK(x[i]);                                                          \
        return bad;                                                                                                    \
    }
DEFINE_CHECK(check_range_f32, float, check_f32)
DEFINE_CHECK(check_range_bf16, uint16_t, check_bf16)
DEFINE_CHECK(check_range_f16, uint16_t, check_f16)

static uint32_t check_range(const void *x, int dtype, int64_t lo, int64_t hi) {
    if (dtype == DT_F32) return check_range_f32((const float *)x, lo, hi);
    if (dtype == DT_BF16) return check_range_bf16((const uint16_t *)x, lo, hi);
    return check_range_f16((const uint16_t *)x, lo, hi);
}

/* the check bits of n elements */
int lmbp_check(const void *x, int dtype, int64_t n, int threads) {
    RETURN_OR_OVER_THREADS(n, check_range(x, dtype, lo, hi));
}

/* Packed 2-bit codes sum_j [x > t_j] of n elements (element i in byte i / 4, bits 2 (i % 4)); returns the check
 * bits of x (the codes are written either way). */
int lmbp_codes2(const void *x, int dtype, int64_t n, float t0, float t1, float t2, uint8_t *out, int threads) {
    RETURN_OR_OVER_THREADS(n, codes2_range(x, dtype, lo, hi, t0, t1, t2, out));
}

/* ------------------------------------------------------------------------------------ dx = dy * slope[code] */
/* 16 elements at a time: their four code bytes read as one word, each lane shifts out its code and selects */
#define DEFINE_SLOPES2(NAME, T, LOAD, STORE)                                                                           \
    static uint32_t NAME(const T *dy, const uint8_t *codes, int64_t lo, int64_t hi, const float *s, T *dx) {           \
        uint32_t nan = 0;                                                                                              \
        int64_t full = lo + ((hi - lo) & ~(int64_t)15);                                                                \
        float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];                                                              \
        for (int64_t j = lo / 16; j < full / 16; j++) { /* 16 elements: four code bytes, one 32-bit word */            \
            uint32_t w = (uint32_t)codes[4 * j] | (uint32_t)codes[4 * j + 1] << 8 |                                    \
                         (uint32_t)codes[4 * j + 2] << 16 | (uint32_t)codes[4 * j + 3] << 24;                          \
            _Pragma("omp simd reduction(| : nan)")                                                                     \
            for (int k = 0; k < 16; k++) {                                                                             \
                uint32_t m = 1u << (2 * k); /* a constant per lane: no variable shift needed */                        \
                float sk = w & (m << 1) ? (w & m ? s3 : s2) : (w & m ? s1 : s0);                                       \
                float v = sk * LOAD(dy[16 * j + k]);                                                                   \
                nan |= (uint32_t)(v != v);                                                                             \
                dx[16 * j + k] = STORE(v);                                                                             \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t i = full; i < hi; i++) {                                                                          \
            float v = s[(codes[i / 4] >> (2 * (i % 4))) & 3u] * LOAD(dy[i]);                                           \
            nan |= (uint32_t)(v != v);                                                                                 \
            dx[i] = STORE(v);                                                                                          \
        }                                                                                                              \
        return nan;                                                                                                    \
    }

DEFINE_SLOPES2(slopes2_f32, float, id_f32, id_f32)
DEFINE_SLOPES2(slopes2_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SLOPES2(slopes2_f16, uint16_t, f16_to_f32, f32_to_f16)

#if defined(__AVX512F__)
/* AVX-512: 16 elements per step; each lane shifts its code out of the broadcast word of four code bytes and picks
 * its slope with one permute. Rounding to bf16 is the integer round-to-nearest-even of f32_to_bf16, to fp16 the
 * hardware conversion (round to nearest even as well; NaN is reported, not compared). */
static uint32_t slopes2_avx512(const void *dy, int dtype, const uint8_t *codes, int64_t lo, int64_t hi,
                               const float *s, void *dx, int64_t *done) {
    __m512 table = _mm512_setr_ps(s[0], s[1], s[2], s[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i three = _mm512_set1_epi32(3);
    __mmask16 nan = 0;
    int64_t full = lo + ((hi - lo) & ~(int64_t)15), i;
    size_t es = dtype == DT_F32 ? 4 : 2;
    for (i = lo; i < full; i += 16) {
        _mm_prefetch((const char *)dy + (i + 512) * es, _MM_HINT_T0);
        uint32_t w;
        memcpy(&w, codes + i / 4, 4);
        __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w), shifts), three);
        __m512 sk = _mm512_permutexvar_ps(idx, table);
        __m512 d;
        if (dtype == DT_F32) {
            d = _mm512_loadu_ps((const float *)dy + i);
        } else {
            __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)dy + i));
            d = dtype == DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                 : _mm512_cvtph_ps(h);
        }
        __m512 v = _mm512_mul_ps(sk, d);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (dtype == DT_F32) {
            _mm512_storeu_ps((float *)dx + i, v);
        } else if (dtype == DT_BF16) {
            __m512i u = _mm512_castps_si512(v);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)dx + i), _mm512_cvtepi32_epi16(u));
        } else {
            _mm256_storeu_si256((__m256i *)((uint16_t *)dx + i),
                                _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
    *done = full;
    return nan != 0;
}
#endif

static uint32_t slopes2_range(const void *dy, int dtype, const uint8_t *codes, int64_t lo, int64_t hi,
                              const float *s, void *dx) {
    uint32_t nan = 0;
#if defined(__AVX512F__)
    nan = slopes2_avx512(dy, dtype, codes, lo, hi, s, dx, &lo); /* the rest (under 16 elements) below */
    if (lo == hi) return nan;
#endif
    if (dtype == DT_F32) return nan | slopes2_f32((const float *)dy, codes, lo, hi, s, (float *)dx);
    if (dtype == DT_BF16) return nan | slopes2_bf16((const uint16_t *)dy, codes, lo, hi, s, (uint16_t *)dx);
    return nan | slopes2_f16((const uint16_t *)dy, codes, lo, hi, s, (uint16_t *)dx);
}

/* dx = s[code] * dy in fp32, rounded once to dy's dtype (dx has it too), over n elements with 2-bit codes `codes`
 * and the four slopes `s`. Returns 1 when some product is NaN (its bits are ATen's only for fp32), else 0. */
int lmbp_slopes2(const void *dy, int dtype, const uint8_t *codes, int64_t n, const float *s, void *dx, int threads) {
    RETURN_OR_OVER_THREADS(n, slopes2_range(dy, dtype, codes, lo, hi, s, dx));
}

/* ------------------------------------------------------------------------------- Mesa's 8-bit quantiser */
/* the counter-based uniform of element i: lowbias32(i * 0x9E3779B9 + seed), its top 24 bits times 2^-24; the loops
 * pass h = i * 0x9E3779B9 + seed as a running sum (HASH_STEP per element), which saves a multiply per element */
#define HASH_STEP 0x9E3779B9u
static inline float hash_uniform(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    return (float)(h >> 8) * 0x1.0p-24f;
}

/* Short rows (inner < SHORT_ROW) whose group pattern, inner * groups elements, fits PATTERN_MAX: the pattern's
 * per-group values expanded per element (and repeated to at least SHORT_ROW elements), so that the element loops run
 * over whole patterns, without a group lookup or a short loop per row. */
#define SHORT_ROW 256
#define PATTERN_MAX 4096
static inline int64_t pattern_length(int64_t inner, int64_t groups) {
    int64_t period = inner * groups;
    if (inner >= SHORT_ROW || period > PATTERN_MAX) return 0;
    return period >= SHORT_ROW ? period : period * ((SHORT_ROW + period - 1) / period);
}
static inline void expand_pattern(const float *a, const float *b, int64_t inner, int64_t groups, int64_t len,
                                  float *pa, float *pb) {
    int64_t period = inner * groups;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t k = 0; k < inner; k++) {
            pa[g * inner + k] = a[g];
            pb[g * inner + k] = b[g];
        }
    }
    for (int64_t j = period; j < len; j++) {
        pa[j] = pa[j - period];
        pb[j] = pb[j - period];
    }
}

#define QUANTIZE8_ELEMENT(LOAD, X, SC, B, HASH)                                                                        \
    {                                                                                                                  \
        float v = (LOAD(X) - (B)) * (SC);                                                                              \
        v = v + hash_uniform(HASH);                                                                                    \
        nan |= (uint32_t)(v != v);                                                                                     \
        /* floor(v) clamped to [0, 255]: clamped first (max / min, a NaN flagged above), truncation is floor there */ \
        v = v > 0.0f ? v : 0.0f;                                                                                       \
        v = v < 255.0f ? v : 255.0f;                                                                                   \
        q = (uint8_t)(int32_t)v;                                                                                       \
    }
#define DEFINE_QUANTIZE8(NAME, T, LOAD)                                                                                \
    static uint32_t NAME(const T *x, int64_t lo, int64_t hi, int64_t inner, int64_t groups, const float *scale,        \
                         const float *beta, uint32_t seed, uint8_t *out) {                                             \
        uint32_t nan = 0;                                                                                              \
        int64_t plen = pattern_length(inner, groups);                                                                  \
        if (plen) {                                                                                                    \
            float sp[PATTERN_MAX], bp[PATTERN_MAX];                                                                    \
            expand_pattern(scale, beta, inner, groups, plen, sp, bp);                                                  \
            for (int64_t i = lo, o = lo % plen; i < hi; o = 0) {                                                       \
                int64_t len = plen - o < hi - i ? plen - o : hi - i, k;                                                \
                const T *xr = x + i;                                                                                   \
                const float *sr = sp + o, *br = bp + o;                                                                \
                uint8_t *qr = out + i, q;                                                                              \
                uint32_t h = (uint32_t)i * HASH_STEP + seed;                                                           \
                _Pragma("omp simd reduction(| : nan) linear(h : HASH_STEP)")                                           \
                for (k = 0; k < len; k++) {                                                                            \
                    QUANTIZE8_ELEMENT(LOAD, xr[k], sr[k], br[k], h)                                                    \
                    h += HASH_STEP;                                                                                    \
                    qr[k] = q;                                                                                         \
                }                                                                                                      \
                i += len;                                                                                              \
            }                                                                                                          \
            return nan;                                                                                                \
        }                                                                                                              \
        int64_t row = lo / inner, g = row % groups;                                                                    \
        for (int64_t i = lo; i < hi;) { /* row by row: one group's scale and beta per row of `inner` elements */       \
            int64_t end = (row + 1) * inner < hi ? (row + 1) * inner : hi;                                             \
            float sc = scale[g], b = beta[g];                                                                          \
            const T *xr = x + i;                                                                                       \
            uint8_t *qr = out + i, q;                                                                                  \
            if (end - i > (1 << 30)) end = i + (1 << 30); /* 32-bit lanes: the index modulo 2^32 */                    \
            uint32_t h = (uint32_t)i * HASH_STEP + seed, len = (uint32_t)(end - i);                                    \
            _Pragma("omp simd reduction(| : nan) linear(h : HASH_STEP)")                                               \
            for (uint32_t k = 0; k < len; k++) {                                                                       \
                QUANTIZE8_ELEMENT(LOAD, xr[k], sc, b, h)                                                               \
                h += HASH_STEP;                                                                                        \
                qr[k] = q;                                                                                             \
            }                                                                                                          \
            i = end;                                                                                                   \
            if (i == (row + 1) * inner) {                                                                              \
                row++;                                                                                                 \
                g = g + 1 == groups ? 0 : g + 1;                                                                       \
            }                                                                                                          \
        }                                                                                                              \
        return nan;                                                                                                    \
    }
DEFINE_QUANTIZE8(quantize8_f32, float, id_f32)
DEFINE_QUANTIZE8(quantize8_bf16, uint16_t, bf16_to_f32)
DEFINE_QUANTIZE8(quantize8_f16, uint16_t, f16_to_f32)

static uint32_t quantize8_range(const void *x, int dtype, int64_t lo, int64_t hi, int64_t inner, int64_t groups,
                                const float *scale, const float *beta, uint32_t seed, uint8_t *out) {
    if (dtype == DT_F32) return quantize8_f32((const float *)x, lo, hi, inner, groups, scale, beta, seed, out);
    if (dtype == DT_BF16) return quantize8_bf16((const uint16_t *)x, lo, hi, inner, groups, scale, beta, seed, out);
    return quantize8_f16((const uint16_t *)x, lo, hi, inner, groups, scale, beta, seed, out);
}

/* Mesa's codes: clamp(floor((x - beta[g]) * scale[g] + u_i), 0, 255), g = (i / inner) % groups. Returns 1 when
 * some value before the clamp is NaN (its code is ATen's conversion of NaN: the caller recomputes), else 0. */
int lmbp_quantize8(const void *x, int dtype, int64_t n, int64_t inner, int64_t groups, const float *scale,
                   const float *beta, uint32_t seed, uint8_t *out, int threads) {
    RETURN_OR_OVER_THREADS(n, quantize8_range(x, dtype, lo, hi, inner, groups, scale, beta, seed, out));
}

#define DEFINE_DEQUANTIZE8(NAME, T, STORE)                                                                             \
    static uint32_t NAME(const uint8_t *q, int64_t lo, int64_t hi, int64_t inner, int64_t groups,                      \
                         const float *step, const float *beta, T *y) {                                                 \
        uint32_t nan = 0;                                                                                              \
        int64_t plen = pattern_length(inner, groups);                                                                  \
        if (plen) { /* short rows: the pattern's step and beta per element (see expand_pattern) */                     \
            float sp[PATTERN_MAX], bp[PATTERN_MAX];                                                                    \
            expand_pattern(step, beta, inner, groups, plen, sp, bp);                                                   \
            for (int64_t i = lo, o = lo % plen; i < hi; o = 0) {                                                       \
                int64_t len = plen - o < hi - i ? plen - o : hi - i, k;                                                \
                const float *sr = sp + o, *br = bp + o;                                                                \
                _Pragma("omp simd reduction(| : nan)")                                                                 \
                for (k = 0; k < len; k++) {                                                                            \
                    float v = (float)q[i + k] * sr[k];                                                                 \
                    v = v + br[k];                                                                                     \
                    nan |= (uint32_t)(v != v);                                                                         \
                    y[i + k] = STORE(v);                                                                               \
                }                                                                                                      \
                i += len;                                                                                              \
            }                                                                                                          \
            return nan;                                                                                                \
        }                                                                                                              \
        int64_t row = lo / inner, g = row % groups;                                                                    \
        for (int64_t i = lo; i < hi;) {                                                                                \
            int64_t end = (row + 1) * inner < hi ? (row + 1) * inner : hi;                                             \
            float st = step[g], b = beta[g];                                                                           \
            int64_t k;                                                                                                 \
            _Pragma("omp simd reduction(| : nan)")                                                                     \
            for (k = i; k < end; k++) {                                                                                \
                float v = (float)q[k] * st;                                                                            \
                v = v + b;                                                                                             \
                nan |= (uint32_t)(v != v);                                                                             \
                y[k] = STORE(v);                                                                                       \
            }                                                                                                          \
            i = end;                                                                                                   \
            row++;                                                                                                     \
            g = g + 1 == groups ? 0 : g + 1;                                                                           \
        }                                                                                                              \
        return nan;                                                                                                    \
    }
DEFINE_DEQUANTIZE8(dequantize8_f32, float, id_f32)
DEFINE_DEQUANTIZE8(dequantize8_bf16, uint16_t, f32_to_bf16)
DEFINE_DEQUANTIZE8(dequantize8_f16, uint16_t, f32_to_f16)

static uint32_t dequantize8_range(const uint8_t *q, int64_t lo, int64_t hi, int64_t inner, int64_t groups,
                                  const float *step, const float *beta, void *y, int dtype) {
    if (dtype == DT_F32) return dequantize8_f32(q, lo, hi, inner, groups, step, beta, (float *)y);
    if (dtype == DT_BF16) return dequantize8_bf16(q, lo, hi, inner, groups, step, beta, (uint16_t *)y);
    return dequantize8_f16(q, lo, hi, inner, groups, step, beta, (uint16_t *)y);
}

/* Mesa's dequantised values q * step[g] + beta[g] in fp32, rounded once to `dtype`. Returns 1 when some value is
 * NaN, else 0. */
int lmbp_dequantize8(const uint8_t *q, int64_t n, int64_t inner, int64_t groups, const float *step,
                     const float *beta, void *y, int dtype, int threads) {
    RETURN_OR_OVER_THREADS(n, dequantize8_range(q, lo, hi, inner, groups, step, beta, y, dtype));
}

/* ------------------------------------------------------------------------- Mesa's EMA quantiser, in one call */
/* Per row of `inner` elements (group g = row % groups): the row's minimum and maximum (plain comparisons: a NaN is
 * left out here and reported by `bad`), whether some element is NaN or ±inf (`bad`) or a negative zero (`negz`). */
static inline uint32_t nonfinite_f32(float v) { return (f_bits(v) & 0x7F800000u) == 0x7F800000u; }
static inline uint32_t nonfinite_16(uint16_t h, uint16_t exp) { return (h & exp) == exp; }
#define DEFINE_MINMAX8(NAME, T, LOAD, BAD, NEGZ)                                                                       \
    static void NAME(const T *x, int64_t lo, int64_t hi, int64_t inner, int64_t groups, float *mn, float *mx,          \
                     uint8_t *negz, uint32_t *bad) {                                                                   \
        uint32_t b = 0;                                                                                                \
        int64_t plen = pattern_length(inner, groups);                                                                  \
        if (plen) { /* short rows: per element of the pattern (see expand_pattern), then per group */                  \
            float pmn[PATTERN_MAX], pmx[PATTERN_MAX];                                                                  \
            uint8_t pnz[PATTERN_MAX];                                                                                  \
            for (int64_t j = 0; j < plen; j++) {                                                                       \
                pmn[j] = FLT_MAX;                                                                                      \
                pmx[j] = -FLT_MAX;                                                                                     \
                pnz[j] = 0;                                                                                            \
            }                                                                                                          \
            for (int64_t i = lo, o = lo % plen; i < hi; o = 0) {                                                       \
                int64_t len = plen - o < hi - i ? plen - o : hi - i, k;                                                \
                const T *xr = x + i;                                                                                   \
                float *lmn = pmn + o, *lmx = pmx + o;                                                                  \
                uint8_t *lnz = pnz + o;                                                                                \
                _Pragma("omp simd reduction(| : b)")                                                                   \
                for (k = 0; k < len; k++) {                                                                            \
                    float v = LOAD(xr[k]);                                                                             \
                    lmn[k] = v < lmn[k] ? v : lmn[k];                                                                  \
                    lmx[k] = v > lmx[k] ? v : lmx[k];                                                                  \
                    b |= BAD(xr[k]);                                                                                   \
                    lnz[k] |= (uint8_t)NEGZ(xr[k]);                                                                    \
                }                                                                                                      \
                i += len;                                                                                              \
            }                                                                                                          \
            for (int64_t j = 0, g = 0, k = 0; j < plen; j++) {                                                         \
                mn[g] = pmn[j] < mn[g] ? pmn[j] : mn[g];                                                               \
                mx[g] = pmx[j] > mx[g] ? pmx[j] : mx[g];                                                               \
                negz[g] |= pnz[j];                                                                                     \
                if (++k == inner) {                                                                                    \
                    k = 0;                                                                                             \
                    g = g + 1 == groups ? 0 : g + 1;                                                                   \
                }                                                                                                      \
            }                                                                                                          \
            *bad |= b;                                                                                                 \
            return;                                                                                                    \
        }                                                                                                              \
        int64_t row = lo / inner, g = row % groups;                                                                    \
        for (int64_t i = lo; i < hi;) {                                                                                \
            int64_t end = (row + 1) * inner < hi ? (row + 1) * inner : hi, k;                                          \
            float lmin = mn[g], lmax = mx[g];                                                                          \
            uint32_t nz = 0;                                                                                           \
            _Pragma("omp simd reduction(min : lmin) reduction(max : lmax) reduction(| : b, nz)")                       \
            for (k = i; k < end; k++) {                                                                                \
                float v = LOAD(x[k]);                                                                                  \
                lmin = v < lmin ? v : lmin;                                                                            \
                lmax = v > lmax ? v : lmax;                                                                            \
                b |= BAD(x[k]);                                                                                        \
                nz |= NEGZ(x[k]);                                                                                      \
            }                                                                                                          \
            mn[g] = lmin;                                                                                              \
            mx[g] = lmax;                                                                                              \
            negz[g] |= (uint8_t)nz;                                                                                    \
            i = end;                                                                                                   \
            row++;                                                                                                     \
            g = g + 1 == groups ? 0 : g + 1;                                                                           \
        }                                                                                                              \
        *bad |= b;                                                                                                     \
    }
#define BAD_BF16(h) nonfinite_16(h, 0x7F80u)
#define BAD_F16(h) nonfinite_16(h, 0x7C00u)
#define NEGZ_F32(v) (uint32_t)(f_bits(v) == 0x80000000u)
#define NEGZ_16(h) (uint32_t)((h) == 0x8000u)
DEFINE_MINMAX8(minmax8_f32, float, id_f32, nonfinite_f32, NEGZ_F32)
DEFINE_MINMAX8(minmax8_bf16, uint16_t, bf16_to_f32, BAD_BF16, NEGZ_16)
DEFINE_MINMAX8(minmax8_f16, uint16_t, f16_to_f32, BAD_F16, NEGZ_16)

static void minmax8_range(const void *x, int dtype, int64_t lo, int64_t hi, int64_t inner, int64_t groups,
                          float *mn, float *mx, uint8_t *negz, uint32_t *bad) {
    for (int64_t g = 0; g < groups; g++) {
        mn[g] = FLT_MAX;
        mx[g] = -FLT_MAX;
        negz[g] = 0;
    }
    if (dtype == DT_F32) minmax8_f32((const float *)x, lo, hi, inner, groups, mn, mx, negz, bad);
    else if (dtype == DT_BF16) minmax8_bf16((const uint16_t *)x, lo, hi, inner, groups, mn, mx, negz, bad);
    else minmax8_f16((const uint16_t *)x, lo, hi, inner, groups, mn, mx, negz, bad);
}

#define PACK8_NAN 1       /* some value before the quantiser's clamp is NaN: the caller recomputes the codes */
#define PACK8_AMBIGUOUS 2 /* a group's minimum or maximum is a zero and the group holds a -0.0: nothing written */
#define PACK8_SKIPPED 4   /* the skipped-batch counter is above zero after this call */
#define PACK8_STACK_GROUPS 1024 /* groups * threads up to this: the scratch is on the stack (work may be NULL) */

/* EMAQuantizer.pack in training mode: each group's minimum and maximum of x; if every element and every range
 * max - min is finite, the EMA update of alpha / beta (the first update sets them, `count` counts updates), else
 * `skipped` += 1 and the ranges stay; then step = a / 255, scale = (1 / a) * 255 with a = max(alpha, min_range) (ATen's
 * clamp_min, division and reciprocal, each rounded to fp32), beta_out = beta, and the codes as lmbp_quantize8.
 * `mom` and `rest` are the fp32 values of momentum and 1 - momentum (each product and the sum rounded to fp32, as
 * ATen's ops). `work`: scratch of 2·G·threads floats and G·threads bytes, or NULL where G·threads is at most
 * PACK8_STACK_GROUPS. Returns PACK8_* bits. */
int lmbp_mesa_pack8(const void *x, int dtype, int64_t n, int64_t inner, int64_t groups, float *alpha, float *beta,
                    int64_t *count, int64_t *skipped, float mom, float rest, float min_range, float *step,
                    float *beta_out, float *scale, uint32_t seed, uint8_t *out, float *work, int threads) {
    int nt = threads > 1 ? threads : 1;
    float small[2 * PACK8_STACK_GROUPS + PACK8_STACK_GROUPS / 4];
    float *part = work ? work : small;                          /* per thread: G minima, then G maxima */
    uint8_t *negz = (uint8_t *)(part + 2 * groups * (int64_t)nt); /* per thread: G flags */
    uint32_t bad = 0;
    int flags = 0, ok;
    if (nt == 1) {
        minmax8_range(x, dtype, 0, n, inner, groups, part, part + groups, negz, &bad);
    } else {
#pragma omp parallel num_threads(nt) reduction(| : bad)
        {
            int64_t lo, hi;
            int t = 0, team = 1;
#ifdef _OPENMP
            t = omp_get_thread_num();
            team = omp_get_num_threads();
#endif
            thread_range(n, t, team, &lo, &hi);
            minmax8_range(x, dtype, lo, lo < hi ? hi : lo, inner, groups, part + 2 * groups * t,
                          part + 2 * groups * t + groups, negz + groups * t, &bad);
        }
        for (int t = 1; t < nt; t++) { /* the exact minimum / maximum: the order of the partial results is free */
            for (int64_t g = 0; g < groups; g++) {
                float a = part[2 * groups * t + g], b = part[2 * groups * t + groups + g];
                part[g] = a < part[g] ? a : part[g];
                part[groups + g] = b > part[groups + g] ? b : part[groups + g];
                negz[g] |= negz[groups * t + g];
            }
        }
    }
    ok = bad == 0;
    for (int64_t g = 0; g < groups; g++) {
        float lo = part[g], hi = part[groups + g];
        if (negz[g] && (lo == 0.0f || hi == 0.0f)) flags |= PACK8_AMBIGUOUS; /* -0.0 or +0.0: ATen's order decides */
        if (nonfinite_f32(hi - lo)) ok = 0;
    }
    if (flags & PACK8_AMBIGUOUS) return flags;
    if (ok) {
        int first = *count == 0;
        for (int64_t g = 0; g < groups; g++) {
            float lo = part[g], rng = part[groups + g] - lo;
            float a = mom * alpha[g], b = mom * beta[g];
            float ra = rest * rng, rb = rest * lo;
            alpha[g] = first ? rng : a + ra;
            beta[g] = first ? lo : b + rb;
        }
        *count += 1;
    } else {
        *skipped += 1;
    }
    for (int64_t g = 0; g < groups; g++) {
        float a = alpha[g];
        a = (a != a) ? a : (a < min_range ? min_range : a);
        step[g] = a / 255.0f;
        scale[g] = (1.0f / a) * 255.0f;
        beta_out[g] = beta[g];
    }
    if (*skipped > 0) flags |= PACK8_SKIPPED;
    return flags | (lmbp_quantize8(x, dtype, n, inner, groups, scale, beta_out, seed, out, threads) ? PACK8_NAN : 0);
}

/* fp32 -> `dtype` as the kernels round (for the tests) */
void lmbp_round(const float *x, int64_t n, void *y, int dtype) {
    for (int64_t i = 0; i < n; i++) {
        if (dtype == DT_F32) ((float *)y)[i] = x[i];
        else if (dtype == DT_BF16) ((uint16_t *)y)[i] = f32_to_bf16(x[i]);
        else ((uint16_t *)y)[i] = f32_to_f16(x[i]);
    }
}

/* ------------------------------------------------------------------------------ MS-LayerNorm / MS-RMSNorm */
/* The element-wise passes of the norms' backward (lowmembp.ops.ms_norm.ms_norm_bwd_cpu). Either lmbp_norm_bwd_rows
 * below runs them row by row with its replica of ATen's row sum, or they run as two passes around ATen's own row sums
 * (ATen's summation order decides the bits). One loop per input type pair (a loop with a type switch inside does not
 * vectorise). */
#define DEFINE_NORM_PROD(NAME, TG, LOADG, TY, LOADY)                                                                   \
    static void NAME(const TG *g, const TY *y, int64_t lo, int64_t hi, float *prod, float *gcopy) {                    \
        int64_t i;                                                                                                     \
        if (gcopy) {                                                                                                   \
            _Pragma("omp simd")                                                                                        \
            for (i = lo; i < hi; i++) {                                                                                \
                float gv = LOADG(g[i]);                                                                                \
                gcopy[i] = gv;                                                                                         \
                prod[i] = gv * LOADY(y[i]);                                                                            \
            }                                                                                                          \
        } else {                                                                                                       \
            _Pragma("omp simd")                                                                                        \
            for (i = lo; i < hi; i++) prod[i] = LOADG(g[i]) * LOADY(y[i]);                                             \
        }                                                                                                              \
    }
DEFINE_NORM_PROD(norm_prod_f32_f32, float, id_f32, float, id_f32)
DEFINE_NORM_PROD(norm_prod_f32_bf16, float, id_f32, uint16_t, bf16_to_f32)
DEFINE_NORM_PROD(norm_prod_f32_f16, float, id_f32, uint16_t, f16_to_f32)
DEFINE_NORM_PROD(norm_prod_bf16_f32, uint16_t, bf16_to_f32, float, id_f32)
DEFINE_NORM_PROD(norm_prod_bf16_bf16, uint16_t, bf16_to_f32, uint16_t, bf16_to_f32)
DEFINE_NORM_PROD(norm_prod_bf16_f16, uint16_t, bf16_to_f32, uint16_t, f16_to_f32)
DEFINE_NORM_PROD(norm_prod_f16_f32, uint16_t, f16_to_f32, float, id_f32)
DEFINE_NORM_PROD(norm_prod_f16_bf16, uint16_t, f16_to_f32, uint16_t, bf16_to_f32)
DEFINE_NORM_PROD(norm_prod_f16_f16, uint16_t, f16_to_f32, uint16_t, f16_to_f32)

typedef void (*norm_prod_fn)(const void *, const void *, int64_t, int64_t, float *, float *);
static const norm_prod_fn NORM_PROD[3][3] = {
    {(norm_prod_fn)norm_prod_f32_f32, (norm_prod_fn)norm_prod_f32_bf16, (norm_prod_fn)norm_prod_f32_f16},
    {(norm_prod_fn)norm_prod_bf16_f32, (norm_prod_fn)norm_prod_bf16_bf16, (norm_prod_fn)norm_prod_bf16_f16},
    {(norm_prod_fn)norm_prod_f16_f32, (norm_prod_fn)norm_prod_f16_bf16, (norm_prod_fn)norm_prod_f16_f16}};

/* prod = fp32(g) * fp32(y) over n elements (the reference's gf * yf), and gcopy = fp32(g) unless gcopy is NULL. */
void lmbp_norm_prod(const void *g, int gdtype, const void *y, int ydtype, int64_t n, float *prod, float *gcopy,
                    int threads) {
    norm_prod_fn fn = NORM_PROD[gdtype][ydtype];
    if (threads <= 1) {
        fn(g, y, 0, n, prod, gcopy);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        team_range(n, &lo, &hi);
        if (lo < hi) fn(g, y, lo, hi, prod, gcopy);
    }
}

/* dx = ((g - y * mgy) - mg) * rstd[r], row r of n elements, rounded once to dx's dtype, with the means
 * mgy = sgy[r] / n and mg = sg[r] / n of ATen's row sums (the reference's sum(-1).div_(n) and mean(-1), which ATen's
 * CPU mean computes as sum_out then div_(n), fp32 division): the reference's addcmul(gf, yf, mgy, value=-1), its
 * sub_(mean) (LayerNorm; sg NULL for RMSNorm) and mul_(rstd), one fp32 operation at a time. ATen's CPU addcmul is self + value * t1 * t2, and (-1 * y) is -y exactly; where torch's build contracts
 * it into a fused multiply-add (the caller probes ATen and passes fused = 1) it is fmaf(-y, m, g) with one rounding,
 * else g - (y * m) with two. */
#define NORM_BWD_LOOP(LOADG, LOADY, STORE, DIFF, MEAN)                                                                 \
    _Pragma("omp simd reduction(| : nan)")                                                                             \
    for (i = 0; i < n; i++) {                                                                                          \
        float gv = LOADG(gr[i]), yv = LOADY(yr[i]);                                                                    \
        float v = DIFF;                                                                                                \
        v = MEAN;                                                                                                      \
        v = v * s;                                                                                                     \
        nan |= (uint32_t)(v != v);                                                                                     \
        dr[i] = STORE(v);                                                                                              \
    }
#define DEFINE_NORM_BWD(NAME, TG, LOADG, TY, LOADY, TD, STORE)                                                         \
    static uint32_t NAME(const TG *g, const TY *y, int64_t r0, int64_t r1, int64_t n, const float *sgy,               \
                         const float *sg, const float *rstd, TD *dx, int fused) {                                      \
        uint32_t nan = 0;                                                                                              \
        const float nf = (float)n;                                                                                     \
        const float *mg = sg;                                                                                          \
        for (int64_t r = r0; r < r1; r++) {                                                                            \
            const TG *gr = g + r * n;                                                                                  \
            const TY *yr = y + r * n;                                                                                  \
            TD *dr = dx + r * n;                                                                                       \
            float m = sgy[r] / nf, s = rstd[r], mean = mg ? mg[r] / nf : 0.0f;                                         \
            int64_t i;                                                                                                 \
            if (mg && fused) {                                                                                         \
                NORM_BWD_LOOP(LOADG, LOADY, STORE, __builtin_fmaf(-yv, m, gv), v - mean)                               \
            } else if (mg) {                                                                                           \
                NORM_BWD_LOOP(LOADG, LOADY, STORE, gv - yv * m, v - mean)                                              \
            } else if (fused) {                                                                                        \
                NORM_BWD_LOOP(LOADG, LOADY, STORE, __builtin_fmaf(-yv, m, gv), v)                                      \
            } else {                                                                                                   \
                NORM_BWD_LOOP(LOADG, LOADY, STORE, gv - yv * m, v)                                                     \
            }                                                                                                          \
        }                                                                                                              \
        return nan;                                                                                                    \
    }
#define DEFINE_NORM_BWD_DX(G, TG, LOADG, Y, TY, LOADY)                                                                 \
    DEFINE_NORM_BWD(norm_bwd_##G##_##Y##_f32, TG, LOADG, TY, LOADY, float, id_f32)                                    \
    DEFINE_NORM_BWD(norm_bwd_##G##_##Y##_bf16, TG, LOADG, TY, LOADY, uint16_t, f32_to_bf16)                           \
    DEFINE_NORM_BWD(norm_bwd_##G##_##Y##_f16, TG, LOADG, TY, LOADY, uint16_t, f32_to_f16)
DEFINE_NORM_BWD_DX(f32, float, id_f32, f32, float, id_f32)
DEFINE_NORM_BWD_DX(f32, float, id_f32, bf16, uint16_t, bf16_to_f32)
DEFINE_NORM_BWD_DX(f32, float, id_f32, f16, uint16_t, f16_to_f32)
DEFINE_NORM_BWD_DX(bf16, uint16_t, bf16_to_f32, f32, float, id_f32)
DEFINE_NORM_BWD_DX(bf16, uint16_t, bf16_to_f32, bf16, uint16_t, bf16_to_f32)
DEFINE_NORM_BWD_DX(bf16, uint16_t, bf16_to_f32, f16, uint16_t, f16_to_f32)
DEFINE_NORM_BWD_DX(f16, uint16_t, f16_to_f32, f32, float, id_f32)
DEFINE_NORM_BWD_DX(f16, uint16_t, f16_to_f32, bf16, uint16_t, bf16_to_f32)
DEFINE_NORM_BWD_DX(f16, uint16_t, f16_to_f32, f16, uint16_t, f16_to_f32)

typedef uint32_t (*norm_bwd_fn)(const void *, const void *, int64_t, int64_t, int64_t, const float *, const float *,
                                const float *, void *, int);
#define NORM_BWD_ROW(G, Y)                                                                                             \
    {(norm_bwd_fn)norm_bwd_##G##_##Y##_f32, (norm_bwd_fn)norm_bwd_##G##_##Y##_bf16,                                   \
     (norm_bwd_fn)norm_bwd_##G##_##Y##_f16}
static const norm_bwd_fn NORM_BWD[3][3][3] = {
    {NORM_BWD_ROW(f32, f32), NORM_BWD_ROW(f32, bf16), NORM_BWD_ROW(f32, f16)},
    {NORM_BWD_ROW(bf16, f32), NORM_BWD_ROW(bf16, bf16), NORM_BWD_ROW(bf16, f16)},
    {NORM_BWD_ROW(f16, f32), NORM_BWD_ROW(f16, bf16), NORM_BWD_ROW(f16, f16)}};

/* The backward's second pass over `rows` rows of n elements (above; fused: addcmul's rounding); the threads split
 * the rows. Returns 1 when
 * some dx is NaN (its bits are ATen's only by chance: the caller recomputes), else 0. */
int lmbp_norm_bwd(const void *g, int gdtype, const void *y, int ydtype, int64_t rows, int64_t n, const float *sgy,
                  const float *sg, const float *rstd, void *dx, int dxdtype, int fused, int threads) {
    norm_bwd_fn fn = NORM_BWD[gdtype][ydtype][dxdtype];
    uint32_t nan = 0;
    if (threads <= 1) return (int)fn(g, y, 0, rows, n, sgy, sg, rstd, dx, fused);
#pragma omp parallel num_threads(threads) reduction(| : nan)
    {
        int64_t r0, r1;
        team_rows(rows, &r0, &r1);
        if (r0 < r1) nan |= fn(g, y, r0, r1, n, sgy, sg, rstd, dx, fused);
    }
    return (int)nan;
}

/* ATen's CPU sum of one contiguous fp32 row (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum), bit for bit:
 * with W the lanes of ATen's Vectorized<float> (16 on AVX-512, 8 on AVX2 and the default build, 4 on NEON) and
 * n >= W, the row's n / W vectors are summed as 4 interleaved partial sums (ilp 4) of groups of 4 vectors, each
 * partial cascaded over 4 levels of 2^p groups (p = max(4, ceil(log2(groups)) / 4)); the leftover vectors go into
 * the first partial, the partials are added in order, then a scalar 0 takes the leftover elements and the lanes in
 * order. For n < W the same cascade runs on scalars. ATen fills the output with 0 and adds the row's sum to it.
 * lowmembp.ops.cpu_kernels.aten_sum_width() probes which W (if any) this torch's `sum` matches. ATen sums a single
 * row of 32768 or more elements on several threads in two passes (another order): the caller keeps such calls. */
static inline int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)x - 1); }

static inline __attribute__((always_inline)) float cascade_sum(const float *x, int64_t n, const int W) {
    float acc[4][4][16]; /* [level][ilp][lane], W <= 16 lanes used */
    const int64_t vecs = n / W, size = vecs / 4;
    int64_t lp = ceil_log2(size) / 4, i = 0, j, v;
    int k, l;
    if (lp < 4) lp = 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    for (j = 0; j < 4; j++)
        for (k = 0; k < 4; k++)
            for (l = 0; l < W; l++) acc[j][k][l] = 0.0f;
    while (i + step <= size) {
        for (j = 0; j < step; j++, i++) {
            const float *b = x + i * 4 * W;
            for (k = 0; k < 4; k++)
                for (l = 0; l < W; l++) acc[0][k][l] += b[k * W + l];
        }
        for (j = 1; j < 4; j++) {
            for (k = 0; k < 4; k++)
                for (l = 0; l < W; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size; i++) {
        const float *b = x + i * 4 * W;
        for (k = 0; k < 4; k++)
            for (l = 0; l < W; l++) acc[0][k][l] += b[k * W + l];
    }
    for (j = 1; j < 4; j++)
        for (k = 0; k < 4; k++)
            for (l = 0; l < W; l++) acc[0][k][l] += acc[j][k][l];
    for (v = size * 4; v < vecs; v++)
        for (l = 0; l < W; l++) acc[0][0][l] += x[v * W + l];
    for (k = 1; k < 4; k++)
        for (l = 0; l < W; l++) acc[0][0][l] += acc[0][k][l];
    if (W == 1) return 0.0f + acc[0][0][0];
    float fin = 0.0f;
    for (v = vecs * W; v < n; v++) fin += x[v];
    for (l = 0; l < W; l++) fin += acc[0][0][l];
    return 0.0f + fin;
}

/* ATen's sum of a contiguous row of n fp32 values for `width` (4, 8 or 16) lanes: the scalar cascade below width */
static float row_sum(const float *x, int64_t n, int width) {
    if (n < width) return cascade_sum(x, n, 1);
    if (width == 16) return cascade_sum(x, n, 16);
    if (width == 8) return cascade_sum(x, n, 8);
    return cascade_sum(x, n, 4);
}

#if defined(HAVE_V8)
/* cascade_sum for W = 8 of a row's fp32 products g·y (sums[0]) and, when S = 2, of its fp32 g (sums[1]), g and y of
 * one dtype dt read and converted as lmbp_norm_prod does: the sums ATen's `sum` gives over the rows of products and
 * of g, in one pass, in AVX2 registers (the same additions lane by lane), without writing those rows. */
static inline __attribute__((always_inline)) void cascade_sums8(const void *g, const void *y, int64_t n, const int dt,
                                                                const int S, float *sums) {
    __m256 acc[2][4][4]; /* [sum][level][ilp] */
    const int64_t vecs = n / 8, size = vecs / 4;
    int64_t lp = ceil_log2(size) / 4, i = 0, j, v;
    int k, t;
    if (lp < 4) lp = 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    for (t = 0; t < 2; t++)
        for (j = 0; j < 4; j++)
            for (k = 0; k < 4; k++) acc[t][j][k] = _mm256_setzero_ps();
#define CASCADE_SUMS8_ADD(K, IDX)                                                                                      \
    {                                                                                                                  \
        __m256 gv = load8_f32(g, IDX, dt);                                                                             \
        acc[0][0][K] = _mm256_add_ps(acc[0][0][K], _mm256_mul_ps(gv, load8_f32(y, IDX, dt)));                          \
        if (S == 2) acc[1][0][K] = _mm256_add_ps(acc[1][0][K], gv);                                                    \
    }
    while (i + step <= size) {
        for (j = 0; j < step; j++, i++)
            for (k = 0; k < 4; k++) CASCADE_SUMS8_ADD(k, i * 32 + k * 8)
        for (j = 1; j < 4; j++) {
            for (t = 0; t < S; t++)
                for (k = 0; k < 4; k++) {
                    acc[t][j][k] = _mm256_add_ps(acc[t][j][k], acc[t][j - 1][k]);
                    acc[t][j - 1][k] = _mm256_setzero_ps();
                }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (k = 0; k < 4; k++) CASCADE_SUMS8_ADD(k, i * 32 + k * 8)
    for (t = 0; t < S; t++)
        for (j = 1; j < 4; j++)
            for (k = 0; k < 4; k++) acc[t][0][k] = _mm256_add_ps(acc[t][0][k], acc[t][j][k]);
    for (v = size * 4; v < vecs; v++) CASCADE_SUMS8_ADD(0, v * 8)
#undef CASCADE_SUMS8_ADD
    for (t = 0; t < S; t++) {
        float lanes[8], fin = 0.0f;
        for (k = 1; k < 4; k++) acc[t][0][0] = _mm256_add_ps(acc[t][0][0], acc[t][0][k]);
        _mm256_storeu_ps(lanes, acc[t][0][0]);
        for (v = vecs * 8; v < n; v++) {
            float gv = load_f32(g, v, dt);
            fin += t == 0 ? gv * load_f32(y, v, dt) : gv;
        }
        for (k = 0; k < 8; k++) fin += lanes[k];
        sums[t] = 0.0f + fin;
    }
}
#endif

/* out[r] = ATen's sum of row r of `rows` contiguous rows of n fp32 values (the probe's and the tests' entry) */
void lmbp_row_sums(const float *x, int64_t rows, int64_t n, int width, float *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = row_sum(x + r * n, n, width);
}

static const int DT_SIZE[3] = {4, 2, 2};

/* The whole backward of the norms, row by row (lowmembp.ops.ms_norm.ms_norm_bwd_cpu): the row sums of the products
 * g·y (and LayerNorm's sum of g) as ATen's `sum` orders them for `width` lanes, then the row's dx as lmbp_norm_bwd
 * writes it. For width 8, g and y of one dtype and rows of 8 or more, the sums come straight from g and y in AVX2
 * registers (cascade_sums8); otherwise the products (and LayerNorm's fp32 copy of a 16-bit g) of one row go into a
 * scratch row that stays in the core's cache, summed by row_sum. Rows are split over an OpenMP team of `threads`.
 * Returns 1 when some dx is NaN (the caller recomputes), 2 when the scratch rows could not be allocated (nothing
 * useful written), else 0. */
int lmbp_norm_bwd_rows(const void *g, int gdtype, const void *y, int ydtype, int64_t rows, int64_t n,
                       const float *rstd, void *dx, int dxdtype, int layernorm, int fused, int width, int threads) {
    norm_prod_fn prod_fn = NORM_PROD[gdtype][ydtype];
    norm_bwd_fn bwd_fn = NORM_BWD[gdtype][ydtype][dxdtype];
    const int copy_g = layernorm && gdtype != DT_F32;
    #if defined(HAVE_V8)
    const int direct = width == 8 && gdtype == ydtype && n >= 8; /* the sums straight from g and y: no scratch */
#else
    const int direct = 0;
#endif
    uint32_t acc = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(| : acc) if (threads > 1)
    {
        int64_t r0, r1;
        team_rows(rows, &r0, &r1);
        float *prod = r0 < r1 && !direct ? (float *)malloc((size_t)(copy_g ? 2 : 1) * (size_t)n * sizeof(float))
                                         : NULL;
        if (r0 < r1 && !direct && prod == NULL) acc |= 2u;
        float *gcopy = copy_g && prod ? prod + n : NULL;
        for (int64_t r = r0; (direct || prod) && r < r1; r++) {
            const char *gr = (const char *)g + r * n * DT_SIZE[gdtype];
            const char *yr = (const char *)y + r * n * DT_SIZE[ydtype];
            char *dr = (char *)dx + r * n * DT_SIZE[dxdtype];
            float sums[2] = {0.0f, 0.0f};
#if defined(HAVE_V8)
            if (direct && layernorm) { /* one inlined copy per dtype */
                if (gdtype == DT_F32) cascade_sums8(gr, yr, n, DT_F32, 2, sums);
                else if (gdtype == DT_BF16) cascade_sums8(gr, yr, n, DT_BF16, 2, sums);
                else cascade_sums8(gr, yr, n, DT_F16, 2, sums);
            } else if (direct) {
                if (gdtype == DT_F32) cascade_sums8(gr, yr, n, DT_F32, 1, sums);
                else if (gdtype == DT_BF16) cascade_sums8(gr, yr, n, DT_BF16, 1, sums);
                else cascade_sums8(gr, yr, n, DT_F16, 1, sums);
            } else
#endif
            {
                prod_fn(gr, yr, 0, n, prod, gcopy);
                sums[0] = row_sum(prod, n, width);
                if (layernorm) sums[1] = row_sum(copy_g ? gcopy : (const float *)gr, n, width);
            }
            acc |= bwd_fn(gr, yr, 0, 1, n, &sums[0], layernorm ? &sums[1] : NULL, rstd + r, dr, fused);
        }
        free(prod);
    }
    return (int)acc;
}

/* y = x converted to `ydtype` (fp16 / bf16 -> fp32 exactly; fp32 -> fp16 / bf16 rounded to nearest even), n
 * elements. Returns 1 when some value is NaN (a rounded NaN's bits are ATen's only by chance), else 0. */
#define DEFINE_CAST(NAME, TX, LOAD, TY, STORE)                                                                         \
    static uint32_t NAME(const TX *x, int64_t lo, int64_t hi, TY *y) {                                                 \
        uint32_t nan = 0;                                                                                              \
        int64_t i;                                                                                                     \
        _Pragma("omp simd reduction(| : nan)")                                                                         \
        for (i = lo; i < hi; i++) {                                                                                    \
            float v = LOAD(x[i]);                                                                                      \
            nan |= (uint32_t)(v != v);                                                                                 \
            y[i] = STORE(v);                                                                                           \
        }                                                                                                              \
        return nan;                                                                                                    \
    }
DEFINE_CAST(cast_bf16_f32, uint16_t, bf16_to_f32, float, id_f32)
DEFINE_CAST(cast_f16_f32, uint16_t, f16_to_f32, float, id_f32)
DEFINE_CAST(cast_f32_bf16, float, id_f32, uint16_t, f32_to_bf16)
DEFINE_CAST(cast_f32_f16, float, id_f32, uint16_t, f32_to_f16)

static uint32_t cast_range(const void *x, int xdtype, int64_t lo, int64_t hi, void *y, int ydtype) {
    if (xdtype == DT_BF16) return cast_bf16_f32((const uint16_t *)x, lo, hi, (float *)y);
    if (xdtype == DT_F16) return cast_f16_f32((const uint16_t *)x, lo, hi, (float *)y);
    if (ydtype == DT_BF16) return cast_f32_bf16((const float *)x, lo, hi, (uint16_t *)y);
    return cast_f32_f16((const float *)x, lo, hi, (uint16_t *)y);
}

/* one of x, y is fp32 and the other fp16 / bf16 */
int lmbp_cast(const void *x, int xdtype, int64_t n, void *y, int ydtype, int threads) {
    RETURN_OR_OVER_THREADS(n, cast_range(x, xdtype, lo, hi, y, ydtype));
}

/* ------------------------------------------------------------------------------- MS-LayerNorm forward */
/* ATen's CPU LayerNorm forward of fp32 rows without weight and bias (aten/src/ATen/native/cpu/layer_norm_kernel.cpp,
 * LayerNormKernelImplInternal<float>), bit for bit, on rows read as fp32 / bf16 / fp16 (converted to fp32 exactly,
 * as the reference's x.float()) with y rounded once to its dtype (the reference's y.to(dtype)). Per row:
 *   [mean, var] = RowwiseMoments(x, N)          (ATen/native/cpu/moments_utils.h, below)
 *   rstd = 1 / sqrt(var + eps)                  (eps as fp32)
 *   y    = (x - mean) * rstd * 1 + 0            (LN_OUT_SUB; older ATen: x * rstd + (-rstd * mean), fused
 *                                                or not, LN_OUT_FMA / LN_OUT_MULADD; the "+ 0" makes -0 +0)
 * RowwiseMoments with W the lanes of the Vectorized<float> of the kernel ATen dispatches to (8 for its AVX2 and
 * default builds, which AVX-512 CPUs run too where the kernel is not registered for AVX-512, as in torch 2.14; 16
 * for an AVX-512 kernel; 4 on NEON): the row's n = N / W vectors in chunks of 16; per chunk a Welford pass from zero in each lane (vector j: delta =
 * x - m1, m1 = fmadd(1/(j+1), delta, m1), m2 = fmadd(delta, x - m1, m2)), merged into a stack of depth
 * CeilLog2(chunks) with AddMomentsVec (binary-counter cascade), the stack folded into its bottom; the N % W leftover
 * elements by a scalar Welford, then each lane merged into it with the scalar AddMoments; var = m2 / N.
 * Which operations ATen's build fuses decides the bits: `flags` (LN_* below) says which of them are fused
 * multiply-adds, `width` gives W; lowmembp.ops.cpu_kernels.layer_norm_variant() probes both once. ATen computes each
 * row on one thread (parallel over rows, grain 1), so no row is split. */
#define LN_VEC_FMA 1       /* the vector fmadd is one rounding (FMA instructions), else a * b + c */
#define LN_VEC_M1_FUSED 2  /* AddMomentsVec's m1 + c * delta contracted into a fused multiply-add */
#define LN_ADD_M1_FUSED 4  /* AddMoments' m1 += c * delta contracted */
#define LN_ADD_M2_FUSED 8  /* AddMoments' m2_add + (delta * delta * c) * m0 contracted */
#define LN_TAIL_FUSED 16   /* the leftover elements' m2 += delta * (x - m1) contracted */
#define LN_OUT_SHIFT 5     /* bits 5-6: the output line */
#define LN_OUT_SUB 0       /* (x + (-mean)) * rstd */
#define LN_OUT_FMA 1       /* fmaf(x, rstd, -rstd * mean) */
#define LN_OUT_MULADD 2    /* x * rstd + (-rstd * mean), two roundings */
#define LN_CHUNK 16        /* ATen's kChunkSize: vectors per Welford chunk */
#define LN_GROUP 8         /* chunks whose (independent) Welford passes run interleaved */
#define LN_MAX_DEPTH 64    /* CeilLog2 of the chunks of a row: at most 64 */
#define LN_MAX_W 16        /* the widest vector: AVX-512's 16 lanes */

static inline __attribute__((always_inline)) float ln_madd(float a, float b, float c, const int fused) {
    return fused ? __builtin_fmaf(a, b, c) : a * b + c;
}

/* The end of RowwiseMoments for K rows of N elements (up to 2, interleaved: each a chain of dependent operations):
 * the scalar Welford of the leftover elements [n * W, N), then each lane's (l1[l], l2[l]) of n elements merged into
 * it with AddMoments (scalar), var = m2 / N. */
static inline __attribute__((always_inline)) void ln_finish(const void *const *xs, int64_t N, int64_t n, int W,
                                                            float (*l1)[LN_MAX_W], float (*l2)[LN_MAX_W],
                                                            float *mean, float *var, int dt, int flags, const int K) {
    int64_t m0 = 0; /* the same count for every row */
    float m1[2] = {0.0f, 0.0f}, m2[2] = {0.0f, 0.0f};
    int k;
    for (int64_t i = n * W; i < N; i++) {
        ++m0;
        for (k = 0; k < K; k++) {
            float xv = load_f32(xs[k], i, dt);
            float delta = xv - m1[k];
            m1[k] += delta / (float)m0;
            m2[k] = flags & LN_TAIL_FUSED ? __builtin_fmaf(delta, xv - m1[k], m2[k]) : m2[k] + delta * (xv - m1[k]);
        }
    }
    for (int l = 0; l < W; l++) { /* AddMoments(n, l1[l], l2[l], m0, m1, m2) */
        const int64_t m0n = m0 + n;
        const float c = m0n == 0 ? 0.0f : (float)n / (float)m0n, m0f = (float)m0;
        for (k = 0; k < K; k++) {
            const float delta = l1[k][l] - m1[k];
            m1[k] = flags & LN_ADD_M1_FUSED ? __builtin_fmaf(c, delta, m1[k]) : m1[k] + c * delta;
            const float t = delta * delta * c;
            m2[k] = m2[k] + (flags & LN_ADD_M2_FUSED ? __builtin_fmaf(t, m0f, l2[k][l]) : l2[k][l] + t * m0f);
        }
        m0 = m0n;
    }
    for (k = 0; k < K; k++) {
        mean[k] = m1[k];
        var[k] = m2[k] / (float)N;
    }
}

/* AddMomentsVec(m0_add, m1_add, m2_add, m0, m1, m2) over W lanes */
static void ln_addv_lanes(int64_t m0_add, const float *m1_add, const float *m2_add, int64_t *m0, float *m1, float *m2,
                          int W, int flags) {
    const int64_t n = *m0 + m0_add;
    const float c = n == 0 ? 0.0f : (float)m0_add / (float)n, m0f = (float)*m0;
    for (int l = 0; l < W; l++) {
        float delta = m1_add[l] - m1[l], m2_tmp = m2[l] + m2_add[l];
        float cd = c * delta, m0d = delta * m0f;
        m1[l] = flags & LN_VEC_M1_FUSED ? __builtin_fmaf(c, delta, m1[l]) : m1[l] + cd;
        m2[l] = ln_madd(m0d, cd, m2_tmp, flags & LN_VEC_FMA);
    }
    *m0 = n;
}

/* RowwiseMoments' vector part of the row x[0, N) for any variant, on lane arrays (the portable build, and the
 * variants without a vector form below): the row's n = N / W vectors in chunks of 16, each chunk's Welford pass from
 * zero (UpdateMomentsVec: vector j's delta = x - m1, m1 = fmadd(1 / (j + 1), delta, m1), m2 = fmadd(delta, x - m1,
 * m2)), merged in order into the bottom of a stack of depth CeilLog2(chunks) whose levels cascade like a binary
 * counter (AddMomentsVec), the stack folded into its bottom: the lanes' m1 and m2 into l1 and l2 (ln_finish ends). */
static void ln_moments_lanes(const void *x, int64_t N, const float *cv, float *l1, float *l2, int dt, int W,
                             int flags) {
    const int64_t n = N / W, m = (n + LN_CHUNK - 1) / LN_CHUNK, depth = ceil_log2(m);
    const int vfma = flags & LN_VEC_FMA;
    float s1[LN_MAX_DEPTH][LN_MAX_W], s2[LN_MAX_DEPTH][LN_MAX_W];
    int64_t s0[LN_MAX_DEPTH], i, j;
    int l;
    for (j = 0; j < depth; j++) {
        s0[j] = 0;
        for (l = 0; l < W; l++) s1[j][l] = s2[j][l] = 0.0f;
    }
    for (i = 0; i < m; i++) {
        float a1[LN_MAX_W], a2[LN_MAX_W];
        const int64_t cnt = n - i * LN_CHUNK < LN_CHUNK ? n - i * LN_CHUNK : LN_CHUNK;
        for (l = 0; l < W; l++) a1[l] = a2[l] = 0.0f;
        for (j = 0; j < cnt; j++) {
            const int64_t base = (i * LN_CHUNK + j) * W;
            for (l = 0; l < W; l++) {
                float xv = load_f32(x, base + l, dt);
                float d = xv - a1[l];
                a1[l] = ln_madd(cv[j], d, a1[l], vfma);
                a2[l] = ln_madd(d, xv - a1[l], a2[l], vfma);
            }
        }
        ln_addv_lanes(cnt, a1, a2, &s0[0], s1[0], s2[0], W, flags);
        int64_t mask = i + 1;
        for (j = 1; j < depth && (mask & 1) == 0; j++) {
            ln_addv_lanes(s0[j - 1], s1[j - 1], s2[j - 1], &s0[j], s1[j], s2[j], W, flags);
            s0[j - 1] = 0;
            for (l = 0; l < W; l++) s1[j - 1][l] = s2[j - 1][l] = 0.0f;
            mask >>= 1;
        }
    }
    for (j = 1; j < depth; j++) ln_addv_lanes(s0[j], s1[j], s2[j], &s0[0], s1[0], s2[0], W, flags);
    for (l = 0; l < W; l++) {
        l1[l] = s1[0][l];
        l2[l] = s2[0][l];
    }
}

#if defined(HAVE_V8)
/* The same in AVX2 registers for W = 8 with fused fmadd (ATen's AVX2 build, which AVX-512 CPUs run too): the same
 * operations lane by lane, so the same bits; the chunks' Welford passes, independent of each other, run up to 8 at a
 * time interleaved (as many dependency chains). */

/* K whole chunks from vector v0, each from zero, into a1[0, K) and a2[0, K) */
static inline __attribute__((always_inline)) void ln_chunks8(const void *x, int64_t v0, const float *cv, __m256 *a1,
                                                             __m256 *a2, const int dt, const int K) {
    __m256 m1[LN_GROUP], m2[LN_GROUP];
    int g;
    for (g = 0; g < K; g++) m1[g] = m2[g] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t j = 0; j < LN_CHUNK; j++) {
        const __m256 c = _mm256_set1_ps(cv[j]);
        for (g = 0; g < K; g++) {
            __m256 xv = load8_f32(x, (v0 + g * LN_CHUNK + j) * 8, dt);
            __m256 d = _mm256_sub_ps(xv, m1[g]);
            m1[g] = _mm256_fmadd_ps(c, d, m1[g]);
            m2[g] = _mm256_fmadd_ps(d, _mm256_sub_ps(xv, m1[g]), m2[g]);
        }
    }
    for (g = 0; g < K; g++) {
        a1[g] = m1[g];
        a2[g] = m2[g];
    }
}

static inline __attribute__((always_inline)) void ln_addv8(int64_t m0_add, __m256 m1_add, __m256 m2_add, int64_t *m0,
                                                           __m256 *m1, __m256 *m2, const int m1_fused) {
    const int64_t n = *m0 + m0_add;
    const __m256 c = _mm256_set1_ps(n == 0 ? 0.0f : (float)m0_add / (float)n);
    const __m256 delta = _mm256_sub_ps(m1_add, *m1), m2_tmp = _mm256_add_ps(*m2, m2_add);
    const __m256 cd = _mm256_mul_ps(c, delta), m0d = _mm256_mul_ps(delta, _mm256_set1_ps((float)*m0));
    *m1 = m1_fused ? _mm256_fmadd_ps(c, delta, *m1) : _mm256_add_ps(*m1, cd);
    *m2 = _mm256_fmadd_ps(m0d, cd, m2_tmp);
    *m0 = n;
}

static inline __attribute__((always_inline)) void ln_moments8(const void *x, int64_t N, const float *cv, float *l1,
                                                              float *l2, const int dt, int flags) {
    const int64_t n = N / 8, m = (n + LN_CHUNK - 1) / LN_CHUNK, depth = ceil_log2(m);
    const int m1_fused = (flags & LN_VEC_M1_FUSED) != 0;
    __m256 s1[LN_MAX_DEPTH], s2[LN_MAX_DEPTH];
    int64_t s0[LN_MAX_DEPTH], i, j;
    for (j = 0; j < depth; j++) {
        s0[j] = 0;
        s1[j] = s2[j] = _mm256_setzero_ps();
    }
    for (i = 0; i < m; i += LN_GROUP) {
        __m256 a1[LN_GROUP], a2[LN_GROUP];
        const int groups = m - i < LN_GROUP ? (int)(m - i) : LN_GROUP;
        const int64_t rest = n - (i + groups - 1) * LN_CHUNK;
        const int64_t last = rest < LN_CHUNK ? rest : LN_CHUNK; /* vectors in the group's last chunk */
        const int full = last == LN_CHUNK ? groups : groups - 1;
        switch (full) { /* a constant count: the chains stay in registers */
        case 8: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 8); break;
        case 7: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 7); break;
        case 6: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 6); break;
        case 5: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 5); break;
        case 4: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 4); break;
        case 3: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 3); break;
        case 2: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 2); break;
        case 1: ln_chunks8(x, i * LN_CHUNK, cv, a1, a2, dt, 1); break;
        default: break;
        }
        if (full < groups) { /* the row's last chunk, under 16 vectors */
            __m256 p1 = _mm256_setzero_ps(), p2 = _mm256_setzero_ps();
            for (j = 0; j < last; j++) {
                __m256 xv = load8_f32(x, ((i + full) * LN_CHUNK + j) * 8, dt);
                __m256 d = _mm256_sub_ps(xv, p1);
                p1 = _mm256_fmadd_ps(_mm256_set1_ps(cv[j]), d, p1);
                p2 = _mm256_fmadd_ps(d, _mm256_sub_ps(xv, p1), p2);
            }
            a1[full] = p1;
            a2[full] = p2;
        }
        for (int g = 0; g < groups; g++) { /* the chunks in order: into the stack's bottom, then the cascade */
            ln_addv8(g < full ? LN_CHUNK : last, a1[g], a2[g], &s0[0], &s1[0], &s2[0], m1_fused);
            int64_t mask = i + g + 1;
            for (j = 1; j < depth && (mask & 1) == 0; j++) {
                ln_addv8(s0[j - 1], s1[j - 1], s2[j - 1], &s0[j], &s1[j], &s2[j], m1_fused);
                s0[j - 1] = 0;
                s1[j - 1] = s2[j - 1] = _mm256_setzero_ps();
                mask >>= 1;
            }
        }
    }
    for (j = 1; j < depth; j++) ln_addv8(s0[j], s1[j], s2[j], &s0[0], &s1[0], &s2[0], m1_fused);
    _mm256_storeu_ps(l1, s1[0]);
    _mm256_storeu_ps(l2, s2[0]);
}
#endif

/* y of one row from its mean and rstd (the output line `out`), rounded to y's dtype; the NaN bit */
static inline __attribute__((always_inline)) uint32_t ln_output(const void *x, int64_t N, float mean, float rstd,
                                                                void *y, const int dt, const int yt, const int out) {
    const float bias = out == LN_OUT_SUB ? -mean : -rstd * mean;
    uint32_t nan = 0;
    int64_t j;
    _Pragma("omp simd reduction(| : nan)")
    for (j = 0; j < N; j++) {
        float xv = load_f32(x, j, dt), v;
        if (out == LN_OUT_SUB) v = (xv + bias) * rstd;
        else if (out == LN_OUT_FMA) v = __builtin_fmaf(xv, rstd, bias);
        else v = xv * rstd + bias;
        v = v + 0.0f; /* ATen's "* gamma (1) + beta (0)": -0 becomes +0 */
        nan |= (uint32_t)(v != v);
        if (yt == DT_F32) ((float *)y)[j] = v;
        else if (yt == DT_BF16) ((uint16_t *)y)[j] = f32_to_bf16(v);
        else ((uint16_t *)y)[j] = f32_to_f16(v);
    }
    return nan;
}

#if defined(__AVX512BW__)
/* ATen's output line (LN_OUT_SUB) in AVX-512 registers, 16 elements a step (the rest as above): bf16 spread to fp32
 * and rounded back (to nearest even, the integer rounding of f32_to_bf16) by word permutes in the elements' order,
 * fp16 by the exact hardware conversions (round to nearest even, as f32_to_f16). */
static const uint16_t LN_SPREAD_IDX[32] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
                                           8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
static const uint16_t LN_HIGH_IDX[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                         1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static inline __attribute__((always_inline)) uint32_t ln_output16(const void *x, int64_t N, float mean, float rstd,
                                                                  void *y, const int dt, const int yt) {
    const __m512 bias = _mm512_set1_ps(-mean), scale = _mm512_set1_ps(rstd), zero = _mm512_setzero_ps();
    const __m512i spread = _mm512_loadu_si512(LN_SPREAD_IDX), high = _mm512_loadu_si512(LN_HIGH_IDX);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) {
        __m512 xv;
        if (dt == DT_F32) {
            xv = _mm512_loadu_ps((const float *)x + j);
        } else {
            __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + j));
            xv = dt == DT_F16 ? _mm512_cvtph_ps(h)
                              : _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread,
                                                                                   _mm512_castsi256_si512(h)));
        }
        __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(xv, bias), scale), zero);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (yt == DT_F32) {
            _mm512_storeu_ps((float *)y + j, v);
        } else if (yt == DT_F16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + j),
                                _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            __m512i u = _mm512_castps_si512(v);
            u = _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + j),
                                _mm512_castsi512_si256(_mm512_permutexvar_epi16(high, u)));
        }
    }
    return (uint32_t)(nan != 0) | ln_output((const char *)x + j * DT_SIZE[dt], N - j, mean, rstd,
                                            (char *)y + j * DT_SIZE[yt], dt, yt, LN_OUT_SUB);
}
#define LN_OUTPUT_SUB(x, N, mean, rstd, y, DT, YT) ln_output16(x, N, mean, rstd, y, DT, YT)
#else
#define LN_OUTPUT_SUB(x, N, mean, rstd, y, DT, YT) ln_output(x, N, mean, rstd, y, DT, YT, LN_OUT_SUB)
#endif

/* ATen's output line (LN_OUT_SUB) for each pair of x and y dtypes; the older lines through one loop */
typedef uint32_t (*ln_output_fn)(const void *, int64_t, float, float, void *);
#define DEFINE_LN_OUTPUT(DT, YT)                                                                                       \
    static uint32_t ln_output_##DT##_##YT(const void *x, int64_t N, float mean, float rstd, void *y) {                 \
        return LN_OUTPUT_SUB(x, N, mean, rstd, y, DT, YT);                                                             \
    }
#define DEFINE_LN_OUTPUT_DT(DT) DEFINE_LN_OUTPUT(DT, 0) DEFINE_LN_OUTPUT(DT, 1) DEFINE_LN_OUTPUT(DT, 2)
DEFINE_LN_OUTPUT_DT(0)
DEFINE_LN_OUTPUT_DT(1)
DEFINE_LN_OUTPUT_DT(2)
#define LN_OUTPUT_DT(DT) {ln_output_##DT##_0, ln_output_##DT##_1, ln_output_##DT##_2}
static const ln_output_fn LN_OUTPUT[3][3] = {LN_OUTPUT_DT(0), LN_OUTPUT_DT(1), LN_OUTPUT_DT(2)};
static uint32_t ln_output_other(const void *x, int dt, int64_t N, float mean, float rstd, void *y, int yt, int out) {
    uint32_t nan = 0;
    for (int64_t j = 0; j < N; j++) {
        float v;
        nan |= ln_output((const char *)x + j * DT_SIZE[dt], 1, mean, rstd, &v, dt, DT_F32, out);
        if (yt == DT_F32) ((float *)y)[j] = v;
        else if (yt == DT_BF16) ((uint16_t *)y)[j] = f32_to_bf16(v);
        else ((uint16_t *)y)[j] = f32_to_f16(v);
    }
    return nan;
}

/* The LayerNorm forward of `rows` contiguous rows of n elements (above): y (n per row, in `ydtype`) and rstd
 * (fp32, one per row), with ATen's arithmetic for vector `width` (16, 8 or 4) and `flags` (LN_*); the rows split
 * over an OpenMP team of `threads`. Returns 1 when some y or rstd is NaN (its bits are ATen's only by chance: the
 * caller recomputes), 0 otherwise, -1 for a width or an output line it does not know. */
int lmbp_layer_norm_fwd(const void *x, int xdtype, int64_t rows, int64_t n, float eps, void *y, int ydtype,
                        float *rstd, int width, int flags, int threads) {
    const int out = (flags >> LN_OUT_SHIFT) & 3;
    if ((width != 16 && width != 8 && width != 4) || out > LN_OUT_MULADD) return -1;
    ln_output_fn output = LN_OUTPUT[xdtype][ydtype];
    float cv[LN_CHUNK]; /* ATen's c_vecs: 1 / (j + 1) */
    for (int j = 0; j < LN_CHUNK; j++) cv[j] = 1.0f / (float)(j + 1);
    uint32_t acc = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(| : acc) if (threads > 1)
    {
        int64_t r0, r1;
        team_rows(rows, &r0, &r1);
        for (int64_t r = r0; r < r1; r += 2) { /* two rows at a time: their moments' ends interleave */
            const int K = r + 1 < r1 ? 2 : 1;
            const void *xs[2];
            float l1[2][LN_MAX_W], l2[2][LN_MAX_W], mean[2], var[2];
            for (int k = 0; k < K; k++) {
                xs[k] = (const char *)x + (r + k) * n * DT_SIZE[xdtype];
#if defined(HAVE_V8)
                if (width == 8 && (flags & LN_VEC_FMA)) { /* one inlined copy per input type */
                    if (xdtype == DT_F32) ln_moments8(xs[k], n, cv, l1[k], l2[k], DT_F32, flags);
                    else if (xdtype == DT_BF16) ln_moments8(xs[k], n, cv, l1[k], l2[k], DT_BF16, flags);
                    else ln_moments8(xs[k], n, cv, l1[k], l2[k], DT_F16, flags);
                } else
#endif
                    ln_moments_lanes(xs[k], n, cv, l1[k], l2[k], xdtype, width, flags);
            }
            if (K == 2) ln_finish(xs, n, n / width, width, l1, l2, mean, var, xdtype, flags, 2);
            else ln_finish(xs, n, n / width, width, l1, l2, mean, var, xdtype, flags, 1);
            for (int k = 0; k < K; k++) {
                char *yr = (char *)y + (r + k) * n * DT_SIZE[ydtype];
                float s = 1.0f / __builtin_sqrtf(var[k] + eps);
                rstd[r + k] = s;
                acc |= (uint32_t)(s != s) | (out == LN_OUT_SUB ? output(xs[k], n, mean[k], s, yr)
                                                               : ln_output_other(xs[k], xdtype, n, mean[k], s, yr,
                                                                                 ydtype, out));
            }
        }
    }
    return (int)acc;
}
