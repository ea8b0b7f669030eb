/*
 * xccl.h: the C ABI of xccl (libxccl.so / libxccl.a), token exchange between attention and
 * expert ranks for disaggregated Mixture-of-Experts serving.
 *
 * Shaped like NCCL: an opaque communicator, a 128-byte unique id, every call returns an
 * xcclResult_t and hands results back through out-parameters, a versioned config struct from an
 * initializer macro.
 *
 * General rules (they hold for every function below unless its comment says otherwise):
 * - Ownership: xccl never takes ownership of a caller's pointer and never keeps one after the
 *   call returns. Buffers passed in are read or written during the call only. Pointers xccl
 *   hands out (batch rows, registered buffers, strings) point into memory xccl owns; each
 *   comment says how long they stay valid.
 * - Errors: a NULL pointer argument is xcclInvalidArgument (an argument that may be NULL says
 *   so). A destroyed or unknown communicator, handle or batch is xcclInvalidUsage (handles are
 *   checked against a registry, never dereferenced). A communicator on which xcclCommAbort was
 *   called returns xcclAborted (from every call but xcclCommDestroy, xcclCommAbort,
 *   xcclCommGetAsyncError and xcclGetLastError). xcclGetLastError gives the message (which call, which
 *   rank or peer, which field): it is per thread, set by every failing call and cleared by
 *   every successful call on that thread (see xcclGetLastError). No function aborts or exits
 *   the process: an internal panic is xcclInternalError and poisons the communicator.
 * - Retryable vs poisoned: a call that fails before publishing anything to a peer (bad
 *   arguments, wrong role, too many calls in flight, a timeout waiting for a buffer or for the
 *   first rows) changes nothing: fix the cause and call again; handles and batches stay valid.
 *   Any other failure (a peer died or broke the protocol, an abort, a failure after data went
 *   out) poisons the communicator: the job is aborted (every peer's blocked call returns
 *   xcclAborted within milliseconds) and every later call on it returns the first error again.
 * - Thread safety: calls on different communicators are independent. Calls on one communicator
 *   are serialised by a lock (two threads calling at once is safe, the second waits until the
 *   first returns), except xcclCommAbort, xcclCommGetAsyncError, xcclGetLastError and the
 *   queries, which never wait for a call in progress, and xcclCommDestroy, which interrupts
 *   it and waits until it has returned. In particular an xcclA2ESend of
 *   microbatch 2 on one thread waits while another thread is blocked in xcclE2ARecv of
 *   microbatch 1: the two share the communicator's protocol state (epochs, buffers, the
 *   failure state), and a call blocked in a wait holds it. To overlap microbatches, do not
 *   block: send microbatch 1 (xcclA2ESend), send microbatch 2 (up to maxInFlight calls may be
 *   in flight), and poll xcclE2ATest between compute steps, calling xcclE2ARecv once it says
 *   done (it then returns without waiting); expert ranks poll xcclA2ERecvTest likewise. Every
 *   call on one communicator from a single thread (or from several, one at a time) is the
 *   supported pattern; calls from several threads at once are safe but serialised.
 * - Blocking: the MoE calls block until their data moved or the call's deadline
 *   (config.timeoutMs) passes (xcclTimeout). Init blocks until every rank joined.
 * - Pairing: every rank makes the same sequence of calls. A2E call e on every attention rank
 *   meets A2E receive e on every expert rank; the E2A of a call completes in A2E order (the
 *   oldest handle or batch first). At most config.maxInFlight calls may be between their A2E
 *   and their E2A; one more fails at once with xcclInvalidArgument. A call with 0 tokens is an
 *   ordinary call. An expert loop ends when the attention ranks say so: each A2E carries a
 *   64-bit user tag (xcclA2ESetTag; for example the step number, or a stop value) that every
 *   expert rank receives with its batch (info `tag` and `sourceTags`).
 * - Output structs that can grow: every struct xccl writes (xcclExpertBatchInfo_t,
 *   xcclTokenBatchInfo_t, xcclStats_t) starts with a `size_t size` the caller sets to the
 *   sizeof of the struct it compiled against; xccl writes no more than `size` bytes (fields
 *   past it are left alone), so a struct from an older header stays safe as fields are added
 *   at the end. Callers whose communicator was made with config version 1 to 3 (whose batch
 *   info structs had no `size` field) get exactly the layout of that version.
 * - Exact results: the combine is bitwise reproducible. On each expert rank
 *   acc = 0; acc = acc + w_j * y_j (f32, over its local experts in ascending order, no FMA),
 *   one rounding to the dtype; on the attention rank one contribution is copied, several are
 *   summed in f32 in ascending expert-rank order, then rounded once.
 */
#ifndef XCCL_H_
#define XCCL_H_

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------- */
/* Version                                                                                   */

/** Version of this header (ci/check-capi.sh checks them against Cargo.toml). */
#define XCCL_MAJOR 0
#define XCCL_MINOR 1
#define XCCL_PATCH 0
/** A version as one comparable integer: x * 10000 + y * 100 + z. */
#define XCCL_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
/** This header's version code. */
#define XCCL_VERSION_CODE XCCL_VERSION(XCCL_MAJOR, XCCL_MINOR, XCCL_PATCH)

/** One rank's communicator: opaque. The value is an id checked against a registry on every
 *  call, so a destroyed communicator is reported (xcclInvalidUsage), never dereferenced. */
typedef struct xcclComm* xcclComm_t;

/* ---------------------------------------------------------------------------------------- */
/* Results                                                                                   */

/** Result of every call. Codes are never reused or renumbered. */
typedef enum {
  /** The call did what it says. */
  xcclSuccess = 0,
  /** An argument is NULL, out of range, of the wrong size or inconsistent (the message names
   *  it). Nothing was sent to any peer: fix it and call again. */
  xcclInvalidArgument = 1,
  /** The call is not allowed now: wrong role for this rank (A2E send on an expert rank), a
   *  destroyed or unknown communicator, handle or batch (also a call that xcclCommDestroy on
   *  another thread interrupted). Nothing was sent. */
  xcclInvalidUsage = 2,
  /** The operating system, a native runtime (an Ascend runtime call's error code) or the
   *  rendezvous failed (shared memory, sockets, a rank that never joined). At init: nothing to
   *  clean up. */
  xcclSystemError = 3,
  /** A peer failed (its process died) or sent data that breaks the protocol. The communicator
   *  is poisoned and the job aborted. */
  xcclRemoteError = 4,
  /** A wait passed the call's deadline (config.timeoutMs), naming the awaited peer. Before
   *  anything was published this is retryable; after, the communicator is poisoned. */
  xcclTimeout = 5,
  /** The job was aborted: xcclCommAbort here or on a peer, a peer's poisoning failure, or a
   *  failure of this rank's own after data went out that is neither a peer's nor a timeout
   *  (the communicator is then poisoned; xcclInvalidArgument and xcclInvalidUsage are only
   *  for calls that sent nothing). The message names the aborting rank and its reason. */
  xcclAborted = 6,
  /** The fabric asked for (config.fabric) is not available in this build or on this host. */
  xcclUnavailable = 7,
  /** A bug in xccl (an internal panic). The communicator is poisoned and the job aborted;
   *  the process keeps running. */
  xcclInternalError = 8
} xcclResult_t;

/** A static, never freed description of `result` ("unknown result code" for others).
 *  Thread-safe; never fails. */
const char* xcclGetErrorString(xcclResult_t result);

/** The message of this thread's last xccl call: every call that fails sets it (which call,
 *  which rank or peer, which field), every call that succeeds clears it to "" (except that a
 *  successful xcclCommGetAsyncError that found an async error leaves that error's message),
 *  and xcclGetErrorString / xcclGetLastError do not change it. One rule, per thread: a call on
 *  another thread never changes what this thread reads. `comm` is not used (kept for the NCCL
 *  shape; pass the communicator or NULL). The string is owned by xccl and stays valid until
 *  this thread's next xccl call. Thread-safe; never fails; never waits for a call in
 *  progress. */
