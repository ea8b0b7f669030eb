/*
 * moe_alltoallv: the MPI baseline of xccl-bench.
 *
 * Replays the routing file written by `xccl-bench --routing-out PATH` (format documented in
 * xccl-bench/README.md) with MPI collectives, doing what xccl-bench does in its default mode
 * (`--layout token --buffers copy`, identity expert), and times it the same way:
 *
 *   A2E: each attention rank packs one row per (token, destination expert rank) -- a token routed
 *        to several experts of one rank travels once, as in xccl -- into one contiguous block per
 *        destination: the rows' payloads, then one 16-byte record per row {u32 token, u32 number
 *        of the rank's experts, f32 sum of their gating weights, pad} (xccl sends the same facts
 *        in its per-row metadata). MPI_Alltoall of the per-destination byte counts, then
 *        MPI_Alltoallv of the blocks.
 *   expert: the identity. The reply rows are the received payloads, sent straight back from the
 *        receive buffer (no extra pass: xccl-bench's identity expert makes none either).
 *   E2A: MPI_Alltoallv of the replies; the attention rank combines each token's rows in
 *        expert-rank order: one row is copied, several are summed in f32 and rounded once to the
 *        dtype -- the order and roundings of xccl's combine. The result is checked bit for bit
 *        against that order outside the timed region.
 *
 * The bf16/f16/f32 loops are written per dtype on restrict pointers so that `-O3 -march=native`
 * vectorises them (bf16 <-> f32 are shifts and a round-to-nearest-even add; f16 uses _Float16,
 * i.e. F16C on x86).
 *
 * Per iteration: MPI_Barrier (outside the timed region), then CLOCK_MONOTONIC timestamps (one
 * clock for every process on a host; MPI_Wtime may use another):
 *   a2e       = max(expert rows received)  - min(attention start)
 *   e2a       = max(attention combine end) - min(expert E2A start)
 *   roundtrip = max(attention combine end) - min(attention start)
 * reduced over ranks with MPI_Reduce (MPI_MIN / MPI_MAX) on rank 0. Warmup iterations are run but
 * not counted. Rank 0 prints the MPI library once and one machine-readable line per token count:
 *
 *   MPILIB Open MPI v4.1.4, ...
 *   MPIBASE tokens=T bytes_per_rank=B a2e_p50_us=.. a2e_p99_us=.. e2a_p50_us=.. e2a_p99_us=..
 *           roundtrip_p50_us=.. roundtrip_p99_us=.. check=passed|failed
 *
 * bytes_per_rank counts payload only (rows x H x dtype size, mean over attention ranks and
 * iterations), as xccl-bench does.
 *
 * Build: mpicc -O3 -march=native -o moe_alltoallv moe_alltoallv.c -lm
 * Run:   mpirun -np M+N --bind-to core ./moe_alltoallv routing.bin   (see ci/mpi-baseline.sh)
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
#define META 16

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *msg) {
    fprintf(stderr, "moe_alltoallv: %s\n", msg);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static void *xmalloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) die("out of memory");
    return p;
}

/* ---- vectorisable row kernels: one loop per dtype ---- */

