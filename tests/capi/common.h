/* Shared by the C11 and C++17 test programs of the C ABI (tests/tests/capi.rs builds them):
 * argument parsing, the unique id's hex form, the workload and its exact reference.
 *
 * Ranks are started by the test harness, each with
 *   --id HEX --rank R --nranks N   (a unique id on the command line), or
 *   --env                          (launcher variables: XCCL_RANK/XCCL_SIZE/XCCL_ROOT or torchrun's).
 *
 * The workload is exact in f32: rows are small integers, gating weights powers of two, and
 * expert e multiplies its input by (e + 1), so the combined output has one exact value whatever
 * the summation order, and is compared bit for bit. */
#ifndef XCCL_TEST_COMMON_H_
#define XCCL_TEST_COMMON_H_

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xccl.h"
#include "xccl.h" /* the header included twice in one translation unit */

#define NUM_EXPERTS 8
#define TOPK 2
#define HIDDEN 32
#define MAX_TOKENS 8

static int g_rank = -1;

#define FAIL(...)                                          \
  do {                                                     \
    fprintf(stderr, "rank %d: %s:%d: ", g_rank, __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__);                          \
    fprintf(stderr, "\n");                                 \
    exit(1);                                               \
  } while (0)

/* `call` must return `code` and, when it is an error, leave a message. */
#define EXPECT(call, code)                                                                      \
  do {                                                                                          \
    xcclResult_t r_ = (call);                                                                   \
    if (r_ != (code))                                                                           \
      FAIL("%s returned %d (%s), expected %d: %s", #call, (int)r_, xcclGetErrorString(r_),     \
           (int)(code), xcclGetLastError(NULL));                                                \
    if ((code) != xcclSuccess && strlen(xcclGetLastError(NULL)) == 0)                           \
      FAIL("%s failed without a message", #call);                                               \
  } while (0)

#define CHECK(call) EXPECT(call, xcclSuccess)

typedef struct {
  int env;
  int rank;
  int nranks;
  xcclUniqueId id;
} Args;

static inline int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static inline Args parse_args(int argc, char** argv) {
  Args a;
  int i;
  memset(&a, 0, sizeof a);
  a.rank = -1;
  for (i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--env") == 0) {
      a.env = 1;
    } else if (strcmp(argv[i], "--rank") == 0 && i + 1 < argc) {
      a.rank = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--nranks") == 0 && i + 1 < argc) {
      a.nranks = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--id") == 0 && i + 1 < argc) {
      const char* h = argv[++i];
      int k;
      if (strlen(h) != 2 * sizeof a.id.internal) FAIL("--id needs 256 hex characters");
      for (k = 0; k < (int)sizeof a.id.internal; k++) {
        int hi = hexval(h[2 * k]), lo = hexval(h[2 * k + 1]);
        if (hi < 0 || lo < 0) FAIL("--id: bad hex digit");
        a.id.internal[k] = (char)(hi * 16 + lo);
      }
    } else {
      FAIL("usage: %s (--id HEX --rank R --nranks N | --env)", argv[0]);
    }
  }
  if (a.env) {
    const char* size = getenv("XCCL_SIZE") ? getenv("XCCL_SIZE") : getenv("WORLD_SIZE");
    const char* rank = getenv("XCCL_RANK") ? getenv("XCCL_RANK") : getenv("RANK");
    if (size == NULL || rank == NULL) FAIL("--env: no XCCL_SIZE/WORLD_SIZE or XCCL_RANK/RANK");
    a.nranks = atoi(size);
    a.rank = atoi(rank);
  }
  g_rank = a.rank;
  return a;
}

/* The config every rank of the test uses: half attention ranks, f32, exact workload. */
static inline xcclConfig_t test_config(int nranks) {
  xcclConfig_t cfg = XCCL_CONFIG_INITIALIZER;
  cfg.numAttentionRanks = nranks / 2;
  cfg.numExperts = NUM_EXPERTS;
  cfg.topk = TOPK;
  cfg.hidden = HIDDEN;
  cfg.maxTokensPerRank = MAX_TOKENS;
  cfg.dtype = xcclFloat32;
  cfg.timeoutMs = 20000;
  return cfg;
}

static inline int tokens_of(int rank, int round) {
  /* rounds 1 and 2 send 0 tokens (the C test replies token-major to odd rounds, expert-major
   * to even ones) */
  return round == 1 || round == 2 ? 0 : MAX_TOKENS - (rank + round) % 3;
}

/* Attention rank `rank`'s inputs of round `round`: x [T, HIDDEN], idx and w [T, TOPK]. */
static inline void make_inputs(int rank, int round, int T, float* x, int* idx, float* w) {
  int t, h, k;
  for (t = 0; t < T; t++) {
    for (h = 0; h < HIDDEN; h++) x[t * HIDDEN + h] = (float)((rank * 31 + round * 7 + t * 3 + h) % 17 - 8);
    for (k = 0; k < TOPK; k++) {
      idx[t * TOPK + k] = (t + k) % 7 == 6 ? -1 : (t * 5 + rank * 3 + round + k) % NUM_EXPERTS;
      w[t * TOPK + k] = 1.0f / (float)(2 << k);
    }
  }
}

/* The expert function: expert e scales its input by e + 1 (exact on these values). */
static inline float expert_fn(int e, float v) { return v * (float)(e + 1); }

/* The exact combined output. */
static inline void reference(int T, const float* x, const int* idx, const float* w, float* out) {
  int t, h, k;
  for (t = 0; t < T; t++)
    for (h = 0; h < HIDDEN; h++) {
      float acc = 0.0f;
      for (k = 0; k < TOPK; k++)
        if (idx[t * TOPK + k] >= 0) acc += w[t * TOPK + k] * expert_fn(idx[t * TOPK + k], x[t * HIDDEN + h]);
      out[t * HIDDEN + h] = acc;
    }
}

static inline void compare(int round, int T, const float* got, const float* want) {
  int i;
  if (T > 0 && memcmp(got, want, (size_t)T * HIDDEN * sizeof(float)) != 0) {
    for (i = 0; i < T * HIDDEN; i++)
      if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
        FAIL("round %d: out[%d][%d] = %.9g, expected %.9g", round, i / HIDDEN, i % HIDDEN,
             (double)got[i], (double)want[i]);
  }
}

static inline xcclComm_t init_comm(const Args* a, const xcclConfig_t* cfg) {
  xcclComm_t comm = NULL;
  if (a->env) {
    CHECK(xcclCommInitFromEnv(&comm, cfg));
  } else {
    CHECK(xcclCommInitRankConfig(&comm, a->nranks, a->id, a->rank, cfg));
  }
  return comm;
}

#endif /* XCCL_TEST_COMMON_H_ */
