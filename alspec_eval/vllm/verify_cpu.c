/* A~ of verified rows straight from vLLM's CPU paged KV cache (CPU_ATTN, isa vec), and d^2, n^2 per row.
 *
 * The arithmetic is alspec_eval.semantics.attend's: scores q.k accumulated in float32 and scaled, a float32 softmax
 * (max, exponentials, sum), the unnormalised probabilities rounded to the values' dtype, P @ V accumulated in float32,
 * divided by the sum, the output rounded to the query's dtype; then squared_distances' d^2 = sum (A~ - A)^2 and
 * n^2 = sum A^2 in float32 over every head and channel. What differs from the torch ops is float32 rounding only:
 * the order of sums (fixed here: a row's bits never depend on the rest of the step) and an exponential within about
 * one ulp of expf. Every row goes through the same code, so a row's bits depend on its own inputs alone.
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

enum { LANES = 16 }; /* keys (or channels) a vector register holds; sums go in LANES partial sums, fixed order */

/* e^x for x <= 0 (a softmax's s - max), within about 1 ulp of expf; below -87.3 it gives float32's smallest
 * normal (about 1.2e-38) where expf gives a denormal or 0, which no sum of probabilities (the max's alone is 1)
 * can see. Written without branches or calls so that its loop vectorises (libm's expf does not without
 * -ffast-math). */