const char* xcclGetLastError(xcclComm_t comm);

/** Writes this library's version code (XCCL_VERSION_CODE of the header it was built with) to
 *  `*version`. Compare it with XCCL_VERSION_CODE to detect a header/library mismatch.
 *  Errors: xcclInvalidArgument if `version` is NULL. */
xcclResult_t xcclGetVersion(int* version);

/* ---------------------------------------------------------------------------------------- */
/* Communicator, unique id, config                                                           */

/** Names a job's rendezvous: 128 opaque bytes, copied freely (by value, over a socket, in a
 *  file, as 256 hex characters: xcclUniqueIdToString / xcclUniqueIdFromString; the bytes may
 *  contain NUL, so do not handle them as a C string). */
typedef struct {
  char internal[128];
} xcclUniqueId;

/** Length of the hex form of an xcclUniqueId, without its terminating NUL. */
#define XCCL_UNIQUE_ID_HEX_LEN 256

/** Writes `uniqueId` as 256 lowercase hex characters and a NUL into `str` (at least
 *  XCCL_UNIQUE_ID_HEX_LEN + 1 = 257 bytes, `len` says how many there are). Never blocks;
 *  thread-safe. Errors: xcclInvalidArgument (NULL, `len` < 257; `str` is then untouched). */
xcclResult_t xcclUniqueIdToString(const xcclUniqueId* uniqueId, char* str, size_t len);

/** Parses the 256 hex characters (NUL-terminated, either case) of xcclUniqueIdToString into
 *  `*uniqueId`. Never blocks; thread-safe. Errors: xcclInvalidArgument (NULL, a length other
 *  than 256, a character that is not a hex digit, bytes that are not an xccl unique id: the
 *  message says which; `*uniqueId` is then untouched). */
xcclResult_t xcclUniqueIdFromString(const char* str, xcclUniqueId* uniqueId);

/** Element type of token rows. */
typedef enum {
  xcclFloat32 = 0,
  xcclFloat16 = 1,
  xcclBfloat16 = 2
} xcclDataType_t;

/** How rows move between ranks (the sender chooses; receivers follow). */
typedef enum {
  /** The sender writes rows into the receiver's memory. */
  xcclTransferPush = 0,
  /** The sender stages rows; the receiver reads them (receiver-controlled incast). */
  xcclTransferPull = 1
} xcclTransferMode_t;

/** How rows travel on the wire (config version 2). */
typedef enum {
  /** In config.dtype. */
  xcclQuantNone = 0,
  /** INT8 with one f32 scale per token: scale = max|x| / 127, q = clamp(round_half_even(x *
   *  (127 / max|x|)), -127, 127), value = q * scale (about half the bytes of bf16). A row with
   *  a NaN or infinity is rejected (A2E: xcclInvalidArgument naming the token). */
  xcclQuantInt8 = 1
} xcclQuant_t;

/** A rank's role. Without config.role, global ranks 0..numAttentionRanks-1 are attention
 *  ranks and the rest expert ranks; with config.role every rank states its own. */
typedef enum {
  xcclRoleAttention = 0,
  xcclRoleExpert = 1
} xcclRole_t;

/** An unset integer field of xcclConfig_t (as NCCL's NCCL_CONFIG_UNDEF_INT). */
#define XCCL_CONFIG_UNDEF_INT INT_MIN
/** xcclConfig_t.magic. */
#define XCCL_CONFIG_MAGIC 0x6c636378u
/** xcclConfig_t.version of this header's layout. Later versions append fields (relay ranks,
 *  data-parallel domains, INT8 rows) after the last field below; `size` and `version` tell the
 *  library which layout the caller compiled against. */
#define XCCL_CONFIG_VERSION 4u

/** The communicator's parameters. Start from XCCL_CONFIG_INITIALIZER (size, magic, version set;
 *  every other field unset), then set fields. Fields marked "agreed" must be equal on every
 *  rank (init fails naming the field and both values otherwise).
 *  Errors at init (xcclInvalidArgument, the message naming the field): an unknown version, a
 *  wrong size or magic, a required field unset, a value out of range. The struct is read during
 *  init only; xccl keeps no pointer into it. */
typedef struct {
  /** sizeof(xcclConfig_t); set by the initializer. */
  size_t size;
  /** XCCL_CONFIG_MAGIC; set by the initializer. */
  unsigned int magic;
  /** XCCL_CONFIG_VERSION; set by the initializer. */
  unsigned int version;
  /** Attention ranks (agreed). At least one of numAttentionRanks and numExpertRanks must be
   *  set; the other defaults to nranks minus it. Both set must sum to nranks. */
  int numAttentionRanks;
  /** Expert ranks (agreed). */
  int numExpertRanks;
  /** Global experts (agreed; required; >= 1). */
  int numExperts;
  /** Routing entries per token (agreed; required; 1..numExperts). */
  int topk;
  /** Elements per token row (agreed; required; >= 1). */
  int hidden;
  /** Most tokens one attention rank passes to one A2E call (agreed; required; >= 1). */
  int maxTokensPerRank;
  /** xcclDataType_t of every row (agreed); default xcclBfloat16. */
  int dtype;
  /** xcclTransferMode_t of this rank's sends (local); default xcclTransferPush. */
  int transferMode;
  /** Calls between their A2E and their E2A (agreed; 1..8); default 2. */
  int maxInFlight;
  /** Deadline of each call, and of each init step (at least 10 s there), in ms (local; >= 1);
   *  default 30000. */
  int timeoutMs;
  /** Fabric name, NUL-terminated (local); NULL means "shm" (processes on one host). "ofi":
   *  libfabric (ranks on any hosts; provider and interface from config.ofiProvider and
   *  config.ofiInterface, else XCCL_OFI_PROVIDER and XCCL_OFI_ADDR). "ascend": windows in NPU
   *  memory (device config.device; needs the CANN runtime: without libascendcl.so init fails
   *  with xcclUnavailable naming it and ASCEND_HOME_PATH, the variable to set). "cuda":
   *  windows in GPU memory (device config.device) shared by CUDA IPC between the processes of
   *  one host, and the device-buffer calls (xcclA2ESendDevice and the others, below); needs the
   *  CUDA driver: without libcuda.so.1 init fails with xcclUnavailable naming it and
   *  XCCL_CUDA_LIBRARY (a path to the driver library). Another name is xcclUnavailable before
   *  any rendezvous. Read during init only. */
  const char* fabric;
  /** Explicit expert placement (agreed), or NULL (with placementRanks NULL) for the contiguous
   *  default: expert e goes to expert-rank index floor(e * numExpertRanks / numExperts), so
   *  consecutive blocks of floor or ceil(numExperts / numExpertRanks) experts (8 experts on 3
   *  expert ranks: experts 0-2, 3-5 and 6-7, blocks of 3, 3, 2; with fewer experts than expert
   *  ranks some host none). placementCounts[e] is the number of replicas of expert e
   *  (numExperts entries, each 1..numExpertRanks). */
  const int* placementCounts;
  /** The global ranks (expert ranks) hosting each expert's replicas, concatenated in expert
   *  order, the primary first (sum of placementCounts entries). A rank hosts an expert at most
   *  once. Attention rank a routes expert e to one of its replicas, deterministically. */
  const int* placementRanks;
  /* ---- version 2 ---- */
  /** xcclQuant_t of this rank's A2E sends (local; receivers follow each message); default
   *  xcclQuantNone. */
  int a2eQuant;
  /** xcclQuant_t of this rank's E2A replies (local); the attention rank dequantizes inside its
   *  sum. Replies from xcclE2AOutput travel in config.dtype. Default xcclQuantNone. */
  int e2aQuant;
  /** Expert ranks: 1 to receive A2E rows as INT8 plus one f32 scale per row (batch info
   *  `int8Rows` and `scales`, `rows` NULL), 0 for rows in config.dtype (local); default 0.
   *  keepInt8 does not need the senders' a2eQuant: rows that arrive in config.dtype are
   *  quantized here on receipt with the same quantizer (see xcclQuantInt8; a row with a NaN or
   *  an infinity is then a protocol error naming its attention rank), rows that arrive as INT8
   *  are kept as they are. */
  int keepInt8;
  /* ---- version 3 ---- */
  /** Rows an expert rank receives from one attention rank per call at most (agreed;
   *  0..maxTokensPerRank); default 0, meaning maxTokensPerRank (the worst case). A lower value
   *  shrinks every expert window; an xcclA2ESend that would send more rows than this to one
   *  expert rank fails with xcclInvalidArgument before sending anything. */
  int recvCapacity;
  /* ---- version 4 ---- */
  /** This rank's xcclRole_t (local), or XCCL_CONFIG_UNDEF_INT. When set (on every rank: a
   *  rank without it fails init, as do the others, within the init round), every rank states
   *  its own role and init gathers them in rank order, so attention ranks need not be the
   *  lowest ranks (mpirun and torchrun order ranks their own way). numAttentionRanks and
   *  numExpertRanks may then stay unset; when set they must match the stated roles.
   *  placementRanks then name expert ranks by global rank. */
  int role;
  /** The device of this rank (local; >= 0): the NPU for fabric "ascend" (default 0), the
   *  CUDA device ordinal for fabric "cuda" (as the driver numbers the devices this process
   *  sees, i.e. after CUDA_VISIBLE_DEVICES; default: rank modulo the device count). NCCL
   *  takes the calling thread's current device; xccl is told: set it to the device whose
   *  memory and streams this rank passes to the device-buffer calls. */
  int device;
  /** libfabric provider for fabric "ofi" (local; e.g. "tcp;ofi_rxm", "verbs;ofi_rxm"), or
   *  NULL: XCCL_OFI_PROVIDER, else "tcp;ofi_rxm". Read during init only. */
  const char* ofiProvider;
  /** Local address (an IP of the interface to use) for fabric "ofi" (local), or NULL:
   *  XCCL_OFI_ADDR, else the provider's first interface. Read during init only. */
  const char* ofiInterface;
} xcclConfig_t;

