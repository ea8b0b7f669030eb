/* C11 test of what an engine needs from the C ABI (built by tests/tests/capi.rs): xcclConfigInit
 * against XCCL_CONFIG_INITIALIZER, the unique id's hex form, the xcclGetLastError rule (per
 * thread, set by failures, cleared by successes), explicit roles (config.role, odd ranks
 * attention: not "attention first"), per-call tags ending the expert loop, the non-blocking
 * tests (xcclE2ATest, xcclA2ERecvTest) polled before every receive, counters
 * (xcclCommGetStats, also into a short struct), batch infos into an old 9-field layout (config
 * version 1) and into a short size, and with --kill R: rank R SIGKILLs itself, the survivors
 * shrink (xcclCommShrink), check the new ranks and placement, and go on checked bit for bit.
 *
 *   capi_engine (--id HEX --rank R --nranks N | --env) [--fabric NAME] [--kill R] [--legacy]
 *
 * With --fabric ofi the provider and the interface come from ENGINE_OFI_PROVIDER and
 * ENGINE_OFI_INTERFACE through config.ofiProvider and config.ofiInterface. */
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define ROUNDS 8
#define STOP_TAG 0xffffffffffffffffull
#define KILL_ROUND 3

static uint64_t tag_of(int round, int rank) {
  return round == ROUNDS - 1 ? STOP_TAG : ((uint64_t)(round + 1) << 32) | (uint64_t)rank;
}

/* The 9-field xcclExpertBatchInfo_t of config version 1 (before int8Rows and scales), with a
 * canary after it that the library must not touch. */
typedef struct {
  size_t numRows, numTokens, numLocalExperts;
  const void* rows;
  const size_t *expertCounts, *expertOffsets;
  const uint32_t *srcRank, *srcToken;
  const float* weights;
  uint64_t canary[4];
} LegacyInfoV1;

static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static void config_init_matches_the_initializer(void) {
  xcclConfig_t a = XCCL_CONFIG_INITIALIZER, b;
  memset(&b, 0x5a, sizeof b);
  CHECK(xcclConfigInit(&b));
  if (a.size != b.size || a.magic != b.magic || a.version != b.version || b.version != 4u ||
      b.size != sizeof(xcclConfig_t) || b.hidden != XCCL_CONFIG_UNDEF_INT ||
      b.role != XCCL_CONFIG_UNDEF_INT || b.device != XCCL_CONFIG_UNDEF_INT ||
      b.recvCapacity != XCCL_CONFIG_UNDEF_INT || b.fabric != NULL || b.ofiProvider != NULL ||
      b.ofiInterface != NULL || b.placementCounts != NULL)
    FAIL("xcclConfigInit differs from XCCL_CONFIG_INITIALIZER");
  EXPECT(xcclConfigInit(NULL), xcclInvalidArgument);
}

static void unique_id_hex_round_trips(const xcclUniqueId* id) {
  char hex[XCCL_UNIQUE_ID_HEX_LEN + 1], small[16];
  xcclUniqueId back;
  CHECK(xcclUniqueIdToString(id, hex, sizeof hex));
  if (strlen(hex) != XCCL_UNIQUE_ID_HEX_LEN) FAIL("hex form has %zu characters", strlen(hex));
  CHECK(xcclUniqueIdFromString(hex, &back));
  if (memcmp(&back, id, sizeof back) != 0) FAIL("the hex form does not round-trip");
  EXPECT(xcclUniqueIdToString(id, small, sizeof small), xcclInvalidArgument);
  hex[7] = 'g';
  EXPECT(xcclUniqueIdFromString(hex, &back), xcclInvalidArgument);
  if (strstr(xcclGetLastError(NULL), "str[7]") == NULL) FAIL("bad digit not named: %s", xcclGetLastError(NULL));
  EXPECT(xcclUniqueIdFromString("abc", &back), xcclInvalidArgument);
}

/* Another thread's failure never shows in this thread's xcclGetLastError. */
static void* fail_on_other_thread(void* arg) {
  (void)arg;
  if (xcclGetVersion(NULL) != xcclInvalidArgument) return (void*)1;
  return strlen(xcclGetLastError(NULL)) > 0 ? NULL : (void*)1;
}

