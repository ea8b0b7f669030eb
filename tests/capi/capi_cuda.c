/* C11 test of the device-buffer calls of the C ABI (xcclA2ESendDevice, xcclE2ARecvDevice,
 * xcclA2ERecvDevice, xcclE2ASendDevice, xcclA2ERecvTokensDevice, xcclE2ASendTokensDevice) on
 * the cuda fabric, built and run as real processes by tests/tests/capi.rs.
 *
 * Device memory comes from the CUDA driver this program dlopens itself: XCCL_CUDA_LIBRARY (the
 * stand-in driver of tests/cuda_standin/ in CI, whose device memory is host shared memory; the
 * same library xccl loads, so both see the same allocations), else libcuda.so.1 (a real GPU).
 *
 * Modes (the first two arguments):
 *   --mode cuda --devices N  config.fabric "cuda", rank r on device r % N. Pairs of rounds on
 *                            the same inputs: the host calls, then the device calls (routing on
 *                            the device and on the host, the default stream and a stream from
 *                            cuStreamCreate); the device results (the expert's received rows and
 *                            metadata, the attention rank's combined rows) must equal the host
 *                            results bit for bit (pair MIXED_PAIR answers the device calls with
 *                            host calls). The expert ranks receive expert-major in pairs
 *                            0..TOKEN_PAIR-1 and token-major from TOKEN_PAIR on (tokens
 *                            compared by their source rank and index, as the batch's order is
 *                            the arrival order; every arrival callback's rows read from `out`
 *                            while the receive goes on; MIXED_TOKEN_PAIR answers the device
 *                            receive with the host send and the host receive with the device
 *                            send). Before the first device round (of each kind) every refused
 *                            pointer (NULL, host memory, too short, another device's memory, the
 *                            routing in the other memory, device memory to a host call) must be
 *                            xcclInvalidArgument naming the argument, with nothing sent (the
 *                            rounds after it would fail otherwise); a driver error before
 *                            anything was sent (cuEventRecord failing through the stand-in's
 *                            CUDA_STANDIN_FAIL; stand-in only) xcclSystemError naming it, the
 *                            call then retried. XCCL_TEST_QUANT=int8: INT8 on the wire both ways
 *                            (config a2eQuant and e2aQuant). XCCL_TEST_DTYPE=bf16: rows of
                            bfloat16 (config.dtype), the test's own values rounded to it.
 *   --mode shm --devices N   a communicator on the shm fabric: every device call is
 *                            xcclInvalidArgument naming the cuda fabric (device memory on a host
 *                            communicator), xcclCommCuDevice says -1; then a host round.
 *   --mode nodriver          config.fabric "cuda" without a driver: init fails naming
 *                            libcuda.so.1 (xcclUnavailable, or xcclAborted carrying a peer's
 *                            such reason). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define PAIRS 12
/* The pair whose device calls are answered by host calls (xcclE2ARecv of a device send's
 * handle, xcclE2ASend of a device receive's batch). */
#define MIXED_PAIR 3
/* The first pair the expert ranks receive token-major. */
#define TOKEN_PAIR 6
/* The token-major pair whose device receive is answered by xcclE2ASendTokens and host receive
 * by xcclE2ASendTokensDevice. */
#define MIXED_TOKEN_PAIR 9

/* ---- the driver, dlopened ---- */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static struct {
  CUresult (*init)(unsigned);
  CUresult (*ctx_retain)(void**, int);
  CUresult (*ctx_set)(void*);
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*free_)(CUdeviceptr);
  CUresult (*htod)(CUdeviceptr, const void*, size_t);
  CUresult (*dtoh)(void*, CUdeviceptr, size_t);
  CUresult (*stream_create)(void**, unsigned);
  CUresult (*stream_destroy)(void*);
} cu;

static void* g_ctx[2];
/* The driver is the stand-in (CUDA_STANDIN_DEVICES set): its failure injection works. */
static int g_standin;
/* INT8 on the wire both ways (XCCL_TEST_QUANT=int8): the combined rows are further from the
 * f32 estimate, still the host calls' bits. */
static int g_int8;
/* Rows of bfloat16 (XCCL_TEST_DTYPE=bf16), else float32; g_esz is the element size. */
static int g_bf16;
static size_t g_esz = sizeof(float);

/* Element i of `rows` (config.dtype) as a float. */
static float get(const void* rows, size_t i) {
  float v;
  if (g_bf16) {
    uint32_t bits = (uint32_t)((const uint16_t*)rows)[i] << 16;
    memcpy(&v, &bits, sizeof v);
  } else {
    memcpy(&v, (const char*)rows + i * sizeof v, sizeof v);
  }
  return v;
}

/* Writes `v` (rounded to nearest even in bf16; no NaNs here) as element i of `rows`. */
static void set(void* rows, size_t i, float v) {
  if (g_bf16) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    ((uint16_t*)rows)[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  } else {
    memcpy((char*)rows + i * sizeof v, &v, sizeof v);
  }
}