/** Initializer of an xcclConfig_t: size, magic and version set, every other field unset. */
#define XCCL_CONFIG_INITIALIZER                                                               \
  {                                                                                          \
    sizeof(xcclConfig_t), XCCL_CONFIG_MAGIC, XCCL_CONFIG_VERSION, XCCL_CONFIG_UNDEF_INT,     \
        XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT,                 \
        XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT,                 \
        XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, NULL, NULL, NULL, \
        XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT,                 \
        XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, XCCL_CONFIG_UNDEF_INT, NULL, NULL       \
  }

/** Fills `*config` as XCCL_CONFIG_INITIALIZER does (size, magic and version of this
 *  library's newest layout, every other field unset), for bindings that cannot use a C macro.
 *  A binding whose struct is an older layout sets size, magic and version itself instead.
 *  Never blocks; thread-safe. Errors: xcclInvalidArgument (`config` NULL). */
xcclResult_t xcclConfigInit(xcclConfig_t* config);

/** Makes a new job id and starts its rendezvous root in this process (a background thread
 *  bound to an ephemeral port on XCCL_SOCKET_ADDR, default 127.0.0.1). This process must live
 *  until every rank has initialised. Give the id to every rank (each calls
 *  xcclCommInitRankConfig with it). Thread-safe.
 *  Errors: xcclInvalidArgument (`uniqueId` NULL), xcclSystemError (no socket). */
xcclResult_t xcclGetUniqueId(xcclUniqueId* uniqueId);

/** Joins the job named by `commId` as `rank` of `nranks` (collective: every rank calls it; it
 *  blocks until all have joined and checked that they share the config's agreed fields).
 *  Writes the new communicator to `*comm` on success (untouched on failure). `config` is read
 *  during the call only. On shm the job lives in shared memory (/dev/shm) until every rank
 *  destroyed its communicator.
 *  Agreement: before any window is sized, every rank sends every agreed field by name (world
 *  size, roles, numAttentionRanks, numExpertRanks, numExperts, placement, hidden, dtype, topk,
 *  maxTokensPerRank, recvCapacity, maxInFlight) in one rendezvous round; a difference fails
 *  init on every rank with xcclRemoteError naming each differing field, the peer and both
 *  values. A rank whose own config is invalid still joins that round (when its id is valid)
 *  and tells every rank its reason, so the others fail at once (xcclRemoteError, the message
 *  naming that rank and its reason) instead of waiting out their timeout; a failure after the
 *  round (a fabric that cannot open) is broadcast as an abort the others see within
 *  milliseconds (xcclAborted naming the rank and its reason).
 *  Errors: xcclInvalidArgument (NULL pointer, nranks < 2, rank outside 0..nranks-1, a config
 *  field, a malformed id), xcclSystemError (rendezvous failed or timed out, shared memory),
 *  xcclRemoteError (a peer has a different agreed field, or a peer's config was invalid),
 *  xcclAborted (a peer's init failed after the agreement), xcclUnavailable (config.fabric). */
xcclResult_t xcclCommInitRankConfig(xcclComm_t* comm, int nranks, xcclUniqueId commId, int rank,
                                    const xcclConfig_t* config);

/** Like xcclCommInitRankConfig, with rank, size and rendezvous read from the launcher's
 *  environment: torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Open MPI
 *  (OMPI_COMM_WORLD_RANK/SIZE), PMI (PMI_RANK/SIZE) or Slurm (SLURM_PROCID/NTASKS) plus
 *  XCCL_ROOT=host:port, or XCCL_RANK, XCCL_SIZE and XCCL_ROOT. Rank 0 hosts the root on that
 *  address and port. Every rank needs the job's key, XCCL_JOB_KEY (64 hex digits, the same on
 *  every rank) or XCCL_JOB_KEY_FILE; without one (and without XCCL_INSECURE_NO_KEY=1) init
 *  fails naming them (docs/SECURITY.md). Errors: as xcclCommInitRankConfig; no launcher variables is xcclInvalidArgument, a
 *  malformed one xcclSystemError naming it. */
xcclResult_t xcclCommInitFromEnv(xcclComm_t* comm, const xcclConfig_t* config);

/** Releases `comm`, its shared memory, and every A2E handle and batch still open on it
 *  (pointers into them become invalid), and leaves the job: this rank's peers see it gone at
 *  once (see xcclCommGetAsyncError). Not collective. Works on aborted and poisoned
 *  communicators.
 *  From another thread while a call on `comm` is in progress: that call is interrupted (its
 *  wait stops within about 40 ms; a call that is not waiting finishes its step) and returns
 *  xcclInvalidUsage ("destroyed by xcclCommDestroy on another thread"), or its own result if
 *  it completed first; calls queued behind it return xcclInvalidUsage. xcclCommDestroy returns
 *  only after that call is done with `comm` and with the caller's buffers, so they may be
 *  freed as soon as it returns (the call's thread may still be on its way out of the
 *  function). Nothing is published by the interruption itself: the job is not aborted (a call
 *  interrupted after it had published poisons as any such failure does, and its peers are
 *  told). Why not refuse while a call runs: the thread tearing an engine down (a watchdog, a
 *  shutdown hook) must not have to retry against a call that may block for config.timeoutMs,
 *  and a blocked call that could outlive the communicator is what made the earlier behaviour
 *  unsafe. To stop the whole job instead, call xcclCommAbort first. Not from an arrival
 *  callback of `comm` (xcclInvalidUsage: the receive is still running; `comm` stays valid);
 *  not during xcclCommShrink of `comm` on another thread (the shrink owns the old
 *  communicator and is not waited for).
 *  Errors: xcclInvalidArgument (NULL), xcclInvalidUsage (already destroyed, also by a racing
 *  xcclCommDestroy; from an arrival callback). */
