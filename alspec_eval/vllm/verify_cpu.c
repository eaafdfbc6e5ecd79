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
 * Rows of a request whose ranges overlap go together as a tile (see cut_tiles); work goes to OpenMP threads by
 * (tile, KV head). A row's result never depends on its tile or on how many threads there are.
 *
 * alspec_verify_listed does the same for rows whose keys a draft chose by content: a list of positions per row and KV
 * head, in place of ranges.
 *
 * Where no other rank holds heads of the rows, the same call goes on to decide: semantics.accept (d <= lambda n, d
 * and n the square roots, lambda = inf accepting all) and semantics.commit (an accepted row's A~ replaces A in
 * place), each row's code and d/n written where the step's rows list it. One call and one parallel region a layer:
 * a decode step's rows take microseconds, so the call's own costs (its arguments, a fork of the threads) are what
 * would otherwise show.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

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

/* Ask for the cache lines of the keys and values in [lo, hi) of each range at KV head h, so that they arrive while
 * the work before them runs (decode rows read scattered blocks: waiting on each line in turn leaves the memory bus
 * idle). */
static void prefetch(const void *cache, const int32_t *row_table, const int64_t *lo, const int64_t *hi,
                     int64_t ranges, int64_t h, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t element) {
    for (int64_t k = 0; k < ranges; ++k) {
        for (int64_t p = lo[k], end = hi[k]; p < end;) {
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

/* Keys (or channels) a vector register holds; sums go in LANES partial sums, fixed order. Without AVX-512, a register
 * of 8 floats (AVX2's): GCC lowers a wider vector type there through memory, op by op (7x slower P @ V). */
#ifdef __AVX512F__
enum { LANES = 16 };
#else
enum { LANES = 8 };
#endif

/* e^x for x <= 0 (a softmax's s - max), within about 1 ulp of expf; below -87.3 it gives about float32's smallest
 * normal (about 1.2e-38) where expf gives a denormal or 0, which no sum of probabilities (the max's alone is 1)
 * can see. Written without branches or calls, so that exp_lanes can do the same on LANES values at once (libm's expf
 * does not vectorise without -ffast-math). */
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

typedef float lanes_f32 __attribute__((vector_size(LANES * 4)));  /* GCC and Clang vectors: one register of */
typedef uint16_t lanes_u16 __attribute__((vector_size(LANES * 2))); /* AVX-512 or AVX2 (split where narrower) */
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

typedef int32_t lanes_i32 __attribute__((vector_size(LANES * 4)));

static inline lanes_f32 select_lanes(lanes_i32 mask, lanes_f32 yes, lanes_f32 no) {
    return (lanes_f32)((mask & (lanes_i32)yes) | (~mask & (lanes_i32)no));
}

/* exp_nonpositive on LANES values at once, op for op (floorf as truncation less one where it rounded up, exact in
 * the range used): the same bits. */
static inline lanes_f32 exp_lanes(lanes_f32 x) {
    const lanes_f32 zero = {0}, low = zero - 87.33654f;
    const lanes_f32 xc = select_lanes(x < low, low, x), t = xc * 1.44269504088896341f + 0.5f;
    const lanes_f32 whole = __builtin_convertvector(__builtin_convertvector(t, lanes_i32), lanes_f32);
    const lanes_f32 n = whole + __builtin_convertvector(whole > t, lanes_f32); /* the mask is -1 where rounded up */
    lanes_f32 r = n * -0.693359375f + xc;
    r = n * 2.12194440e-4f + r;
    lanes_f32 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const lanes_f32 pr = p * r, y = (pr * r + r) + 1.0f;
    return y * (lanes_f32)((__builtin_convertvector(n, lanes_i32) + 127) << 23);
}

/* A softmax's numerators in place: s[j] = e^(s[j] - best), best their max, returning their sum; rounded to the
 * values' dtype after the sum where it is not float32 (P @ V takes them so). The sum goes in LANES partial sums (lane
 * j % LANES), then across the lanes in order: vectorised, and the same bits for the same scores whatever else the call
 * holds. The exponential is exp_nonpositive, LANES at a time, the tail one by one. */
static float softmax(float *s, int64_t n, float best, int dtype) {
    const int64_t whole = n / LANES * LANES;
    lanes_f32 total = {0};
    for (int64_t j = 0; j < whole; j += LANES) {
        lanes_f32 v;
        memcpy(&v, s + j, sizeof v);
        v = exp_lanes(v - best);
        total += v;
        memcpy(s + j, &v, sizeof v);
    }
    float part[LANES];
    memcpy(part, &total, sizeof part);
    for (int64_t j = whole; j < n; ++j) {
        s[j] = exp_nonpositive(s[j] - best);
        part[j - whole] += s[j];
    }
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += part[l];
    if (dtype != FLOAT32)
        for (int64_t j = 0; j < n; ++j) s[j] = rounded(s[j], dtype);
    return sum;
}

/* to[j] = from[j] * scale for j < n, returning the running max ``most`` with theirs (a max is exact in any order). */
static float scaled_copy(float *to, const float *from, int64_t n, float scale, float most) {
    const int64_t whole = n / LANES * LANES;
    lanes_f32 top = {0};
    top += most;
    for (int64_t j = 0; j < whole; j += LANES) {
        lanes_f32 v;
        memcpy(&v, from + j, sizeof v);
        v *= scale;
        top = select_lanes(v > top, v, top);
        memcpy(to + j, &v, sizeof v);
    }
    float part[LANES];
    memcpy(part, &top, sizeof part);
    for (int l = 0; l < LANES; ++l) most = part[l] > most ? part[l] : most;
    for (int64_t j = whole; j < n; ++j) {
        to[j] = from[j] * scale;
        most = to[j] > most ? to[j] : most;
    }
    return most;
}

/* e^x of x[0..n) (every x <= 0) as the softmax takes it, LANES at a time and the tail one by one: for its test. */
void alspec_exp(const float *x, float *y, int64_t n) {
    const int64_t whole = n / LANES * LANES;
    for (int64_t j = 0; j < whole; j += LANES) {
        lanes_f32 v;
        memcpy(&v, x + j, sizeof v);
        v = exp_lanes(v);
        memcpy(y + j, &v, sizeof v);
    }
    for (int64_t j = whole; j < n; ++j) y[j] = exp_nonpositive(x[j]);
}

/* Rows of one request whose key ranges overlap (a prefill's consecutive positions: the same first S keys, last S
 * keys one apart) are verified together, as a tile: each key is read once for all of the tile's queries, so that
 * the hot loops run from registers and L1 at the FMA units' rate rather than the loads'. A tile reads the union of
 * its rows' ranges; rows join while that union is at most 5/4 of the longest row's keys. Every score and every
 * channel of P @ V is still one chain of fmas over its own row's keys in their order, so tiling changes no bit. */
enum { TILE_QUERIES = 48, MOST_TILE_ROWS = 16, MOST_QUERIES = 6 };
/* How many LANES-wide vectors a tile keeps: score_tile's keys per query, weigh_tile's channels per query. With
 * AVX-512 a vector is one of 32 registers (6 queries x 4 = 24 accumulators); AVX2 has 16, and tiles that size would
 * spill their accumulators to memory at every key, so they take a quarter. */
#ifdef __AVX512F__
#define KEY_VECTORS 4
#define CHANNEL_VECTORS 8
#else
#define KEY_VECTORS 1
#define CHANNEL_VECTORS 2
#endif

#define INLINE static inline __attribute__((always_inline))

/* Scores of nq queries (q: D floats each, consecutive) against nk x LANES consecutive keys of a transposed block (key
 * 0's channel 0 at ``keys``, channels N apart): each a sum over the channels in order. Reading past the block's last
 * key stays inside its (block, head) span (its values follow its keys); the first ``count`` of each query's are kept,
 * ``stride`` apart. */
INLINE void score_tile(const int nq, const int nk, const float *q, int64_t dim, const void *cache, int64_t keys,
                       int64_t block_size, int dtype, float *out, int64_t stride, int64_t count) {
    lanes_f32 a[MOST_QUERIES][KEY_VECTORS];
    for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) a[i][j] = (lanes_f32){0};
    for (int64_t d = 0; d < dim; ++d) {
        lanes_f32 k[KEY_VECTORS];
        for (int j = 0; j < nk; ++j) k[j] = lanes_at(cache, keys + d * block_size + j * LANES, dtype);
        for (int i = 0; i < nq; ++i) {
            const float s = q[i * dim + d];
            for (int j = 0; j < nk; ++j) a[i][j] += s * k[j];
        }
    }
    for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) {
            const int64_t left = count - j * LANES;
            memcpy(out + i * stride + j * LANES, &a[i][j], sizeof(float) * (left < LANES ? left : LANES));
        }
}

/* Scores of queries q[0..padded) (padded a multiple of qs: 3, 4 or 6) against ``count`` keys of one block run: each
 * KEY_VECTORS x LANES keys, read into L1 once, serve every block of qs queries. */
static void score_run(const int qs, int64_t padded, const float *q, int64_t dim, const void *cache, int64_t keys,
                      int64_t block_size, int dtype, float *out, int64_t stride, int64_t count) {
    for (int64_t j = 0; j < count; j += KEY_VECTORS * LANES) {
        const int64_t left = count - j < KEY_VECTORS * LANES ? count - j : KEY_VECTORS * LANES;
        const int nk = (int)((left + LANES - 1) / LANES);
        for (int64_t g = 0; g < padded; g += qs) {
#define SCORE(NQ, NK)                                                                                                  \
    case NQ * 8 + NK:                                                                                                  \
        score_tile(NQ, NK, q + g * dim, dim, cache, keys + j, block_size, dtype, out + g * stride + j, stride, left); \
        break;
            switch (qs * 8 + nk) {
                SCORE(3, 1) SCORE(4, 1) SCORE(6, 1)
#if KEY_VECTORS == 4
                SCORE(3, 2) SCORE(3, 3) SCORE(3, 4) SCORE(4, 2) SCORE(4, 3) SCORE(4, 4) SCORE(6, 2) SCORE(6, 3) SCORE(6, 4)
#endif
            }
#undef SCORE
        }
    }
}

/* How many queries score_run scores together, for ``queries`` of them: 6, 4 or 3, whichever pads least (the larger
 * on a tie); the padding is computed and dropped. */
static inline int query_block(int64_t queries) {
    const int64_t pad6 = (queries + 5) / 6 * 6 - queries, pad4 = (queries + 3) / 4 * 4 - queries;
    const int64_t pad3 = (queries + 2) / 3 * 3 - queries;
    return pad6 <= pad4 && pad6 <= pad3 ? 6 : pad4 <= pad3 ? 4 : 3;
}

/* Queries of one P @ V pass at ``chunks`` x LANES channels: as many as keep their accumulators in registers. */
static inline int pv_queries(int chunks) {
#if CHANNEL_VECTORS == 8
    return chunks <= 4 ? 6 : chunks <= 6 ? 4 : 3;
#else
    return chunks <= 1 ? 6 : 3;
#endif
}

/* acc[i] (chunks x LANES channels) += w[i][j] v_j over a run of keys (values ``dim`` apart from ``values``), keys in
 * order: nq x chunks independent chains in registers. */
INLINE void weigh_tile(const int nq, const int chunks, float *const *acc, const float *const *w, const void *cache,
                       int64_t values, int64_t dim, int64_t run, int dtype) {
    lanes_f32 a[MOST_QUERIES][CHANNEL_VECTORS];
    const float *wi[MOST_QUERIES];
    for (int i = 0; i < nq; ++i) {
        wi[i] = w[i];
        for (int c = 0; c < chunks; ++c) memcpy(&a[i][c], acc[i] + c * LANES, sizeof a[i][c]);
    }
    for (int64_t j = 0; j < run; ++j)
        for (int c = 0; c < chunks; ++c) {
            const lanes_f32 v = lanes_at(cache, values + j * dim + c * LANES, dtype);
            for (int i = 0; i < nq; ++i) a[i][c] += wi[i][j] * v;
        }
    for (int i = 0; i < nq; ++i)
        for (int c = 0; c < chunks; ++c) memcpy(acc[i] + c * LANES, &a[i][c], sizeof a[i][c]);
}

/* weigh_tile with ``slots`` queries: pv_queries(chunks), or 3 where a pass has no more (a decode row of a GQA group of
 * 3, a tile's last pass), so that fewer slots are computed on the spare. */
static void weigh_run(int slots, int chunks, float *const *acc, const float *const *w, const void *cache,
                      int64_t values, int64_t dim, int64_t run, int dtype) {
#define WEIGH(S, C) \
    case S * 16 + C: weigh_tile(S, C, acc, w, cache, values, dim, run, dtype); break;
    switch (slots * 16 + chunks) {
        WEIGH(6, 1) WEIGH(3, 1) WEIGH(3, 2)
#if CHANNEL_VECTORS == 8
        WEIGH(6, 2) WEIGH(6, 3) WEIGH(6, 4) WEIGH(4, 5) WEIGH(4, 6)
        WEIGH(3, 3) WEIGH(3, 4) WEIGH(3, 5) WEIGH(3, 6) WEIGH(3, 7) WEIGH(3, 8)
#endif
    }
#undef WEIGH
}

/* A tile: rows [first, first + count) and per range k the union [lo, hi) of their keys. */
typedef struct {
    int64_t first, count;
} tile_t;

static inline int64_t row_keys(const int64_t *starts, const int64_t *ends, int64_t ranges, int64_t m) {
    int64_t n = 0;
    for (int64_t k = 0; k < ranges; ++k) n += ends[m * ranges + k] - starts[m * ranges + k];
    return n;
}

/* Cuts the rows into tiles (each row's tile depends on the rows before it only through where tiles start, and no
 * result depends on its tile); fills lo, hi (tiles x ranges) and returns the count of tiles, and the most keys a
 * tile's union holds in *most_union. */
static int64_t cut_tiles(int64_t rows, const int64_t *request, const int64_t *starts, const int64_t *ends,
                         int64_t ranges, int64_t tile_rows, tile_t *tiles, int64_t *lo, int64_t *hi,
                         int64_t *most_union) {
    int64_t count = 0;
    *most_union = 0;
    for (int64_t m = 0; m < rows; ++count) {
        int64_t *l = lo + count * ranges, *h = hi + count * ranges, longest = row_keys(starts, ends, ranges, m);
        for (int64_t k = 0; k < ranges; ++k) {
            l[k] = starts[m * ranges + k];
            h[k] = ends[m * ranges + k];
        }
        tiles[count].first = m++;
        for (; m < rows && m - tiles[count].first < tile_rows && request[m] == request[tiles[count].first]; ++m) {
            const int64_t mine = row_keys(starts, ends, ranges, m), most = mine > longest ? mine : longest;
            int64_t total = 0;
            for (int64_t k = 0; k < ranges; ++k) {
                const int64_t s = starts[m * ranges + k], e = ends[m * ranges + k];
                const int64_t a = s == e ? l[k] : l[k] == h[k] ? s : s < l[k] ? s : l[k];
                const int64_t b = s == e ? h[k] : l[k] == h[k] ? e : e > h[k] ? e : h[k];
                total += b - a;
            }
            if (4 * total > 5 * most + 4) break;
            for (int64_t k = 0; k < ranges; ++k) {
                const int64_t s = starts[m * ranges + k], e = ends[m * ranges + k];
                if (s == e) continue;
                if (l[k] == h[k]) l[k] = s, h[k] = e;
                else l[k] = s < l[k] ? s : l[k], h[k] = e > h[k] ? e : h[k];
            }
            longest = most;
        }
        tiles[count].count = m - tiles[count].first;
        int64_t total = 0;
        for (int64_t k = 0; k < ranges; ++k) total += h[k] - l[k];
        *most_union = total > *most_union ? total : *most_union;
    }
    return count;
}

/* One tile at KV head h: every query's scores over the tile's union, its row's keys copied out in its own order, the
 * softmax, then P @ V in passes of pv_queries() queries, each pass over the union cut where its rows' ranges start
 * or end (a query whose row has no key in a piece keeps its slot busy with a copy of another's, written to a
 * scratch accumulator). */
static void verify_tile(const tile_t tile, const int64_t *lo, const int64_t *hi, int64_t h, const void *query,
                        int64_t q_stride, const void *cache, const int32_t *row_table, const int64_t *token,
                        const int64_t *starts, const int64_t *ends, int64_t ranges, int64_t w_stride, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int dtype, void *approx,
                        float *q, float *scores, float *w, float *sum, float *acc, float *spare) {
    const int64_t group = heads / kv_heads, block_elems = 2 * block_size * dim, queries = tile.count * group;
    const int qs = query_block(queries);
    const int64_t padded = (queries + qs - 1) / qs * qs;
    int64_t width = 0;
    for (int64_t k = 0; k < ranges; ++k) width += hi[k] - lo[k];
    for (int64_t i = 0; i < padded; ++i) { /* the tile's queries as float32 rows, the padding zero */
        const int64_t m = tile.first + i / group, at = token[m] * q_stride + (h * group + i % group) * dim;
        if (i >= queries) memset(q + i * dim, 0, sizeof(float) * dim);
        else if (dtype == FLOAT32) memcpy(q + i * dim, (const float *)query + at, sizeof(float) * dim);
        else for (int64_t d = 0; d < dim; ++d) q[i * dim + d] = from_bf16(((const uint16_t *)query)[at + d]);
    }
    for (int64_t k = 0, u = 0; k < ranges; u += hi[k] - lo[k], ++k) /* scores: q.k over the union, a run at a time */
        for (int64_t p = lo[k], end = hi[k]; p < end;) {
            const int64_t offset = p % block_size, run = end - p < block_size - offset ? end - p : block_size - offset;
            const int64_t keys = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems + offset;
            score_run(qs, padded, q, dim, cache, keys, block_size, dtype, scores + u + (p - lo[k]), width, run);
            p += run;
        }
    for (int64_t i = 0; i < queries; ++i) { /* each query's own keys in order; the softmax in float32 */
        const int64_t m = tile.first + i / group;
        float *s = w + i * w_stride;
        int64_t n = 0;
        float best = -INFINITY;
        for (int64_t k = 0, u = 0; k < ranges; u += hi[k] - lo[k], ++k) {
            const int64_t len = ends[m * ranges + k] - starts[m * ranges + k];
            best = scaled_copy(s + n, scores + i * width + u + (starts[m * ranges + k] - lo[k]), len, scale, best);
            n += len;
        }
        sum[i] = softmax(s, n, best, dtype);
    }
    const int vectors = dim % LANES == 0 ? (int)(dim / LANES) : 0; /* else channel by channel */
    const int64_t per_pass = vectors ? pv_queries(vectors < CHANNEL_VECTORS ? vectors : CHANNEL_VECTORS) : 1;
    for (int64_t b = 0; b < queries; b += per_pass) {
        const int64_t nq = queries - b < per_pass ? queries - b : per_pass, slots = nq <= 3 ? 3 : per_pass;
        for (int64_t c0 = 0; c0 < dim; c0 += CHANNEL_VECTORS * LANES) {
            const int64_t width_c = dim - c0 < CHANNEL_VECTORS * LANES ? dim - c0 : CHANNEL_VECTORS * LANES;
            memset(acc, 0, sizeof(float) * MOST_QUERIES * CHANNEL_VECTORS * LANES);
            for (int64_t k = 0; k < ranges; ++k) {
                int64_t cuts[2 * MOST_QUERIES], ncuts = 0; /* where the pass's rows' ranges start and end, sorted */
                for (int64_t i = 0; i < nq; ++i) {
                    const int64_t m = tile.first + (b + i) / group;
                    for (int e = 0; e < 2; ++e) {
                        int64_t x = e ? ends[m * ranges + k] : starts[m * ranges + k], at = ncuts;
                        while (at > 0 && cuts[at - 1] > x) --at;
                        if (at > 0 && cuts[at - 1] == x) continue;
                        memmove(cuts + at + 1, cuts + at, sizeof(int64_t) * (ncuts - at));
                        cuts[at] = x;
                        ++ncuts;
                    }
                }
                for (int64_t c = 0; c + 1 < ncuts; ++c) {
                    const int64_t from = cuts[c], to = cuts[c + 1];
                    float *slot_acc[MOST_QUERIES];
                    const float *slot_w[MOST_QUERIES];
                    int64_t any = -1;
                    for (int64_t i = 0; i < nq; ++i) {
                        const int64_t m = tile.first + (b + i) / group, s = starts[m * ranges + k];
                        if (s <= from && to <= ends[m * ranges + k]) {
                            int64_t before = 0; /* the row's keys in earlier ranges */
                            for (int64_t kk = 0; kk < k; ++kk) before += ends[m * ranges + kk] - starts[m * ranges + kk];
                            slot_acc[i] = acc + i * CHANNEL_VECTORS * LANES;
                            slot_w[i] = w + (b + i) * w_stride + before + (from - s);
                            any = i;
                        } else {
                            slot_acc[i] = NULL;
                        }
                    }
                    if (any < 0) continue;
                    for (int64_t i = 0; i < MOST_QUERIES; ++i) /* weigh_run fills ``slots`` slots */
                        if (i >= nq || slot_acc[i] == NULL) slot_acc[i] = spare, slot_w[i] = slot_w[any];
                    for (int64_t p = from; p < to;) {
                        const int64_t offset = p % block_size, run = to - p < block_size - offset ? to - p
                                                                                                 : block_size - offset;
                        const int64_t values = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems
                                               + block_size * dim + offset * dim + c0;
                        if (vectors)
                            weigh_run((int)slots, (int)(width_c / LANES), slot_acc, slot_w, cache, values, dim, run,
                                      dtype);
                        else
                            for (int64_t j = 0; j < run; ++j)
                                for (int64_t l = 0; l < width_c; ++l)
                                    slot_acc[0][l] = fmaf(slot_w[0][j], load(cache, values + j * dim + l, dtype),
                                                          slot_acc[0][l]);
                        for (int64_t i = 0; i < MOST_QUERIES; ++i) slot_w[i] += run;
                        p += run;
                    }
                }
            }
            for (int64_t i = 0; i < nq; ++i) {
                const int64_t m = tile.first + (b + i) / group, at = (m * heads + h * group + (b + i) % group) * dim + c0;
                const float *from = acc + i * CHANNEL_VECTORS * LANES, total = sum[b + i];
                if (dtype == FLOAT32)
                    for (int64_t l = 0; l < width_c; ++l) ((float *)approx)[at + l] = from[l] / total;
                else
                    for (int64_t l = 0; l < width_c; ++l) ((uint16_t *)approx)[at + l] = to_bf16(from[l] / total);
            }
        }
    }
}

/* d^2 and n^2 of row m over every head and channel, in lanes; where ``decide``, then its decision: accepted
 * iff sqrt(d2) <= lambda sqrt(n2) (lambda = inf: always), an accepted row's A~ copied over A (exact, in place),
 * codes[live[m]] = accepted or rejected and ratios[live[m]] = d / n. */
static void measure_row(int64_t m, void *exact, int64_t o_stride, const void *approx, const int64_t *token,
                        int64_t heads, int64_t dim, int dtype, float *d2, float *n2, int decide, double lambda,
                        const int64_t *live, int8_t accepted, int8_t rejected, int8_t *codes, float *ratios) {
    const int64_t whole = heads * dim / LANES * LANES;
    lanes_f32 dv = {0}, nv = {0};
    for (int64_t i = 0; i < whole; i += LANES) {
        const lanes_f32 a = lanes_at(exact, token[m] * o_stride + i, dtype);
        const lanes_f32 diff = lanes_at(approx, m * heads * dim + i, dtype) - a;
        dv += diff * diff;
        nv += a * a;
    }
    float dd[LANES], nn[LANES];
    memcpy(dd, &dv, sizeof dd);
    memcpy(nn, &nv, sizeof nn);
    for (int64_t i = whole; i < heads * dim; ++i) {
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
    if (!decide) return;
    const float d = sqrtf(dsum), n = sqrtf(nsum);
    const int accept = isinf(lambda) && lambda > 0 ? 1 : d <= (float)lambda * n;
    const size_t element = dtype == FLOAT32 ? 4 : 2, row_bytes = (size_t)(heads * dim) * element;
    if (accept)
        memcpy((char *)exact + (size_t)(token[m] * o_stride) * element, (const char *)approx + (size_t)m * row_bytes,
               row_bytes);
    codes[live[m]] = accept ? accepted : rejected;
    ratios[live[m]] = d / n;
}

/* measure_row for every row, shared among the threads of the enclosing parallel region. */
static void measure_rows(int64_t rows, void *exact, int64_t o_stride, const void *approx, const int64_t *token,
                         int64_t heads, int64_t dim, int dtype, float *d2, float *n2, int decide, double lambda,
                         const int64_t *live, int8_t accepted, int8_t rejected, int8_t *codes, float *ratios) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; ++m)
        measure_row(m, exact, o_stride, approx, token, heads, dim, dtype, d2, n2, decide, lambda, live, accepted,
                    rejected, codes, ratios);
}