/* The `n` elements at `got` equal those at `want` bit for bit, or FAIL naming the first. */
static void same_bits(const void* got, const void* want, size_t n, int pair, const char* what) {
  size_t i;
  if (n == 0 || memcmp(got, want, n * g_esz) == 0) return;
  for (i = 0; i < n; i++)
    if (memcmp((const char*)got + i * g_esz, (const char*)want + i * g_esz, g_esz) != 0)
      FAIL("pair %d: %s[%zu][%zu] = %.9g, the host call's %.9g", pair, what, i / HIDDEN, i % HIDDEN,
           (double)get(got, i), (double)get(want, i));
}

static void sym(void* lib, const char* name, void* fn_ptr) {
  void* p = dlsym(lib, name);
  if (p == NULL) FAIL("dlsym %s: %s", name, dlerror());
  memcpy(fn_ptr, &p, sizeof p); /* a function pointer from void*, without a pedantic cast */
}

#define CU(call)                                          \
  do {                                                    \
    CUresult c_ = (call);                                 \
    if (c_ != 0) FAIL("%s returned CUresult %d", #call, c_); \
  } while (0)

/* Opens the driver and retains the primary contexts of `dev` (slot 0) and `other` (slot 1). */
static void driver_open(int dev, int other) {
  const char* path = getenv("XCCL_CUDA_LIBRARY");
  void* lib = dlopen(path != NULL && path[0] != 0 ? path : "libcuda.so.1", RTLD_NOW);
  if (lib == NULL) FAIL("dlopen: %s", dlerror());
  sym(lib, "cuInit", &cu.init);
  sym(lib, "cuDevicePrimaryCtxRetain", &cu.ctx_retain);
  sym(lib, "cuCtxSetCurrent", &cu.ctx_set);
  sym(lib, "cuMemAlloc_v2", &cu.alloc);
  sym(lib, "cuMemFree_v2", &cu.free_);
  sym(lib, "cuMemcpyHtoD_v2", &cu.htod);
  sym(lib, "cuMemcpyDtoH_v2", &cu.dtoh);
  sym(lib, "cuStreamCreate", &cu.stream_create);
  sym(lib, "cuStreamDestroy_v2", &cu.stream_destroy);
  CU(cu.init(0));
  CU(cu.ctx_retain(&g_ctx[0], dev)); /* cuDeviceGet(ordinal) is the ordinal */
  CU(cu.ctx_retain(&g_ctx[1], other));
  CU(cu.ctx_set(g_ctx[0]));
}

/* `bytes` of device memory on the device of context slot `slot` (at least 1 byte). */
static void* dalloc_on(int slot, size_t bytes) {
  CUdeviceptr p = 0;
  CU(cu.ctx_set(g_ctx[slot]));
  CU(cu.alloc(&p, bytes > 0 ? bytes : 1));
  CU(cu.ctx_set(g_ctx[0]));
  return (void*)(uintptr_t)p;
}

static void* dalloc(size_t bytes) { return dalloc_on(0, bytes); }

static void dfree(void* p) { CU(cu.free_((CUdeviceptr)(uintptr_t)p)); }

static void h2d(void* d, const void* h, size_t n) {
  if (n > 0) CU(cu.htod((CUdeviceptr)(uintptr_t)d, h, n));
}

static void d2h(void* h, const void* d, size_t n) {
  if (n > 0) CU(cu.dtoh(h, (CUdeviceptr)(uintptr_t)d, n));
}

/* ---- the workload: values that are not exact in f32, so the sums round ---- */

/* Attention rank `rank`'s inputs of pair `pair`: `x` as floats and `xd` in config.dtype (x then
 * holds the values xd rounded them to). */
static void inputs(int rank, int pair, int T, float* x, void* xd, int* idx, float* w) {
  int t, h;
  make_inputs(rank, pair, T, x, idx, w);
  for (t = 0; t < T; t++) {
    for (h = 0; h < HIDDEN; h++) {
      int i = t * HIDDEN + h;
      set(xd, i, x[i] * 0.1f + 0.013f * (float)h);
      x[i] = get(xd, i);
    }
    w[t * TOPK] = 0.3f + 0.011f * (float)t;
    w[t * TOPK + 1] = 0.7f - 0.017f * (float)t;
  }
}

static float expert_out(int e, float v) { return v * (1.0f + 0.37f * (float)e) + 0.01f; }

/* The approximate combined row of token t (the exact bits are the host call's). */
static float approx(int t, int h, const float* x, const int* idx, const float* w) {
  float acc = 0.0f;
  int k;
  for (k = 0; k < TOPK; k++)
    if (idx[t * TOPK + k] >= 0) acc += w[t * TOPK + k] * expert_out(idx[t * TOPK + k], x[t * HIDDEN + h]);
  return acc;
}

/* `call` must fail with xcclInvalidArgument and a message holding `a` and `b`. */
#define EXPECT_INVALID(call, a, b)                                                        \
  do {                                                                                    \
    const char* m_;                                                                       \
    EXPECT(call, xcclInvalidArgument);                                                    \
    m_ = xcclGetLastError(NULL);                                                          \
    if (strstr(m_, (a)) == NULL || strstr(m_, (b)) == NULL)                               \
      FAIL("%s: the message does not name \"%s\" and \"%s\": %s", #call, (a), (b), m_); \
  } while (0)

/* A driver error before anything was sent is retryable: `call` (made while the stand-in's
 * CUDA_STANDIN_FAIL fails cuEventRecord, which orders the call after the caller's stream) must
 * fail with xcclSystemError naming the driver call; the caller then calls again. */
#define driver_error_is_retryable(call)                                                    \
  do {                                                                                     \
    if (!g_standin) break;                                                                 \
    if (setenv("CUDA_STANDIN_FAIL", "cuEventRecord:999", 1) != 0) FAIL("setenv");         \
    EXPECT(call, xcclSystemError);                                                         \
    unsetenv("CUDA_STANDIN_FAIL");                                                         \
    if (strstr(xcclGetLastError(NULL), "cuEventRecord") == NULL)                           \
      FAIL("%s: the message does not name cuEventRecord: %s", #call, xcclGetLastError(NULL)); \
  } while (0)

/* Every refused input of the E2A device send `dev` (`dev(comm, b, input, s)`, the input named
 * `name`, `bytes` bytes) and of its host twin `host` given the device buffer `d`; `hostbuf` is
 * host memory. The batch `b` stays valid. */
#define send_refusals(dev, host, name, b, hostbuf, d, bytes, s)                              \
  do {                                                                                      \
    void* short_ = dalloc((bytes) - 2);                                                     \
    EXPECT_INVALID(dev(comm, b, NULL, s), name " is NULL", #dev);                           \
    EXPECT_INVALID(dev(comm, b, hostbuf, s), name ": ", "not device memory");               \
    EXPECT_INVALID(dev(comm, b, short_, s), name ": ", "past the end");                     \
    EXPECT_INVALID(host(comm, b, d), name " (", "is device memory");                        \
    dfree(short_);                                                                          \
  } while (0)

/* ---- attention rank ---- */

/* Every refused pointer of the attention side's device calls (nothing is sent). */
static void attention_refusals(xcclComm_t comm, int T, void* dx, void* didx, void* dw, int ndev,
                               const float* x, const int* idx, const float* w) {
  size_t row = HIDDEN * g_esz;
  xcclA2EHandle_t h = NULL;
  void* shortx = dalloc(T * row - 4);
  void* other = ndev > 1 ? dalloc_on(1, T * row) : NULL;
  /* x, topkIdx, topkWeights, routingMemory, and what the message names. */
  struct {
    const void *x, *idx, *w;
    int mem;
    const char *a, *b;
  } refused[] = {
      {NULL, didx, dw, xcclMemoryDevice, "x is NULL", "xcclA2ESendDevice"},
      {x, didx, dw, xcclMemoryDevice, "x: ", "not device memory"},
      {shortx, didx, dw, xcclMemoryDevice, "x: ", "past the end of their allocation"},
      {dx, idx, dw, xcclMemoryDevice, "topkIdx: ", "not device memory"},
      {dx, didx, w, xcclMemoryDevice, "topkWeights: ", "not device memory"},
      {dx, didx, dw, xcclMemoryHost, "topkIdx", "is device memory"},
      {dx, idx, dw, xcclMemoryHost, "topkWeights", "is device memory"},
      {dx, didx, dw, 5, "routingMemory", "xcclMemory_t"},
      {other, didx, dw, xcclMemoryDevice, "x: ", "is memory of CUDA device"},
  };
  size_t i, n = sizeof refused / sizeof refused[0] - (other == NULL);
  for (i = 0; i < n; i++)
    EXPECT_INVALID(xcclA2ESendDevice(comm, refused[i].x, T, (const int32_t*)refused[i].idx,
                                     (const float*)refused[i].w, (xcclMemory_t)refused[i].mem, NULL, &h),
                   refused[i].a, refused[i].b);
  if (other != NULL) dfree(other);
  EXPECT_INVALID(xcclA2ESendDevice(comm, dx, T, didx, dw, xcclMemoryDevice, NULL, NULL), "handle",
                 "NULL");
  /* The host call on a cuda communicator refuses device memory. */
  EXPECT_INVALID(xcclA2ESend(comm, dx, T, idx, w, &h), "x (", "is device memory");
  EXPECT_INVALID(xcclA2ESend(comm, x, T, didx, w, &h), "topkIdx (", "is device memory");
  if (h != NULL) FAIL("a refused call wrote a handle");
  dfree(shortx);
}

static void attention(xcclComm_t comm, int rank, int ndev) {
  size_t row = HIDDEN * g_esz;
  void* dx = dalloc(MAX_TOKENS * row);
  void* dout = dalloc(MAX_TOKENS * row);
  void* didx = dalloc(MAX_TOKENS * TOPK * sizeof(int));
  void* dw = dalloc(MAX_TOKENS * TOPK * sizeof(float));
  void* raw = NULL;
  xcclCudaStream_t stream;
  int pair;
  size_t maxTokens = 1, tokBytes = 1;
  CHECK(xcclCommDeviceRecvTokensSize(comm, &maxTokens, &tokBytes));
  if (maxTokens != 0 || tokBytes != 0)
    FAIL("xcclCommDeviceRecvTokensSize on an attention rank: %zu tokens, %zu bytes", maxTokens, tokBytes);
  CU(cu.stream_create(&raw, 1 /* CU_STREAM_NON_BLOCKING */));
  stream = (xcclCudaStream_t)raw;
  for (pair = 0; pair < PAIRS; pair++) {
    int T = tokens_of(rank, pair), t, h;
    float x[MAX_TOKENS * HIDDEN], xd[MAX_TOKENS * HIDDEN], w[MAX_TOKENS * TOPK];
    float host_out[MAX_TOKENS * HIDDEN], dev_out[MAX_TOKENS * HIDDEN];
    int idx[MAX_TOKENS * TOPK];
    int routing_on_device = pair % 2 == 0;
    xcclCudaStream_t s = (pair / 2) % 2 == 0 ? stream : NULL;
    xcclA2EHandle_t h1 = NULL, h2 = NULL;
    inputs(rank, pair, T, x, xd, idx, w);
    /* Host calls. */
    CHECK(xcclA2ESend(comm, xd, T, idx, w, &h1));
    CHECK(xcclE2ARecv(comm, h1, host_out));
    /* Device calls on the same inputs. */
    h2d(dx, xd, T * row);
    h2d(didx, idx, T * TOPK * sizeof(int));
    h2d(dw, w, T * TOPK * sizeof(float));
    if (pair == 0) attention_refusals(comm, T, dx, didx, dw, ndev, xd, idx, w);
    if (pair == 1) driver_error_is_retryable(xcclA2ESendDevice(comm, dx, T, idx, w, xcclMemoryHost, s, &h2));
    if (routing_on_device)
      CHECK(xcclA2ESendDevice(comm, dx, T, didx, dw, xcclMemoryDevice, s, &h2));
    else
      CHECK(xcclA2ESendDevice(comm, dx, T, idx, w, xcclMemoryHost, s, &h2));
    if (pair == 0) {
      float hostbuf[MAX_TOKENS * HIDDEN];
      void* shortout = dalloc(T * row - 1);
      /* Refused outputs leave the handle valid. */
      EXPECT_INVALID(xcclE2ARecvDevice(comm, h2, NULL, s), "out is NULL", "xcclE2ARecvDevice");
      EXPECT_INVALID(xcclE2ARecvDevice(comm, h2, hostbuf, s), "out: ", "not device memory");
      EXPECT_INVALID(xcclE2ARecvDevice(comm, h2, shortout, s), "out: ", "past the end");
      EXPECT_INVALID(xcclE2ARecv(comm, h2, dout), "out (", "is device memory");
      dfree(shortout);
    }
    memset(dev_out, 0xff, sizeof dev_out);
    if (pair == MIXED_PAIR) {
      /* A handle of xcclA2ESendDevice received by the host call. */
      CHECK(xcclE2ARecv(comm, h2, dev_out));
    } else {
      CHECK(xcclE2ARecvDevice(comm, h2, dout, s));
      d2h(dev_out, dout, T * row);
    }
    same_bits(dev_out, host_out, (size_t)T * HIDDEN, pair, "device out");
    for (t = 0; t < T; t++)
      for (h = 0; h < HIDDEN; h++) {
        float want = approx(t, h, x, idx, w), got = get(host_out, (size_t)(t * HIDDEN + h));
        float d = got - want, mag = want < 0 ? -want : want;
        float tol = g_int8 ? 0.06f + 0.02f * mag : g_bf16 ? 0.01f + 0.02f * mag : 1e-4f;
        if (d < -tol || d > tol)
          FAIL("pair %d: out[%d][%d] = %.9g, about %.9g expected", pair, t, h, (double)got, (double)want);
      }
  }
  CU(cu.stream_destroy(raw));
  dfree(dx);
  dfree(dout);
  dfree(didx);
  dfree(dw);
}

/* ---- expert rank ---- */

/* The expert outputs of the batch's rows `rows` into `y` (host memory, config.dtype). */
static void compute(const xcclExpertBatchInfo_t* info, const void* rows, const int* experts, void* y) {
  size_t j, r, h;
  for (j = 0; j < info->numLocalExperts; j++)
    for (r = info->expertOffsets[j]; r < info->expertOffsets[j + 1]; r++)
      for (h = 0; h < HIDDEN; h++) set(y, r * HIDDEN + h, expert_out(experts[j], get(rows, r * HIDDEN + h)));
}

#define MAX_ROWS (4 * MAX_TOKENS * TOPK)

/* What a host receive gave, kept to compare with the device receive of the same inputs. */
typedef struct {
  size_t numRows, numTokens;
  size_t offsets[NUM_EXPERTS + 1];
  uint32_t srcRank[MAX_ROWS], srcToken[MAX_ROWS];
  float weights[MAX_ROWS];
  float rows[MAX_ROWS * HIDDEN];
} Kept;

/* ---- expert rank, token-major ---- */

/* What a host token-major receive gave, kept to compare with the device receive of the same
 * inputs token by token: the batch's order is the arrival order, which may differ between the
 * two, so `at[srcRank][srcToken]` is the kept token's index (+1; 0: not received). */
typedef struct {
  size_t numTokens;
  size_t at[8][MAX_TOKENS];
  uint32_t expertCount[4 * MAX_TOKENS], localExperts[4 * MAX_TOKENS * TOPK];
  float weights[4 * MAX_TOKENS * TOPK];
  float rows[4 * MAX_TOKENS * HIDDEN];
} KeptTokens;

/* The kept token `srcRank`/`srcToken` (its index), or FAIL naming `what`. */
static size_t kept_token(const KeptTokens* k, uint32_t srcRank, uint32_t srcToken, const char* what) {
  if (srcRank >= 8 || srcToken >= MAX_TOKENS || k->at[srcRank][srcToken] == 0)
    FAIL("%s: token %u of rank %u is not in the host batch", what, srcToken, srcRank);
  return k->at[srcRank][srcToken] - 1;
}

/* Token i of `info` (rows `rows`, host memory) equals its kept twin bit for bit. */
static void same_token(const KeptTokens* k, const xcclTokenBatchInfo_t* info, size_t i,
                       const void* rows, int pair, const char* what) {
  size_t j = kept_token(k, info->srcRank[i], info->srcToken[i], what);
  size_t n = info->expertCount[i];
  if (n != k->expertCount[j] ||
      memcmp(&info->localExperts[i * TOPK], &k->localExperts[j * TOPK], n * sizeof(uint32_t)) != 0 ||
      memcmp(&info->weights[i * TOPK], &k->weights[j * TOPK], n * sizeof(float)) != 0)
    FAIL("pair %d: %s: token %zu's experts or weights differ from the host batch's", pair, what, i);
  if (memcmp(rows, (const char*)k->rows + j * HIDDEN * g_esz, HIDDEN * g_esz) != 0)
    FAIL("pair %d: %s: token %zu's row (rank %u token %u) differs from the host batch's", pair,
         what, i, info->srcRank[i], info->srcToken[i]);
}

/* Each token's reply: its local experts' outputs summed with its gating weights, into `y`
 * (config.dtype; `rows` too). */
static void reduce_tokens(const xcclTokenBatchInfo_t* info, const void* rows, const int* experts, void* y) {
  size_t t, k, h;
  for (t = 0; t < info->numTokens; t++)
    for (h = 0; h < HIDDEN; h++) {
      float acc = 0.0f;
      for (k = 0; k < info->expertCount[t]; k++) {
        float p = info->weights[t * TOPK + k] *
                  expert_out(experts[info->localExperts[t * TOPK + k]], get(rows, t * HIDDEN + h));
        acc += p;
      }
      set(y, t * HIDDEN + h, acc);
    }
}

/* What the arrival callback of a device receive checks against. */
typedef struct {
  const KeptTokens* kept;
  const void* dout;
  int pair, calls;
  size_t seen[4 * MAX_TOKENS];
} Arrivals;

/* The arrival callback: the arrived tokens' rows are in `out` already (read them there). */
static void on_arrival(void* user, const xcclTokenBatchInfo_t* arrived, size_t first, size_t n) {
  Arrivals* a = (Arrivals*)user;
  float row[HIDDEN];
  size_t i;
  a->calls++;
  if (arrived->rows != NULL) FAIL("pair %d: a device receive's arrival info.rows is not NULL", a->pair);
  for (i = first; i < first + n; i++) {
    if (i >= 4 * MAX_TOKENS || a->seen[i]++ != 0) FAIL("pair %d: token %zu arrived twice", a->pair, i);
    d2h(row, (const char*)a->dout + i * HIDDEN * g_esz, HIDDEN * g_esz);
    same_token(a->kept, arrived, i, row, a->pair, "arrival callback");
  }
}

/* Every refused argument of the token-major device receive (nothing is consumed). */
static void token_recv_refusals(xcclComm_t comm, void* dtok, size_t tokBytes, int ndev, xcclCudaStream_t s) {
  size_t row = HIDDEN * g_esz;
  float hostbuf[HIDDEN];
  xcclTokenBatch_t b = NULL;
  void* other = ndev > 1 ? dalloc_on(1, tokBytes) : NULL;
  EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &b, NULL, tokBytes, s, NULL, NULL), "out is NULL",
                 "xcclA2ERecvTokensDevice");
  EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &b, hostbuf, tokBytes, s, NULL, NULL), "out: ",
                 "not device memory");
  EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &b, dtok, tokBytes - 1, s, NULL, NULL), "outBytes",
                 "xcclCommDeviceRecvTokensSize");
  EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &b, dtok, tokBytes + row, s, NULL, NULL), "out: ",
                 "past the end");
  EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, NULL, dtok, tokBytes, s, NULL, NULL), "batch", "NULL");
  if (other != NULL) {
    EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &b, other, tokBytes, s, NULL, NULL), "out: ",
                   "is memory of CUDA device");
    dfree(other);
  }
  if (b != NULL) FAIL("a refused receive wrote a batch");
}

