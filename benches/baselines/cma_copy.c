/*
 * Single copy by cross-memory attach against the copies xccl makes, on this machine.
 *
 * With the caller's buffers, xccl (like the streaming limit of xccl-bench) moves a row in two
 * copies: the sender into the receiver's shared window, the receiver out of it, pipelined over
 * two cores. The one-copy alternative for ordinary process memory is cross-memory attach
 * (`process_vm_readv`, what Open MPI's `vader` BTL uses for large messages): the receiver copies
 * straight from the sender's private buffer. This program measures both copies of the same
 * bytes between two processes of the same run:
 *
 *   memcpy   the receiver copies the bytes out of a shared mapping (one of xccl's two copies);
 *   cma      the receiver reads the sender's private buffer with one process_vm_readv;
 *   cma rows the same in rows of ROW bytes, 1024 iovecs per call (a token-layout receive).
 *
 * Usage: cma_copy [bytes (default 7340032: T=512 rows of H=7168 bf16)] [reps (50)] [row (14336)]
 * Prints each copy's median and fastest time and GB/s, and cma's time over memcpy's.
 * Build: gcc -O2 -Wall -Wextra -o cma_copy benches/baselines/cma_copy.c
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of `n` times (sorts them). */
static double median(double *t, int n) {
    qsort(t, n, sizeof *t, cmp_double);
    return t[n / 2];
}

static void report(const char *what, double *t, int n, size_t bytes, double *med_out) {
    double med = median(t, n);
    printf("%-9s %10zu B: median %9.1f us (%6.2f GB/s), fastest %9.1f us (%6.2f GB/s)\n", what,
           bytes, med * 1e6, bytes / med / 1e9, t[0] * 1e6, bytes / t[0] / 1e9);
    if (med_out)
        *med_out = med;
}

int main(int argc, char **argv) {
    size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 512 * 7168 * 2;
    int reps = argc > 2 ? atoi(argv[2]) : 50;
    size_t row = argc > 3 ? strtoull(argv[3], NULL, 10) : 7168 * 2;
    if (bytes == 0 || reps < 1 || row == 0 || row > bytes) {
        fprintf(stderr, "usage: cma_copy [bytes] [reps] [row]\n");
        return 2;
    }
    /* The sender's private buffer (what CMA reads) and a shared window (what memcpy reads). */
    char *src = malloc(bytes);
    char *window = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (!src || window == MAP_FAILED) {
        perror("allocating");
        return 1;
    }
    memset(src, 1, bytes);
    memset(window, 2, bytes);
    pid_t sender = getpid();
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child > 0) {
        /* The sender only keeps its memory alive while the receiver reads it. */
        int status = 0;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    char *dst = malloc(bytes);
    double *t = malloc(reps * sizeof *t);
    size_t rows = bytes / row;
    struct iovec *local = malloc(rows * sizeof *local), *remote = malloc(rows * sizeof *remote);
    if (!dst || !t || !local || !remote) {
        perror("allocating");
        return 1;
    }
    memset(dst, 0, bytes);
    double memcpy_med = 0, cma_med = 0, rows_med = 0;
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        memcpy(dst, window, bytes);
        t[i] = now_s() - t0;
    }
    report("memcpy", t, reps, bytes, &memcpy_med);
    for (int i = 0; i < reps; i++) {
        struct iovec l = {dst, bytes}, r = {src, bytes};
        double t0 = now_s();
        ssize_t got = process_vm_readv(sender, &l, 1, &r, 1, 0);
        t[i] = now_s() - t0;
        if (got != (ssize_t)bytes) {
            perror("process_vm_readv (needs ptrace access to the sender)");
            return 1;
        }
    }
    report("cma", t, reps, bytes, &cma_med);
    /* Rows land in order; they come from a permutation of the sender's rows, as routed. */
    for (size_t j = 0; j < rows; j++) {
        local[j] = (struct iovec){dst + j * row, row};
        remote[j] = (struct iovec){src + (j * 7 % rows) * row, row};
    }
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        ssize_t got = 0;
        for (size_t j = 0; j < rows; j += 1024) {
            unsigned long n = rows - j < 1024 ? rows - j : 1024;
            got += process_vm_readv(sender, local + j, n, remote + j, n, 0);
        }
        t[i] = now_s() - t0;
        if (got != (ssize_t)(rows * row)) {
            perror("process_vm_readv of rows");
            return 1;
        }
    }
    report("cma rows", t, reps, rows * row, &rows_med);
    printf("cma / memcpy (medians): %.2f; cma rows / memcpy: %.2f\n", cma_med / memcpy_med,
           rows_med / memcpy_med * bytes / (rows * row));
    return 0;
}
