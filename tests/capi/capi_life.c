/* C11 test of the end of a communicator's life (built by tests/tests/capi.rs).
 *
 * --leave L --stamp PATH [--open] [--fabric NAME] (2 ranks, one process each; rank 0 attention,
 * rank 1 expert): two exact rounds, then (with --open) one more A2E that the expert rank
 * receives and nobody answers, so the attention rank holds a handle and the expert rank a
 * batch. Rank L destroys its communicator, writes its pid to PATH and exits. The survivor waits
 * for PATH, then:
 *   --open: xcclCommGetAsyncError says xcclRemoteError naming rank L ("left the job") at the
 *           first look on shm (the departure mark is set before xcclCommDestroy returns), within
 *           5 s on ofi (a message), and again after L's process exited; the attention rank's
 *           xcclE2ARecv of the open handle then fails with xcclRemoteError naming L, long before
 *           its 20 s timeout;
 *   else:   the normal end of a job: nothing is open, so xcclCommGetAsyncError says xcclSuccess
 *           (for 200 ms, and after L's process exited); the next call that needs L
 *           (xcclA2ERecv, or xcclA2ESend + xcclE2ARecv) fails with xcclRemoteError naming it,
 *           long before its timeout.
 *
 * --destroy-blocked N (one process, both ranks as threads, N tries of each case): a thread
 * blocks in xcclA2ERecv (expert) or xcclE2ARecv (attention) for a peer that never sends;
 * another thread calls xcclCommDestroy (or xcclCommAbort). Destroy returns xcclSuccess only
 * after the blocked call returned (xcclInvalidUsage), within 5 s; the caller's output buffer
 * is freed right after (a late write would be a use after free); the handle is gone. Abort
 * returns at once and the blocked call returns xcclAborted. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

static void expect_names(const char* msg, int rank, const char* what) {
  char who[32];
  snprintf(who, sizeof who, "rank %d", rank);
  if (strstr(msg, who) == NULL || strstr(msg, what) == NULL)
    FAIL("the message does not name %s (\"%s\"): %s", who, what, msg);
}

/* ---- --leave ---------------------------------------------------------------------------- */

static void attention_round(xcclComm_t comm, int rank, int round) {
  float x[MAX_TOKENS * HIDDEN], out[MAX_TOKENS * HIDDEN], want[MAX_TOKENS * HIDDEN];
  int idx[MAX_TOKENS * TOPK];
  float w[MAX_TOKENS * TOPK];
  int T = tokens_of(rank, round);
  xcclA2EHandle_t h = NULL;
  make_inputs(rank, round, T, x, idx, w);
  reference(T, x, idx, w, want);
  CHECK(xcclA2ESend(comm, x, T, idx, w, &h));
  CHECK(xcclE2ARecv(comm, h, out));
  compare(round, T, out, want);
}

static void expert_round(xcclComm_t comm) {
  int n = 0, experts[NUM_EXPERTS], j, h;
  size_t r;
  xcclExpertBatch_t b = NULL;
  xcclExpertBatchInfo_t info;
  float* y;
  CHECK(xcclCommLocalExperts(comm, &n, experts));
  CHECK(xcclA2ERecv(comm, &b));
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(xcclExpertBatchGetInfo(b, &info));
  y = (float*)malloc((info.numRows + 1) * HIDDEN * sizeof(float));
  for (j = 0; j < n; j++)
    for (r = info.expertOffsets[j]; r < info.expertOffsets[j + 1]; r++)
      for (h = 0; h < HIDDEN; h++)
        y[r * HIDDEN + h] = expert_fn(experts[j], ((const float*)info.rows)[r * HIDDEN + h]);
  CHECK(xcclE2ASend(comm, b, y));
  free(y);
}

static pid_t wait_for_stamp(const char* path) {
  double until = now_s() + 30.0;
  while (now_s() < until) {
    FILE* f = fopen(path, "r");
    if (f != NULL) {
      long pid = 0;
      int got = fscanf(f, "%ld", &pid);
      fclose(f);
      if (got == 1 && pid > 0) return (pid_t)pid;
    }
    sleep_ms(2);
  }
  FAIL("the leaving rank never wrote %s", path);
  return 0;
}

static void write_stamp(const char* path) {
  char tmp[4096];
  FILE* f;
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  f = fopen(tmp, "w");
  if (f == NULL) FAIL("cannot write %s", tmp);
  fprintf(f, "%ld\n", (long)getpid());
  fclose(f);
  if (rename(tmp, path) != 0) FAIL("cannot rename %s", tmp);
}

