// C++17 test of the C ABI (built by tests/tests/capi.rs with g++ -std=c++17 -Wall -Wextra
// -Werror): an explicit expert placement with replicas, the zero-copy forms (registered A2E
// input, registered E2A output) with two calls in flight, in f32 or (--bf16) bfloat16, checked
// bit for bit, and RAII ownership of the communicator.
//
// In bf16 the reference is the exact f32 result rounded once to bf16: each token has two
// experts, and a contribution of one expert (w * x * (e + 1), a small integer times a power of
// two) is exact in bf16, so the documented roundings (once per expert rank, once on the
// attention rank when several contributions are summed) reduce to one rounding of the exact
// sum.
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "xccl.h"  // a third time, from C++

namespace {

// Owns a communicator; destroys it on scope exit.
struct CommDeleter {
  void operator()(xcclComm* c) const { xcclCommDestroy(c); }
};
using Comm = std::unique_ptr<xcclComm, CommDeleter>;

constexpr int kRounds = 6;

// Element types: f32 as is, bf16 as its bits (round to nearest even; no NaNs here).
struct Bf16 {
  uint16_t bits;
};
inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename E>
E from_float(float f);
template <>
float from_float<float>(float f) {
  return f;
}
template <>
Bf16 from_float<Bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

template <typename E>
void attention(xcclComm_t comm, int rank) {
  for (int round = 0; round < kRounds; round += 2) {
    xcclA2EHandle_t handles[2] = {nullptr, nullptr};
    std::vector<E> want[2];
    int T[2];
    for (int i = 0; i < 2; i++) {
      int r = round + i;
      T[i] = tokens_of(rank, r);
      std::vector<float> x(MAX_TOKENS * HIDDEN), w(MAX_TOKENS * TOPK);
      std::vector<int> idx(MAX_TOKENS * TOPK);
      make_inputs(rank, r, T[i], x.data(), idx.data(), w.data());
      std::vector<float> exact(MAX_TOKENS * HIDDEN);
      reference(T[i], x.data(), idx.data(), w.data(), exact.data());
      for (float v : exact) want[i].push_back(from_float<E>(v));
      void* input = nullptr;
      CHECK(xcclA2EInput(comm, &input));
      for (int k = 0; k < T[i] * HIDDEN; k++) static_cast<E*>(input)[k] = from_float<E>(x[k]);
      CHECK(xcclA2ESendInput(comm, T[i], idx.data(), w.data(), &handles[i]));
    }
    // A third call in flight fails at once and changes nothing.
    xcclA2EHandle_t extra = nullptr;
    EXPECT(xcclA2ESendInput(comm, 0, nullptr, nullptr, &extra), xcclInvalidArgument);
    // E2A completes in A2E order: the newer handle first is rejected; both stay valid.
    std::vector<E> out(MAX_TOKENS * HIDDEN);
    EXPECT(xcclE2ARecv(comm, handles[1], out.data()), xcclInvalidArgument);
    for (int i = 0; i < 2; i++) {
      CHECK(xcclE2ARecv(comm, handles[i], out.data()));
      if (std::memcmp(out.data(), want[i].data(), static_cast<size_t>(T[i]) * HIDDEN * sizeof(E)) != 0)
        for (int k = 0; k < T[i] * HIDDEN; k++)
          if (std::memcmp(&out[k], &want[i][k], sizeof(E)) != 0)
            FAIL("round %d: out[%d][%d] = %.9g, expected %.9g", round + i, k / HIDDEN, k % HIDDEN,
                 static_cast<double>(to_float(out[k])), static_cast<double>(to_float(want[i][k])));
    }
  }
}

// Token i's reply: acc = 0; acc += w_c * expert_c(row) over its local experts, one rounding.
template <typename E>
E reduce_token(const xcclTokenBatchInfo_t& info, const std::vector<int>& experts, size_t i, int h) {
  auto* rows = static_cast<const E*>(info.rows);
  float acc = 0.0f;
  for (uint32_t c = 0; c < info.expertCount[i]; c++) {
    int e = experts.at(info.localExperts[i * info.topk + c]);
    acc += info.weights[i * info.topk + c] * expert_fn(e, to_float(rows[i * HIDDEN + h]));
  }
  return from_float<E>(acc);
}

// What the arrival callback computed: replies of the tokens that have landed.
template <typename E>
struct Early {
  xcclComm_t comm;
  const std::vector<int>* experts;
  std::vector<E> reduced;
  std::vector<int> covered;  // per token: how many callbacks covered it
};

template <typename E>
void on_arrival(void* user, const xcclTokenBatchInfo_t* arrived, size_t first, size_t n) {
  auto* early = static_cast<Early<E>*>(user);
  // Calls on the receiving communicator from here fail instead of deadlocking.
  int count = 0;
  if (xcclCommUserRank(early->comm, &count) != xcclSuccess) std::abort();  // queries are fine
  xcclTokenBatch_t b = nullptr;
  if (xcclA2ERecvTokens(early->comm, &b) != xcclInvalidUsage) std::abort();
  early->reduced.resize(arrived->numTokens * HIDDEN);
  early->covered.resize(arrived->numTokens);
  for (size_t i = first; i < first + n; i++) {
    early->covered[i]++;
    for (int h = 0; h < HIDDEN; h++) early->reduced[i * HIDDEN + h] = reduce_token<E>(*arrived, *early->experts, i, h);
  }
}

template <typename E>
void expert(xcclComm_t comm, const std::vector<int>& experts) {
  for (int round = 0; round < kRounds; round += 2) {
    // The first call of each pair computes its replies in the arrival callback.
    Early<E> early{comm, &experts, {}, {}};
    xcclTokenBatch_t batches[2] = {nullptr, nullptr};
    CHECK(xcclA2ERecvTokensWithCallback(comm, &batches[0], on_arrival<E>, &early));
    CHECK(xcclA2ERecvTokens(comm, &batches[1]));
    for (int k = 0; k < 2; k++) {
      xcclTokenBatch_t b = batches[k];
      xcclTokenBatchInfo_t info;
      info.size = sizeof info;
      CHECK(xcclTokenBatchGetInfo(b, &info));
      void* output = nullptr;
      CHECK(xcclE2AOutput(comm, b, &output));
      auto* red = static_cast<E*>(output);
      if (k == 0) {
        early.covered.resize(info.numTokens);
        for (size_t i = 0; i < info.numTokens; i++)
          if (early.covered[i] != 1) FAIL("token %zu was in %d arrival callbacks", i, early.covered[i]);
        if (info.numTokens > 0) std::memcpy(red, early.reduced.data(), info.numTokens * HIDDEN * sizeof(E));
      } else {
        for (size_t i = 0; i < info.numTokens; i++)
          for (int h = 0; h < HIDDEN; h++) red[i * HIDDEN + h] = reduce_token<E>(info, experts, i, h);
      }
      CHECK(xcclE2ASendOutput(comm, b));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // --bf16 (first) selects bfloat16 rows; the rest are the common arguments.
  const bool bf16 = argc > 1 && std::strcmp(argv[1], "--bf16") == 0;
  if (bf16) {
    argv[1] = argv[0];
    argv++;
    argc--;
  }
  Args a = parse_args(argc, argv);
  xcclConfig_t cfg = test_config(a.nranks);
  if (bf16) cfg.dtype = xcclBfloat16;
  // Explicit placement over the expert ranks (m..n-1): expert e on m + e % nexp, experts 0 and
  // 3 with a second replica on the next expert rank.
  const int m = a.nranks / 2, nexp = a.nranks - m;
  std::vector<int> counts, ranks;
  for (int e = 0; e < NUM_EXPERTS; e++) {
    counts.push_back(1);
    ranks.push_back(m + e % nexp);
    if ((e == 0 || e == 3) && nexp > 1) {
      counts.back() = 2;
      ranks.push_back(m + (e + 1) % nexp);
    }
  }
  cfg.placementCounts = counts.data();
  cfg.placementRanks = ranks.data();
  cfg.transferMode = xcclTransferPull;

  Comm comm(init_comm(&a, &cfg));
  int role = -1, nlocal = 0;
  CHECK(xcclCommRole(comm.get(), &role));
  CHECK(xcclCommLocalExperts(comm.get(), &nlocal, nullptr));
  std::vector<int> experts(static_cast<size_t>(nlocal));
  CHECK(xcclCommLocalExperts(comm.get(), &nlocal, experts.data()));
  // Before the rounds: once a peer has finished and left, it counts as failed.
  xcclResult_t async = xcclInternalError;
  CHECK(xcclCommGetAsyncError(comm.get(), &async));
  if (async != xcclSuccess) FAIL("async error %d", static_cast<int>(async));
  size_t rowBytes = 0, maxTokens = 0, maxRows = 0;
  CHECK(xcclCommBufferSizes(comm.get(), &rowBytes, &maxTokens, &maxRows));
  if (rowBytes != HIDDEN * (bf16 ? 2u : 4u)) FAIL("rowBytes %zu", rowBytes);
  if (role == xcclRoleAttention && bf16)
    attention<Bf16>(comm.get(), a.rank);
  else if (role == xcclRoleAttention)
    attention<float>(comm.get(), a.rank);
  else if (bf16)
    expert<Bf16>(comm.get(), experts);
  else
    expert<float>(comm.get(), experts);
  std::printf("rank %d: ok\n", a.rank);
  return 0;
}