/* acc[i] = row[i] as f32 */
static void to_f32(int dt, const void *restrict row, float *restrict acc, int h) {
    if (dt == DT_BF16) {
        const uint16_t *restrict r = row;
        for (int i = 0; i < h; i++) {
            uint32_t u = (uint32_t)r[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            acc[i] = f;
        }
    } else if (dt == DT_F16) {
        const _Float16 *restrict r = row;
        for (int i = 0; i < h; i++) acc[i] = (float)r[i];
    } else {
        memcpy(acc, row, (size_t)h * 4);
    }
}

/* acc[i] += row[i] */
static void accumulate(int dt, const void *restrict row, float *restrict acc, int h) {
    if (dt == DT_BF16) {
        const uint16_t *restrict r = row;
        for (int i = 0; i < h; i++) {
            uint32_t u = (uint32_t)r[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            acc[i] += f;
        }
    } else if (dt == DT_F16) {
        const _Float16 *restrict r = row;
        for (int i = 0; i < h; i++) acc[i] += (float)r[i];
    } else {
        const float *restrict r = row;
        for (int i = 0; i < h; i++) acc[i] += r[i];
    }
}

/* row[i] = acc[i] rounded to nearest even (NaN stays NaN, as the `half` crate does) */
static void from_f32(int dt, const float *restrict acc, void *restrict row, int h) {
    if (dt == DT_BF16) {
        uint16_t *restrict r = row;
        for (int i = 0; i < h; i++) {
            uint32_t u;
            memcpy(&u, &acc[i], 4);
            uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            uint32_t nan = (u >> 16) | 0x40u;
            r[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
        }
    } else if (dt == DT_F16) {
        _Float16 *restrict r = row;
        for (int i = 0; i < h; i++) r[i] = (_Float16)acc[i];
    } else {
        memcpy(row, acc, (size_t)h * 4);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
/* Nearest-rank percentile of sorted v. */
static double pct(const double *v, int n, double q) {
    int idx = (int)ceil(q * n);
    if (idx < 1) idx = 1;
    if (idx > n) idx = n;
    return v[idx - 1];
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 2) die("usage: moe_alltoallv ROUTING_FILE");
    if (rank == 0) {
        char lib[MPI_MAX_LIBRARY_VERSION_STRING];
        int len = 0;
        MPI_Get_library_version(lib, &len);
        char *nl = strchr(lib, '\n');
        if (nl) *nl = 0;
        printf("MPILIB %s\n", lib);
        fflush(stdout);
    }

    FILE *f = fopen(argv[1], "rb");
    if (!f) die("cannot open the routing file");
    char magic[8];
    uint32_t hdr[10];
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "XCCLRT01", 8) != 0) die("not a routing file");
    if (fread(hdr, 4, 10, f) != 10) die("truncated header");
    const int M = (int)hdr[0], N = (int)hdr[1], E = (int)hdr[2], K = (int)hdr[3], H = (int)hdr[4];
    const int dt = (int)hdr[5], S = (int)hdr[6], warmup = (int)hdr[7], iters = (int)hdr[8];
    const int rounds = warmup + iters;
    if (size != M + N) die("the world size must be M + N of the routing file");
    if (dt != DT_F32 && dt != DT_F16 && dt != DT_BF16) die("unknown dtype");
    const size_t esize = dt == DT_F32 ? 4 : 2;
    const size_t payload = (size_t)H * esize;
    const size_t rowbytes = payload + META; /* one row on the wire: payload + its record */
    const int is_att = rank < M;

    int *scounts = calloc(size, sizeof(int)), *rcounts = calloc(size, sizeof(int));
    int *sdispl = calloc(size, sizeof(int)), *rdispl = calloc(size, sizeof(int));
    int *bscounts = calloc(size, sizeof(int)), *brcounts = calloc(size, sizeof(int));
    int *bsdispl = calloc(size, sizeof(int)), *brdispl = calloc(size, sizeof(int));
    int *cnt = calloc(N, sizeof(int)), *cursor = calloc(N, sizeof(int)), *first = calloc(N, sizeof(int));
    float *dest_w = calloc(N, sizeof(float));
    int *dest_n = calloc(N, sizeof(int));
    float *acc = xmalloc((size_t)H * sizeof(float));
    double *lat[3];
    for (int i = 0; i < 3; i++) lat[i] = calloc(iters, sizeof(double));

    for (int s = 0; s < S; s++) {
        uint32_t T;
        if (fread(&T, 4, 1, f) != 1) die("truncated token count");
        const size_t tk = (size_t)T * K;
        int32_t *ids = malloc(tk * 4 + 4);
        float *wts = malloc(tk * 4 + 4);
        /* Per token: bitmask-free list of destination ranks, as a byte per (token, rank). */
        unsigned char *goes = calloc((size_t)T * N + 1, 1);
        unsigned char *x = xmalloc((size_t)T * payload);
        unsigned char *out = xmalloc((size_t)T * payload);
        unsigned char *sendbuf = xmalloc((size_t)T * N * rowbytes);
        unsigned char *backbuf = xmalloc((size_t)T * N * payload);
        /* Expert side: at most M * T rows arrive. */
        unsigned char *recvbuf = is_att ? NULL : xmalloc((size_t)M * T * rowbytes);
        unsigned char *want = xmalloc(payload);
        double total_rows = 0;
        int check_ok = 1;
        if (is_att) {
            float *tmp = xmalloc((size_t)H * sizeof(float));
            for (size_t t = 0; t < T; t++) {
                for (int i = 0; i < H; i++) {
                    size_t j = t * (size_t)H + (size_t)i;
                    tmp[i] = (float)((long)((j * 2654435761u + (size_t)rank * 97) % 2001) - 1000) / 512.0f;
                }
                from_f32(dt, tmp, x + t * payload, H);
            }
            free(tmp);
        }
        memset(out, 0, (size_t)T * payload);

        for (int it = 0; it < rounds; it++) {
            /* Every rank reads every record to stay in step; attention ranks keep theirs. */
            for (int a = 0; a < M; a++) {
                if (a == rank) {
                    if (fread(ids, 4, tk, f) != tk || fread(wts, 4, tk, f) != tk) die("truncated routing");
                } else if (fseek(f, (long)(tk * 8), SEEK_CUR) != 0) {
                    die("truncated routing");
                }
            }
            MPI_Barrier(MPI_COMM_WORLD);
            double t_a2e_start = 1e300, t_recv_end = 0, t_e2a_start = 1e300, t_end = 0;
            int nrows = 0;
            memset(scounts, 0, size * sizeof(int));
            memset(sdispl, 0, size * sizeof(int));
            if (is_att) {
                /* The routing -> layout pass is part of the A2E, as in xccl. */
                t_a2e_start = now_s();
                memset(cnt, 0, sizeof(int) * N);
                for (uint32_t t = 0; t < T; t++) {
                    unsigned char *g = goes + (size_t)t * N;
                    memset(g, 0, N);
                    for (int k = 0; k < K; k++) {
                        int e = ids[(size_t)t * K + k];
                        if (e >= 0) g[(long)e * N / E] = 1;
                    }
                    for (int d = 0; d < N; d++) cnt[d] += g[d];
                }
                size_t off = 0;
                for (int d = 0; d < N; d++) {
                    sdispl[M + d] = (int)off;
                    scounts[M + d] = cnt[d] * (int)rowbytes;
                    off += (size_t)cnt[d] * rowbytes;
                    first[d] = nrows;
                    nrows += cnt[d];
                    cursor[d] = 0;
                }
                for (uint32_t t = 0; t < T; t++) {
                    const unsigned char *g = goes + (size_t)t * N;
                    for (int d = 0; d < N; d++) { dest_w[d] = 0; dest_n[d] = 0; }
                    for (int k = 0; k < K; k++) {
                        int e = ids[(size_t)t * K + k];
                        if (e < 0) continue;
                        int d = (int)((long)e * N / E);
                        dest_w[d] += wts[(size_t)t * K + k];
                        dest_n[d]++;
                    }
                    for (int d = 0; d < N; d++) {
                        if (!g[d]) continue;
                        int r = cursor[d]++;
                        unsigned char *block = sendbuf + sdispl[M + d];
                        memcpy(block + (size_t)r * payload, x + (size_t)t * payload, payload);
                        uint32_t meta[4] = {t, (uint32_t)dest_n[d], 0, 0};
                        memcpy(&meta[2], &dest_w[d], 4);
                        memcpy(block + (size_t)cnt[d] * payload + (size_t)r * META, meta, META);
                    }
                }
            }
            MPI_Alltoall(scounts, 1, MPI_INT, rcounts, 1, MPI_INT, MPI_COMM_WORLD);
            int roff = 0;
            for (int r = 0; r < size; r++) { rdispl[r] = roff; roff += rcounts[r]; }
            MPI_Alltoallv(sendbuf, scounts, sdispl, MPI_BYTE, recvbuf, rcounts, rdispl, MPI_BYTE,
                          MPI_COMM_WORLD);
            memset(bscounts, 0, size * sizeof(int));
            memset(bsdispl, 0, size * sizeof(int));
            memset(brcounts, 0, size * sizeof(int));
            memset(brdispl, 0, size * sizeof(int));
            if (!is_att) {
                t_recv_end = now_s();
                t_e2a_start = t_recv_end;
                /* Identity expert: each source's payloads go back from where they landed. */
                for (int a = 0; a < M; a++) {
                    int rows = rcounts[a] / (int)rowbytes;
                    bscounts[a] = rows * (int)payload;
                    bsdispl[a] = rdispl[a];
                }
            } else {
                for (int d = 0; d < N; d++) {
                    brcounts[M + d] = cnt[d] * (int)payload;
                    brdispl[M + d] = first[d] * (int)payload;
                }
            }
            MPI_Alltoallv(recvbuf, bscounts, bsdispl, MPI_BYTE, backbuf, brcounts, brdispl, MPI_BYTE,
                          MPI_COMM_WORLD);
            if (is_att) {
                /* Combine: a token's rows in expert-rank order; one row is the answer as is. */
                for (int d = 0; d < N; d++) cursor[d] = first[d];
                for (uint32_t t = 0; t < T; t++) {
                    const unsigned char *g = goes + (size_t)t * N;
                    unsigned char *o = out + (size_t)t * payload;
                    int n = 0;
                    const unsigned char *single = NULL;
                    for (int d = 0; d < N; d++) {
                        if (!g[d]) continue;
                        const unsigned char *row = backbuf + (size_t)cursor[d]++ * payload;
                        if (n == 0) {
                            single = row;
                        } else if (n == 1) {
                            to_f32(dt, single, acc, H);
                            accumulate(dt, row, acc, H);
                        } else {
                            accumulate(dt, row, acc, H);
                        }
                        n++;
                    }
                    if (n == 0) memset(o, 0, payload);
                    else if (n == 1) memcpy(o, single, payload);
                    else from_f32(dt, acc, o, H);
                }
                t_end = now_s();
                total_rows += nrows;
                /* Outside the timed region, bit for bit: out = x summed n times in f32, rounded. */
                for (uint32_t t = 0; t < T && check_ok; t++) {
                    int n = 0;
                    for (int d = 0; d < N; d++) n += goes[(size_t)t * N + d];
                    const unsigned char *xt = x + (size_t)t * payload;
                    if (n == 0) {
                        memset(want, 0, payload);
                    } else if (n == 1) {
                        memcpy(want, xt, payload);
                    } else {
                        to_f32(dt, xt, acc, H);
                        for (int i = 1; i < n; i++) accumulate(dt, xt, acc, H);
                        from_f32(dt, acc, want, H);
                    }
                    if (memcmp(want, out + (size_t)t * payload, payload) != 0) check_ok = 0;
                }
            }
            double mins[2] = {t_a2e_start, t_e2a_start}, maxs[2] = {t_recv_end, t_end};
            double gmin[2], gmax[2];
            MPI_Reduce(mins, gmin, 2, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
            MPI_Reduce(maxs, gmax, 2, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            if (rank == 0 && it >= warmup) {
                lat[0][it - warmup] = (gmax[0] - gmin[0]) * 1e6;
                lat[1][it - warmup] = (gmax[1] - gmin[1]) * 1e6;
                lat[2][it - warmup] = (gmax[1] - gmin[0]) * 1e6;
            }
            if (it < warmup && is_att) total_rows -= nrows;
        }
        double rows_sum = 0;
        int ok_all = 0;
        MPI_Reduce(&total_rows, &rows_sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&check_ok, &ok_all, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            for (int i = 0; i < 3; i++) qsort(lat[i], iters, sizeof(double), cmp_double);
            double bytes = rows_sum / ((double)M * iters) * (double)payload;
            printf("MPIBASE tokens=%u bytes_per_rank=%.0f a2e_p50_us=%.2f a2e_p99_us=%.2f "
                   "e2a_p50_us=%.2f e2a_p99_us=%.2f roundtrip_p50_us=%.2f roundtrip_p99_us=%.2f "
                   "check=%s\n",
                   T, bytes, pct(lat[0], iters, 0.5), pct(lat[0], iters, 0.99), pct(lat[1], iters, 0.5),
                   pct(lat[1], iters, 0.99), pct(lat[2], iters, 0.5), pct(lat[2], iters, 0.99),
                   ok_all ? "passed" : "failed");
            fflush(stdout);
        }
        free(ids); free(wts); free(goes); free(x); free(out); free(sendbuf); free(backbuf);
        free(recvbuf); free(want);
    }
    fclose(f);
    MPI_Finalize();
    return 0;
}