/* Waits until process `pid` is gone (reaped by the test), at most 20 s. */
static void wait_for_exit(pid_t pid) {
  double until = now_s() + 20.0;
  while (now_s() < until) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return;
    sleep_ms(5);
  }
  FAIL("process %ld did not exit", (long)pid);
}

static int leave(const Args* a, const char* fabric, int leaver, const char* stamp, int open_calls) {
  xcclConfig_t cfg = test_config(a->nranks);
  xcclComm_t comm;
  xcclA2EHandle_t h = NULL;
  xcclExpertBatch_t b = NULL;
  xcclResult_t async = xcclSuccess, r;
  int attention = a->rank == 0, round, peer = 1 - a->rank;
  float x[MAX_TOKENS * HIDDEN], out[MAX_TOKENS * HIDDEN];
  int idx[MAX_TOKENS * TOPK];
  float w[MAX_TOKENS * TOPK];
  int T = tokens_of(0, 0);
  double t0, took;
  pid_t pid;
  char ready[4096];
  cfg.fabric = fabric;
  cfg.ofiProvider = getenv("ENGINE_OFI_PROVIDER");
  cfg.ofiInterface = getenv("ENGINE_OFI_INTERFACE");
  comm = init_comm(a, &cfg);
  make_inputs(0, 0, T, x, idx, w);
  for (round = 0; round < 2; round++) {
    if (attention) attention_round(comm, a->rank, round);
    else expert_round(comm);
  }
  if (open_calls) {
    if (attention) CHECK(xcclA2ESend(comm, x, T, idx, w, &h));
    else CHECK(xcclA2ERecv(comm, &b));
  }
  snprintf(ready, sizeof ready, "%s.ready", stamp);
  if (a->rank == leaver) {
    wait_for_stamp(ready); /* the survivor looked before anyone left */
    CHECK(xcclCommDestroy(comm));
    write_stamp(stamp);
    printf("rank %d: left the job\n", a->rank);
    printf("rank %d: ok\n", a->rank);
    return 0;
  }
  CHECK(xcclCommGetAsyncError(comm, &async));
  if (async != xcclSuccess) FAIL("async error %d before anyone left: %s", (int)async, xcclGetLastError(comm));
  write_stamp(ready);
  pid = wait_for_stamp(stamp);
  t0 = now_s();
  if (open_calls) {
    /* shm: reported by the first look (the mark is set before the peer's destroy returned);
     * ofi: once the peer's departure message arrived. */
    double bound = fabric != NULL && strcmp(fabric, "ofi") == 0 ? 5.0 : 0.0;
    int looks = 0;
    for (;;) {
      CHECK(xcclCommGetAsyncError(comm, &async));
      looks++;
      if (async != xcclSuccess || now_s() - t0 > bound) break;
      sleep_ms(1);
    }
    took = now_s() - t0;
    if (async != xcclRemoteError)
      FAIL("xcclCommGetAsyncError said %d after %.3f s (%d looks), want xcclRemoteError: %s", (int)async, took,
           looks, xcclGetLastError(comm));
    expect_names(xcclGetLastError(comm), peer, "left the job");
    printf("rank %d: async error after %.3f s (%d looks): %s\n", a->rank, took, looks, xcclGetLastError(comm));
    wait_for_exit(pid);
    CHECK(xcclCommGetAsyncError(comm, &async));
    if (async != xcclRemoteError) FAIL("after the peer exited: async %d", (int)async);
    expect_names(xcclGetLastError(comm), peer, "left the job");
    if (attention) {
      t0 = now_s();
      EXPECT(xcclE2ARecv(comm, h, out), xcclRemoteError);
      took = now_s() - t0;
      expect_names(xcclGetLastError(comm), peer, "left the job");
      if (took > 5.0) FAIL("the E2A receive took %.1f s to fail", took);
      printf("rank %d: E2A receive failed after %.3f s: %s\n", a->rank, took, xcclGetLastError(comm));
    }
  } else {
    /* The normal end of a job: nothing open waits for the peer. */
    while (now_s() - t0 < 0.2) {
      CHECK(xcclCommGetAsyncError(comm, &async));
      if (async != xcclSuccess) FAIL("spurious async error %d at the normal end: %s", (int)async, xcclGetLastError(comm));
      sleep_ms(5);
    }
    wait_for_exit(pid);
    CHECK(xcclCommGetAsyncError(comm, &async));
    if (async != xcclSuccess) FAIL("spurious async error %d after the peer exited: %s", (int)async, xcclGetLastError(comm));
    printf("rank %d: no async error after the peer's normal end\n", a->rank);
    /* A further call needs the peer: it fails naming it, long before the 20 s timeout. */
    t0 = now_s();
    if (attention) {
      r = xcclA2ESend(comm, x, T, idx, w, &h);
      if (r == xcclSuccess) r = xcclE2ARecv(comm, h, out);
    } else {
      r = xcclA2ERecv(comm, &b);
    }
    took = now_s() - t0;
    if (r != xcclRemoteError) FAIL("the call after the peer left returned %d: %s", (int)r, xcclGetLastError(comm));
    expect_names(xcclGetLastError(comm), peer, "left the job");
    if (took > 5.0) FAIL("the call took %.1f s to fail", took);
    printf("rank %d: the next call failed after %.3f s: %s\n", a->rank, took, xcclGetLastError(comm));
  }
  CHECK(xcclCommDestroy(comm));
  printf("rank %d: ok\n", a->rank);
  return 0;
}

