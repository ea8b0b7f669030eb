/* xccl from C: one process starts N ranks of itself; attention ranks dispatch tokens to the
 * expert ranks (A2E) and receive the weighted sum of the experts' outputs (E2A).
 *
 *   cc -std=c11 xccl_example.c $(pkg-config --cflags --libs xccl) -o xccl_example
 *   ./xccl_example 4          # 2 attention ranks + 2 expert ranks on this host
 *
 * The launcher calls xcclGetUniqueId (which hosts the rendezvous in this process), then runs
 * `xccl_example --rank R --nranks N --id HEX` for every rank; under torchrun or mpirun each rank
 * would call xcclCommInitFromEnv instead. Expert e multiplies its rows by (e + 1), so every
 * attention rank can check its result exactly. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xccl.h>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    xcclResult_t r_ = (call);                                                             \
    if (r_ != xcclSuccess) {                                                              \
      fprintf(stderr, "%s failed: %s: %s\n", #call, xcclGetErrorString(r_),              \
              xcclGetLastError(NULL));                                                    \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

enum { HIDDEN = 128, TOPK = 2, EXPERTS = 8, MAX_TOKENS = 16, ROUNDS = 4 };

static int run_rank(int rank, int nranks, const xcclUniqueId* id) {
  xcclConfig_t cfg = XCCL_CONFIG_INITIALIZER;
  cfg.numAttentionRanks = nranks / 2; /* ranks 0..nranks/2-1; the rest host the experts */
  cfg.numExperts = EXPERTS;
  cfg.topk = TOPK;
  cfg.hidden = HIDDEN;
  cfg.maxTokensPerRank = MAX_TOKENS;
  cfg.dtype = xcclFloat32;

  xcclComm_t comm;
  CHECK(xcclCommInitRankConfig(&comm, nranks, *id, rank, &cfg));
  int role, nlocal;
  int experts[EXPERTS];
  CHECK(xcclCommRole(comm, &role));
  CHECK(xcclCommLocalExperts(comm, &nlocal, experts));
  size_t rowBytes, maxTokens, maxRows;
  CHECK(xcclCommBufferSizes(comm, &rowBytes, &maxTokens, &maxRows));

  if (role == xcclRoleAttention) {
    float* x = malloc(MAX_TOKENS * rowBytes);
    float* out = malloc(MAX_TOKENS * rowBytes);
    int32_t idx[MAX_TOKENS * TOPK];
    float w[MAX_TOKENS * TOPK];
    for (int round = 0; round < ROUNDS; round++) {
      int T = MAX_TOKENS - round;
      for (int t = 0; t < T; t++) {
        for (int h = 0; h < HIDDEN; h++) x[t * HIDDEN + h] = (float)((t + h + rank) % 9 - 4);
        idx[t * TOPK + 0] = (t + round) % EXPERTS;
        idx[t * TOPK + 1] = (t + round + 3) % EXPERTS;
        w[t * TOPK + 0] = 0.75f;
        w[t * TOPK + 1] = 0.25f;
      }
      xcclA2EHandle_t handle;
      CHECK(xcclA2ESend(comm, x, T, idx, w, &handle));
      /* ... overlap: compute something else while the experts work ... */
      CHECK(xcclE2ARecv(comm, handle, out));
      for (int i = 0; i < T * HIDDEN; i++) {
        int t = i / HIDDEN;
        float want = 0.75f * x[i] * (float)(idx[t * TOPK] + 1) + 0.25f * x[i] * (float)(idx[t * TOPK + 1] + 1);
        if (out[i] != want) {
          fprintf(stderr, "rank %d round %d: out[%d] = %g, expected %g\n", rank, round, i, out[i], want);
          return 1;
        }
      }
    }
    free(x);
    free(out);
  } else {
    float* y = malloc(maxRows * rowBytes);
    for (int round = 0; round < ROUNDS; round++) {
      xcclExpertBatch_t batch;
      xcclExpertBatchInfo_t info;
      CHECK(xcclA2ERecv(comm, &batch));
      info.size = sizeof info;
      CHECK(xcclExpertBatchGetInfo(batch, &info));
      const float* rows = info.rows;
      for (size_t j = 0; j < info.numLocalExperts; j++) /* local expert j is experts[j] */
        for (size_t r = info.expertOffsets[j]; r < info.expertOffsets[j + 1]; r++)
          for (int h = 0; h < HIDDEN; h++) y[r * HIDDEN + h] = rows[r * HIDDEN + h] * (float)(experts[j] + 1);
      CHECK(xcclE2ASend(comm, batch, y)); /* frees the batch */
    }
    free(y);
  }
  CHECK(xcclCommDestroy(comm));
  printf("rank %d (%s) ok\n", rank, role == xcclRoleAttention ? "attention" : "expert");
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 7 && strcmp(argv[1], "--rank") == 0) { /* one rank: --rank R --nranks N --id HEX */
    xcclUniqueId id;
    const char* hex = argv[6];
    if (strlen(hex) != 2 * sizeof id.internal) return 2;
    for (size_t i = 0; i < sizeof id.internal; i++) {
      unsigned byte;
      if (sscanf(hex + 2 * i, "%2x", &byte) != 1) return 2;
      id.internal[i] = (char)byte;
    }
    return run_rank(atoi(argv[2]), atoi(argv[4]), &id);
  }

  /* The launcher: make the id, start the ranks, wait for them. */
  int nranks = argc > 1 ? atoi(argv[1]) : 4;
  if (nranks < 2) {
    fprintf(stderr, "usage: %s [nranks >= 2]\n", argv[0]);
    return 2;
  }
  xcclUniqueId id;
  CHECK(xcclGetUniqueId(&id));
  char hex[2 * sizeof id.internal + 1];
  for (size_t i = 0; i < sizeof id.internal; i++) sprintf(hex + 2 * i, "%02x", (unsigned char)id.internal[i]);
  for (int r = 0; r < nranks; r++) {
    pid_t pid = fork();
    if (pid == 0) {
      char rank[16], size[16];
      snprintf(rank, sizeof rank, "%d", r);
      snprintf(size, sizeof size, "%d", nranks);
      execl("/proc/self/exe", argv[0], "--rank", rank, "--nranks", size, "--id", hex, (char*)NULL);
      _exit(127);
    }
    if (pid < 0) return 1;
  }
  int failed = 0;
  for (int r = 0; r < nranks; r++) {
    int status;
    if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
  }
  if (failed) {
    fprintf(stderr, "%d of %d ranks failed\n", failed, nranks);
    return 1;
  }
  printf("all %d ranks ok\n", nranks);
  return 0;
}