/* One token-major pair on an expert rank: the host calls, then the device calls on the same
 * inputs; `dtok` and `dred` hold tokBytes each. */
static void expert_tokens(xcclComm_t comm, int pair, int ndev, const int* experts, void* dtok,
                          size_t tokBytes, void* dred, xcclCudaStream_t s) {
  size_t row = HIDDEN * g_esz, i;
  static KeptTokens kept;
  static float rows[4 * MAX_TOKENS * HIDDEN], y[4 * MAX_TOKENS * HIDDEN];
  static Arrivals arr;
  xcclTokenBatch_t b = NULL;
  xcclTokenBatchInfo_t info;
  int with_callback = pair % 2 == 1;
  /* Host calls. */
  CHECK(xcclA2ERecvTokens(comm, &b));
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(xcclTokenBatchGetInfo(b, &info));
  if (info.numTokens * row > tokBytes) FAIL("a host batch larger than xcclCommDeviceRecvTokensSize");
  memset(&kept, 0, sizeof kept);
  kept.numTokens = info.numTokens;
  for (i = 0; i < info.numTokens; i++) {
    if (info.srcRank[i] >= 8 || info.srcToken[i] >= MAX_TOKENS) FAIL("token %zu: bad source", i);
    kept.at[info.srcRank[i]][info.srcToken[i]] = i + 1;
  }
  memcpy(kept.expertCount, info.expertCount, info.numTokens * sizeof(uint32_t));
  memcpy(kept.localExperts, info.localExperts, info.numTokens * TOPK * sizeof(uint32_t));
  memcpy(kept.weights, info.weights, info.numTokens * TOPK * sizeof(float));
  if (info.numTokens > 0) memcpy(kept.rows, info.rows, info.numTokens * row);
  reduce_tokens(&info, kept.rows, experts, y);
  if (pair == MIXED_TOKEN_PAIR) {
    /* A batch of xcclA2ERecvTokens answered by the device call. */
    h2d(dred, y, info.numTokens * row);
    CHECK(xcclE2ASendTokensDevice(comm, b, dred, s));
  } else {
    CHECK(xcclE2ASendTokens(comm, b, y));
  }
  /* Device calls on the same inputs. */
  b = NULL;
  if (pair == TOKEN_PAIR) token_recv_refusals(comm, dtok, tokBytes, ndev, s);
  if (pair == TOKEN_PAIR + 1)
    driver_error_is_retryable(xcclA2ERecvTokensDevice(comm, &b, dtok, tokBytes, s, NULL, NULL));
  memset(&arr, 0, sizeof arr);
  arr.kept = &kept;
  arr.dout = dtok;
  arr.pair = pair;
  if (with_callback)
    CHECK(xcclA2ERecvTokensDevice(comm, &b, dtok, tokBytes, s, on_arrival, &arr));
  else
    CHECK(xcclA2ERecvTokensDevice(comm, &b, dtok, tokBytes, s, NULL, NULL));
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(xcclTokenBatchGetInfo(b, &info));
  if (info.rows != NULL) FAIL("pair %d: a device token batch's info.rows is not NULL", pair);
  if (info.numTokens != kept.numTokens)
    FAIL("pair %d: %zu tokens on the device, %zu on the host", pair, info.numTokens, kept.numTokens);
  if (with_callback) {
    if (arr.calls == 0 || (size_t)arr.calls > info.numSources)
      FAIL("pair %d: %d arrival callbacks for %zu sources", pair, arr.calls, info.numSources);
    for (i = 0; i < info.numTokens; i++)
      if (arr.seen[i] != 1) FAIL("pair %d: token %zu was in no arrival callback", pair, i);
  }
  d2h(rows, dtok, info.numTokens * row);
  for (i = 0; i < info.numTokens; i++) same_token(&kept, &info, i, (const char*)rows + i * row, pair, "device batch");
  reduce_tokens(&info, rows, experts, y);
  h2d(dred, y, info.numTokens * row);
  if (pair == TOKEN_PAIR && info.numTokens > 0)
    send_refusals(xcclE2ASendTokensDevice, xcclE2ASendTokens, "reduced", b, y, dred, info.numTokens * row, s);
  if (pair == MIXED_TOKEN_PAIR)
    CHECK(xcclE2ASendTokens(comm, b, y)); /* a batch of xcclA2ERecvTokensDevice, host reply */
  else
    CHECK(xcclE2ASendTokensDevice(comm, b, dred, s));
}