/* ---- --destroy-blocked ------------------------------------------------------------------ */

typedef struct {
  xcclComm_t comm;
  int rank;
  xcclUniqueId id;
} Init;

static void* init_rank(void* arg) {
  Init* in = (Init*)arg;
  xcclConfig_t cfg = test_config(2);
  cfg.timeoutMs = 20000;
  if (xcclCommInitRankConfig(&in->comm, 2, in->id, in->rank, &cfg) != xcclSuccess) {
    fprintf(stderr, "init of rank %d: %s\n", in->rank, xcclGetLastError(NULL));
    return (void*)1;
  }
  return NULL;
}

/* Both ranks of a 1A:1E job in this process: comms[0] attention, comms[1] expert. */
static void two_ranks(xcclComm_t comms[2]) {
  Init in[2];
  pthread_t t[2];
  void* res;
  int r;
  xcclUniqueId id;
  CHECK(xcclGetUniqueId(&id));
  for (r = 0; r < 2; r++) {
    in[r].comm = NULL;
    in[r].rank = r;
    in[r].id = id;
    if (pthread_create(&t[r], NULL, init_rank, &in[r]) != 0) FAIL("pthread_create");
  }
  for (r = 0; r < 2; r++) {
    pthread_join(t[r], &res);
    if (res != NULL) FAIL("init of rank %d failed", r);
    comms[r] = in[r].comm;
  }
}

typedef struct {
  xcclComm_t comm;
  int attention;
  xcclA2EHandle_t handle;
  float* out;
  xcclResult_t result;
  char message[512];
  _Atomic int started, returned;
  double returned_at;
} Blocked;

static void* block(void* arg) {
  Blocked* b = (Blocked*)arg;
  xcclExpertBatch_t batch = NULL;
  atomic_store(&b->started, 1);
  if (b->attention) b->result = xcclE2ARecv(b->comm, b->handle, b->out);
  else b->result = xcclA2ERecv(b->comm, &batch);
  snprintf(b->message, sizeof b->message, "%s", xcclGetLastError(b->comm));
  b->returned_at = now_s();
  atomic_store(&b->returned, 1);
  return NULL;
}

/* One try: rank `side` (0 attention, 1 expert) blocks for a peer that never sends; this
 * thread destroys (or aborts) its communicator. Returns Destroy's (or Abort's) duration. */