/* query (tokens, Hq, D) with ``q_stride`` elements a token; exact (tokens, Hq, D) with ``o_stride``; cache (blocks,
 * Hkv, N, 2D); table (requests, table_stride) int32; per row its token, request and ``ranges`` [starts, ends);
 * approx (rows, Hq, D) out, in the dtype; d2, n2 (rows,) out; where ``decide``, each row decided at ``lambda``
 * (measure_row: exact written in place, codes and ratios at the rows' ``live``). Returns 0, or -1 where scratch
 * memory ran out (nothing decided then). */
int alspec_verify(const void *query, int64_t q_stride, void *exact, int64_t o_stride, const void *cache,
                  const int32_t *table, int64_t table_stride, int64_t rows, const int64_t *token,
                  const int64_t *request, const int64_t *starts, const int64_t *ends, int64_t ranges,
                  int64_t most_keys, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                  int dtype, void *approx, float *d2, float *n2, int decide, double lambda, const int64_t *live,
                  int8_t accepted, int8_t rejected, int8_t *codes, float *ratios) {
    const int64_t group = heads / kv_heads, element = dtype == FLOAT32 ? 4 : 2;
    const int64_t tile_rows = TILE_QUERIES / group < 1 ? 1 : TILE_QUERIES / group > MOST_TILE_ROWS ? MOST_TILE_ROWS
                                                                                                   : TILE_QUERIES / group;
    const int64_t w_stride = most_keys > 0 ? most_keys : 1;
    tile_t *tiles = malloc(sizeof(tile_t) * (rows > 0 ? rows : 1));
    int64_t *lo = malloc(sizeof(int64_t) * (rows > 0 ? rows : 1) * ranges);
    int64_t *hi = malloc(sizeof(int64_t) * (rows > 0 ? rows : 1) * ranges);
    if (!tiles || !lo || !hi) {
        free(tiles), free(lo), free(hi);
        return -1;
    }
    int64_t most_union;
    const int64_t count = cut_tiles(rows, request, starts, ends, ranges, tile_rows, tiles, lo, hi, &most_union);
    const int64_t most_queries = tile_rows * group + 6; /* a tile's queries, padded */
    int failed = 0;
#pragma omp parallel
    {
        float *q = malloc(sizeof(float) * most_queries * dim);
        float *scores = malloc(sizeof(float) * most_queries * (most_union > 0 ? most_union : 1));
        float *w = malloc(sizeof(float) * tile_rows * group * w_stride);
        float *sum = malloc(sizeof(float) * tile_rows * group);
        float *acc = malloc(sizeof(float) * (MOST_QUERIES + 1) * CHANNEL_VECTORS * LANES);
        int primed = 0;
        if (!q || !scores || !w || !sum || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t work = 0; work < count * kv_heads; ++work) {
            if (failed) continue;
            const int64_t t = work / kv_heads, h = work % kv_heads;
            const int32_t *row_table = table + request[tiles[t].first] * table_stride;
            if (!primed) /* a thread's first item, then always its next (static chunks: work + 1) */
                prefetch(cache, row_table, lo + t * ranges, hi + t * ranges, ranges, h, kv_heads, dim, block_size,
                         element);
            primed = 1;
            if (work + 1 < count * kv_heads) {
                const int64_t next = (work + 1) / kv_heads;
                prefetch(cache, table + request[tiles[next].first] * table_stride, lo + next * ranges,
                         hi + next * ranges, ranges, (work + 1) % kv_heads, kv_heads, dim, block_size, element);
            }
            verify_tile(tiles[t], lo + t * ranges, hi + t * ranges, h, query, q_stride, cache, row_table, token,
                        starts, ends, ranges, w_stride, heads, kv_heads, dim, block_size, scale, dtype, approx, q,
                        scores, w, sum, acc, acc + MOST_QUERIES * CHANNEL_VECTORS * LANES);
        }
        free(q);
        free(scores);
        free(w);
        free(sum);
        free(acc);
        /* the loop's barrier: every A~ is written, and every thread reads the same ``failed`` */
        if (!failed)
            measure_rows(rows, exact, o_stride, approx, token, heads, dim, dtype, d2, n2, decide, lambda, live,
                         accepted, rejected, codes, ratios);
    }
    free(tiles);
    free(lo);
    free(hi);
    return failed ? -1 : 0;
}

