/* C11 test of INT8 on the wire through the C ABI (config version 2): 1 attention rank and 1
 * expert rank. The attention rank sends with a2eQuant = xcclQuantInt8; the expert keeps the rows
 * as INT8 (keepInt8 = 1) and checks every value and scale against the quantizer the header
 * specifies, replayed here; its replies (each token's rows weighted and summed from the
 * dequantized values) go back in f32, and the attention rank checks them bit for bit against the
 * same replay. Built by tests/tests/capi.rs with gcc -std=c11 -Wall -Wextra -Werror. */
#include <stdint.h>

#include "common.h"

/* The specified quantizer: scale = amax / 127; q = clamp(round_half_even(x * (127 / amax))).
 * Rounding to nearest even by adding and subtracting 1.5 * 2^23 (|x * inv| <= 127). */
static void quantize(const float* x, int8_t* q, float* scale) {
  float amax = 0.0f, inv;
  int h;
  for (h = 0; h < HIDDEN; h++) {
    float a = x[h] < 0 ? -x[h] : x[h];
    if (a > amax) amax = a;
  }
  if (amax == 0.0f) {
    memset(q, 0, HIDDEN);
    *scale = 0.0f;
    return;
  }
  inv = 127.0f / amax;
  for (h = 0; h < HIDDEN; h++) {
    volatile float r = x[h] * inv + 12582912.0f;
    int v = (int)(r - 12582912.0f);
    q[h] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
  }
  *scale = amax / 127.0f;
}

/* Token t's reply as the expert computes it from the dequantized row. */
static void reply(const int8_t* q, float scale, const int* experts, const xcclTokenBatchInfo_t* info,
                  size_t i, float* out) {
  int h;
  uint32_t c;
  for (h = 0; h < HIDDEN; h++) {
    float acc = 0.0f, v = (float)q[h] * scale;
    for (c = 0; c < info->expertCount[i]; c++)
      acc += info->weights[i * info->topk + c] * expert_fn(experts[info->localExperts[i * info->topk + c]], v);
    out[h] = acc;
  }
}

int main(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  xcclConfig_t cfg = test_config(a.nranks);
  xcclComm_t comm;
  int role = -1, nlocal = 0, experts[NUM_EXPERTS];
  int round;
  if (cfg.version != 4u || cfg.a2eQuant != XCCL_CONFIG_UNDEF_INT || cfg.recvCapacity != XCCL_CONFIG_UNDEF_INT ||
      cfg.role != XCCL_CONFIG_UNDEF_INT || cfg.ofiInterface != NULL)
    FAIL("initializer of version 4");
  cfg.a2eQuant = xcclQuantInt8;
  cfg.keepInt8 = 1;
  /* A value out of range names the field. */
  cfg.e2aQuant = 7;
  {
    xcclComm_t bad = NULL;
    xcclUniqueId none; /* names no job: a bad config with a real id would end the job */
    memset(&none, 0, sizeof none);
    EXPECT(xcclCommInitRankConfig(&bad, a.nranks, none, a.rank, &cfg), xcclInvalidArgument);
    if (strstr(xcclGetLastError(NULL), "e2aQuant") == NULL) FAIL("message: %s", xcclGetLastError(NULL));
  }
  cfg.e2aQuant = xcclQuantNone;
  comm = init_comm(&a, &cfg);
  CHECK(xcclCommRole(comm, &role));
  CHECK(xcclCommLocalExperts(comm, &nlocal, NULL));
  CHECK(xcclCommLocalExperts(comm, &nlocal, experts));
  for (round = 0; round < 4; round++) {
    int T = tokens_of(0, round), t, h;
    float x[MAX_TOKENS * HIDDEN], w[MAX_TOKENS * TOPK];
    int idx[MAX_TOKENS * TOPK];
    make_inputs(0, round, T, x, idx, w);
    /* Non-integer values, so the quantization is not exact. */
    for (t = 0; t < T * HIDDEN; t++) x[t] = x[t] * 0.37f + (float)(t % 5) * 0.011f;
    if (role == xcclRoleAttention) {
      xcclA2EHandle_t handle = NULL;
      float out[MAX_TOKENS * HIDDEN], want[MAX_TOKENS * HIDDEN];
      CHECK(xcclA2ESend(comm, x, T, idx, w, &handle));
      CHECK(xcclE2ARecv(comm, handle, out));
      for (t = 0; t < T; t++) {
        int8_t q[HIDDEN];
        float scale, acc[HIDDEN];
        int k;
        quantize(&x[t * HIDDEN], q, &scale);
        for (h = 0; h < HIDDEN; h++) {
          float v = (float)q[h] * scale;
          acc[h] = 0.0f;
          /* The expert's order: local experts ascending (contiguous placement: id order). */
          for (k = 0; k < NUM_EXPERTS; k++) {
            int s;
            float wk = 0.0f;
            int hit = 0;
            for (s = 0; s < TOPK; s++)
              if (idx[t * TOPK + s] == k) {
                wk += w[t * TOPK + s];
                hit = 1;
              }
            if (hit) acc[h] += wk * expert_fn(k, v);
          }
          want[t * HIDDEN + h] = acc[h];
        }
      }
      compare(round, T, out, want);
    } else {
      xcclTokenBatch_t batch = NULL;
      xcclTokenBatchInfo_t info;
      float reduced[MAX_TOKENS * HIDDEN];
      size_t i;
      CHECK(xcclA2ERecvTokens(comm, &batch));
      info.size = sizeof info;
      CHECK(xcclTokenBatchGetInfo(batch, &info));
      if (info.rows != NULL || (info.numTokens > 0 && (info.int8Rows == NULL || info.scales == NULL)))
        FAIL("round %d: keepInt8 must give int8Rows and scales, rows NULL", round);
      for (i = 0; i < info.numTokens; i++) {
        int8_t q[HIDDEN];
        float scale;
        quantize(&x[info.srcToken[i] * HIDDEN], q, &scale);
        if (memcmp(q, &info.int8Rows[i * HIDDEN], HIDDEN) != 0 || memcmp(&scale, &info.scales[i], 4) != 0)
          FAIL("round %d token %u: INT8 row or scale differs from the specified quantizer", round,
               info.srcToken[i]);
        reply(&info.int8Rows[i * HIDDEN], info.scales[i], experts, &info, i, &reduced[i * HIDDEN]);
      }
      CHECK(xcclE2ASendTokens(comm, batch, reduced));
    }
  }
  CHECK(xcclCommDestroy(comm));
  printf("rank %d: ok\n", a.rank);
  return 0;
}