static double one_try(int side, int abort_it) {
  xcclComm_t comms[2];
  Blocked b;
  pthread_t t;
  double t0, took;
  float x[MAX_TOKENS * HIDDEN];
  int idx[MAX_TOKENS * TOPK];
  float w[MAX_TOKENS * TOPK];
  int T = tokens_of(0, 0), done = 0;
  two_ranks(comms);
  memset(&b, 0, sizeof b);
  b.comm = comms[side];
  b.attention = side == 0;
  b.out = (float*)malloc(MAX_TOKENS * HIDDEN * sizeof(float));
  if (side == 0) {
    /* The expert rank never receives, so never replies. */
    make_inputs(0, 0, T, x, idx, w);
    CHECK(xcclA2ESend(comms[0], x, T, idx, w, &b.handle));
  }
  if (side == 0) memset(b.out, 0, MAX_TOKENS * HIDDEN * sizeof(float));
  if (pthread_create(&t, NULL, block, &b) != 0) FAIL("pthread_create");
  while (!atomic_load(&b.started)) sleep_ms(1);
  sleep_ms(30); /* into the wait */
  if (atomic_load(&b.returned)) FAIL("the call returned before anyone stopped it: %s", b.message);
  t0 = now_s();
  if (abort_it) {
    CHECK(xcclCommAbort(comms[side]));
    took = now_s() - t0;
    pthread_join(t, NULL);
    if (b.result != xcclAborted) FAIL("after xcclCommAbort the blocked call returned %d: %s", (int)b.result, b.message);
    if (strstr(b.message, "xcclCommAbort") == NULL) FAIL("the abort is not named: %s", b.message);
    if (b.returned_at - t0 > 5.0) FAIL("the blocked call returned %.1f s after the abort", b.returned_at - t0);
    CHECK(xcclCommDestroy(comms[side]));
  } else {
    size_t k;
    CHECK(xcclCommDestroy(comms[side]));
    took = now_s() - t0;
    /* Destroy returned only after the blocked call's work in xccl ended: nothing writes `out`
     * now (a canary stays, and the buffer is freed while the thread may still be on its way
     * out of the call: a late write would be a use after free under valgrind or ASan). */
    for (k = 0; k < MAX_TOKENS * HIDDEN; k++) b.out[k] = -7.0f;
    sleep_ms(5);
    for (k = 0; k < MAX_TOKENS * HIDDEN; k++)
      if (b.out[k] != -7.0f) FAIL("out[%zu] was written after xcclCommDestroy returned", k);
    free(b.out);
    b.out = NULL;
    pthread_join(t, NULL);
    if (b.result != xcclInvalidUsage) FAIL("after xcclCommDestroy the blocked call returned %d: %s", (int)b.result, b.message);
    if (strstr(b.message, "xcclCommDestroy") == NULL) FAIL("destroy is not named: %s", b.message);
    if (b.returned_at - t0 > 5.0) FAIL("the blocked call returned %.1f s after the destroy", b.returned_at - t0);
    /* The communicator and the handle are gone. */
    EXPECT(xcclCommDestroy(comms[side]), xcclInvalidUsage);
    EXPECT(xcclA2ERecvTest(comms[side], &done), xcclInvalidUsage);
    if (side == 0) EXPECT(xcclA2EHandleFree(b.handle), xcclInvalidUsage);
  }
  if (took > 5.0) FAIL("%s took %.1f s", abort_it ? "xcclCommAbort" : "xcclCommDestroy", took);
  free(b.out);
  CHECK(xcclCommDestroy(comms[1 - side]));
  return took;
}

static int destroy_blocked(int tries) {
  int i, side, abort_it;
  g_rank = 0;
  for (abort_it = 0; abort_it < 2; abort_it++)
    for (side = 0; side < 2; side++) {
      double worst = 0.0, took;
      for (i = 0; i < tries; i++) {
        took = one_try(side, abort_it);
        if (took > worst) worst = took;
      }
      printf("%s of a blocked %s: %d tries, slowest %.3f s\n", abort_it ? "abort" : "destroy",
             side == 0 ? "E2A receive" : "A2E receive", tries, worst);
    }
  printf("destroy-blocked: ok\n");
  return 0;
}

int main(int argc, char** argv) {
  const char* fabric = NULL;
  const char* stamp = NULL;
  int leaver = -1, open_calls = 0, tries = 0, i, nrest = 1;
  char** rest = (char**)calloc((size_t)argc + 1, sizeof(char*));
  Args a;
  rest[0] = argv[0];
  for (i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--fabric") == 0 && i + 1 < argc) fabric = argv[++i];
    else if (strcmp(argv[i], "--leave") == 0 && i + 1 < argc) leaver = atoi(argv[++i]);
    else if (strcmp(argv[i], "--stamp") == 0 && i + 1 < argc) stamp = argv[++i];
    else if (strcmp(argv[i], "--open") == 0) open_calls = 1;
    else if (strcmp(argv[i], "--destroy-blocked") == 0 && i + 1 < argc) tries = atoi(argv[++i]);
    else rest[nrest++] = argv[i];
  }
  if (tries > 0) {
    free(rest);
    return destroy_blocked(tries);
  }
  a = parse_args(nrest, rest);
  free(rest);
  if (leaver < 0 || stamp == NULL || a.nranks != 2) FAIL("usage: --leave L --stamp PATH with 2 ranks");
  return leave(&a, fabric, leaver, stamp, open_calls);
}