static void last_error_is_per_thread_set_by_failures_and_cleared_by_successes(void) {
  int v;
  pthread_t t;
  void* res;
  EXPECT(xcclGetVersion(NULL), xcclInvalidArgument);
  if (strstr(xcclGetLastError(NULL), "xcclGetVersion") == NULL) FAIL("failure not recorded");
  CHECK(xcclGetVersion(&v));
  if (strcmp(xcclGetLastError(NULL), "") != 0) FAIL("a success did not clear: %s", xcclGetLastError(NULL));
  if (pthread_create(&t, NULL, fail_on_other_thread, NULL) != 0) FAIL("pthread_create");
  pthread_join(t, &res);
  if (res != NULL) FAIL("the other thread's failure was not recorded there");
  if (strcmp(xcclGetLastError(NULL), "") != 0) FAIL("another thread's failure showed here");
}

/* With --kill: survivors go on with the new communicator. Every expert has a replica on both
 * expert ranks, so any one expert rank may die. */
static int placement_counts[NUM_EXPERTS];
static int placement_ranks[2 * NUM_EXPERTS];

static xcclConfig_t engine_config(const Args* a, const char* fabric, int legacy) {
  xcclConfig_t cfg = test_config(a->nranks);
  int e;
  cfg.numAttentionRanks = XCCL_CONFIG_UNDEF_INT;
  cfg.role = a->rank % 2 == 1 ? xcclRoleAttention : xcclRoleExpert;
  cfg.fabric = fabric;
  /* ofi: provider and interface through the config fields (the test names the namespace's
   * address in ENGINE_OFI_INTERFACE); ascend: device 0 of the stand-in runtime. */
  cfg.ofiProvider = getenv("ENGINE_OFI_PROVIDER");
  cfg.ofiInterface = getenv("ENGINE_OFI_INTERFACE");
  cfg.device = 0;
  if (a->nranks == 4 && !legacy) {
    /* ranks 0 and 2 are the expert ranks: every expert on both */
    for (e = 0; e < NUM_EXPERTS; e++) {
      placement_counts[e] = 2;
      placement_ranks[2 * e] = e % 2 == 0 ? 0 : 2;
      placement_ranks[2 * e + 1] = e % 2 == 0 ? 2 : 0;
    }
    cfg.placementCounts = placement_counts;
    cfg.placementRanks = placement_ranks;
  }
  if (legacy) {
    /* A caller compiled against the version 1 header: its struct ends before a2eQuant, and
     * explicit roles did not exist. */
    cfg.version = 1;
    cfg.size = offsetof(xcclConfig_t, a2eQuant);
    cfg.numAttentionRanks = a->nranks / 2;
  }
  return cfg;
}

static void check_stats(xcclComm_t comm, int nranks, int rounds) {
  xcclPeerStats_t last[8], total[8];
  xcclStats_t st;
  struct {
    xcclStats_t head;
    uint64_t canary;
  } shortened;
  size_t cut = offsetof(xcclStats_t, last);
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  st.peerCapacity = 8;
  st.lastPeers = last;
  st.totalPeers = total;
  CHECK(xcclCommGetStats(comm, &st));
  if (st.numPeers != (size_t)nranks) FAIL("stats numPeers %zu", st.numPeers);
  if (st.total.calls < (uint64_t)rounds || st.last.calls != 1) FAIL("stats calls %llu / %llu",
                                                                    (unsigned long long)st.total.calls,
                                                                    (unsigned long long)st.last.calls);
  if (st.total.recordsWritten == 0 || st.total.recordsPolled == 0) FAIL("no records counted");
  /* A caller's struct that ends before `last`: nothing past its size is written. */
  memset(&shortened, 0x77, sizeof shortened);
  shortened.head.size = cut;
  shortened.head.peerCapacity = 0;
  shortened.head.lastPeers = NULL;
  shortened.head.totalPeers = NULL;
  CHECK(xcclCommGetStats(comm, &shortened.head));
  if (shortened.head.numPeers != (size_t)nranks) FAIL("short stats: numPeers not written");
  {
    const unsigned char* p = (const unsigned char*)&shortened.head;
    size_t i;
    for (i = cut; i < sizeof shortened; i++)
      if (p[i] != 0x77) FAIL("xcclCommGetStats wrote byte %zu past the caller's size %zu", i, cut);
  }
  st.size = 4;
  EXPECT(xcclCommGetStats(comm, &st), xcclInvalidArgument);
}