/* Rows whose keys a draft chose by content: per row and KV head a list of ``width`` logical positions, the slots
 * ``valid`` marks counting (NULL: all; the others never read), and a weighted draft's log-weights added to the
 * scaled scores (NULL: none). The same arithmetic as alspec_verify's rows, key by key in the list's order: a row's
 * keys are copied out as a (D, n) matrix, scored in lanes of keys (channels in order), the softmax, then P @ V over
 * the values in the list's order.
 *
 * Consecutive rows of a request (a prefill) go together as a tile, by KV head. In the cache a key's D channels lie N
 * apart (its block's keys are transposed), so a key read alone costs a cache line a channel: a block that two or more
 * of the tile's rows read is copied once, its keys made whole (N x D, float32), and the rows read their keys there.
 * Where a key comes from moves data only: a row's bits never depend on its tile. */
enum { LISTED_TILE_ROWS = 64 };

typedef struct { /* each with its row and KV-head strides in elements (0: one list for every head) */
    const int64_t *positions;
    const uint8_t *valid;
    const float *bias;
    int64_t width, strides[3][2];
    /* the contexts the draft read to select (NULL: none): (contexts, Hkv, L, D) keys in the cache's dtype, with
     * ``context_strides`` of a context and a head (a position's D elements consecutive), and per row its context
     * (context_row, -1: read from the cache) */
    const void *context;
    const int64_t *context_row;
    int64_t context_strides[2];
} listed_t;