static inline float exp_nonpositive(float x) {
    const float low = -87.33654f, xc = x < low ? low : x;
    const float n = floorf(fmaf(xc, 1.44269504088896341f, 0.5f));
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float y = fmaf(p * r, r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

/* The sum of x[0..n) as LANES partial sums (lane j % LANES) added in lane order: vectorised, and the same bits
 * for the same values whatever else the call holds. */
static inline float lane_sum(const float *x, int64_t n) {
    float part[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += x[j + l];
    for (int l = 0; j + l < n; ++l) part[l] += x[j + l];
    float total = 0.0f;
    for (int l = 0; l < LANES; ++l) total += part[l];
    return total;
}

static inline float lane_max(const float *x, int64_t n) {
    float part[LANES];
    for (int l = 0; l < LANES; ++l) part[l] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; ++l) part[l] = x[j + l] > part[l] ? x[j + l] : part[l];
    for (int l = 0; j + l < n; ++l) part[l] = x[j + l] > part[l] ? x[j + l] : part[l];
    float best = -INFINITY;
    for (int l = 0; l < LANES; ++l) best = part[l] > best ? part[l] : best;
    return best;
}

typedef float lanes_f32 __attribute__((vector_size(LANES * 4)));  /* GCC and Clang vectors: one register where */
typedef uint16_t lanes_u16 __attribute__((vector_size(LANES * 2))); /* the CPU has 16 float lanes, else split */
typedef uint32_t lanes_u32 __attribute__((vector_size(LANES * 4)));

static inline lanes_f32 lanes_at(const void *base, int64_t i, int dtype) { /* LANES consecutive values as float32 */
    lanes_f32 v;
    if (dtype == FLOAT32) {
        memcpy(&v, (const float *)base + i, sizeof v);
    } else {
        lanes_u16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        const lanes_u32 u = __builtin_convertvector(h, lanes_u32) << 16;
        memcpy(&v, &u, sizeof v);
    }
    return v;
}

enum { QUERIES = 4 }; /* queries scored together: each key's lanes read once for four independent fma chains */

/* Scores of QUERIES queries (q: D floats each, consecutive) against LANES consecutive keys of a transposed block
 * (key 0's channel 0 at ``keys``, channels N apart): each key's sum over the channels in order, in registers.
 * Reading past the block's last key stays inside its (block, head) span (its values follow its keys); the first
 * ``count`` of each query's are kept, ``stride`` apart. */
static inline void score_block(const float *q, int64_t dim, const void *cache, int64_t keys, int64_t block_size,
                               int dtype, float *out, int64_t stride, int64_t count) {
    lanes_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t d = 0; d < dim; ++d) {
        const lanes_f32 k = lanes_at(cache, keys + d * block_size, dtype);
        a0 += q[d] * k;
        a1 += q[dim + d] * k;
        a2 += q[2 * dim + d] * k;
        a3 += q[3 * dim + d] * k;
    }
    memcpy(out, &a0, sizeof(float) * count);
    memcpy(out + stride, &a1, sizeof(float) * count);
    memcpy(out + 2 * stride, &a2, sizeof(float) * count);
    memcpy(out + 3 * stride, &a3, sizeof(float) * count);
}

/* acc (CHUNKS x LANES channels) += w_j v_j over a run of keys (values ``dim`` apart from ``values``), keys in order:
 * CHUNKS independent chains in registers (CHUNKS a constant where called). */
static inline void weigh_values(lanes_f32 *acc, const int chunks, const float *w, const void *cache, int64_t values,
                                int64_t dim, int64_t run, int dtype) {
    lanes_f32 a[8];
    for (int c = 0; c < chunks; ++c) a[c] = acc[c];
    for (int64_t j = 0; j < run; ++j)
        for (int c = 0; c < chunks; ++c) a[c] += w[j] * lanes_at(cache, values + j * dim + c * LANES, dtype);
    for (int c = 0; c < chunks; ++c) acc[c] = a[c];
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
    const int64_t stride = most_keys > 0 ? most_keys : 1;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * ((group + QUERIES - 1) / QUERIES * QUERIES) * stride);
        const int64_t padded = (group + QUERIES - 1) / QUERIES * QUERIES; /* queries scored in fours; the rest 0 */
        float *q = calloc(padded * dim, sizeof(float));
        float *sum = malloc(sizeof(float) * group);
        int primed = 0;
        if (!scores || !q || !sum) {
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
            int64_t n = 0; /* scores: q.k over the ranges' keys in order, LANES keys of a block at a time */
            for (int64_t k = 0; k < ranges; ++k) {
                for (int64_t p = starts[m * ranges + k], end = ends[m * ranges + k]; p < end;) {
                    const int64_t offset = p % block_size, run = end - p < block_size - offset ? end - p
                                                                                              : block_size - offset;
                    const int64_t keys = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems + offset;
                    for (int64_t j = 0; j < run; j += LANES)
                        for (int64_t g = 0; g < padded; g += QUERIES)
                            score_block(q + g * dim, dim, cache, keys + j, block_size, dtype,
                                        scores + g * stride + n + j, stride, run - j < LANES ? run - j : LANES);
                    n += run;
                    p += run;
                }
            }
            for (int64_t g = 0; g < group; ++g) { /* the softmax's max, exponentials and sum, in float32 */
                float *s = scores + g * stride;
                for (int64_t j = 0; j < n; ++j) s[j] *= scale;
                const float best = lane_max(s, n);
                for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - best);
                sum[g] = lane_sum(s, n);
                if (dtype != FLOAT32) /* P @ V takes the probabilities rounded to the values' dtype */
                    for (int64_t j = 0; j < n; ++j) s[j] = rounded(s[j], dtype);
            }
            const int chunks = dim % LANES == 0 && dim / LANES <= 8 ? (int)(dim / LANES) : 0;
            for (int64_t g = 0; g < group; ++g) { /* P @ V: each channel's sum over the keys in order */
                const float *w = scores + g * stride;
                lanes_f32 acc[8] = {{0}};
                float tail[LANES * 8] = {0}; /* head_dim not a multiple of LANES (or past 8 LANES): channel by channel */
                float *out = chunks ? (float *)acc : tail;
                for (int64_t c0 = 0; c0 < (chunks ? LANES : dim); c0 += LANES * 8) {
                    if (!chunks) memset(tail, 0, sizeof tail);
                    n = 0;
                    for (int64_t k = 0; k < ranges; ++k) {
                        for (int64_t p = starts[m * ranges + k], end = ends[m * ranges + k]; p < end;) {
                            const int64_t offset = p % block_size, run = end - p < block_size - offset
                                                                             ? end - p : block_size - offset;
                            const int64_t values = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems
                                                   + block_size * dim + offset * dim;
                            if (chunks == 4) weigh_values(acc, 4, w + n, cache, values, dim, run, dtype);
                            else if (chunks == 8) weigh_values(acc, 8, w + n, cache, values, dim, run, dtype);
                            else if (chunks) weigh_values(acc, chunks, w + n, cache, values, dim, run, dtype);
                            else
                                for (int64_t j = 0; j < run; ++j)
                                    for (int64_t l = c0; l < dim && l < c0 + LANES * 8; ++l)
                                        tail[l - c0] = fmaf(w[n + j], load(cache, values + j * dim + l, dtype),
                                                            tail[l - c0]);
                            n += run;
                            p += run;
                        }
                    }
                    const int64_t from = chunks ? 0 : c0, to = chunks ? dim : (c0 + LANES * 8 < dim ? c0 + LANES * 8 : dim);
                    for (int64_t l = from; l < to; ++l)
                        store(approx, (m * heads + h * group + g) * dim + l, out[l - from] / sum[g], dtype);
                }
            }
        }
        free(scores);
        free(q);
        free(sum);
    }
    if (failed) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < rows; ++m) { /* d^2 and n^2 over every head and channel of the row, in lanes */
        float dd[LANES] = {0}, nn[LANES] = {0};
        for (int64_t i = 0; i < heads * dim; ++i) {
            const float a = load(exact, token[m] * o_stride + i, dtype);
            const float diff = load(approx, m * heads * dim + i, dtype) - a;
            dd[i % LANES] = fmaf(diff, diff, dd[i % LANES]);
            nn[i % LANES] = fmaf(a, a, nn[i % LANES]);
        }
        float dsum = 0.0f, nsum = 0.0f;
        for (int l = 0; l < LANES; ++l) {
            dsum += dd[l];
            nsum += nn[l];
        }
        d2[m] = dsum;
        n2[m] = nsum;
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