xcclResult_t xcclCommDestroy(xcclComm_t comm);

/** Aborts the job: returns promptly (no waiting for a call in progress), callable from any
 *  thread, also while another thread is blocked in a call on `comm`. Every blocked call, here
 *  and on every peer, returns xcclAborted within milliseconds; later calls on `comm` return
 *  xcclAborted; peers' later calls fail too. Unlike ncclCommAbort it does not free `comm`:
 *  call xcclCommDestroy afterwards. Calling it again is a no-op. Bounded: the out-of-band
 *  abort through the bootstrap waits at most 0.25 s for another thread's bootstrap write and
 *  0.5 s for its own (ofi also flushes its abort writes for at most 2 s). Not
 *  async-signal-safe (it takes locks and allocates): from a signal handler, set a flag and call
 *  it from a thread.
 *  Errors: xcclInvalidArgument (NULL), xcclInvalidUsage (destroyed). */
xcclResult_t xcclCommAbort(xcclComm_t comm);

/** Writes to `*asyncError` the failure that poisoned `comm`, or one raised since outside any
 *  call, or xcclSuccess; the message (naming the rank) is then in xcclGetLastError(comm):
 *  - an abort by a peer or here: xcclAborted;
 *  - a peer process that died without destroying its communicator: xcclRemoteError, whatever
 *    this rank has open;
 *  - a peer that left the job (destroyed its communicator; its process may still run or have
 *    exited) while an open call of this rank still needs it: xcclRemoteError ("rank P failed:
 *    left the job ...; the E2A receive of call epoch E needs it"). Open calls are: on an
 *    attention rank, an A2E handle whose E2A has not been received and to which that expert
 *    rank (or its relay) has not contributed yet; on an expert rank, a batch not replied to
 *    whose call that attention rank took part in. Such a call can never complete; it fails
 *    too when called (xcclRemoteError naming the peer, within milliseconds, not at its
 *    timeout). On shm and ascend the departure is seen by the first look after the peer's
 *    xcclCommDestroy returned (a query another thread of that peer runs at that moment delays
 *    it until the query returns); on ofi when its departure message arrives (milliseconds).
 *  A peer that left after answering everything this rank has open is the normal end of a job
 *  and is not an error: xcclSuccess. (Each rank needs the other role: an attention rank's calls
 *  wait for the expert ranks, an expert rank's for the attention ranks; a rank that has
 *  received its last E2A, or replied to its last batch, needs nobody.) If this rank then makes
 *  a call that needs the departed peer, that call fails with xcclRemoteError naming it, within
 *  milliseconds, and poisons the communicator as any peer failure does (the job is aborted).
 *  This function only looks: it never poisons the communicator nor aborts the job (call
 *  xcclCommAbort to tell the other ranks, or xcclCommDestroy); the same answer stays until then.
 *  Never waits for a call in progress (while another thread's call holds `comm`, the open-call
 *  look is skipped: that call fails on such a peer itself, and the poisoning is reported);
 *  works on aborted communicators.
 *  Errors: xcclInvalidArgument (NULL), xcclInvalidUsage (destroyed). */
xcclResult_t xcclCommGetAsyncError(xcclComm_t comm, xcclResult_t* asyncError);

/* ---------------------------------------------------------------------------------------- */
/* Queries (never wait for a call in progress; xcclAborted after xcclCommAbort)              */

/** Number of ranks in the job. */
xcclResult_t xcclCommCount(xcclComm_t comm, int* count);

/** This rank. */
xcclResult_t xcclCommUserRank(xcclComm_t comm, int* rank);

/** This rank's role (an xcclRole_t value). */
xcclResult_t xcclCommRole(xcclComm_t comm, int* role);

/** Number of experts this rank hosts (`*count`; 0 on attention ranks) and, when `experts` is
 *  not NULL, their global ids in ascending order (the local expert index j of a batch is
 *  experts[j]); `experts` must hold `*count` ints (query with NULL first). */
xcclResult_t xcclCommLocalExperts(xcclComm_t comm, int* count, int* experts);

/** Sizes of the buffers one call needs on this rank:
 *  `*rowBytes` = hidden * element size (bytes of one token row);
 *  `*maxRecvTokens`: attention ranks: maxTokensPerRank (rows of xcclE2ARecv's `out`); expert
 *  ranks: the most tokens of a token-major batch (numAttentionRanks * maxTokensPerRank, or
 *  numAttentionRanks * recvCapacity when that is set);
 *  `*maxRecvRows`: expert ranks: the most rows of an expert-major batch
 *  (maxRecvTokens * min(topk, local experts)); attention ranks: maxTokensPerRank.
 *  Multiply by rowBytes for buffer sizes. */
xcclResult_t xcclCommBufferSizes(xcclComm_t comm, size_t* rowBytes, size_t* maxRecvTokens,
                                 size_t* maxRecvRows);

/* ---------------------------------------------------------------------------------------- */
/* Counters                                                                                  */

/** What this rank exchanged with one peer. This struct never grows (new per-peer counters
 *  would come in a new array). */
typedef struct {
  /** Rows this rank announced to the peer in records it wrote. */
  uint64_t rowsSent;
  /** Rows the peer announced to this rank in records this rank read. */
  uint64_t rowsReceived;
  /** Bytes this rank wrote into the peer's window (records and rows). */
  uint64_t bytesPut;
  /** Bytes this rank read from the peer's window (pulled rows). */
  uint64_t bytesGot;
  /** Nanoseconds this rank waited for the peer (signals, records, rows, credits). */
  uint64_t waitedNs;
} xcclPeerStats_t;

/** Counters of one call or of every call so far. */
typedef struct {
  /** Calls counted. */
  uint64_t calls;
  /** Metadata records this rank wrote (relay headers included). */
  uint64_t recordsWritten;
  /** Metadata records this rank read and validated. */
  uint64_t recordsPolled;
  /** Rows this rank forwarded as a relay. */
  uint64_t relayRowsForwarded;
  /** Expert selections dropped because their expert has no replica left (after an
   *  xcclCommShrink with dropOrphanedExperts). */
  uint64_t droppedSlots;
  /** The peer this rank waited for longest, or -1 when it waited for none. */
  int slowestPeer;
  /** A peer waited for more than 4 times as long as the median of the peers waited for (and
   *  at least 200 us), or -1. */
  int straggler;
  /** Nanoseconds waited for slowestPeer. */
  uint64_t slowestWaitedNs;
} xcclCallStats_t;

/** What xcclCommGetStats writes. The caller sets `size` (sizeof(xcclStats_t)),
 *  `peerCapacity` and the two arrays; xccl writes the rest, never past `size` bytes. */
typedef struct {
  /** sizeof(xcclStats_t) of the caller's header (set by the caller). */
  size_t size;
  /** Entries of lastPeers and totalPeers (set by the caller; 0 with both NULL). */
  size_t peerCapacity;
  /** Caller-owned array of peerCapacity entries for the last call's counters per rank (entry r
   *  is rank r, this rank's own entry counting writes into its own window), or NULL. */
  xcclPeerStats_t* lastPeers;
  /** The same for the totals, or NULL. */
  xcclPeerStats_t* totalPeers;
  /** Written: the ranks of the job (entries beyond peerCapacity are not written). */
  size_t numPeers;
  /** Written: the counters of the last call on this communicator (a failed call's too;
   *  xcclE2ATest and xcclA2ERecvTest count nothing). */
  xcclCallStats_t last;
  /** Written: the counters of every call so far, added up. */
  xcclCallStats_t total;
} xcclStats_t;