typedef struct { /* a thread's buffers */
    int64_t *at, *last, *touched; /* per slot its position; per logical block the last row that read it; the
                                   * tile's blocks */
    int32_t *readers, *copy; /* per logical block how many of the tile's rows read it, and its copy (-1: none) */
    float *bias, *keys, *q, *w, *acc, *copies;
    int64_t copies_held;  /* blocks ``copies`` holds room for */
} listed_scratch_t;

static inline const int64_t *listed_positions(const listed_t *list, int64_t m, int64_t h) {
    return list->positions + m * list->strides[0][0] + h * list->strides[0][1];
}

static inline const uint8_t *listed_valid(const listed_t *list, int64_t m, int64_t h) {
    return list->valid ? list->valid + m * list->strides[1][0] + h * list->strides[1][1] : NULL;
}

/* Row m at KV head h: A~ of its query heads over its listed keys, written to ``approx``. Blocks with copy[b] >= 0 are
 * read from their copies (``copies``, N x D each), the rest from the cache. */
static void verify_listed_row(int64_t m, int64_t h, const listed_t *list, const void *query, int64_t q_stride,
                              const void *cache, const int32_t *row_table, const int64_t *token, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int dtype, void *approx,
                              listed_scratch_t *t) {
    const int64_t group = heads / kv_heads, block_elems = 2 * block_size * dim;
    const int64_t *pos = listed_positions(list, m, h);
    const uint8_t *valid = listed_valid(list, m, h);
    const float *weight = list->bias ? list->bias + m * list->strides[2][0] + h * list->strides[2][1] : NULL;
    int64_t n = 0;
    for (int64_t j = 0; j < list->width; ++j) /* each counted slot's key: its logical position */
        if (!valid || valid[j]) {
            t->at[n] = pos[j];
            t->bias[n++] = weight ? weight[j] : 0.0f;
        }
    const int64_t padded = (n + LANES - 1) / LANES * LANES;
    const int64_t context = list->context ? list->context_row[m] : -1;
    float *keys = t->keys;
    for (int64_t j = 0; j < n;) { /* keys as a (D, padded) matrix: from the row's context, a copy, or the cache */
        const int64_t p = t->at[j], b = p / block_size, offset = p % block_size;
        if (context >= 0) { /* whole keys, as the draft read them: D consecutive elements */
            const int64_t at = context * list->context_strides[0] + h * list->context_strides[1] + p * dim;
            for (int64_t d = 0; d < dim; ++d) keys[d * padded + j] = load(list->context, at + d, dtype);
            ++j;
            continue;
        }
        if (t->copy[b] >= 0) {
            const float *k = t->copies + ((int64_t)t->copy[b] * block_size + offset) * dim;
            for (int64_t d = 0; d < dim; ++d) keys[d * padded + j] = k[d];
            ++j;
            continue;
        }
        int64_t run = 1;
        while (j + run < n && t->at[j + run] == p + run && offset + run < block_size) ++run;
        const int64_t at = ((int64_t)row_table[b] * kv_heads + h) * block_elems + offset;
        if (run == 1 && dtype == FLOAT32) { /* a key alone (a draft's scattered keys): one load a channel, where a
                                             * memcpy call each (as a copy loop compiles to) cost 2x the whole call */
            const float *k = (const float *)cache + at;
            for (int64_t d = 0; d < dim; ++d) keys[d * padded + j] = k[d * block_size];
        } else
            for (int64_t d = 0; d < dim; ++d) {
                if (dtype == FLOAT32) memcpy(keys + d * padded + j, (const float *)cache + at + d * block_size,
                                             sizeof(float) * run);
                else for (int64_t r = 0; r < run; ++r) keys[d * padded + j + r] = load(cache, at + d * block_size + r,
                                                                                       dtype);
            }
        j += run;
    }
    for (int64_t d = 0; d < dim; ++d) memset(keys + d * padded + n, 0, sizeof(float) * (padded - n));
    for (int64_t i = 0; i < group; ++i) {
        const int64_t from = token[m] * q_stride + (h * group + i) * dim;
        for (int64_t d = 0; d < dim; ++d) t->q[d] = load(query, from + d, dtype);
        float *s = t->w, best = -INFINITY;
        for (int64_t j = 0; j < padded; j += LANES) { /* q.k in lanes of keys, channels in order */
            lanes_f32 a = {0};
            for (int64_t d = 0; d < dim; ++d) {
                lanes_f32 k;
                memcpy(&k, keys + d * padded + j, sizeof k);
                a += t->q[d] * k;
            }
            memcpy(s + j, &a, sizeof a);
        }
        for (int64_t j = 0; j < n; ++j) s[j] = s[j] * scale;
        if (weight) /* added to the rounded scaled score, as torch adds the two tensors */
            for (int64_t j = 0; j < n; ++j) s[j] = s[j] + t->bias[j];
        for (int64_t j = 0; j < n; ++j) best = s[j] > best ? s[j] : best;
        const float total = softmax(s, n, best, dtype);
        float *out = t->acc;
        memset(out, 0, sizeof(float) * dim);
        for (int64_t j = 0; j < n; ++j) { /* P @ V in the list's order, one chain per channel */
            const int64_t p = t->at[j], offset = p % block_size;
            const int64_t values = ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems
                                   + (block_size + offset) * dim;
            const float w = s[j];
            int64_t c = 0;
            for (; c + LANES <= dim; c += LANES) {
                lanes_f32 o;
                memcpy(&o, out + c, sizeof o);
                o += w * lanes_at(cache, values + c, dtype);
                memcpy(out + c, &o, sizeof o);
            }
            for (; c < dim; ++c) out[c] = fmaf(w, load(cache, values + c, dtype), out[c]);
        }
        const int64_t to = (m * heads + h * group + i) * dim;
        for (int64_t c = 0; c < dim; ++c) store(approx, to + c, out[c] / total, dtype);
    }
}

