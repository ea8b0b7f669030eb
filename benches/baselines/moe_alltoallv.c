/*
 * moe_alltoallv: the MPI baseline of xccl-bench.
 *
 * Replays the routing file written by `xccl-bench --routing-out PATH` (format documented in
 * xccl-bench/README.md) with Open MPI collectives and times it the way xccl-bench does:
 *
 *   A2E: MPI_Alltoall of per-destination byte counts, MPI_Alltoallv of rows. Attention ranks
 *        (0..M) send, expert ranks (M..M+N) receive; one row per (token, destination rank), like
 *        xccl: H elements plus 16 bytes of metadata {u32 token, u32 experts, f32 weight sum, pad}.
 *   expert: the identity, scaled by the token's summed gating weight of this rank's experts
 *        (what xccl's E2A send does when every expert is the identity).
 *   E2A: MPI_Alltoallv of one H-element row per received row back to its attention rank, which
 *        sums the rows of a token in expert-rank order (f32 accumulators) into its output.
 *
 * Per iteration: MPI_Barrier (outside the timed region), then CLOCK_MONOTONIC timestamps (one
 * clock for every process on a host; MPI_Wtime may use another):
 *   a2e       = max(expert rows received)  - min(attention start)
 *   e2a       = max(attention combine end) - min(expert E2A start)
 *   roundtrip = max(attention combine end) - min(attention start)
 * reduced over ranks with MPI_Reduce (MPI_MIN / MPI_MAX) on rank 0. Warmup iterations are run but
 * not counted. Rank 0 prints one machine-readable line per token count:
 *
 *   MPIBASE tokens=T bytes_per_rank=B a2e_p50_us=.. a2e_p99_us=.. e2a_p50_us=.. e2a_p99_us=..
 *           roundtrip_p50_us=.. roundtrip_p99_us=.. check=passed|failed
 *
 * bytes_per_rank counts payload only (rows x H x dtype size, mean over attention ranks and
 * iterations), as xccl-bench does.
 *
 * Build: mpicc -O2 -o moe_alltoallv moe_alltoallv.c
 * Run:   mpirun -np M+N ./moe_alltoallv routing.bin
 */
#define _POSIX_C_SOURCE 199309L
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

