/* A~ of verified rows straight from vLLM's CPU paged KV cache (CPU_ATTN, isa vec), and d^2, n^2 per row.
 *
 * The arithmetic is alspec_eval.semantics.attend's: scores q.k accumulated in float32 and scaled, a float32 softmax
 * (max, exponentials, sum), the unnormalised probabilities rounded to the values' dtype, P @ V accumulated in float32,
 * divided by the sum, the output rounded to the query's dtype; then squared_distances' d^2 = sum (A~ - A)^2 and
 * n^2 = sum A^2 in float32 over every head and channel. Only the order of float32 sums differs from the torch ops.
 *
 * The cache: per (block, KV head) its N keys transposed (a D x N matrix), then its N values (N x D). Each row reads
 * its key ranges [starts, ends) (logical positions) through its request's block table, a run of a block at a time.
 * Work goes to OpenMP threads by (row, KV head); a row's result never depends on how many threads there are.
 *
 * alspec_decide goes on where no other rank holds heads of the rows: semantics.accept (d <= lambda n, d and n the
 * square roots, lambda = inf accepting all) and semantics.commit (an accepted row's A~ replaces A in place), and
 * each row's code and d/n written where the step's rows list it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FLOAT32 = 0, BFLOAT16 = 1 };

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype == FLOAT32 ? ((const float *)base)[i] : from_bf16(((const uint16_t *)base)[i]);
}

static inline float rounded(float x, int dtype) { return dtype == FLOAT32 ? x : from_bf16(to_bf16(x)); }

static inline void store(void *base, int64_t i, float x, int dtype) {
    if (dtype == FLOAT32) ((float *)base)[i] = x;
    else ((uint16_t *)base)[i] = to_bf16(x);
}

/* Ask for the cache lines of row m's keys and values at KV head h, so that they arrive while the work before them
 * runs (rows read scattered blocks: waiting on each line in turn leaves the memory bus idle). */
static void prefetch(const void *cache, const int32_t *table, int64_t table_stride, const int64_t *request,
                     const int64_t *starts, const int64_t *ends, int64_t ranges, int64_t m, int64_t h,
                     int64_t kv_heads, int64_t dim, int64_t block_size, int64_t element) {
    const int32_t *row_table = table + request[m] * table_stride;
    for (int64_t k = 0; k < ranges; ++k) {
        for (int64_t p = starts[m * ranges + k], end = ends[m * ranges + k]; p < end;) {
            const int64_t offset = p % block_size, run = end - p < block_size - offset ? end - p : block_size - offset;
            const char *base = (const char *)cache
                               + (((int64_t)row_table[p / block_size] * kv_heads + h) * 2 * block_size * dim) * element;
            for (int64_t d = 0; d < dim; ++d)
                for (int64_t b = 0; b < run * element; b += 64)
                    __builtin_prefetch(base + (d * block_size + offset) * element + b);
            for (int64_t b = 0; b < run * dim * element; b += 64)
                __builtin_prefetch(base + (block_size * dim + offset * dim) * element + b);
            p += run;
        }
    }
}

/* query (tokens, Hq, D) with ``q_stride`` elements a token; exact (tokens, Hq, D) with ``o_stride``; cache (blocks,
 * Hkv, N, 2D); table (requests, table_stride) int32; per row its token, request and ``ranges`` [starts, ends);
 * approx (rows, Hq, D) out, in the dtype; d2, n2 (rows,) out. Returns 0, or -1 where scratch memory ran out. */
