/* cblas_sgemm for decoding on a CPU: matmuls with few rows stream the weight once.
 *
 * A decode step multiplies 1-16 rows of activations by each weight matrix.
 * OpenBLAS 0.3.21 runs those through its blocked GEMM (packing the weight on
 * every call) at 5-8 GB/s of weight read on a machine that streams memory at
 * 20-27 GB/s. Here every output is a dot product of an activation row with a
 * weight row, in tiles of one to eight rows against four weight rows, the
 * weight rows split between threads: one pass over the weight, near memory
 * speed. The weight rows are fetched ahead of the arithmetic (PREFETCH): with
 * more than one row the multiply-adds take long enough that the memory stream,
 * left to the CPU's own prefetcher, stalls behind them.
 *
 * Every output it computes is summed in the same order whatever the number of
 * rows, the tile it falls in or the thread that computes it, so a row's result
 * does not depend on how many rows (up to 16) share the call: a verify pass
 * sees the same logits as a one-token pass for the same row. Everything else
 * (more rows, column-major, transposed activations) goes to
 * OpenBLAS, one-threaded, each thread of ours taking a slice of the columns:
 * one thread pool, not two fighting over the cores.
 *
 * Subnormal floats are flushed to zero in what goes to OpenBLAS (x86: MXCSR's
 * FTZ and DAZ, in the calling thread or ours, restored after), as Metal does: on x86
 * each product with a subnormal takes a slow path, and training a head
 * against a wide vocabulary makes them by the million (a confident softmax's
 * gradient, divided by the batch). Measured on a Linux CPU: a head-0 fit's
 * steps went from ~1 s to 5-8 s as it learned, with 0.15% of one operand
 * subnormal doubling a 948 x 16384 x 1536 product. Decoding rarely meets one.
 *
 * Loaded before OpenBLAS (RTLD_GLOBAL) so that MLX's cblas_sgemm resolves
 * here; clp_mlx/native/blas.py builds and loads it. Plain C with GCC vector
 * extensions and OpenMP.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#define FLUSH_BITS 0x8040u /* MXCSR: FTZ (bit 15) and DAZ (bit 6) */
static inline unsigned flush_subnormals(void) {
    unsigned was = _mm_getcsr();
    _mm_setcsr(was | FLUSH_BITS);
    return was;
}
static inline void restore_fp(unsigned was) { _mm_setcsr(was); }
#else /* elsewhere subnormals keep the IEEE rules (and, mostly, full speed) */
static inline unsigned flush_subnormals(void) { return 0; }
static inline void restore_fp(unsigned was) { (void)was; }
#endif

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
#ifndef LANES
#define LANES 8 /* floats a vector holds: 8 (AVX2; NEON: two registers), 16 where AVX-512 */
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };
#ifndef TILE_ROWS
#define TILE_ROWS 4 /* rows of A a tile takes at most: 1-8 (8 where AVX-512VL, few_rows.py) */
#endif
#if TILE_ROWS < 1 || TILE_ROWS > 8
#error "TILE_ROWS must be 1-8: the tiles hold at most eight rows"
#endif
/* Floats ahead of the tile that each weight row is fetched: the weight stream
 * does not wait for the arithmetic (see tile). */
#define PREFETCH 256
enum { MAX_ROWS = 16, PARALLEL_FROM = 1 << 18, FALLBACK_SPLIT_FROM = 1 << 22 };

static sgemm_fn fallback;
static int threads = 1;
static long served; /* calls answered here, not by the fallback: for tests */

/* Before OpenBLAS is made one-threaded (which may set OpenMP's count too). */
void few_rows_init(void *openblas_sgemm) {
    fallback = (sgemm_fn)openblas_sgemm;
    threads = omp_get_max_threads();
}
long few_rows_served(void) { return served; }

/* Keep a vector in a register. Without it GCC folds the weight's load into
 * each row's multiply-add, loading it once per row (measured on a Linux CPU
 * with AVX-512: tiles of 2 and 3 rows 10-25% slower). */