/* Rows [first, first + count) of one request at KV head h: the blocks two or more of them read copied (keys whole;
 * none where the request's context is given), then each row verified. Returns -1 where memory for the copies ran
 * out. */
static int verify_listed_tile(int64_t first, int64_t count, int64_t h, const listed_t *list, const void *query,
                              int64_t q_stride, const void *cache, const int32_t *row_table, const int64_t *token,
                              int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int dtype,
                              void *approx, listed_scratch_t *t) {
    int64_t copied = 0, touched = 0;
    const int whole = list->context && list->context_row[first] >= 0; /* the request's keys given whole */
    for (int64_t m = first; m < first + count && count > 1 && !whole; ++m) { /* how many rows read each block */
        const int64_t *pos = listed_positions(list, m, h);
        const uint8_t *valid = listed_valid(list, m, h);
        for (int64_t j = 0; j < list->width; ++j)
            if (!valid || valid[j]) {
                const int64_t b = pos[j] / block_size;
                if (t->last[b] != m) {
                    if (t->last[b] < 0) t->touched[touched++] = b;
                    t->last[b] = m;
                    if (++t->readers[b] == 2) t->copy[b] = (int32_t)copied++;
                }
            }
    }
    int status = 0;
    if (copied > t->copies_held) {
        float *more = realloc(t->copies, sizeof(float) * copied * block_size * dim);
        if (more) t->copies = more, t->copies_held = copied;
        else status = -1;
    }
    for (int64_t k = 0; k < touched && !status; ++k) { /* each copied block's keys made whole */
        const int64_t b = t->touched[k];
        if (t->copy[b] < 0) continue;
        const int64_t keys = ((int64_t)row_table[b] * kv_heads + h) * 2 * block_size * dim;
        float *to = t->copies + (int64_t)t->copy[b] * block_size * dim;
        for (int64_t d = 0; d < dim; ++d)
            for (int64_t o = 0; o < block_size; ++o) to[o * dim + d] = load(cache, keys + d * block_size + o, dtype);
    }
    for (int64_t m = first; m < first + count && !status; ++m)
        verify_listed_row(m, h, list, query, q_stride, cache, row_table, token, heads, kv_heads, dim, block_size,
                          scale, dtype, approx, t);
    for (int64_t k = 0; k < touched; ++k) /* reset what the tile marked */
        t->last[t->touched[k]] = -1, t->readers[t->touched[k]] = 0, t->copy[t->touched[k]] = -1;
    return status;
}

/* alspec_verify for rows whose keys are listed (verify_listed_tile): positions (rows, Hkv, width) int64 logical
 * positions inside each row's context, valid (uint8) and bias (float32) the same (NULL: none), their row and head
 * strides in ``strides`` (positions', valid's, bias'; a head stride of 0 where one list serves every head), each
 * slot next to the last; ``context`` (NULL: none), ``context_row`` and ``context_strides`` as listed_t's. Where a key
 * is read from moves data only: the same bits from a context, a tile's copy or the cache. The rest as
 * alspec_verify's. */