int alspec_verify(const void *query, int64_t q_stride, const void *exact, int64_t o_stride, const void *cache,
                  const int32_t *table, int64_t table_stride, int64_t rows, const int64_t *token,
                  const int64_t *request, const int64_t *starts, const int64_t *ends, int64_t ranges,
                  int64_t most_keys, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                  int dtype, void *approx, float *d2, float *n2) {
    const int64_t group = heads / kv_heads, block_elems = 2 * block_size * dim, element = dtype == FLOAT32 ? 4 : 2;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * group * (most_keys > 0 ? most_keys : 1));
        float *acc = malloc(sizeof(float) * group * dim);
        float *q = malloc(sizeof(float) * group * dim);
        float *sum = malloc(sizeof(float) * group);
        int primed = 0;
        if (!scores || !acc || !q || !sum) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t work = 0; work < rows * kv_heads; ++work) {
            if (failed) continue;
            const int64_t m = work / kv_heads, h = work % kv_heads;
            if (!primed) /* a thread's first item, then always its next (static chunks: work + 1) */
                prefetch(cache, table, table_stride, request, starts, ends, ranges, m, h, kv_heads, dim, block_size,
                         element);
            primed = 1;
            if (work + 1 < rows * kv_heads)
                prefetch(cache, table, table_stride, request, starts, ends, ranges, (work + 1) / kv_heads,
                         (work + 1) % kv_heads, kv_heads, dim, block_size, element);
            const int64_t t = token[m];
            const int32_t *row_table = table + request[m] * table_stride;
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < dim; ++d)
                    q[g * dim + d] = load(query, t * q_stride + (h * group + g) * dim + d, dtype);
            int64_t n = 0; /* scores: q.k over the ranges' keys, run by run */
            for (int64_t k = 0; k < ranges; ++k) {
                for (int64_t p = starts[m * ranges + k], end = ends[m * ranges + k]; p < end;) {
                    const int64_t offset = p % block_size, run = end - p < block_size - offset ? end - p
                                                                                              : block_size - offset;
                    const int64_t keys = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems + offset;
                    for (int64_t g = 0; g < group; ++g)
                        for (int64_t j = 0; j < run; ++j) scores[g * most_keys + n + j] = 0.0f;
                    for (int64_t d = 0; d < dim; ++d) { /* a row of the transposed keys, for every query of the group */
                        const int64_t at = keys + d * block_size;
                        for (int64_t g = 0; g < group; ++g) {
                            const float qd = q[g * dim + d];
                            float *restrict s = scores + g * most_keys + n;
                            if (dtype == FLOAT32) {
                                const float *restrict kd = (const float *)cache + at;
                                for (int64_t j = 0; j < run; ++j) s[j] += qd * kd[j];
                            } else {
                                const uint16_t *restrict kd = (const uint16_t *)cache + at;
                                for (int64_t j = 0; j < run; ++j) s[j] += qd * from_bf16(kd[j]);
                            }
                        }
                    }
                    n += run;
                    p += run;
                }
            }
            for (int64_t g = 0; g < group; ++g) { /* the softmax's max, exponentials and sum, in float32 */
                float *s = scores + g * most_keys, best = -INFINITY, total = 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    s[j] *= scale;
                    best = s[j] > best ? s[j] : best;
                }
                for (int64_t j = 0; j < n; ++j) {
                    s[j] = expf(s[j] - best);
                    total += s[j];
                }
                sum[g] = total;
            }
            memset(acc, 0, sizeof(float) * group * dim);
            n = 0; /* P @ V, the probabilities rounded to the values' dtype */
            for (int64_t k = 0; k < ranges; ++k) {
                for (int64_t p = starts[m * ranges + k], end = ends[m * ranges + k]; p < end;) {
                    const int64_t offset = p % block_size, run = end - p < block_size - offset ? end - p
                                                                                              : block_size - offset;
                    const int64_t values = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems
                                           + block_size * dim + offset * dim;
                    for (int64_t j = 0; j < run; ++j) {
                        for (int64_t g = 0; g < group; ++g) {
                            const float w = rounded(scores[g * most_keys + n + j], dtype);
                            float *restrict a = acc + g * dim;
                            if (dtype == FLOAT32) {
                                const float *restrict v = (const float *)cache + values + j * dim;
                                for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
                            } else {
                                const uint16_t *restrict v = (const uint16_t *)cache + values + j * dim;
                                for (int64_t d = 0; d < dim; ++d) a[d] += w * from_bf16(v[d]);
                            }
                        }
                    }
                    n += run;
                    p += run;
                }
            }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < dim; ++d)
                    store(approx, (m * heads + h * group + g) * dim + d, acc[g * dim + d] / sum[g], dtype);
        }
        free(scores);
        free(acc);
        free(q);
        free(sum);
    }
    if (failed) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < rows; ++m) { /* d^2 and n^2 over every head and channel of the row */
        float dd = 0.0f, nn = 0.0f;
        for (int64_t i = 0; i < heads * dim; ++i) {
            const float a = load(exact, token[m] * o_stride + i, dtype);
            const float diff = load(approx, m * heads * dim + i, dtype) - a;
            dd += diff * diff;
            nn += a * a;
        }
        d2[m] = dd;
        n2[m] = nn;
    }
    return 0;
}

/* After alspec_verify: row m is accepted iff sqrt(d2) <= lambda sqrt(n2) (lambda = inf: always); an accepted row's
 * A~ (approx, in the dtype) is copied over A (exact, written in place); codes[live[m]] = accepted or rejected and
 * ratios[live[m]] = d / n. */
void alspec_decide(void *exact, int64_t o_stride, const void *approx, int64_t rows, const int64_t *token,
                   const int64_t *live, int64_t heads, int64_t dim, int dtype, const float *d2, const float *n2,
                   double lambda, int8_t accepted, int8_t rejected, int8_t *codes, float *ratios) {
    const size_t row_bytes = (size_t)(heads * dim) * (dtype == FLOAT32 ? 4 : 2);
    const float lam = (float)lambda;
    for (int64_t m = 0; m < rows; ++m) {
        const float d = sqrtf(d2[m]), n = sqrtf(n2[m]);
        const int accept = isinf(lambda) && lambda > 0 ? 1 : d <= lam * n;
        if (accept)
            memcpy((char *)exact + (size_t)(token[m] * o_stride) * (row_bytes / (size_t)(heads * dim)),
                   (const char *)approx + (size_t)m * row_bytes, row_bytes);
        codes[live[m]] = accept ? accepted : rejected;
        ratios[live[m]] = d / n;
    }
}
