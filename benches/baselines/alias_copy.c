/*
 * A one-row round trip between two processes, by the distance of the private row from the
 * shared one modulo 4 KiB: what made `memcpy` 4-10x slower for xccl's window rows.
 *
 * Process A (core 0) copies its private row into a page-aligned shared row and raises a flag;
 * process B (core 1) copies the shared row into its private row, copies it back and raises the
 * flag; A copies the shared row into its private row. Four copies of ROW bytes per round trip,
 * the graph of a T=1 call at 1A:1E. Each private row starts `distance` bytes after a page
 * start, so every copy's destination lies `distance` (or `4096 - distance`) bytes from its
 * source modulo 4 KiB. With glibc 2.36 on the AMD EPYC development VM, distances 8 and 16
 * (and 4080, 4088) take 18-22 us against 2.2-6.5 us elsewhere; a 256-byte AVX2 block loop at
 * distance 16 took 3.3-9.2 us against `memcpy`'s 16-21 us. xccl copies window rows in that
 * band with such a loop (`xccl/src/fabric/copy.rs`).
 *
 * Usage: alias_copy [distance ... (default 0 8 16 32 64 128 2048 4080 4088)]
 * Prints the mean round trip per distance, `memcpy` and the AVX2 loop side by side.
 * Build: gcc -O2 -mavx2 -Wall -Wextra -o alias_copy benches/baselines/alias_copy.c
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ROW 14336 /* one row of H=7168 bf16 */
#define ROUNDS 20000

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

/* 256 bytes loaded into eight registers, then stored (ROW is a multiple of 256). */
static void block_copy(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i + 256 <= n; i += 256) {
        __m256i r[8];
        for (int k = 0; k < 8; k++)
            r[k] = _mm256_loadu_si256((const __m256i *)(src + i + 32 * k));
        for (int k = 0; k < 8; k++)
            _mm256_storeu_si256((__m256i *)(dst + i + 32 * k), r[k]);
    }
}

static void copy(int loop, char *dst, const char *src) {
    if (loop)
        block_copy(dst, src, ROW);
    else
        memcpy(dst, src, ROW);
}

/* Mean round trip in us at `distance`, with `memcpy` (loop 0) or the block loop (loop 1). */
static double round_trip(size_t distance, int loop) {
    size_t shared_len = 2 * 4096 + ROW;
    char *shared = mmap(NULL, shared_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                        -1, 0);
    if (shared == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    memset(shared, 0, shared_len);
    _Atomic long *flag = (_Atomic long *)shared;
    char *row = shared + 4096; /* page-aligned, as a window region is */
    pid_t child = fork();
    char *mem = aligned_alloc(4096, ROW + 8192);
    char *mine = mem + distance;
    memset(mine, child == 0 ? 2 : 1, ROW);
    double took = 0;
    if (child == 0) {
        pin(1);
        for (long i = 0; i < ROUNDS; i++) {
            while (atomic_load(flag) != 2 * i + 1)
                ;
            copy(loop, mine, row);
            copy(loop, row, mine);
            atomic_store(flag, 2 * i + 2);
        }
        _exit(0);
    }
    pin(0);
    double t0 = now_us();
    for (long i = 0; i < ROUNDS; i++) {
        copy(loop, row, mine);
        atomic_store(flag, 2 * i + 1);
        while (atomic_load(flag) != 2 * i + 2)
            ;
        copy(loop, mine, row);
    }
    took = (now_us() - t0) / ROUNDS;
    waitpid(child, NULL, 0);
    free(mem);
    munmap(shared, shared_len);
    return took;
}

int main(int argc, char **argv) {
    size_t defaults[] = {0, 8, 16, 32, 64, 128, 2048, 4080, 4088};
    int n = argc > 1 ? argc - 1 : (int)(sizeof defaults / sizeof defaults[0]);
    printf("%8s %12s %12s\n", "distance", "memcpy us", "loop us");
    for (int i = 0; i < n; i++) {
        size_t d = argc > 1 ? (size_t)atol(argv[i + 1]) % 4096 : defaults[i];
        printf("%8zu %12.2f %12.2f\n", d, round_trip(d, 0), round_trip(d, 1));
    }
    return 0;
}