int alspec_verify_listed(const void *query, int64_t q_stride, void *exact, int64_t o_stride, const void *cache,
                         const int32_t *table, int64_t table_stride, int64_t rows, const int64_t *token,
                         const int64_t *request, const int64_t *positions, const uint8_t *valid, const float *bias,
                         int64_t width, const int64_t *strides, const void *context, const int64_t *context_row,
                         const int64_t *context_strides, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t block_size, float scale, int dtype, void *approx, float *d2, float *n2, int decide,
                         double lambda, const int64_t *live, int8_t accepted, int8_t rejected, int8_t *codes,
                         float *ratios) {
    const listed_t list = {positions, valid, bias, width, {{strides[0], strides[1]}, {strides[2], strides[3]},
                                                          {strides[4], strides[5]}}, context, context_row,
                           {context ? context_strides[0] : 0, context ? context_strides[1] : 0}};
    const int64_t padded = (width + LANES - 1) / LANES * LANES + LANES;
    int64_t most = 0, count = 0; /* the furthest position listed; the tiles: consecutive rows of a request */
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t *pos = listed_positions(&list, m, h);
            const uint8_t *ok = listed_valid(&list, m, h);
            for (int64_t j = 0; j < width; ++j)
                if ((!ok || ok[j]) && pos[j] > most) most = pos[j];
        }
    const int64_t blocks = most / block_size + 1;
    tile_t *tiles = malloc(sizeof(tile_t) * (rows > 0 ? rows : 1));
    if (!tiles) return -1;
    for (int64_t m = 0; m < rows; ++count) {
        tiles[count].first = m++;
        while (m < rows && request[m] == request[tiles[count].first] && m - tiles[count].first < LISTED_TILE_ROWS) ++m;
        tiles[count].count = m - tiles[count].first;
    }
    int failed = 0;
#pragma omp parallel
    {
        listed_scratch_t t = {malloc(sizeof(int64_t) * padded), malloc(sizeof(int64_t) * blocks),
                              malloc(sizeof(int64_t) * blocks), malloc(sizeof(int32_t) * blocks),
                              malloc(sizeof(int32_t) * blocks), malloc(sizeof(float) * padded),
                              malloc(sizeof(float) * dim * padded), malloc(sizeof(float) * dim),
                              malloc(sizeof(float) * padded), malloc(sizeof(float) * dim), NULL, 0};
        if (!t.at || !t.last || !t.touched || !t.readers || !t.copy || !t.bias || !t.keys || !t.q || !t.w || !t.acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t b = 0; b < blocks; ++b) t.last[b] = -1, t.readers[b] = 0, t.copy[b] = -1;
        }
#pragma omp for schedule(static)
        for (int64_t work = 0; work < count * kv_heads; ++work) {
            if (failed) continue;
            const tile_t tile = tiles[work / kv_heads];
            if (verify_listed_tile(tile.first, tile.count, work % kv_heads, &list, query, q_stride, cache,
                                   table + request[tile.first] * table_stride, token, heads, kv_heads, dim,
                                   block_size, scale, dtype, approx, &t)) {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(t.at), free(t.last), free(t.touched), free(t.readers), free(t.copy), free(t.bias), free(t.keys);
        free(t.q), free(t.w), free(t.acc), free(t.copies);
        /* the loop's barrier: every A~ is written, and every thread reads the same ``failed`` */
        if (!failed)
            measure_rows(rows, exact, o_stride, approx, token, heads, dim, dtype, d2, n2, decide, lambda, live,
                         accepted, rejected, codes, ratios);
    }
    free(tiles);
    return failed ? -1 : 0;
}

#ifdef __AVX2__
/* An 8 x 8 tile of 4-byte elements transposed in registers: in's rows ``in_stride`` apart to out's ``out_stride``
 * apart, in 8 loads and 8 stores where the element-wise way takes 64 of each. */
static inline void transpose8(const float *in, int64_t in_stride, float *out, int64_t out_stride) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * in_stride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(out + (i + 4) * out_stride, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}
#endif

#ifdef __SSE2__
/* The same for 2-byte elements (bfloat16), in SSE2's 16-byte registers. */
static inline void transpose8_16(const uint16_t *in, int64_t in_stride, uint16_t *out, int64_t out_stride) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128((const __m128i *)(in + i * in_stride));
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm_unpacklo_epi16(r[i], r[i + 1]);
        a[i + 1] = _mm_unpackhi_epi16(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm_unpacklo_epi32(a[i], a[i + 2]);
        b[i + 1] = _mm_unpackhi_epi32(a[i], a[i + 2]);
        b[i + 2] = _mm_unpacklo_epi32(a[i + 1], a[i + 3]);
        b[i + 3] = _mm_unpackhi_epi32(a[i + 1], a[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        _mm_storeu_si128((__m128i *)(out + 2 * i * out_stride), _mm_unpacklo_epi64(b[i], b[i + 4]));
        _mm_storeu_si128((__m128i *)(out + (2 * i + 1) * out_stride), _mm_unpackhi_epi64(b[i], b[i + 4]));
    }
}
#endif

/* One block's transposed keys (D x N) made whole (N x D): in 8 x 8 register tiles (4-byte elements where AVX2 is
 * built in, 2-byte ones where SSE2 is), what remains (every element, where neither is) one at a time. A block is at
 * most tens of KB, within the core's caches, so the element-wise way needs no tiling of its own. */
static void untranspose(const void *in, void *out, int64_t block_size, int64_t dim, int64_t element) {
    int64_t tiled_o = 0, tiled_d = 0; /* [0, tiled_o) x [0, tiled_d) done in registers */
#ifdef __AVX2__
    if (element == 4) {
        tiled_o = block_size / 8 * 8, tiled_d = dim / 8 * 8;
        for (int64_t o = 0; o < tiled_o; o += 8)
            for (int64_t d = 0; d < tiled_d; d += 8)
                transpose8((const float *)in + d * block_size + o, block_size, (float *)out + o * dim + d, dim);
    }
#endif
#ifdef __SSE2__
    if (element == 2) {
        tiled_o = block_size / 8 * 8, tiled_d = dim / 8 * 8;
        for (int64_t o = 0; o < tiled_o; o += 8)
            for (int64_t d = 0; d < tiled_d; d += 8)
                transpose8_16((const uint16_t *)in + d * block_size + o, block_size, (uint16_t *)out + o * dim + d,
                              dim);
    }
#endif
    for (int64_t o = 0; o < block_size; ++o)
        for (int64_t d = o < tiled_o ? tiled_d : 0; d < dim; ++d) {
            if (element == 4)
                ((uint32_t *)out)[o * dim + d] = ((const uint32_t *)in)[d * block_size + o];
            else
                ((uint16_t *)out)[o * dim + d] = ((const uint16_t *)in)[d * block_size + o];
        }
}

/* Whole blocks' keys (and values) as the drafts read a context: ids (rows, count) physical blocks; keys out (rows,
 * Hkv, count N, D), each block's transposed (D x N) keys made whole (N x D) (untranspose); values out (NULL: not
 * read) the same shape, each block's (N x D) values copied. Elements of ``element`` bytes (4 or 2), moved, never
 * converted: torch's index_select and permuted copy, in one pass. */
void alspec_read_blocks(const void *cache, int64_t kv_heads, int64_t block_size, int64_t dim, int64_t element,
                        const int64_t *ids, int64_t rows, int64_t count, void *keys, void *values) {
    const int64_t block_elems = 2 * block_size * dim, span = block_size * dim;
#pragma omp parallel for schedule(static)
    for (int64_t work = 0; work < rows * kv_heads * count; ++work) {
        const int64_t r = work / (kv_heads * count), h = work / count % kv_heads, b = work % count;
        const int64_t from = (ids[r * count + b] * kv_heads + h) * block_elems;
        const int64_t to = ((r * kv_heads + h) * count + b) * span;
        untranspose((const char *)cache + from * element, (char *)keys + to * element, block_size, dim, element);
        if (values)
            memcpy((char *)values + to * element, (const char *)cache + (from + span) * element,
                   (size_t)(span * element));
    }
}

/* q.k of every key of each row's context straight from the cache (semantics.key_scores): per KV head the largest
 * over its group of query heads, float32 (each score one chain of fmas over the channels in order), out (rows, Hkv,
 * width); a row's keys at [0, length) through its request's block table, every slot past them -inf; NaN wins the
 * max, as torch's amax. Returns 0, or -1 where scratch memory ran out. */
int alspec_key_scores(const void *query, int64_t q_stride, const void *cache, const int32_t *table,
                       int64_t table_stride, int64_t rows, const int64_t *token, const int64_t *request,
                       const int64_t *length, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                       int dtype, float *out, int64_t width) {
    const int64_t group = heads / kv_heads, block_elems = 2 * block_size * dim;
    const int qs = query_block(group);
    const int64_t padded = (group + qs - 1) / qs * qs;
    int failed = 0;
#pragma omp parallel
    {
        float *q = malloc(sizeof(float) * padded * dim);
        float *s = malloc(sizeof(float) * padded * block_size);
        if (!q || !s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t work = 0; work < rows * kv_heads; ++work) {
            if (failed) continue;
            const int64_t m = work / kv_heads, h = work % kv_heads, n = length[m] < width ? length[m] : width;
            const int32_t *row_table = table + request[m] * table_stride;
            float *o = out + work * width;
            for (int64_t i = 0; i < padded; ++i) { /* the group's queries as float32 rows, the padding zero */
                const int64_t at = token[m] * q_stride + (h * group + i) * dim;
                for (int64_t d = 0; d < dim; ++d) q[i * dim + d] = i < group ? load(query, at + d, dtype) : 0.0f;
            }
            for (int64_t p = 0; p < n; p += block_size) {
                const int64_t run = n - p < block_size ? n - p : block_size;
                score_run(qs, padded, q, dim, cache, ((int64_t)row_table[p / block_size] * kv_heads + h) * block_elems,
                          block_size, dtype, s, block_size, run);
                for (int64_t j = 0; j < run; ++j) {
                    float best = s[j];
                    for (int64_t i = 1; i < group; ++i) {
                        const float x = s[i * block_size + j];
                        best = x > best || isnan(x) ? x : best; /* NaN stays */
                    }
                    o[p + j] = best;
                }
            }
            for (int64_t j = n; j < width; ++j) o[j] = -INFINITY;
        }
        free(q);
        free(s);
    }
    return failed ? -1 : 0;
}

/* Quest's selection straight from the page summaries kept beside the cache (semantics.page_bounds, then
 * semantics.quest_positions and Quest.select's clamp, for rows without left padding). kept: (blocks, parts a block,
 * Hkv, 2D) in kept_dtype, a part of ``part`` keys its channels' minima then maxima; a page of page / part parts merged
 * (the minimum of minima, the maximum of maxima, NaN kept). Per row m and KV head h, each candidate page j
 * (1 <= j < current = pos / page) is bounded by q+ . max + q- . min (q+ = max(q, 0), q- = min(q, 0), NaN kept),
 * summed in LANES partial sums then halved in a fixed order (torch's products to float32 rounding), the largest over
 * the group's query heads (NaN wins, as amax); every other page of [0, max(pages, others)) ranks as -inf. The pages:
 * 0, the current one, then the ``others`` first of the stable descending order (NaN first, ties to the earlier page),
 * each valid where it is a candidate; positions p page + i clamped to length - 1, valid where the page is and
 * p page + i <= pos. Out: positions (rows, Hkv, n) int64 and valid (rows, Hkv, n) uint8, n = (others + 2) page.
 * Returns 0, or -1 where scratch memory ran out. */
static inline int ranks_before(float a, int64_t ia, float b, int64_t ib) { /* a strictly first in the order */
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a > b || (a == b && ia < ib);
}

static float page_bound(const float *q, int64_t group, int64_t dim, const float *low, const float *high) {
    float top = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < group; ++i) {
        const float *plus = q + 2 * i * dim, *minus = plus + dim;
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] += plus[d + l] * high[d + l] + minus[d + l] * low[d + l];
        for (int64_t r = 0; d < dim; ++d, ++r) acc[r] += plus[d] * high[d] + minus[d] * low[d];
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
        nan |= isnan(acc[0]);
        top = i == 0 || acc[0] > top ? acc[0] : top;
    }
    return nan ? NAN : top;
}

