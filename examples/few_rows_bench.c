/* Time the few-row kernel alone on one weight, fastest of 9 calls per row count.
 *
 *   cc -O3 -fopenmp -mavx2 -mfma -mavx512f -mavx512vl -DTILE_ROWS=8 -DLANES=16 \
 *       -o few_rows_bench examples/few_rows_bench.c
 *   ./few_rows_bench 151936 1536        # N x K: the 1.5B's output projection
 *
 * -DTILE_ROWS=8 -DLANES=16 is what the package builds where the CPU has
 * AVX-512VL; -DTILE_ROWS=4 (no LANES: vectors of 8 floats) where it has only
 * AVX2, and -DTILE_ROWS=2 (without the AVX-512 flags) rows in pairs, as at first:
 * docs/RESULTS.md, "Where one step's time goes". */
#include "../clp_mlx/native/few_rows.c"
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fputs("usage: few_rows_bench N K\n", stderr);
        return 2;
    }
    int N = atoi(argv[1]), K = atoi(argv[2]);
    if (N <= 0 || K <= 0) {
        fputs("few_rows_bench: N and K must be positive integers\n", stderr);
        return 2;
    }
    float *B = malloc((size_t)N * K * 4), *A = malloc((size_t)MAX_ROWS * K * 4),
          *C = malloc((size_t)MAX_ROWS * N * 4);
    if (!A || !B || !C) {
        fputs("few_rows_bench: not enough memory for an N x K weight\n", stderr);
        return 2;
    }
    for (size_t i = 0; i < (size_t)N * K; i++) B[i] = (float)(i % 97) * 0.01f;
    for (size_t i = 0; i < (size_t)MAX_ROWS * K; i++) A[i] = (float)(i % 13) * 0.1f;
    threads = omp_get_max_threads();
    const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 16};
    for (int r = 0; r < 9; r++) {
        double best = 1e9;
        for (int it = 0; it < 9; it++) {
            double t0 = now();
            a_bt(rows[r], N, K, 1.0f, A, K, B, K, 0.0f, C, N);
            double t = now() - t0;
            if (t < best) best = t;
        }
        printf("rows %2d: %.1f ms\n", rows[r], best * 1e3);
    }
    return 0;
}
