// C++17 test of the C ABI (built by tests/tests/capi.rs with g++ -std=c++17 -Wall -Wextra
// -Werror): an explicit expert placement with replicas, the zero-copy forms (registered A2E
// input, registered E2A output) with two calls in flight, checked bit for bit, and RAII
// ownership of the communicator.
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

void attention(xcclComm_t comm, int rank) {
  for (int round = 0; round < kRounds; round += 2) {
    xcclA2EHandle_t handles[2] = {nullptr, nullptr};
    std::vector<float> want[2];
    int T[2];
    for (int i = 0; i < 2; i++) {
      int r = round + i;
      T[i] = tokens_of(rank, r);
      std::vector<float> x(MAX_TOKENS * HIDDEN), w(MAX_TOKENS * TOPK);
      std::vector<int> idx(MAX_TOKENS * TOPK);
      make_inputs(rank, r, T[i], x.data(), idx.data(), w.data());
      want[i].resize(MAX_TOKENS * HIDDEN);
      reference(T[i], x.data(), idx.data(), w.data(), want[i].data());
      void* input = nullptr;
      CHECK(xcclA2EInput(comm, &input));
      std::memcpy(input, x.data(), static_cast<size_t>(T[i]) * HIDDEN * sizeof(float));
      CHECK(xcclA2ESendInput(comm, T[i], idx.data(), w.data(), &handles[i]));
    }
    // A third call in flight fails at once and changes nothing.
    xcclA2EHandle_t extra = nullptr;
    EXPECT(xcclA2ESendInput(comm, 0, nullptr, nullptr, &extra), xcclInvalidArgument);
    // E2A completes in A2E order: the newer handle first is rejected; both stay valid.
    std::vector<float> out(MAX_TOKENS * HIDDEN);
    EXPECT(xcclE2ARecv(comm, handles[1], out.data()), xcclInvalidArgument);
    for (int i = 0; i < 2; i++) {
      CHECK(xcclE2ARecv(comm, handles[i], out.data()));
      compare(round + i, T[i], out.data(), want[i].data());
    }
  }
}

void expert(xcclComm_t comm, const std::vector<int>& experts) {
  for (int round = 0; round < kRounds; round += 2) {
    xcclTokenBatch_t batches[2] = {nullptr, nullptr};
    for (auto& b : batches) CHECK(xcclA2ERecvTokens(comm, &b));
    for (auto b : batches) {
      xcclTokenBatchInfo_t info;
      CHECK(xcclTokenBatchGetInfo(b, &info));
      void* output = nullptr;
      CHECK(xcclE2AOutput(comm, b, &output));
      auto* red = static_cast<float*>(output);
      auto* rows = static_cast<const float*>(info.rows);
      for (size_t i = 0; i < info.numTokens; i++)
        for (int h = 0; h < HIDDEN; h++) {
          float acc = 0.0f;
          for (uint32_t c = 0; c < info.expertCount[i]; c++) {
            int e = experts.at(info.localExperts[i * info.topk + c]);
            acc += info.weights[i * info.topk + c] * expert_fn(e, rows[i * HIDDEN + h]);
          }
          red[i * HIDDEN + h] = acc;
        }
      CHECK(xcclE2ASendOutput(comm, b));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  xcclConfig_t cfg = test_config(a.nranks);
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
  if (role == xcclRoleAttention)
    attention(comm.get(), a.rank);
  else
    expert(comm.get(), experts);
  std::printf("rank %d: ok\n", a.rank);
  return 0;
}