static inline int64_t part_at(const int32_t *row_table, int64_t at, int64_t block_size, int64_t per_block,
                              int64_t part) { /* the kept part holding logical position at, in parts */
    return (int64_t)row_table[at / block_size] * per_block + at % block_size / part;
}

int alspec_quest_pages(const void *query, int64_t q_stride, int q_dtype, const void *kept, int kept_dtype,
                       const int32_t *table, int64_t table_stride, int64_t rows, const int64_t *request,
                       const int64_t *pos, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                       int64_t part, int64_t page, int64_t others, int64_t pages, int64_t length, int64_t *positions,
                       uint8_t *valid) {
    enum { AHEAD = 4 }; /* pages whose summaries are asked for before they are read: the blocks lie anywhere */
    const int64_t group = heads / kv_heads, per_block = block_size / part, n = (others + 2) * page;
    /* the pages ranked (none where the budget is page 0 and the current one: page = S) */
    const int64_t ranked = others == 0 ? 0 : pages > others ? pages : others, span = kv_heads * 2 * dim;
    const int64_t element = kept_dtype == FLOAT32 ? 4 : 2;
    const int direct = page == part && kept_dtype == FLOAT32; /* a page's summary read where it lies */
    int failed = 0;
#pragma omp parallel
    {
        float *q = malloc(sizeof(float) * 2 * heads * dim + 1); /* per query head: q+, then q- */
        float *merged = malloc(sizeof(float) * span + 1);        /* a page's summaries, every KV head */
        float *best = malloc(sizeof(float) * kv_heads * (others + 1));
        int64_t *best_at = malloc(sizeof(int64_t) * kv_heads * (others + 1)), *held = malloc(sizeof(int64_t) * kv_heads);
        if (!q || !merged || !best || !best_at || !held) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; ++m) {
            if (failed) continue;
            const int64_t current = pos[m] / page;
            const int32_t *row_table = table + request[m] * table_stride;
            for (int64_t i = 0; i < heads; ++i)
                for (int64_t d = 0; d < dim; ++d) {
                    const float x = load(query, m * q_stride + i * dim + d, q_dtype);
                    q[2 * i * dim + d] = x < 0.0f ? 0.0f : x; /* NaN stays, as torch's clamp */
                    q[(2 * i + 1) * dim + d] = x > 0.0f ? 0.0f : x;
                }
            for (int64_t h = 0; h < kv_heads; ++h) held[h] = 0;
            for (int64_t j = 0; j < ranked; ++j) {
                const int candidate = j >= 1 && j < current;
                if (candidate && j + AHEAD < current)
                    for (int64_t k = 0; k < page / part; ++k) {
                        const char *ahead = (const char *)kept
                                            + part_at(row_table, (j + AHEAD) * page + k * part, block_size, per_block,
                                                      part) * span * element;
                        for (int64_t b = 0; b < span * element; b += 64) __builtin_prefetch(ahead + b);
                    }
                const float *summary = merged;
                if (candidate && direct)
                    summary = (const float *)kept + part_at(row_table, j * page, block_size, per_block, part) * span;
                else if (candidate)
                    for (int64_t k = 0; k < page / part; ++k) { /* the page's parts, merged */
                        const int64_t from = part_at(row_table, j * page + k * part, block_size, per_block, part) * span;
                        for (int64_t e = 0; e < span; ++e) {
                            const float x = load(kept, from + e, kept_dtype), y = merged[e];
                            const int lower = e % (2 * dim) < dim; /* a minimum, else a maximum */
                            merged[e] = k == 0 || isnan(x) ? x : isnan(y) ? y : lower ? (x < y ? x : y)
                                                                                     : (x > y ? x : y);
                        }
                    }
                for (int64_t h = 0; h < kv_heads; ++h) {
                    const float *low = summary + h * 2 * dim;
                    const float bound = candidate ? page_bound(q + 2 * h * group * dim, group, dim, low, low + dim)
                                                  : -INFINITY;
                    float *top = best + h * (others + 1);
                    int64_t *top_at = best_at + h * (others + 1);
                    if (held[h] == others && !ranks_before(bound, j, top[others - 1], top_at[others - 1])) continue;
                    int64_t slot = held[h] < others ? held[h]++ : others - 1;
                    while (slot > 0 && ranks_before(bound, j, top[slot - 1], top_at[slot - 1])) {
                        top[slot] = top[slot - 1];
                        top_at[slot] = top_at[slot - 1];
                        --slot;
                    }
                    top[slot] = bound;
                    top_at[slot] = j;
                }
            }
            for (int64_t h = 0; h < kv_heads; ++h) {
                int64_t *out = positions + (m * kv_heads + h) * n;
                uint8_t *ok = valid + (m * kv_heads + h) * n;
                for (int64_t s = 0; s < others + 2; ++s) {
                    const int64_t p = s == 0 ? 0 : s == 1 ? current : best_at[h * (others + 1) + s - 2];
                    const int counts = s < 2 || (p >= 1 && p < current);
                    for (int64_t i = 0; i < page; ++i) {
                        const int64_t at = p * page + i;
                        out[s * page + i] = at < length - 1 ? at : length - 1;
                        ok[s * page + i] = (uint8_t)(counts && at <= pos[m]);
                    }
                }
            }
        }
        free(q);
        free(merged);
        free(best);
        free(best_at);
        free(held);
    }
    return failed ? -1 : 0;
}