/* One attention round: tag, send, poll xcclE2ATest, receive, compare. */
static void attention_round(xcclComm_t comm, int rank, int round, int* polls) {
  float x[MAX_TOKENS * HIDDEN], out[MAX_TOKENS * HIDDEN], want[MAX_TOKENS * HIDDEN];
  int idx[MAX_TOKENS * TOPK];
  float w[MAX_TOKENS * TOPK];
  int T = tokens_of(rank, round), done = 0;
  xcclA2EHandle_t h = NULL;
  make_inputs(rank, round, T, x, idx, w);
  reference(T, x, idx, w, want);
  CHECK(xcclA2ESetTag(comm, tag_of(round, rank)));
  CHECK(xcclA2ESend(comm, x, T, idx, w, &h));
  while (!done) {
    CHECK(xcclE2ATest(comm, h, &done));
    if (!done) {
      (*polls)++;
      sleep_us(50);
    }
  }
  CHECK(xcclE2ARecv(comm, h, out));
  compare(round, T, out, want);
}

/* One expert round; returns the call's tag. */
static uint64_t expert_round(xcclComm_t comm, int legacy, int* round_out, int* polls) {
  int ready = 0, n = 0, experts[NUM_EXPERTS];
  size_t i, r, s;
  int h;
  xcclExpertBatch_t b = NULL;
  xcclExpertBatchInfo_t info;
  LegacyInfoV1 old;
  float* y;
  const float* rows;
  const size_t* offsets;
  size_t num_rows;
  uint64_t tag;
  CHECK(xcclCommLocalExperts(comm, &n, experts));
  *round_out = -1;
  while (!ready) {
    CHECK(xcclA2ERecvTest(comm, &ready));
    if (!ready) {
      (*polls)++;
      sleep_us(50);
    }
  }
  CHECK(xcclA2ERecv(comm, &b));
  if (legacy) {
    /* A version 1 caller: the 9-field layout, nothing written past it; no tags. */
    memset(&old, 0, sizeof old);
    old.canary[0] = old.canary[1] = old.canary[2] = old.canary[3] = 0xc0ffee;
    CHECK(xcclExpertBatchGetInfo(b, (xcclExpertBatchInfo_t*)(void*)&old));
    for (i = 0; i < 4; i++)
      if (old.canary[i] != 0xc0ffee) FAIL("the library wrote past the 9-field layout (word %zu)", i);
    if (old.numLocalExperts != (size_t)n || old.expertOffsets[n] != old.numRows) FAIL("legacy info fields");
    num_rows = old.numRows;
    offsets = old.expertOffsets;
    rows = (const float*)old.rows;
    tag = 0;
  } else {
    /* A caller whose struct ends before `tag`: nothing past its size is written. */
    struct {
      xcclExpertBatchInfo_t head;
      uint64_t canary;
    } cut;
    const size_t at = offsetof(xcclExpertBatchInfo_t, tag);
    const unsigned char* p = (const unsigned char*)&cut;
    memset(&cut, 0x77, sizeof cut);
    cut.head.size = at;
    CHECK(xcclExpertBatchGetInfo(b, &cut.head));
    for (i = at; i < sizeof cut; i++)
      if (p[i] != 0x77) FAIL("xcclExpertBatchGetInfo wrote byte %zu past the caller's size %zu", i, at);
    if (cut.head.size != at || cut.head.numLocalExperts != (size_t)n) FAIL("short info fields");
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(xcclExpertBatchGetInfo(b, &info));
    if (info.numSources == 0) FAIL("no sources");
    tag = info.tag;
    num_rows = info.numRows;
    offsets = info.expertOffsets;
    rows = (const float*)info.rows;
    for (s = 0; s < info.numSources; s++) {
      uint64_t t = info.sourceTags[s];
      int round = t == STOP_TAG ? ROUNDS - 1 : (int)(t >> 32) - 1;
      if (t != tag_of(round, (int)info.sourceRanks[s]))
        FAIL("source %u sent tag %llx", info.sourceRanks[s], (unsigned long long)t);
      if (s == 0) *round_out = round;
    }
    if (tag != info.sourceTags[0]) FAIL("call tag is not its first source's");
  }
  y = (float*)malloc((num_rows + 1) * HIDDEN * sizeof(float));
  for (i = 0; i < (size_t)n; i++)
    for (r = offsets[i]; r < offsets[i + 1]; r++)
      for (h = 0; h < HIDDEN; h++) y[r * HIDDEN + h] = expert_fn(experts[i], rows[r * HIDDEN + h]);
  CHECK(xcclE2ASend(comm, b, y));
  free(y);
  return tag;
}