#if defined(__AVX512F__) || (defined(__AVX__) && LANES == 8) /* a vector fits one register */
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float total(vec v) { /* fixed order: lane 0 first */
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

static inline void store(float *c, float v, float alpha, float beta) {
    *c = alpha * v + (beta == 0.0f ? 0.0f : beta * *c); /* beta 0: C may be garbage */
}

/* s[i * cols + j] = dot(a_i, w_j) from the accumulated lanes of c (same layout)
 * and the leftover k..K-1: the one summation order of every output. */
static void finish(const vec *c, const float **a, int rows, const float **w, int cols, int k,
                   int K, float *s) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float t = total(c[i * cols + j]);
            for (int r = k; r < K; r++) t += a[i][r] * w[j][r];
            s[i * cols + j] = t;
        }
}

/* A tile of R activation rows (1-8) against four weight rows, s as in finish.
 * R is a constant at each call, so the loops unroll and c stays in registers:
 * 4 x 4 needs 16 accumulators + 4 rows + 1 weight vector, 6 x 4 needs 24
 * accumulators + 4 weight vectors + 1 row, hence AVX-512VL's
 * 32 registers where the CPU has them (see few_rows.py). 7 and 8 rows need
 * more than 32: some spill to L1, which still costs less than a second tile
 * over the block (measured: 8 rows 1.07-1.33x of 4 rows in one tile, 1.29-1.53x
 * in two). */
static inline __attribute__((always_inline)) void tile(const float **a, const float **w, int K,
                                                       float *s, const int R) {
    vec c[8][4] = {{0}};
    int k = 0;
    for (; k + LANES <= K; k += LANES) {
        for (int j = 0; j < 4; j++) /* past a row's end: the next row, or (the last) nothing */
            __builtin_prefetch(w[j] + k + PREFETCH, 0, 3);
        if (R <= 4) { /* the rows first, as the tiles of four always did */
            vec x[4];
            for (int i = 0; i < R; i++) x[i] = load(a[i] + k);
            for (int j = 0; j < 4; j++) {
                vec y = load(w[j] + k);
                IN_REGISTER(y);
                for (int i = 0; i < R; i++) c[i][j] += x[i] * y;
            }
        } else { /* the weight's four vectors first, then a row at a time */
            vec y[4];
            for (int j = 0; j < 4; j++) y[j] = load(w[j] + k);
            for (int i = 0; i < R; i++) {
                vec x = load(a[i] + k);
                for (int j = 0; j < 4; j++) c[i][j] += x * y[j];
            }
        }
    }
    finish(&c[0][0], a, R, w, 4, k, K, s);
}

static void tile_1(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 1); }
static void tile_2(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 2); }
static void tile_3(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 3); }
static void tile_4(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 4); }
static void tile_5(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 5); }
static void tile_6(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 6); }
static void tile_7(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 7); }
static void tile_8(const float **a, const float **w, int K, float *s) { tile(a, w, K, s, 8); }

typedef void (*tile_fn)(const float **, const float **, int, float *);
static const tile_fn tiles[9] = {NULL,   tile_1, tile_2, tile_3, tile_4,
                                 tile_5, tile_6, tile_7, tile_8};

/* C = alpha A B^T + beta C, B stored N x K (a weight; attention keys): blocks of
 * four weight rows (the last one repeated at the end), the rows of A split as
 * evenly as the fewest tiles allow (9 in tiles of 8: 5 + 4); a block's rows stay in
 * L1 or L2 for the tiles after the first. (Four rows against two weight rows,
 * tried, cost 20% more at four rows, and eight against two 60% more than four
 * against four: the weight stream stalled behind the arithmetic.) */