/* ---- element conversions ---- */
static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) {
            u = s;
        } else {
            e = 127 - 15 + 1;
            while (!(m & 0x400)) { m <<= 1; e--; }
            u = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        u = s | 0x7f800000u | (m << 13);
    } else {
        u = s | ((e + 127 - 15) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000u;
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t m = u & 0x7fffffu;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00u | (m ? 0x200u : 0));
    if (e >= 31) return (uint16_t)(s | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)s;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(s | r);
    }
    uint32_t r = ((uint32_t)e << 10) | (m >> 13), rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(s | r);
}
static float load(int dt, const unsigned char *p, size_t i) {
    uint16_t h;
    float f;
    switch (dt) {
    case DT_F32: memcpy(&f, p + 4 * i, 4); return f;
    case DT_F16: memcpy(&h, p + 2 * i, 2); return f16_to_f32(h);
    default: memcpy(&h, p + 2 * i, 2); return bf16_to_f32(h);
    }
}
static void store(int dt, unsigned char *p, size_t i, float f) {
    uint16_t h;
    switch (dt) {
    case DT_F32: memcpy(p + 4 * i, &f, 4); return;
    case DT_F16: h = f32_to_f16(f); memcpy(p + 2 * i, &h, 2); return;
    default: h = f32_to_bf16(f); memcpy(p + 2 * i, &h, 2); return;
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
    const size_t esize = dt == DT_F32 ? 4 : 2;
    const size_t payload = (size_t)H * esize;
    const size_t stride = (payload + META + 15) / 16 * 16;
    const int is_att = rank < M;

    int *scounts = calloc(size, sizeof(int)), *rcounts = calloc(size, sizeof(int));
    int *sdispl = calloc(size, sizeof(int)), *rdispl = calloc(size, sizeof(int));
    int *bscounts = calloc(size, sizeof(int)), *brcounts = calloc(size, sizeof(int));
    int *bsdispl = calloc(size, sizeof(int)), *brdispl = calloc(size, sizeof(int));
    double *lat[3];
    for (int i = 0; i < 3; i++) lat[i] = calloc(iters, sizeof(double));

    for (int s = 0; s < S; s++) {
        uint32_t T;
        if (fread(&T, 4, 1, f) != 1) die("truncated token count");
        const size_t tk = (size_t)T * K;
        int32_t *ids = malloc(tk * 4 + 4);
        float *wts = malloc(tk * 4 + 4);
        /* Attention side buffers. */
        unsigned char *x = calloc((size_t)T * payload + 1, 1);
        unsigned char *out = calloc((size_t)T * payload + 1, 1);
        float *acc = calloc((size_t)T * H + 1, sizeof(float));
        unsigned char *sendbuf = malloc((size_t)T * N * stride + 1);
        unsigned char *backbuf = malloc((size_t)T * N * payload + 1);
        int *row_token = malloc(((size_t)T * N + 1) * sizeof(int));
        /* Expert side buffers: at most M * T rows arrive. */
        unsigned char *recvbuf = is_att ? NULL : malloc((size_t)M * T * stride + 1);
        unsigned char *replybuf = is_att ? NULL : malloc((size_t)M * T * payload + 1);
        float *dest_w = malloc((size_t)N * sizeof(float));
        int *dest_n = malloc((size_t)N * sizeof(int));
        double total_rows = 0;
        int check_ok = 1;
        if (is_att)
            for (size_t i = 0; i < (size_t)T * H; i++)
                store(dt, x, i, (float)((long)((i * 2654435761u + (size_t)rank * 97) % 2001) - 1000) / 512.0f);

        for (int it = 0; it < rounds; it++) {
            /* Every rank reads every record to stay in step; attention ranks keep theirs. */
            for (int a = 0; a < M; a++) {
                if (a == rank) {
                    if (fread(ids, 4, tk, f) != tk || fread(wts, 4, tk, f) != tk) die("truncated routing");
                } else if (fseek(f, (long)(tk * 8), SEEK_CUR) != 0) {
                    die("truncated routing");
                }
            }
            /* Build the send rows outside the timed region? No: layout is part of A2E in xccl. */
            MPI_Barrier(MPI_COMM_WORLD);
            double t_a2e_start = 1e300, t_recv_end = 0, t_e2a_start = 1e300, t_end = 0;
            int nrows = 0;
            memset(scounts, 0, size * sizeof(int));
            if (is_att) {
                t_a2e_start = now_s();
                /* Group rows by destination rank: count, then fill. */
                int cnt[1024];
                if (N > 1024) die("too many expert ranks");
                memset(cnt, 0, sizeof(int) * N);
                for (uint32_t t = 0; t < T; t++) {
                    for (int d = 0; d < N; d++) dest_n[d] = 0;
                    for (int k = 0; k < K; k++) {
                        int e = ids[t * K + k];
                        if (e >= 0) dest_n[(long)e * N / E] = 1;
                    }
                    for (int d = 0; d < N; d++) cnt[d] += dest_n[d];
                }
                int off = 0;
                for (int d = 0; d < N; d++) {
                    sdispl[M + d] = off * (int)stride;
                    scounts[M + d] = cnt[d] * (int)stride;
                    off += cnt[d];
                    cnt[d] = sdispl[M + d] / (int)stride; /* cursor */
                }
                nrows = off;
                for (uint32_t t = 0; t < T; t++) {
                    for (int d = 0; d < N; d++) { dest_w[d] = 0; dest_n[d] = 0; }
                    for (int k = 0; k < K; k++) {
                        int e = ids[t * K + k];
                        if (e < 0) continue;
                        int d = (int)((long)e * N / E);
                        dest_w[d] += wts[t * K + k];
                        dest_n[d]++;
                    }
                    for (int d = 0; d < N; d++) {
                        if (!dest_n[d]) continue;
                        int r = cnt[d]++;
                        unsigned char *row = sendbuf + (size_t)r * stride;
                        memcpy(row, x + (size_t)t * payload, payload);
                        uint32_t meta[4] = {t, (uint32_t)dest_n[d], 0, 0};
                        memcpy(&meta[2], &dest_w[d], 4);
                        memcpy(row + payload, meta, META);
                        row_token[r] = (int)t;
                    }
                }
            }
            MPI_Alltoall(scounts, 1, MPI_INT, rcounts, 1, MPI_INT, MPI_COMM_WORLD);
            int roff = 0;
            for (int r = 0; r < size; r++) { rdispl[r] = roff; roff += rcounts[r]; }
            MPI_Alltoallv(sendbuf, scounts, sdispl, MPI_BYTE, recvbuf, rcounts, rdispl, MPI_BYTE,
                          MPI_COMM_WORLD);
            memset(bscounts, 0, size * sizeof(int));
            memset(brcounts, 0, size * sizeof(int));
            if (!is_att) {
                t_recv_end = now_s();
                t_e2a_start = now_s();
                /* Identity expert: reply = (sum of this rank's weights for the token) * x. */
                int nr = roff / (int)stride;
                for (int r = 0; r < nr; r++) {
                    const unsigned char *row = recvbuf + (size_t)r * stride;
                    float w;
                    memcpy(&w, row + payload + 8, 4);
                    unsigned char *rep = replybuf + (size_t)r * payload;
                    for (int i = 0; i < H; i++) store(dt, rep, i, w * load(dt, row, i));
                }
                for (int a = 0; a < M; a++) {
                    bscounts[a] = rcounts[a] / (int)stride * (int)payload;
                    bsdispl[a] = rdispl[a] / (int)stride * (int)payload;
                }
            } else {
                for (int d = 0; d < N; d++) {
                    brcounts[M + d] = scounts[M + d] / (int)stride * (int)payload;
                    brdispl[M + d] = sdispl[M + d] / (int)stride * (int)payload;
                }
            }
            MPI_Alltoallv(replybuf, bscounts, bsdispl, MPI_BYTE, backbuf, brcounts, brdispl, MPI_BYTE,
                          MPI_COMM_WORLD);
            if (is_att) {
                memset(acc, 0, (size_t)T * H * sizeof(float));
                for (int r = 0; r < nrows; r++) { /* rows are in expert-rank order */
                    float *a = acc + (size_t)row_token[r] * H;
                    const unsigned char *row = backbuf + (size_t)r * payload;
                    for (int i = 0; i < H; i++) a[i] += load(dt, row, i);
                }
                for (size_t i = 0; i < (size_t)T * H; i++) store(dt, out, i, acc[i]);
                t_end = now_s();
                total_rows += nrows;
                /* Outside the timed region: out = x * (sum of weights) = x, within rounding. */
                for (uint32_t t = 0; t < T && check_ok; t++) {
                    float wsum = 0;
                    for (int k = 0; k < K; k++)
                        if (ids[t * K + k] >= 0) wsum += wts[t * K + k];
                    for (int i = 0; i < H; i++) {
                        float want = wsum * load(dt, x, (size_t)t * H + i);
                        float got = load(dt, out, (size_t)t * H + i);
                        if (fabsf(got - want) > 3e-2f * (1.0f + fabsf(want))) { check_ok = 0; break; }
                    }
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
        free(ids); free(wts); free(x); free(out); free(acc); free(sendbuf); free(backbuf);
        free(row_token); free(recvbuf); free(replybuf); free(dest_w); free(dest_n);
    }
    fclose(f);
    MPI_Finalize();
    return 0;
}