int main(int argc, char** argv) {
  Args a;
  const char* fabric = NULL;
  int kill_rank = -1, bad_rank = -1, mismatch_rank = -1, legacy = 0, expect_unavailable = 0, i, role = 0, rank, nranks, round, polls = 0;
  char** rest = (char**)calloc((size_t)argc + 1, sizeof(char*));
  int nrest = 1;
  xcclConfig_t cfg;
  xcclComm_t comm;
  rest[0] = argv[0];
  for (i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--fabric") == 0 && i + 1 < argc) {
      fabric = argv[++i];
    } else if (strcmp(argv[i], "--kill") == 0 && i + 1 < argc) {
      kill_rank = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--bad-rank") == 0 && i + 1 < argc) {
      bad_rank = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--mismatch-rank") == 0 && i + 1 < argc) {
      mismatch_rank = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--legacy") == 0) {
      legacy = 1;
    } else if (strcmp(argv[i], "--expect-unavailable") == 0) {
      expect_unavailable = 1;
    } else {
      rest[nrest++] = argv[i];
    }
  }
  a = parse_args(nrest, rest);
  free(rest);
  config_init_matches_the_initializer();
  last_error_is_per_thread_set_by_failures_and_cleared_by_successes();
  if (!a.env) unique_id_hex_round_trips(&a.id);

  cfg = engine_config(&a, fabric, legacy);
  if (expect_unavailable) {
    comm = NULL;
    EXPECT(xcclCommInitRankConfig(&comm, a.nranks, a.id, a.rank, &cfg), xcclUnavailable);
    printf("rank %d: init said: %s\n", a.rank, xcclGetLastError(NULL));
    printf("rank %d: ok\n", a.rank);
    return 0;
  }
  if (bad_rank >= 0 || mismatch_rank >= 0) {
    /* One rank's invalid config (hidden unset) or different config (hidden 64): every rank's
     * init fails within the init round, naming the rank, the field and the values, long before
     * the 20 s timeout. */
    struct timespec t0, t1;
    double took;
    xcclResult_t want;
    const char* msg;
    comm = NULL;
    if (a.rank == bad_rank) cfg.hidden = XCCL_CONFIG_UNDEF_INT;
    if (a.rank == mismatch_rank) cfg.hidden = 64;
    want = a.rank == bad_rank ? xcclInvalidArgument : xcclRemoteError;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    EXPECT(xcclCommInitRankConfig(&comm, a.nranks, a.id, a.rank, &cfg), want);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    took = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    msg = xcclGetLastError(NULL);
    printf("rank %d: init failed after %.3f s: %s\n", a.rank, took, msg);
    if (strstr(msg, "hidden") == NULL) FAIL("the message does not name the field");
    if (mismatch_rank >= 0 && (strstr(msg, "64") == NULL || strstr(msg, "32") == NULL))
      FAIL("the message does not give both values");
    if (bad_rank >= 0 && a.rank != bad_rank) {
      char who[32];
      snprintf(who, sizeof who, "rank %d", bad_rank);
      if (strstr(msg, who) == NULL) FAIL("the message does not name the failing rank");
    }
    if (took > 10.0) FAIL("init took %.1f s to fail", took);
    printf("rank %d: ok\n", a.rank);
    return 0;
  }
  comm = init_comm(&a, &cfg);
  CHECK(xcclCommRole(comm, &role));
  if (!legacy && role != (a.rank % 2 == 1 ? xcclRoleAttention : xcclRoleExpert)) FAIL("role %d", role);
  rank = a.rank;
  nranks = a.nranks;
  for (round = 0;; round++) {
    if (kill_rank == rank && round == KILL_ROUND) {
      /* An expert rank dies holding this round's A2E unanswered: the attention ranks sent it only
       * after their last E2A, so every rank has finished the round before and only this one
       * fails. (Dying at the round's start raced: an attention rank still waiting on the other
       * expert's reply to the round before saw the death and aborted that round everywhere.) */
      xcclExpertBatch_t held = NULL;
      if (role == xcclRoleExpert) (void)xcclA2ERecv(comm, &held);
      printf("rank %d: killing itself\n", rank);
      fflush(stdout);
      raise(SIGKILL);
    }
    if (role == xcclRoleAttention) {
      if (round == ROUNDS) break;
      if (kill_rank >= 0 && round == KILL_ROUND) {
        /* The killed expert rank never replies: the call fails naming it, then shrink. */
        float x[MAX_TOKENS * HIDDEN], out[MAX_TOKENS * HIDDEN];
        int idx[MAX_TOKENS * TOPK];
        float w[MAX_TOKENS * TOPK];
        int T = tokens_of(rank, round);
        xcclA2EHandle_t h = NULL;
        xcclResult_t r;
        xcclShrinkOptions_t opts;
        xcclComm_t next = NULL;
        int new_rank = -2, dead_new = -2, n_after = 0;
        make_inputs(rank, round, T, x, idx, w);
        r = xcclA2ESend(comm, x, T, idx, w, &h);
        if (r == xcclSuccess) r = xcclE2ARecv(comm, h, out);
        if (r != xcclRemoteError && r != xcclAborted) FAIL("round %d after the kill returned %d: %s", round, (int)r, xcclGetLastError(NULL));
        printf("rank %d: round %d failed as expected: %s\n", rank, round, xcclGetLastError(NULL));
        memset(&opts, 0, sizeof opts);
        opts.size = sizeof opts;
        opts.timeoutMs = 20000;
        CHECK(xcclCommShrink(comm, &opts, &next));
        EXPECT(xcclA2ESetTag(comm, 1), xcclInvalidUsage); /* the old one is spent */
        CHECK(xcclCommDestroy(comm));
        comm = next;
        CHECK(xcclCommRankAfterShrink(comm, rank, &new_rank));
        CHECK(xcclCommRankAfterShrink(comm, kill_rank, &dead_new));
        CHECK(xcclCommUserRank(comm, &rank));
        CHECK(xcclCommCount(comm, &n_after));
        if (dead_new != -1 || new_rank != rank || n_after != nranks - 1)
          FAIL("after shrink: new rank %d (user rank %d), dead -> %d, %d ranks", new_rank, rank, dead_new, n_after);
        nranks = n_after;
        printf("rank %d: shrunk to %d ranks\n", rank, nranks);
        continue;
      }
      attention_round(comm, rank, round, &polls);
    } else {
      int seen_round = -1;
      uint64_t tag;
      if (kill_rank >= 0 && round == KILL_ROUND) {
        /* The other expert rank died: this receive (or the reply) fails, then shrink. */
        xcclExpertBatch_t b = NULL;
        xcclResult_t r = xcclA2ERecv(comm, &b);
        xcclShrinkOptions_t opts;
        xcclComm_t next = NULL;
        int n = 0, experts[NUM_EXPERTS], e;
        if (r == xcclSuccess) {
          xcclExpertBatchInfo_t info;
          float* y;
          memset(&info, 0, sizeof info);
          info.size = sizeof info;
          CHECK(xcclExpertBatchGetInfo(b, &info));
          y = (float*)calloc(info.numRows + 1, HIDDEN * sizeof(float));
          r = xcclE2ASend(comm, b, y);
          free(y);
          if (r == xcclSuccess) {
            /* The attention ranks fail on the dead rank's missing reply; their abort arrives. */
            r = xcclA2ERecv(comm, &b);
          }
        }
        if (r != xcclRemoteError && r != xcclAborted) FAIL("expert round after the kill returned %d: %s", (int)r, xcclGetLastError(NULL));
        memset(&opts, 0, sizeof opts);
        opts.size = sizeof opts;
        opts.timeoutMs = 20000;
        CHECK(xcclCommShrink(comm, &opts, &next));
        CHECK(xcclCommDestroy(comm));
        comm = next;
        CHECK(xcclCommUserRank(comm, &rank));
        CHECK(xcclCommCount(comm, &nranks));
        /* The reference for the new placement: the survivor hosts every expert now. */
        CHECK(xcclCommLocalExperts(comm, &n, experts));
        if (n != NUM_EXPERTS) FAIL("after shrink the surviving expert rank hosts %d experts", n);
        for (e = 0; e < n; e++)
          if (experts[e] != e) FAIL("local expert %d is %d", e, experts[e]);
        printf("rank %d: shrunk to %d ranks, hosting all %d experts\n", rank, nranks, n);
        continue;
      }
      tag = expert_round(comm, legacy, &seen_round, &polls);
      if (!legacy && seen_round != round) FAIL("call %d carried the tags of round %d", round, seen_round);
      if (legacy ? round == ROUNDS - 1 : tag == STOP_TAG) {
        printf("rank %d: expert loop ended by the stop tag after %d calls\n", rank, round + 1);
        break;
      }
    }
  }
  check_stats(comm, nranks, kill_rank >= 0 ? 1 : ROUNDS);
  printf("rank %d: polled %d times\n", rank, polls);
  CHECK(xcclCommDestroy(comm));
  printf("rank %d: ok\n", a.rank);
  return 0;
}