static void a_bt(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                 int ldb, float beta, float *C, int ldc) {
    int blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)N * K >= PARALLEL_FROM)
    for (int b = 0; b < blocks; b++) {
        int n = 4 * b, nr = N - n < 4 ? N - n : 4;
        const float *w[4];
        for (int j = 0; j < 4; j++) w[j] = B + (size_t)(n + (j < nr ? j : nr - 1)) * ldb;
        for (int m = 0, rows; m < M; m += rows) {
            int left = (M - m + TILE_ROWS - 1) / TILE_ROWS; /* tiles still to go */
            rows = (M - m + left - 1) / left;
            const float *a[8];
            for (int i = 0; i < rows; i++) a[i] = A + (size_t)(m + i) * lda;
            float s[8][4];
            tiles[rows](a, w, K, &s[0][0]);
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < nr; j++)
                    store(C + (size_t)(m + i) * ldc + n + j, s[i][j], alpha, beta);
        }
    }
}

/* C = alpha A B + beta C, B stored K x N (attention values): each row of C
 * accumulates rows of B, in order of k */
static void a_b(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                int ldb, float beta, float *C, int ldc) {
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)N * K >= PARALLEL_FROM)
    for (int m = 0; m < M; m++) {
        float row[N];
        memset(row, 0, sizeof row);
        for (int k = 0; k < K; k++) {
            float a = A[(size_t)m * lda + k];
            const float *b = B + (size_t)k * ldb;
            for (int n = 0; n < N; n++) row[n] += a * b[n];
        }
        for (int n = 0; n < N; n++) store(C + (size_t)m * ldc + n, row[n], alpha, beta);
    }
}

/* Many rows: OpenBLAS (one-threaded), our threads splitting the columns. */
static void split_columns(int ta, int tb, int M, int N, int K, float alpha, const float *A,
                          int lda, const float *B, int ldb, float beta, float *C, int ldc) {
#pragma omp parallel num_threads(threads)
    {
        unsigned was = flush_subnormals();
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int n0 = (int)((long)N * t / T / 16 * 16);
        int n1 = t == T - 1 ? N : (int)((long)N * (t + 1) / T / 16 * 16);
        const float *b = tb == NO_TRANS ? B + n0 : B + (size_t)n0 * ldb;
        if (n1 > n0)
            fallback(ROW_MAJOR, ta, tb, M, n1 - n0, K, alpha, A, lda, b, ldb, beta, C + n0, ldc);
        restore_fp(was);
    }
}

/* C = beta C, beta 0 writing zeros (C may hold garbage then), any storage order. */
static void scale_c(int order, int M, int N, float beta, float *C, int ldc) {
    int rows = order == ROW_MAJOR ? M : N, cols = order == ROW_MAJOR ? N : M;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float *x = C + (size_t)r * ldc + c;
            *x = beta == 0.0f ? 0.0f : beta * *x;
        }
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (!fallback) {
        fputs("few_rows: cblas_sgemm called before few_rows_init\n", stderr);
        abort();
    }
    /* The CBLAS contract is kept here, not left to whichever BLAS kernel the CPU
     * gets: nothing to do without rows or columns; alpha 0 or no K: C = beta C,
     * A and B unread (some BLAS builds read them); beta 0: C is not read (it may
     * hold NaN), zeroed before a fallback call so that 0 stays 0 whatever it does. */
    if (M <= 0 || N <= 0) return;
    if (alpha == 0.0f || K <= 0) {
        scale_c(order, M, N, beta, C, ldc);
        return;
    }
    if (order == ROW_MAJOR && ta == NO_TRANS && M <= MAX_ROWS) {
        if (tb == TRANS || tb == CONJ_TRANS) { /* real numbers: the same */
            __atomic_add_fetch(&served, 1, __ATOMIC_RELAXED);
            a_bt(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
            return;
        }
        if (tb == NO_TRANS && N <= 4096) {
            __atomic_add_fetch(&served, 1, __ATOMIC_RELAXED);
            a_b(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
            return;
        }
    }
    if (beta == 0.0f) scale_c(order, M, N, 0.0f, C, ldc);
    if (order == ROW_MAJOR && (long)M * N * K >= FALLBACK_SPLIT_FROM && N >= 32) {
        split_columns(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
        unsigned was = flush_subnormals();
        fallback(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        restore_fp(was);
    }
}