static void expert(xcclComm_t comm, int ndev, int nranks) {
  size_t row = HIDDEN * g_esz, maxRows = 0, outBytes = 0, maxTokens = 0, tokBytes = 0;
  int experts[NUM_EXPERTS], nlocal = 0, pair;
  void* dout;
  void* dy;
  void* dtok;
  void* dred;
  void* raw = NULL;
  xcclCudaStream_t stream;
  static Kept kept;
  static float rows[MAX_ROWS * HIDDEN], y[MAX_ROWS * HIDDEN];
  CHECK(xcclCommLocalExperts(comm, &nlocal, experts));
  CHECK(xcclCommDeviceRecvSize(comm, &maxRows, &outBytes));
  {
    size_t per_token = (size_t)(nlocal < TOPK ? nlocal : TOPK);
    if (maxRows != (size_t)(nranks / 2) * MAX_TOKENS * per_token || outBytes != maxRows * row)
      FAIL("xcclCommDeviceRecvSize: %zu rows, %zu bytes", maxRows, outBytes);
    if (maxRows > MAX_ROWS) FAIL("more rows than the test holds");
  }
  CHECK(xcclCommDeviceRecvTokensSize(comm, &maxTokens, &tokBytes));
  if (maxTokens != (size_t)(nranks / 2) * MAX_TOKENS || tokBytes != maxTokens * row)
    FAIL("xcclCommDeviceRecvTokensSize: %zu tokens, %zu bytes", maxTokens, tokBytes);
  if (maxTokens > 4 * MAX_TOKENS) FAIL("more tokens than the test holds");
  dout = dalloc(outBytes);
  dy = dalloc(outBytes);
  dtok = dalloc(tokBytes);
  dred = dalloc(tokBytes);
  CU(cu.stream_create(&raw, 1));
  stream = (xcclCudaStream_t)raw;
  for (pair = 0; pair < PAIRS; pair++) {
    xcclExpertBatch_t b = NULL;
    xcclExpertBatchInfo_t info;
    xcclCudaStream_t s = (pair / 2) % 2 == 0 ? stream : NULL;
    if (pair >= TOKEN_PAIR) {
      expert_tokens(comm, pair, ndev, experts, dtok, tokBytes, dred, s);
      continue;
    }
    /* Host calls. */
    CHECK(xcclA2ERecv(comm, &b));
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(xcclExpertBatchGetInfo(b, &info));
    kept.numRows = info.numRows;
    kept.numTokens = info.numTokens;
    memcpy(kept.offsets, info.expertOffsets, (info.numLocalExperts + 1) * sizeof(size_t));
    memcpy(kept.srcRank, info.srcRank, info.numRows * sizeof(uint32_t));
    memcpy(kept.srcToken, info.srcToken, info.numRows * sizeof(uint32_t));
    memcpy(kept.weights, info.weights, info.numRows * sizeof(float));
    if (info.numRows > 0) memcpy(kept.rows, info.rows, info.numRows * row);
    compute(&info, kept.rows, experts, y);
    CHECK(xcclE2ASend(comm, b, y));
    /* Device calls on the same inputs. */
    b = NULL;
    if (pair == 0) {
      float hostbuf[HIDDEN];
      void* other = ndev > 1 ? dalloc_on(1, outBytes) : NULL;
      EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, NULL, outBytes, s), "out is NULL", "xcclA2ERecvDevice");
      EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, hostbuf, outBytes, s), "out: ", "not device memory");
      EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, dout, outBytes - 1, s), "outBytes", "xcclCommDeviceRecvSize");
      EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, dout, outBytes + row, s), "out: ", "past the end");
      EXPECT_INVALID(xcclA2ERecvDevice(comm, NULL, dout, outBytes, s), "batch", "NULL");
      if (other != NULL) {
        EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, other, outBytes, s), "out: ", "is memory of CUDA device");
        dfree(other);
      }
      if (b != NULL) FAIL("a refused receive wrote a batch");
    }
    if (pair == 1) driver_error_is_retryable(xcclA2ERecvDevice(comm, &b, dout, outBytes, s));
    CHECK(xcclA2ERecvDevice(comm, &b, dout, outBytes, s));
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(xcclExpertBatchGetInfo(b, &info));
    if (info.rows != NULL) FAIL("pair %d: a device batch's info.rows is not NULL", pair);
    if (info.numRows != kept.numRows || info.numTokens != kept.numTokens ||
        memcmp(info.expertOffsets, kept.offsets, (info.numLocalExperts + 1) * sizeof(size_t)) != 0 ||
        memcmp(info.srcRank, kept.srcRank, info.numRows * sizeof(uint32_t)) != 0 ||
        memcmp(info.srcToken, kept.srcToken, info.numRows * sizeof(uint32_t)) != 0 ||
        memcmp(info.weights, kept.weights, info.numRows * sizeof(float)) != 0)
      FAIL("pair %d: the device batch's metadata differs from the host batch's", pair);
    d2h(rows, dout, info.numRows * row);
    same_bits(rows, kept.rows, info.numRows * HIDDEN, pair, "device row");
    compute(&info, rows, experts, y);
    h2d(dy, y, info.numRows * row);
    if (pair == 0 && info.numRows > 0)
      send_refusals(xcclE2ASendDevice, xcclE2ASend, "expertOut", b, y, dy, info.numRows * row, s);
    if (pair == MIXED_PAIR)
      CHECK(xcclE2ASend(comm, b, y)); /* a batch of xcclA2ERecvDevice replied by the host call */
    else
      CHECK(xcclE2ASendDevice(comm, b, dy, s));
  }
  CU(cu.stream_destroy(raw));
  dfree(dout);
  dfree(dy);
  dfree(dtok);
  dfree(dred);
}