/** Writes the counters of the last call and of every call so far to `*stats` (see
 *  xcclStats_t) and to its per-peer arrays. Takes the communicator's lock (waits for a call in
 *  progress on another thread). Errors: xcclInvalidArgument (NULL, `size` smaller than the
 *  fields up to peerCapacity, lastPeers or totalPeers misaligned), xcclInvalidUsage
 *  (destroyed or shrunk communicator), xcclAborted. */
xcclResult_t xcclCommGetStats(xcclComm_t comm, xcclStats_t* stats);

/* ---------------------------------------------------------------------------------------- */
/* Shrink: going on past dead ranks                                                          */

/** Options of xcclCommShrink. The caller sets `size` (sizeof(xcclShrinkOptions_t)); fields
 *  past it read as unset. */
typedef struct {
  /** sizeof(xcclShrinkOptions_t) of the caller's header. */
  size_t size;
  /** 1: drop (and count, xcclCallStats_t.droppedSlots) the selections of an expert whose
   *  every replica died; 0 (default): fail with xcclRemoteError naming the expert. */
  int dropOrphanedExperts;
  /** Bound of each agreement round in ms (how long a survivor waits for the others to call
   *  xcclCommShrink); XCCL_CONFIG_UNDEF_INT or 0: 60000. */
  int timeoutMs;
} xcclShrinkOptions_t;

/** After a peer failure (xcclRemoteError naming a dead rank), every survivor calls
 *  xcclCommShrink (collective among the survivors): they agree on the dead ranks through the
 *  bootstrap, renumber the survivors densely in old rank order (xcclCommRankAfterShrink),
 *  serve the dead ranks' experts by their surviving replicas, and build a new communicator of
 *  the same fabric (shm or ofi; the bootstrap root's process must be alive), written to
 *  `*newcomm`. `options` may be NULL (defaults). Once the arguments are checked `comm` is spent
 *  whatever the outcome: its handles and batches are freed, every later call on it but
 *  xcclCommDestroy (which the caller still calls) returns xcclInvalidUsage. Blocks until the survivors agreed and built
 *  the new communicator. Errors: xcclInvalidArgument (NULL `newcomm`, a bad option),
 *  xcclInvalidUsage (destroyed or already shrunk `comm`; called from an arrival callback of
 *  `comm`, which then stays valid), xcclInternalError (`comm` was poisoned by an internal
 *  error), xcclRemoteError (an expert with no replica left, naming it; survivors that
 *  disagree), xcclSystemError (the bootstrap root is gone, naming its address), xcclTimeout (a
 *  survivor did not call xcclCommShrink). */
xcclResult_t xcclCommShrink(xcclComm_t comm, const xcclShrinkOptions_t* options,
                            xcclComm_t* newcomm);

/** The rank that rank `oldRank` of the communicator `comm` was shrunk from has in `comm`
 *  (made by xcclCommShrink), or -1 when it died (or is out of range). Errors:
 *  xcclInvalidArgument (NULL), xcclInvalidUsage (`comm` not made by xcclCommShrink). */
xcclResult_t xcclCommRankAfterShrink(xcclComm_t comm, int oldRank, int* newRank);

/* ---------------------------------------------------------------------------------------- */
/* Attention ranks: A2E send, E2A receive                                                    */

/** One A2E call's token on its way to the experts, kept for its E2A receive: opaque, an id. */
typedef struct xcclA2EHandle* xcclA2EHandle_t;

/** A2E (dispatch) on an attention rank: sends each of `numTokens` tokens of `x`
 *  ([numTokens, hidden] rows of config.dtype, row-major, caller-owned, read during the call
 *  only) to the expert ranks hosting the experts of its row of `topkIdx` ([numTokens, topk]
 *  int32 global expert ids, -1 = no expert) with the gating weights `topkWeights`
 *  ([numTokens, topk] finite float32). `numTokens` is 0..maxTokensPerRank; with 0 the three
 *  pointers may be NULL. Validates everything before anything goes out. Blocks until the rows
 *  are handed to the fabric (a free buffer may need the E2A of call e - maxInFlight on the
 *  peers). Writes the call's handle to `*handle`; pass it to xcclE2ARecv.
 *  Errors: xcclInvalidArgument (NULL, numTokens, an expert id out of range, a non-finite
 *  weight, too many calls in flight), xcclInvalidUsage (expert rank), xcclTimeout,
 *  xcclRemoteError, xcclAborted. */
xcclResult_t xcclA2ESend(xcclComm_t comm, const void* x, int numTokens, const int32_t* topkIdx,
                         const float* topkWeights, xcclA2EHandle_t* handle);

/** E2A (combine) on an attention rank: waits for the expert outputs of the call of `handle`
 *  and writes out[t] = sum_k topkWeights[t,k] * expert_k(x[t]) ([numTokens, hidden] of
 *  config.dtype, caller-owned, written during the call only), combined exactly as documented at
 *  the top of this header. `handle` must be the oldest unanswered handle of `comm`. On success
 *  `handle` is freed (do not use it again). On a retryable failure (a rejected handle, a
 *  timeout before any row arrived, a NULL `out`) it stays valid: call again. After a poisoning
 *  failure free it with xcclA2EHandleFree (or xcclCommDestroy frees it).
 *  Errors: xcclInvalidArgument (NULL, a handle that is not the oldest: the message names both
 *  epochs), xcclInvalidUsage (unknown or used handle, expert rank), xcclTimeout,
 *  xcclRemoteError, xcclAborted. */
xcclResult_t xcclE2ARecv(xcclComm_t comm, xcclA2EHandle_t handle, void* out);

/** Non-blocking: writes 1 to `*done` when every contribution to the E2A of `handle` has
 *  landed (the next xcclE2ARecv of it returns without waiting for a peer), else 0. Never
 *  blocks (it takes the communicator's lock, so it waits for a call in progress on another
 *  thread); counts nothing in the stats. Errors (as xcclE2ARecv's): xcclInvalidArgument
 *  (NULL, a handle that is not the oldest: changes nothing), xcclInvalidUsage (unknown or
 *  used handle, another communicator's handle, expert rank), xcclRemoteError (a peer it
 *  waits for died: poisons), xcclAborted. */
xcclResult_t xcclE2ATest(xcclComm_t comm, xcclA2EHandle_t handle, int* done);

/** Sets the 64-bit user tag this rank's next A2E call (xcclA2ESend or xcclA2ESendInput)
 *  carries to every expert rank it reaches, also those it sends 0 rows to, and through relays
 *  (expert ranks read it as batch info `tag` / `sourceTags`). The tag is consumed by the call
 *  that sends it; a call that fails before sending anything keeps it for the retry. A call
 *  after which none was set carries 0. Never blocks (beyond the lock). Errors:
 *  xcclInvalidUsage (expert rank, destroyed communicator), xcclAborted. */
xcclResult_t xcclA2ESetTag(xcclComm_t comm, uint64_t tag);

/** Frees a handle without receiving its E2A, after the communicator failed (poisoned) or was
 *  aborted. On a healthy communicator a handle whose E2A is still to be received is refused
 *  (xcclInvalidUsage, the handle stays valid): freeing it would leave the communicator and its
 *  peers waiting for that E2A. Call xcclCommAbort first to give up on it. Errors:
 *  xcclInvalidArgument (NULL), xcclInvalidUsage (unknown, freed, or live on a healthy
 *  communicator). */
