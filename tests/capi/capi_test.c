/* C11 test of the C ABI (built by tests/tests/capi.rs with gcc -std=c11 -Wall -Wextra -Werror):
 * every function with NULL pointers, config errors naming the field, A2E/E2A rounds across real
 * processes checked bit for bit (expert-major and token-major replies, a 0-token round), a call
 * in the wrong role, then xcclCommAbort from another thread while the main thread is blocked,
 * every function on the aborted communicator and on the destroyed one. */
#include <pthread.h>
#include <time.h>

#include "common.h"

#define ROUNDS 6

static void null_pointer_checks_without_comm(void) {
  xcclConfig_t cfg = test_config(2);
  xcclUniqueId id;
  xcclComm_t comm = NULL;
  memset(&id, 0, sizeof id);
  EXPECT(xcclGetVersion(NULL), xcclInvalidArgument);
  EXPECT(xcclGetUniqueId(NULL), xcclInvalidArgument);
  EXPECT(xcclCommInitRankConfig(NULL, 2, id, 0, &cfg), xcclInvalidArgument);
  EXPECT(xcclCommInitRankConfig(&comm, 2, id, 0, NULL), xcclInvalidArgument);
  EXPECT(xcclCommInitFromEnv(NULL, &cfg), xcclInvalidArgument);
  EXPECT(xcclCommInitFromEnv(&comm, NULL), xcclInvalidArgument);
  EXPECT(xcclCommDestroy(NULL), xcclInvalidArgument);
  EXPECT(xcclCommAbort(NULL), xcclInvalidArgument);
  EXPECT(xcclCommGetAsyncError(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommCount(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommUserRank(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommRole(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommLocalExperts(NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommBufferSizes(NULL, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ESend(NULL, NULL, 0, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ARecv(NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2EHandleFree(NULL), xcclInvalidArgument);
  EXPECT(xcclA2EInput(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ESendInput(NULL, 0, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecv(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclExpertBatchGetInfo(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASend(NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclExpertBatchFree(NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecvTokens(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecvTokensWithCallback(NULL, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclTokenBatchGetInfo(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASendTokens(NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2AOutput(NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASendOutput(NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclTokenBatchFree(NULL), xcclInvalidArgument);
  if (strlen(xcclGetErrorString(xcclAborted)) == 0 || strlen(xcclGetErrorString((xcclResult_t)99)) == 0)
    FAIL("xcclGetErrorString gave an empty string");
}

/* Bad configs fail naming the field. With a valid id a rank whose config is invalid joins the
 * rendezvous to tell the others why (their init fails at once with its reason), which ends the
 * job: these cases use an id that names no job (all zero), so nothing can be reported and the
 * real init below still works. */
static void config_errors(const Args* a) {
  xcclUniqueId none;
  struct {
    const char* field;
    xcclConfig_t cfg;
  } cases[6];
  int i;
  xcclComm_t comm = NULL;
  memset(&none, 0, sizeof none);
  for (i = 0; i < 6; i++) cases[i].cfg = test_config(a->nranks);
  cases[0].field = "magic";
  cases[0].cfg.magic = 1;
  cases[1].field = "size";
  cases[1].cfg.size = 8;
  cases[2].field = "version";
  cases[2].cfg.version = 99;
  cases[3].field = "hidden";
  cases[3].cfg.hidden = XCCL_CONFIG_UNDEF_INT;
  cases[4].field = "topk";
  cases[4].cfg.topk = 0;
  cases[5].field = "maxInFlight";
  cases[5].cfg.maxInFlight = 100;
  for (i = 0; i < 6; i++) {
    EXPECT(xcclCommInitRankConfig(&comm, a->nranks, none, a->rank, &cases[i].cfg), xcclInvalidArgument);
    if (strstr(xcclGetLastError(NULL), cases[i].field) == NULL)
      FAIL("config error does not name %s: %s", cases[i].field, xcclGetLastError(NULL));
    if (comm != NULL) FAIL("a failed init wrote the communicator");
  }
  cases[0].cfg = test_config(a->nranks);
  cases[0].cfg.fabric = "no-such-fabric";
  EXPECT(xcclCommInitRankConfig(&comm, a->nranks, none, a->rank, &cases[0].cfg), xcclUnavailable);
  if (strstr(xcclGetLastError(NULL), "no-such-fabric") == NULL) FAIL("%s", xcclGetLastError(NULL));
  EXPECT(xcclCommInitRankConfig(&comm, 1, a->id, 0, &cases[1].cfg), xcclInvalidArgument);
  EXPECT(xcclCommInitRankConfig(&comm, a->nranks, a->id, a->nranks, &cases[1].cfg), xcclInvalidArgument);
}

/* Every function that takes pointers, on a live communicator, with NULL pointers. */
static void null_pointer_checks(xcclComm_t comm) {
  xcclA2EHandle_t h = NULL;
  EXPECT(xcclCommGetAsyncError(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclCommCount(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclCommUserRank(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclCommRole(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclCommLocalExperts(comm, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclCommBufferSizes(comm, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ESend(comm, NULL, 1, NULL, NULL, &h), xcclInvalidArgument);
  EXPECT(xcclA2ESend(comm, NULL, 0, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ARecv(comm, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2EInput(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ESendInput(comm, 0, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecv(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASend(comm, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecvTokens(comm, NULL), xcclInvalidArgument);
  EXPECT(xcclA2ERecvTokensWithCallback(comm, NULL, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASendTokens(comm, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2AOutput(comm, NULL, NULL), xcclInvalidArgument);
  EXPECT(xcclE2ASendOutput(comm, NULL), xcclInvalidArgument);
  if (strlen(xcclGetLastError(comm)) == 0) FAIL("xcclGetLastError(comm) is empty after a failure");
}

static void attention_round(xcclComm_t comm, int rank, int round) {
  float x[MAX_TOKENS * HIDDEN], w[MAX_TOKENS * TOPK], out[MAX_TOKENS * HIDDEN], want[MAX_TOKENS * HIDDEN];
  int idx[MAX_TOKENS * TOPK];
  int T = tokens_of(rank, round);
  xcclA2EHandle_t h = NULL;
  xcclExpertBatch_t b = NULL;
  make_inputs(rank, round, T, x, idx, w);
  reference(T, x, idx, w, want);
  CHECK(xcclA2ESend(comm, x, T, idx, w, &h));
  EXPECT(xcclA2ERecv(comm, &b), xcclInvalidUsage); /* wrong role: nothing changes */
  EXPECT(xcclE2ARecv(comm, h, NULL), T > 0 ? xcclInvalidArgument : xcclSuccess);
  if (T > 0) CHECK(xcclE2ARecv(comm, h, out)); /* the handle survived the rejected call */
  EXPECT(xcclE2ARecv(comm, h, out), xcclInvalidUsage); /* freed on success */
  compare(round, T, out, want);
}

static void expert_round(xcclComm_t comm, int round, const int* experts) {
  size_t i, r;
  int h;
  if (round % 2 == 0) {
    xcclExpertBatch_t b = NULL;
    xcclExpertBatchInfo_t info;
    float* y;
    CHECK(xcclA2ERecv(comm, &b));
    info.size = sizeof info;
    CHECK(xcclExpertBatchGetInfo(b, &info));
    if (info.expertOffsets[info.numLocalExperts] != info.numRows) FAIL("offsets do not end at numRows");
    y = (float*)malloc((info.numRows + 1) * HIDDEN * sizeof(float));
    for (i = 0; i < info.numLocalExperts; i++) {
      if (info.expertOffsets[i + 1] - info.expertOffsets[i] != info.expertCounts[i]) FAIL("counts vs offsets");
      for (r = info.expertOffsets[i]; r < info.expertOffsets[i + 1]; r++)
        for (h = 0; h < HIDDEN; h++)
          y[r * HIDDEN + h] = expert_fn(experts[i], ((const float*)info.rows)[r * HIDDEN + h]);
    }
    EXPECT(xcclE2ASend(comm, b, info.numRows > 0 ? NULL : y), info.numRows > 0 ? xcclInvalidArgument : xcclSuccess);
    if (info.numRows > 0) CHECK(xcclE2ASend(comm, b, y));
    EXPECT(xcclExpertBatchGetInfo(b, &info), xcclInvalidUsage); /* freed on success */
    free(y);
  } else {
    xcclTokenBatch_t b = NULL;
    xcclTokenBatchInfo_t info;
    float* red;
    CHECK(xcclA2ERecvTokens(comm, &b));
    info.size = sizeof info;
    CHECK(xcclTokenBatchGetInfo(b, &info));
    red = (float*)malloc((info.numTokens + 1) * HIDDEN * sizeof(float));
    for (i = 0; i < info.numTokens; i++)
      for (h = 0; h < HIDDEN; h++) {
        float acc = 0.0f;
        for (r = 0; r < info.expertCount[i]; r++) {
          int e = experts[info.localExperts[i * info.topk + r]];
          acc += info.weights[i * info.topk + r] * expert_fn(e, ((const float*)info.rows)[i * HIDDEN + h]);
        }
        red[i * HIDDEN + h] = acc;
      }
    CHECK(xcclE2ASendTokens(comm, b, red));
    free(red);
  }
}

typedef struct {
  xcclComm_t comm;
} AbortArg;

static void* abort_later(void* p) {
  struct timespec ts = {0, 300 * 1000 * 1000};
  nanosleep(&ts, NULL);
  if (xcclCommAbort(((AbortArg*)p)->comm) != xcclSuccess) FAIL("xcclCommAbort from a thread failed");
  return NULL;
}

/* Every function on a communicator that is aborted (`code` = xcclAborted) or destroyed
 * (xcclInvalidUsage): an error and a message, never a crash. */
static void dead_comm_checks(xcclComm_t comm, xcclResult_t code) {
  int n = 0;
  size_t s = 0;
  float buf[HIDDEN];
  void* p = NULL;
  xcclResult_t async = xcclSuccess;
  xcclA2EHandle_t h = NULL;
  xcclExpertBatch_t eb = NULL;
  xcclTokenBatch_t tb = NULL;
  EXPECT(xcclCommCount(comm, &n), code);
  EXPECT(xcclCommUserRank(comm, &n), code);
  EXPECT(xcclCommRole(comm, &n), code);
  EXPECT(xcclCommLocalExperts(comm, &n, NULL), code);
  EXPECT(xcclCommBufferSizes(comm, &s, &s, &s), code);
  EXPECT(xcclA2ESend(comm, buf, 0, NULL, NULL, &h), code);
  EXPECT(xcclE2ARecv(comm, (xcclA2EHandle_t)buf, buf), code);
  EXPECT(xcclA2EInput(comm, &p), code);
  EXPECT(xcclA2ESendInput(comm, 0, NULL, NULL, &h), code);
  EXPECT(xcclA2ERecv(comm, &eb), code);
  EXPECT(xcclE2ASend(comm, (xcclExpertBatch_t)buf, buf), code);
  EXPECT(xcclA2ERecvTokens(comm, &tb), code);
  EXPECT(xcclA2ERecvTokensWithCallback(comm, &tb, NULL, NULL), code);
  EXPECT(xcclE2ASendTokens(comm, (xcclTokenBatch_t)buf, buf), code);
  EXPECT(xcclE2AOutput(comm, (xcclTokenBatch_t)buf, &p), code);
  EXPECT(xcclE2ASendOutput(comm, (xcclTokenBatch_t)buf), code);
  if (code == xcclAborted) {
    CHECK(xcclCommGetAsyncError(comm, &async));
    if (async != xcclAborted) FAIL("async error after abort is %d", (int)async);
    if (strstr(xcclGetLastError(comm), "abort") == NULL) FAIL("no abort message: %s", xcclGetLastError(comm));
    CHECK(xcclCommAbort(comm)); /* again: a no-op */
  } else {
    EXPECT(xcclCommGetAsyncError(comm, &async), code);
    EXPECT(xcclCommAbort(comm), code);
    EXPECT(xcclCommDestroy(comm), code);
  }
}

int main(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  xcclConfig_t cfg = test_config(a.nranks);
  xcclComm_t comm;
  int version = 0, n = 0, rank = -1, role = -1, nexp = 0, round;
  int experts[NUM_EXPERTS];
  size_t rowBytes = 0, maxTokens = 0, maxRows = 0;
  xcclResult_t async = xcclInternalError, got;
  pthread_t aborter;
  AbortArg arg;

  CHECK(xcclGetVersion(&version));
  if (version != XCCL_VERSION_CODE) FAIL("library version %d, header %d", version, XCCL_VERSION_CODE);
  null_pointer_checks_without_comm();
  if (!a.env) config_errors(&a);

  comm = init_comm(&a, &cfg);
  CHECK(xcclCommCount(comm, &n));
  CHECK(xcclCommUserRank(comm, &rank));
  CHECK(xcclCommRole(comm, &role));
  CHECK(xcclCommLocalExperts(comm, &nexp, NULL));
  CHECK(xcclCommLocalExperts(comm, &nexp, experts));
  CHECK(xcclCommBufferSizes(comm, &rowBytes, &maxTokens, &maxRows));
  CHECK(xcclCommGetAsyncError(comm, &async));
  if (n != a.nranks || rank != a.rank || async != xcclSuccess || rowBytes != HIDDEN * sizeof(float))
    FAIL("queries: count %d rank %d async %d rowBytes %zu", n, rank, (int)async, rowBytes);
  if (role != (rank < a.nranks / 2 ? xcclRoleAttention : xcclRoleExpert)) FAIL("role %d", role);
  if (role == xcclRoleExpert && (nexp < 1 || maxRows < maxTokens)) FAIL("expert sizes");
  null_pointer_checks(comm);

  for (round = 0; round < ROUNDS; round++) {
    if (role == xcclRoleAttention)
      attention_round(comm, rank, round);
    else
      expert_round(comm, round, experts);
  }

  /* Abort: rank 0 aborts from a second thread while its main thread is blocked; every rank's
   * blocked call returns xcclAborted. Attention ranks send, then wait for an E2A the experts
   * never send; experts receive that call, then wait for one that never comes. */
  if (rank == 0) {
    arg.comm = comm;
    if (pthread_create(&aborter, NULL, abort_later, &arg) != 0) FAIL("pthread_create");
  }
  if (role == xcclRoleAttention) {
    float x[HIDDEN], w[TOPK], out[HIDDEN];
    int idx[TOPK];
    xcclA2EHandle_t h = NULL;
    make_inputs(rank, 0, 1, x, idx, w);
    got = xcclA2ESend(comm, x, 1, idx, w, &h);
    if (got == xcclSuccess) got = xcclE2ARecv(comm, h, out);
    if (got != xcclAborted) FAIL("blocked attention call returned %d: %s", (int)got, xcclGetLastError(comm));
    if (h != NULL) CHECK(xcclA2EHandleFree(h));
  } else {
    xcclExpertBatch_t b = NULL;
    got = xcclA2ERecv(comm, &b);
    if (got == xcclSuccess) got = xcclA2ERecv(comm, &b);
    if (got != xcclAborted) FAIL("blocked expert call returned %d: %s", (int)got, xcclGetLastError(comm));
  }
  if (strstr(xcclGetLastError(comm), "rank 0") == NULL) FAIL("abort message does not name rank 0: %s", xcclGetLastError(comm));
  if (rank == 0) pthread_join(aborter, NULL);
  CHECK(xcclCommAbort(comm));
  dead_comm_checks(comm, xcclAborted);
  CHECK(xcclCommDestroy(comm));
  dead_comm_checks(comm, xcclInvalidUsage);
  printf("rank %d: ok\n", rank);
  return 0;
}