/* ---- a host communicator ---- */

static void on_shm(xcclComm_t comm, int role, int rank) {
  int dev = 7;
  size_t row = HIDDEN * sizeof(float);
  void* d = dalloc(MAX_TOKENS * row);
  xcclA2EHandle_t h = NULL;
  xcclExpertBatch_t b = NULL;
  xcclTokenBatch_t tb = NULL;
  CHECK(xcclCommCuDevice(comm, &dev));
  if (dev != -1) FAIL("xcclCommCuDevice on shm: %d", dev);
  if (role == xcclRoleAttention) {
    int T = tokens_of(rank, 0);
    float x[MAX_TOKENS * HIDDEN], w[MAX_TOKENS * TOPK], out[MAX_TOKENS * HIDDEN], want[MAX_TOKENS * HIDDEN];
    int idx[MAX_TOKENS * TOPK];
    make_inputs(rank, 0, T, x, idx, w);
    EXPECT_INVALID(xcclA2ESendDevice(comm, d, T, idx, w, xcclMemoryHost, NULL, &h), "cuda fabric",
                   "shm fabric");
    EXPECT_INVALID(xcclE2ARecvDevice(comm, h, d, NULL), "cuda fabric", "xcclE2ARecvDevice");
    /* Nothing was sent: a host round works. */
    CHECK(xcclA2ESend(comm, x, T, idx, w, &h));
    CHECK(xcclE2ARecv(comm, h, out));
    reference(T, x, idx, w, want);
    compare(0, T, out, want);
  } else {
    xcclExpertBatchInfo_t info;
    static float y[MAX_ROWS * HIDDEN];
    int experts[NUM_EXPERTS], nlocal = 0;
    size_t j, r;
    int k;
    EXPECT_INVALID(xcclA2ERecvDevice(comm, &b, d, MAX_TOKENS * row, NULL), "cuda fabric", "xcclA2ERecvDevice");
    EXPECT_INVALID(xcclA2ERecvTokensDevice(comm, &tb, d, MAX_TOKENS * row, NULL, NULL, NULL), "cuda fabric",
                   "xcclA2ERecvTokensDevice");
    EXPECT_INVALID(xcclE2ASendTokensDevice(comm, tb, d, NULL), "cuda fabric", "xcclE2ASendTokensDevice");
    if (tb != NULL) FAIL("a refused receive wrote a batch");
    CHECK(xcclCommLocalExperts(comm, &nlocal, experts));
    CHECK(xcclA2ERecv(comm, &b));
    EXPECT_INVALID(xcclE2ASendDevice(comm, b, d, NULL), "cuda fabric", "xcclE2ASendDevice");
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(xcclExpertBatchGetInfo(b, &info));
    for (j = 0; j < info.numLocalExperts; j++)
      for (r = info.expertOffsets[j]; r < info.expertOffsets[j + 1]; r++)
        for (k = 0; k < HIDDEN; k++)
          y[r * HIDDEN + k] = expert_fn(experts[j], ((const float*)info.rows)[r * HIDDEN + k]);
    CHECK(xcclE2ASend(comm, b, y));
  }
  dfree(d);
}