/* kvpress's ranked (alspec_eval/approximations/kvpress.py) of the per-key scores kept beside the cache (a key-only
 * press whose score reads its key alone: Knorm), for rows without left padding. kept: (blocks, N, Hkv) float32, one
 * score per key. Per row m and KV head h, its keys [0, pos] (NaN as -inf) in the stable descending order; a score
 * within ``tie`` (relative) of the next better one, or equal to it, is in its group (both finite for the first); the
 * ``keep`` first by (group, key), in that order; keys past pos (the context read to ``length``) after them, earlier
 * first. The order's first 2 keep are found by a heap and sorted by it; where the group at place keep runs past them,
 * every key is sorted. Out: (rows, Hkv, keep) int64. Returns 0, or -1 where scratch memory ran out. */
/* A key and its score as one int64 that orders as the order does (larger: first): the score's float32 bits made to
 * order as the floats do (-0.0 as 0.0, NaN already -inf) above, and ``last`` - key (the earlier key larger) below. */
static inline int64_t ranked_key(float score, int64_t key, int64_t last) {
    const float x = score + 0.0f;
    int32_t bits;
    memcpy(&bits, &x, 4);
    bits ^= (bits >> 31) & 0x7fffffff;
    return (int64_t)bits * 4294967296LL + (last - key);
}

static inline float ranked_score(int64_t ranked) {
    int32_t bits = (int32_t)(ranked >> 32);
    bits ^= (bits >> 31) & 0x7fffffff;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static int descending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

static int ascending(const void *a, const void *b) { return descending(b, a); }

static void sift_down(int64_t *heap, int64_t count, int64_t at) { /* a min-heap: its root is the last in the order */
    const int64_t moving = heap[at];
    for (;;) {
        int64_t child = 2 * at + 1;
        if (child >= count) break;
        if (child + 1 < count && heap[child + 1] < heap[child]) ++child;
        if (heap[child] >= moving) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = moving;
}

/* a[0, n) in descending order, by bytes from the lowest (a radix sort: no comparison branches), ``spare`` n more */
static void sort_descending(int64_t *a, int64_t n, int64_t *spare) {
    int64_t *from = a, *to = spare;
    for (int shift = 0; shift < 64; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; ++i) ++count[((~(uint64_t)from[i] ^ 0x8000000000000000ULL) >> shift & 255) + 1];
        if (count[((~(uint64_t)from[0] ^ 0x8000000000000000ULL) >> shift & 255) + 1] == n) continue; /* one byte */
        for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; ++i) to[count[(~(uint64_t)from[i] ^ 0x8000000000000000ULL) >> shift & 255]++] = from[i];
        int64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != a) memcpy(a, from, sizeof(int64_t) * n);
}

static inline int same_group(float better, float worse, float tie) {
    const float gap = better - worse, bound = tie * fmaxf(fabsf(better), fabsf(worse));
    return better == worse || (gap <= bound && isfinite(better) && isfinite(worse));
}

/* the first ``keep`` of ``sorted`` (count, in the order) by (group, key), into out; returns whether the groups that
 * reach place keep end before the last of them (or they are every key): then that is the answer */
static int first_by_group(int64_t *sorted, int64_t count, int64_t every, int64_t keep, float tie, int64_t last,
                          int64_t *out) {
    int64_t end = 0, taken = 0;
    while (taken < keep && end < count) {
        const int64_t start = end++;
        while (end < count && same_group(ranked_score(sorted[end - 1]), ranked_score(sorted[end]), tie)) ++end;
        if (end == count && count < every && end - start + taken >= keep) return 0; /* the group may run on */
        for (int64_t i = start; i < end; ++i) sorted[i] = last - (sorted[i] & 0xffffffffLL); /* its keys */
        if (end - start > 16)
            qsort(sorted + start, (size_t)(end - start), sizeof(int64_t), ascending);
        else /* a group is mostly one key: sorted here, no call */
            for (int64_t i = start + 1; i < end; ++i)
                for (int64_t k = i; k > start && sorted[k - 1] > sorted[k]; --k) {
                    const int64_t swap = sorted[k];
                    sorted[k] = sorted[k - 1];
                    sorted[k - 1] = swap;
                }
        for (int64_t i = start; i < end && taken < keep; ++i) out[taken++] = sorted[i];
    }
    return 1;
}

int alspec_rank_kept(const float *kept, const int32_t *table, int64_t table_stride, int64_t rows,
                     const int64_t *request, const int64_t *pos, int64_t kv_heads, int64_t block_size, int64_t keep,
                     int64_t length, float tie, int64_t *out) {
    int failed = 0;
    int64_t most = 0;
    for (int64_t m = 0; m < rows; ++m) most = pos[m] + 1 > most ? pos[m] + 1 : most;
#pragma omp parallel
    {
        int64_t *scores = malloc(sizeof(int64_t) * (most + 1)), *heap = malloc(sizeof(int64_t) * (4 * keep + 1));
        if (!scores || !heap) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t work = 0; work < rows * kv_heads; ++work) {
            if (failed) continue;
            const int64_t m = work / kv_heads, h = work % kv_heads, count = pos[m] + 1 < length ? pos[m] + 1 : length;
            const int64_t last = count - 1;
            const int32_t *row_table = table + request[m] * table_stride;
            int64_t *o = out + work * keep;
            for (int64_t first = 0; first < count; first += block_size) { /* a block at a time: no division a key */
                const float *block = kept + (int64_t)row_table[first / block_size] * block_size * kv_heads + h;
                const int64_t run = count - first < block_size ? count - first : block_size;
                for (int64_t k = 0; k < run; ++k) {
                    const float x = block[k * kv_heads];
                    scores[first + k] = ranked_key(isnan(x) ? -INFINITY : x, first + k, last);
                }
            }
            int64_t taken = 0;
            const int64_t top = 2 * keep < count ? 2 * keep : count;
            if (top < count) { /* the order's first 2 keep: a min-heap whose root is the last of them */
                memcpy(heap, scores, sizeof(int64_t) * top);
                for (int64_t i = top / 2 - 1; i >= 0; --i) sift_down(heap, top, i);
                for (int64_t j = top; j < count; ++j)
                    if (scores[j] > heap[0]) {
                        heap[0] = scores[j];
                        sift_down(heap, top, 0);
                    }
                sort_descending(heap, top, heap + top);
                if (first_by_group(heap, top, count, keep, tie, last, o)) taken = keep < count ? keep : count;
            }
            if (!taken) {
                qsort(scores, (size_t)count, sizeof(int64_t), descending);
                first_by_group(scores, count, count, keep, tie, last, o);
                taken = keep < count ? keep : count;
            }
            for (int64_t j = count; taken < keep; ++j) o[taken++] = j; /* keys past pos, earlier first */
        }
        free(scores);
        free(heap);
    }
    return failed ? -1 : 0;
}