xcclResult_t xcclA2EHandleFree(xcclA2EHandle_t handle);

/** Zero-copy A2E, step 1: writes to `*input` the registered input of the next A2E call:
 *  [maxTokensPerRank, hidden] rows of config.dtype inside this rank's shared window, owned by
 *  xccl. Blocks until the buffer's previous use has been consumed by every expert rank.
 *  Lifetime: write token t's row into row t (ideally the layer producing it writes there),
 *  then call xcclA2ESendInput; after that call returns, do not touch the buffer (expert ranks
 *  read it) until the next xcclA2EInput returns it again. Valid until xcclCommDestroy.
 *  Errors: xcclInvalidArgument (NULL), xcclInvalidUsage (expert rank), xcclTimeout,
 *  xcclAborted. */
xcclResult_t xcclA2EInput(xcclComm_t comm, void** input);

/** Zero-copy A2E, step 2: A2E of the first `numTokens` rows of the registered input (see
 *  xcclA2EInput, which must have been called for this call); arguments and errors as
 *  xcclA2ESend without `x`. Only routing metadata is written: expert ranks gather the rows. */
xcclResult_t xcclA2ESendInput(xcclComm_t comm, int numTokens, const int32_t* topkIdx,
                              const float* topkWeights, xcclA2EHandle_t* handle);

/* ---------------------------------------------------------------------------------------- */
/* Expert ranks: A2E receive, E2A send                                                       */

/** The rows one A2E call brought to this expert rank, grouped by local expert: opaque, an id.
 *  Owned by xccl; freed by a successful E2A send or by xcclExpertBatchFree. */
typedef struct xcclExpertBatch* xcclExpertBatch_t;

/** What an expert batch holds. Every pointer points into the batch (owned by xccl) and stays
 *  valid until the batch is freed (a successful xcclE2ASend, xcclExpertBatchFree or
 *  xcclCommDestroy). Read only. Set `size` before xcclExpertBatchGetInfo (see "Output structs
 *  that can grow"; config version 1 to 3 callers have the layout without `size`, `tag` and
 *  the source fields, version 1 also without int8Rows and scales). */
typedef struct {
  /** sizeof(xcclExpertBatchInfo_t), set by the caller. */
  size_t size;
  /** Rows: received (token, local expert) pairs. */
  size_t numRows;
  /** Received tokens (one per (source rank, token)). */
  size_t numTokens;
  /** Local experts of this rank (see xcclCommLocalExperts for their global ids). */
  size_t numLocalExperts;
  /** [numRows, hidden] rows of config.dtype: the rows of local expert j are
   *  expertOffsets[j]..expertOffsets[j+1], within an expert ordered by (source rank, token). */
  const void* rows;
  /** Rows per local expert [numLocalExperts]. */
  const size_t* expertCounts;
  /** [numLocalExperts + 1] row offsets (0 first, numRows last). */
  const size_t* expertOffsets;
  /** Per row: the attention rank it came from. */
  const uint32_t* srcRank;
  /** Per row: the token's index at that attention rank. */
  const uint32_t* srcToken;
  /** Per row: the gating weight of this (token, expert). */
  const float* weights;
  /** With config.keepInt8: [numRows, hidden] INT8 values (a value is int8Rows * scales[row]),
   *  and `rows` is NULL; otherwise NULL. */
  const int8_t* int8Rows;
  /** With config.keepInt8: [numRows] per-row scales; otherwise NULL. */
  const float* scales;
  /** The call's user tag: the one its first source sent (the lowest attention rank taking
   *  part in the call; see xcclA2ESetTag). */
  uint64_t tag;
  /** Attention ranks of the job (entries of the four source arrays, in rank order). */
  size_t numSources;
  /** Per source: its global rank. */
  const uint32_t* sourceRanks;
  /** Per source: tokens received from it in this call. */
  const size_t* sourceCounts;
  /** Per source: index of its first token among the batch's tokens. */
  const size_t* sourceFirstToken;
  /** Per source: the tag its call carried (0 for a source outside the call's DP domain). */
  const uint64_t* sourceTags;
} xcclExpertBatchInfo_t;

/** A2E receive on an expert rank, expert-major: blocks until every attention rank's rows of
 *  the next A2E call arrived, writes the batch to `*batch`. Compute each local expert on its
 *  rows, then reply with xcclE2ASend. At most maxInFlight batches may be unreplied.
 *  Errors: xcclInvalidArgument (NULL, too many unreplied batches), xcclInvalidUsage (attention
 *  rank), xcclTimeout (no rows in time: retryable), xcclRemoteError, xcclAborted. */
xcclResult_t xcclA2ERecv(xcclComm_t comm, xcclExpertBatch_t* batch);

/** Non-blocking: writes 1 to `*ready` when every row of the next A2E call has arrived (the
 *  next receive, any variant, returns without waiting for a peer), else 0. On a relay rank it
 *  also needs its members' rows, and every expert rank's receive through relays needs every
 *  relay to have forwarded, which a relay does inside its own receive: with several relays do
 *  not wait for 1 on a relay before calling its receive. Never blocks (beyond the lock);
 *  counts nothing in the stats. Errors: xcclInvalidArgument (NULL), xcclInvalidUsage
 *  (attention rank), xcclRemoteError (a dead peer or a bad record: poisons), xcclAborted. */
xcclResult_t xcclA2ERecvTest(xcclComm_t comm, int* ready);

/** Describes `batch` (see xcclExpertBatchInfo_t for the lifetime of the pointers), writing no
 *  more than info->size bytes. Thread-safe. Errors: xcclInvalidArgument (NULL, info->size
 *  smaller than a size_t), xcclInvalidUsage (freed batch). */
xcclResult_t xcclExpertBatchGetInfo(xcclExpertBatch_t batch, xcclExpertBatchInfo_t* info);

/** E2A send on an expert rank: `expertOut` ([numRows, hidden] of config.dtype, same layout as
 *  the batch rows, caller-owned, read during the call only) holds each row's expert output.
 *  xccl reduces each token's local experts with its gating weights (acc = 0; acc += w_j * y_j
 *  over local experts ascending, in f32, one rounding) and sends one row per token back. The
 *  batch must be the oldest unreplied one. On success `batch` is freed; on a retryable failure
 *  it stays valid (call again).
 *  Errors: xcclInvalidArgument (NULL, not the oldest batch), xcclInvalidUsage (freed batch,
 *  attention rank), xcclTimeout, xcclRemoteError, xcclAborted. */
xcclResult_t xcclE2ASend(xcclComm_t comm, xcclExpertBatch_t batch, const void* expertOut);

/** Frees a batch without replying, after the communicator failed (poisoned) or was aborted.
 *  On a healthy communicator it is refused (xcclInvalidUsage, the batch stays valid): the
 *  attention ranks wait for the reply. Call xcclCommAbort first to give up on it. Errors:
 *  xcclInvalidArgument (NULL), xcclInvalidUsage (freed, or live on a healthy communicator). */
xcclResult_t xcclExpertBatchFree(xcclExpertBatch_t batch);

/** The tokens one A2E call brought to this expert rank, one row per token: opaque, an id.
 *  Owned by xccl; freed by a successful E2A send or by xcclTokenBatchFree. */
typedef struct xcclTokenBatch* xcclTokenBatch_t;

/** What a token batch holds; pointers into the batch, valid until the batch is freed. Set
 *  `size` before xcclTokenBatchGetInfo (layouts of older config versions as for
 *  xcclExpertBatchInfo_t). */