int main(int argc, char** argv) {
  const char* mode;
  int ndev = 1, role = -1, dev = -1, shift = 4;
  Args a;
  xcclConfig_t cfg;
  xcclComm_t comm;
  if (argc < 3 || strcmp(argv[1], "--mode") != 0) FAIL("usage: %s --mode M [--devices N] ...", argv[0]);
  mode = argv[2];
  if (argc >= 5 && strcmp(argv[3], "--devices") == 0)
    ndev = atoi(argv[4]);
  else
    shift = 2;
  argv[shift] = argv[0];
  a = parse_args(argc - shift, argv + shift);
  cfg = test_config(a.nranks);
  g_standin = getenv("CUDA_STANDIN_DEVICES") != NULL;
  g_int8 = getenv("XCCL_TEST_QUANT") != NULL && strcmp(getenv("XCCL_TEST_QUANT"), "int8") == 0;
  g_bf16 = getenv("XCCL_TEST_DTYPE") != NULL && strcmp(getenv("XCCL_TEST_DTYPE"), "bf16") == 0;
  if (g_bf16) {
    cfg.dtype = xcclBfloat16;
    g_esz = 2;
  }
  if (g_int8) {
    cfg.a2eQuant = xcclQuantInt8;
    cfg.e2aQuant = xcclQuantInt8;
  }
  if (strcmp(mode, "nodriver") == 0) {
    xcclComm_t c = NULL;
    xcclResult_t r;
    cfg.fabric = "cuda";
    r = a.env ? xcclCommInitFromEnv(&c, &cfg) : xcclCommInitRankConfig(&c, a.nranks, a.id, a.rank, &cfg);
    if ((r != xcclUnavailable && r != xcclAborted) || c != NULL ||
        strstr(xcclGetLastError(NULL), "libcuda.so.1") == NULL)
      FAIL("init without a driver returned %d: %s", (int)r, xcclGetLastError(NULL));
    printf("rank %d: %s\n", a.rank, xcclGetLastError(NULL));
    printf("rank %d: ok\n", a.rank);
    return 0;
  }
  driver_open(a.rank % ndev, (a.rank + 1) % ndev);
  if (strcmp(mode, "cuda") == 0) {
    cfg.fabric = "cuda";
    cfg.device = a.rank % ndev;
  } else if (strcmp(mode, "shm") != 0) {
    FAIL("unknown mode %s", mode);
  }
  comm = init_comm(&a, &cfg);
  CHECK(xcclCommRole(comm, &role));
  if (strcmp(mode, "shm") == 0) {
    on_shm(comm, role, a.rank);
  } else {
    CHECK(xcclCommCuDevice(comm, &dev));
    if (dev != a.rank % ndev) FAIL("xcclCommCuDevice: %d, config.device %d", dev, a.rank % ndev);
    if (role == xcclRoleAttention)
      attention(comm, a.rank, ndev);
    else
      expert(comm, ndev, a.nranks);
  }
  CHECK(xcclCommDestroy(comm));
  printf("rank %d: ok\n", a.rank);
  return 0;
}