typedef struct {
  /** sizeof(xcclTokenBatchInfo_t), set by the caller. */
  size_t size;
  /** Received tokens, each source's tokens consecutive, sources in arrival order. */
  size_t numTokens;
  /** Row stride of localExperts and weights (config.topk). */
  size_t topk;
  /** [numTokens, hidden] rows of config.dtype. */
  const void* rows;
  /** Per token: the attention rank it came from. */
  const uint32_t* srcRank;
  /** Per token: its index at that attention rank. */
  const uint32_t* srcToken;
  /** Per token: how many of this rank's local experts it selected (1..topk). */
  const uint32_t* expertCount;
  /** [numTokens, topk]: token i's local expert indices, ascending, the first expertCount[i]
   *  entries valid. */
  const uint32_t* localExperts;
  /** [numTokens, topk]: the matching gating weights. */
  const float* weights;
  /** With config.keepInt8: [numTokens, hidden] INT8 values, and `rows` is NULL; else NULL. */
  const int8_t* int8Rows;
  /** With config.keepInt8: [numTokens] per-token scales; otherwise NULL. */
  const float* scales;
  /** The call's user tag (its lowest source's, see xcclExpertBatchInfo_t.tag); 0 in an
   *  arrival callback, where the call is not complete. */
  uint64_t tag;
  /** Attention ranks of the job (entries of the source arrays); 0 (and the arrays NULL) in an
   *  arrival callback. */
  size_t numSources;
  /** Per source: its global rank. */
  const uint32_t* sourceRanks;
  /** Per source: tokens received from it in this call. */
  const size_t* sourceCounts;
  /** Per source: index of its first token in this batch. */
  const size_t* sourceFirstToken;
  /** Per source: the tag its call carried. */
  const uint64_t* sourceTags;
} xcclTokenBatchInfo_t;

/** A2E receive, token-major: like xcclA2ERecv with one row per received token (reply with
 *  xcclE2ASendTokens or, zero-copy, xcclE2AOutput + xcclE2ASendOutput). */
xcclResult_t xcclA2ERecvTokens(xcclComm_t comm, xcclTokenBatch_t* batch);

/** Called by xcclA2ERecvTokensWithCallback on the receiving thread each time one attention
 *  rank's tokens have all landed (`arrived` has the layout of the caller's config version:
 *  from version 4 its `size` is xccl's sizeof, read only the fields the caller knows):
 *  tokens firstToken..firstToken+numTokens-1 of `arrived` are
 *  complete (with those of earlier callbacks of this receive; other tokens may still be
 *  arriving). `arrived` itself is valid during the callback only; the array pointers in it
 *  (rows, srcRank, weights, ...) keep their addresses for the whole receive (the worst case is
 *  reserved when it starts) and stay valid until `*batch` is replied to or freed. Start the
 *  experts' work on those tokens here to overlap it with the rest of the receive. The callback
 *  must return normally (no C++ exception, no longjmp) and must not call xccl functions on the
 *  same communicator (they fail with xcclInvalidUsage); `userData` is passed through. */
typedef void (*xcclArrivalFn)(void* userData, const xcclTokenBatchInfo_t* arrived,
                              size_t firstToken, size_t numTokens);

/** xcclA2ERecvTokens calling `onArrival` (not NULL) as each source's tokens land, in completion
 *  order: at most once per attention rank (numTokens may be 0); every received token is in
 *  exactly one callback's range. Errors as xcclA2ERecv. */
xcclResult_t xcclA2ERecvTokensWithCallback(xcclComm_t comm, xcclTokenBatch_t* batch,
                                           xcclArrivalFn onArrival, void* userData);

/** Describes `batch`, writing no more than info->size bytes. Errors: xcclInvalidArgument
 *  (NULL, info->size smaller than a size_t), xcclInvalidUsage (freed batch). */
xcclResult_t xcclTokenBatchGetInfo(xcclTokenBatch_t batch, xcclTokenBatchInfo_t* info);

/** E2A send, token-major: `reduced` ([numTokens, hidden] of config.dtype, caller-owned, read
 *  during the call only) holds each token's reply, already the gating-weighted sum over its
 *  local experts. Frees `batch` on success; a retryable failure leaves it valid. Errors as
 *  xcclE2ASend. */
xcclResult_t xcclE2ASendTokens(xcclComm_t comm, xcclTokenBatch_t batch, const void* reduced);

/** Zero-copy E2A, step 1: writes to `*output` the registered output of `batch`'s reply:
 *  [numTokens, hidden] rows of config.dtype in this rank's shared window, owned by xccl, row i
 *  for the batch's token i. Blocks until the buffer's previous use was consumed. Lifetime:
 *  write every row, then call xcclE2ASendOutput; do not touch the buffer after that (the
 *  attention ranks read it). `batch` stays valid. Errors as xcclE2ASend. */
xcclResult_t xcclE2AOutput(xcclComm_t comm, xcclTokenBatch_t batch, void** output);

/** Zero-copy E2A, step 2: replies with the rows written into xcclE2AOutput (which must have
 *  been called for this batch); only records and signals go out. Frees `batch` on success.
 *  Errors as xcclE2ASend. */
xcclResult_t xcclE2ASendOutput(xcclComm_t comm, xcclTokenBatch_t batch);

/** Frees a token batch without replying, under the rule of xcclExpertBatchFree (refused with
 *  xcclInvalidUsage while live on a healthy communicator). */
xcclResult_t xcclTokenBatchFree(xcclTokenBatch_t batch);

/* ---------------------------------------------------------------------------------------- */
/* Device buffers (config.fabric "cuda")                                                     */
/*
 * The calls below take rows in GPU memory: device pointers (CUdeviceptr / cudaMalloc
 * memory, passed as void*) of the communicator's device (xcclCommCuDevice), each inside one
 * allocation, and a stream of that device. They exist on every communicator; on another
 * fabric each fails with xcclInvalidArgument ("needs a communicator on the cuda fabric").
 *
 * Pointers: every device buffer is checked before anything is read, written or sent: NULL
 * (allowed only for a buffer of 0 bytes), host memory (pageable, pinned or managed), memory of
 * another GPU (the message names both devices), or a buffer that runs past the end of its
 * allocation is xcclInvalidArgument naming the argument, and nothing was sent (retryable, the
 * handle or batch stays valid). The host-buffer calls (xcclA2ESend, xcclE2ARecv, xcclE2ASend,
 * xcclA2ESendInput, xcclE2ASendTokens) on a cuda communicator likewise refuse device memory
 * with xcclInvalidArgument. Failures after the check follow the rule of the host call
 * (retryable before anything is published, poisoned after).
 *
 * Streams: `stream` is a cudaStream_t / CUstream of the communicator's device (a stream of
 * its primary context, which is the CUDA runtime's), or NULL for the legacy default stream.
 * Each call is ordered after the work already queued on `stream` (it records an event there
 * and makes its own stream wait for it), so it reads what kernels queued before it write; and
 * it returns with its work done (synchronous to the host): rows it writes are in place, the
 * buffers it reads may be reused, and work queued on any stream afterwards sees them. It does
 * not wait for other streams' work: order that before the call (cudaStreamWaitEvent). Not
 * capturable in a CUDA graph. `stream` must stay valid during the call.
 *
 * The rows are copied and summed by device copies and kernels on the communicator's stream
 * (the host plans and moves metadata; docs/device.md); the results are bit for bit those of
 * the host calls on the same inputs.
 */

/** A cudaStream_t / CUstream (the same type: `struct CUstream_st*`), declared here so that
 *  this header needs no CUDA header; pass the runtime's or the driver's stream as it is. NULL
 *  is the legacy default stream. */
typedef struct CUstream_st* xcclCudaStream_t;

/** Where an argument of a device-buffer call lives. */
typedef enum {
  /** Host memory (read by the host during the call). */
  xcclMemoryHost = 0,
  /** Device memory of the communicator's GPU. */
  xcclMemoryDevice = 1
} xcclMemory_t;

/** A2E (dispatch) of device rows: as xcclA2ESend, with `x` ([numTokens, hidden] of
 *  config.dtype) in device memory, ordered after the work queued on `stream`. The routing
 *  (`topkIdx` [numTokens, topk] int32, `topkWeights` [numTokens, topk] float32) lives where
 *  `routingMemory` says, never guessed from the pointers: xcclMemoryHost (host memory, read
 *  during the call) or xcclMemoryDevice (device memory of the communicator's GPU, copied to
 *  the host once per call on the call's stream, after the work queued on `stream`, e.g. a
 *  router kernel's output). With numTokens 0 the three pointers may be NULL. Returns once `x`
 *  and the routing have been read (they may then be reused) and the rows handed to the fabric;
 *  writes the call's handle to `*handle` (for xcclE2ARecvDevice or xcclE2ARecv).
 *  Errors: as xcclA2ESend, and xcclInvalidArgument for a pointer the device-buffer rules refuse
 *  (see above), routing in the other memory than `routingMemory` says, a `routingMemory`
 *  that is not an xcclMemory_t, a communicator on another fabric. */
xcclResult_t xcclA2ESendDevice(xcclComm_t comm, const void* x, int numTokens,
                               const int32_t* topkIdx, const float* topkWeights,
                               xcclMemory_t routingMemory, xcclCudaStream_t stream,
                               xcclA2EHandle_t* handle);

/** E2A (combine) into device memory: as xcclE2ARecv, writing `out` ([numTokens, hidden] of
 *  config.dtype, numTokens of the handle's call) in device memory; ordered after the work
 *  queued on `stream` (e.g. the last reader of `out`), and `out` holds the combined rows when
 *  it returns. On success `handle` is freed; on a retryable failure (a refused `out` among
 *  them) it stays valid. Errors: as xcclE2ARecv, and the device-buffer rules' (see above). */
xcclResult_t xcclE2ARecvDevice(xcclComm_t comm, xcclA2EHandle_t handle, void* out,
                               xcclCudaStream_t stream);

/** A2E receive into device memory, expert-major: as xcclA2ERecv, with the batch's rows written
 *  into `out` (device memory of `outBytes` bytes, at least the `outBytes` of
 *  xcclCommDeviceRecvSize): rows 0..numRows-1 of `out` are the batch's rows, the rows of local
 *  expert j being expertOffsets[j]..expertOffsets[j+1] (as in a host batch); the rest of `out`
 *  is left alone. Ordered after the work queued on `stream` (e.g. the experts' last read of
 *  `out`); the rows are in place when it returns. The batch (`*batch`) carries everything
 *  else (xcclExpertBatchGetInfo: counts, offsets, sources, weights, tags; its `rows` is NULL)
 *  and is replied to with xcclE2ASendDevice (or xcclE2ASend). Not with config.keepInt8
 *  (xcclInvalidArgument). Errors: as xcclA2ERecv, and xcclInvalidArgument for `outBytes`
 *  below the needed size and the device-buffer rules' (see above). */
xcclResult_t xcclA2ERecvDevice(xcclComm_t comm, xcclExpertBatch_t* batch, void* out,
                               size_t outBytes, xcclCudaStream_t stream);

/** E2A send from device memory: as xcclE2ASend, with `expertOut` ([numRows, hidden] of
 *  config.dtype, one output row per batch row, in the batch's row order) in device memory,
 *  ordered after the work queued on `stream` (the experts' kernels that wrote it); `expertOut`
 *  may be reused once it returns. On success `batch` is freed; on a retryable failure it
 *  stays valid. Errors: as xcclE2ASend, and the device-buffer rules' (see above). */
xcclResult_t xcclE2ASendDevice(xcclComm_t comm, xcclExpertBatch_t batch, const void* expertOut,
                               xcclCudaStream_t stream);

/** A2E receive into device memory, token-major: as xcclA2ERecvTokens, with the batch's rows
 *  written into `out` (device memory of `outBytes` bytes, at least the `outBytes` of
 *  xcclCommDeviceRecvTokensSize): row i of `out` is the batch's token i (numTokens rows); the
 *  rest of `out` is left alone. Ordered after the work queued on `stream` (e.g. the experts'
 *  last read of `out`); the rows are in place when it returns. The batch (`*batch`) carries
 *  everything else (xcclTokenBatchGetInfo: sources, expertCount, localExperts, weights, tags;
 *  its `rows` is NULL) and is replied to with xcclE2ASendTokensDevice (or xcclE2ASendTokens).
 *  `onArrival`, when not NULL, is called as in xcclA2ERecvTokensWithCallback, each time one
 *  attention rank's rows are in place in `out` (rows firstToken..firstToken+numTokens-1; the
 *  info's `rows` is NULL): queue the experts' kernels on those rows there to overlap them with
 *  the rest of the receive; NULL: no callback. Not with config.keepInt8 (xcclInvalidArgument).
 *  Errors: as xcclA2ERecv, and xcclInvalidArgument for `outBytes` below the needed size and
 *  the device-buffer rules' (see above). */
xcclResult_t xcclA2ERecvTokensDevice(xcclComm_t comm, xcclTokenBatch_t* batch, void* out,
                                     size_t outBytes, xcclCudaStream_t stream,
                                     xcclArrivalFn onArrival, void* userData);

/** E2A send, token-major, from device memory: as xcclE2ASendTokens, with `reduced`
 *  ([numTokens, hidden] of config.dtype, row i the reply of the batch's token i, already the
 *  gating-weighted sum over its local experts) in device memory, ordered after the work
 *  queued on `stream` (the kernels that wrote it); `reduced` may be reused once it returns.
 *  On success `batch` is freed; on a retryable failure (a refused `reduced` among them) it
 *  stays valid. Errors: as xcclE2ASendTokens, and the device-buffer rules' (see above). */
xcclResult_t xcclE2ASendTokensDevice(xcclComm_t comm, xcclTokenBatch_t batch, const void* reduced,
                                     xcclCudaStream_t stream);

/** Writes the CUDA device ordinal of a communicator on the cuda fabric to `*device` (the
 *  device whose memory and streams the device-buffer calls take), -1 on other fabrics (as
 *  ncclCommCuDevice, plus the -1). A query. Errors: xcclInvalidArgument (NULL),
 *  xcclInvalidUsage (destroyed), xcclAborted. */
xcclResult_t xcclCommCuDevice(xcclComm_t comm, int* device);

/** Sizes of xcclA2ERecvDevice's `out` on this rank: `*maxExpertRows` = the most rows an
 *  expert-major batch can have (numAttentionRanks * maxTokensPerRank * min(topk, local
 *  experts); 0 on attention ranks), `*outBytes` = maxExpertRows * rowBytes. Allocate `out`
 *  once with outBytes and reuse it for every receive. A query (any fabric). Errors:
 *  xcclInvalidArgument (NULL), xcclInvalidUsage (destroyed), xcclAborted. */
xcclResult_t xcclCommDeviceRecvSize(xcclComm_t comm, size_t* maxExpertRows, size_t* outBytes);

/** Sizes of xcclA2ERecvTokensDevice's `out` on this rank: `*maxRecvTokens` = the most tokens a
 *  token-major batch can have (numAttentionRanks * maxTokensPerRank; 0 on attention ranks),
 *  `*outBytes` = maxRecvTokens * rowBytes. Allocate `out` once with outBytes and reuse it for
 *  every receive. A query (any fabric). Errors: xcclInvalidArgument (NULL), xcclInvalidUsage
 *  (destroyed), xcclAborted. */
xcclResult_t xcclCommDeviceRecvTokensSize(xcclComm_t comm, size_t* maxRecvTokens,
                                          size_t* outBytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* XCCL_H_ */
