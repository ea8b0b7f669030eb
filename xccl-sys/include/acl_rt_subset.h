/*
 * The subset of the Ascend CANN runtime C API (AscendCL, libascendcl.so) that xccl's `ascend`
 * fabric calls. Written for xccl, not copied: the prototypes, constants and enum values follow the
 * public `acl/acl_rt.h` and `acl/acl_base_rt.h` of CANN 9.0.1 (header version ACL 1.17.0,
 * open-sourced runtime tag v9.0.1), and the CANN 8.2/8.3/8.5 API reference pages for the same
 * calls. Only what xccl uses is declared.
 *
 * `xccl-sys/src/acl/bindings.rs` is generated from this file by `ci/gen-acl-bindings.sh`
 * (bindgen, allowlist `acl.*`, dynamic loading: every function becomes a field of `AclRuntime`
 * resolved with dlsym). `ci/gen-acl-bindings.sh --check` fails when the committed file is stale.
 *
 * Signals: the stream-ordered value calls (aclrtValueWrite/aclrtValueWait) rather than notifies.
 * They are the better documented fit: a 64-bit store into any device memory, IPC-imported memory
 * included, ordered after the earlier tasks of its stream, with documented comparison modes for
 * the wait; so a signal is one store into the block the peer already exported, and the host can
 * read the value. A notify carries no value (set/reset only), needs an IPC export per notify and
 * peer, and cannot be read from the host.
 *
 * Availability (from the API reference): the IPC memory calls, aclrtValueWrite/aclrtValueWait,
 * aclrtDeviceGetBareTgid and aclrtSynchronizeStreamWithTimeout exist in CANN 8.2 and later only;
 * xccl resolves them as optional symbols and checks them before use. The rest are required.
 */
#ifndef XCCL_ACL_RT_SUBSET_H
#define XCCL_ACL_RT_SUBSET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- acl_base_rt.h: status codes and handles ---- */

/** 0 on success; any other value is an error code (ACL_ERROR_* below, or a runtime code). */
typedef int aclError;
/** An opaque stream handle; NULL means the default stream. */
typedef void *aclrtStream;

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
/* aclInit was already called in this process (e.g. by the application): not a failure for xccl. */
#define ACL_ERROR_REPEAT_INITIALIZE 100002
/* From error_codes/rt_error_codes.h, the codes xccl's tests and messages refer to. */
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_NO_PERMISSION 207006
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046

/* ---- acl_rt.h: enums and flags ---- */

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEFAULT,
} aclrtMemcpyKind;

typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_MEM_MALLOC_HUGE_ONLY,
    ACL_MEM_MALLOC_NORMAL_ONLY,
    /** The _P2P policies allocate memory that another device may access (IPC across devices). */
    ACL_MEM_MALLOC_HUGE_FIRST_P2P,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P,
} aclrtMemMallocPolicy;

/* aclrtIpcMemGetExportKey flags: DEFAULT checks importers against a pid whitelist
 * (aclrtIpcMemSetImportPid); DISABLE_PID_VALIDATION lets any process import. */
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL
/* aclrtIpcMemImportByKey flags: DEFAULT needs aclrtDeviceEnablePeerAccess for memory of another
 * device; ENABLE_PEER_ACCESS enables it as part of the import. */
#define ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS 0x1UL
/* The `len` argument of aclrtIpcMemGetExportKey is fixed at 65 (64 characters and a NUL). */
#define ACL_IPC_MEM_KEY_LEN 65

/* aclrtValueWait comparisons (flag argument). */
#define ACL_STREAM_WAIT_VALUE_GEQ 0x00000000U /* until (int64_t)(*devAddr - value) >= 0 */
#define ACL_STREAM_WAIT_VALUE_EQ 0x00000001U  /* until *devAddr == value */
#define ACL_STREAM_WAIT_VALUE_AND 0x00000002U /* until (*devAddr & value) != 0 */
#define ACL_STREAM_WAIT_VALUE_NOR 0x00000003U /* until ~(*devAddr | value) != 0 */

/* ---- process and device ---- */

/** Initialises AscendCL; once per process. configPath may be NULL. */
aclError aclInit(const char *configPath);
/** Releases AscendCL; once per process, before exit. */
aclError aclFinalize(void);
/** The calling thread's most recent error message, or NULL. */
const char *aclGetRecentErrMsg(void);
/** Makes deviceId the calling thread's current device (creating its default context). */
aclError aclrtSetDevice(int32_t deviceId);
/** Releases the device resources of this process on deviceId. */
aclError aclrtResetDevice(int32_t deviceId);
/** The pid under which the device driver knows this process (use it for import whitelists). */
aclError aclrtDeviceGetBareTgid(int32_t *pid);
/** *canAccessPeer = 1 if deviceId can access peerDeviceId's memory. */
aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId, int32_t peerDeviceId);
/** Lets the current device access peerDeviceId's memory; flags must be 0. */
aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags);

/* ---- device memory and copies ---- */

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
/** Synchronous copy. */
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);
/** Asynchronous copy on stream; complete after aclrtSynchronizeStream. On-chip device-to-device
 * copies need 64-byte aligned source and destination addresses. */
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);

/* ---- streams ---- */

aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
/** Blocks the host until every task on stream has completed. */
aclError aclrtSynchronizeStream(aclrtStream stream);
/** Likewise with a timeout in milliseconds (-1: forever, 0: poll). */
aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);

/* ---- stream-ordered memory values (signals) ---- */

/** Writes the 64-bit value at devAddr (8-byte aligned) after earlier tasks of stream; flag 0. */
aclError aclrtValueWrite(void *devAddr, uint64_t value, uint32_t flag, aclrtStream stream);
/** Blocks stream (not the host) until the 64-bit value at devAddr satisfies flag against value. */
aclError aclrtValueWait(void *devAddr, uint64_t value, uint32_t flag, aclrtStream stream);

/* ---- inter-process device memory ---- */

/** Makes [devPtr, devPtr+size) shareable and writes its key (len must be 65). */
aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
/** Adds num pids (from each importer's aclrtDeviceGetBareTgid) to key's import whitelist. */
aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num);
/** Maps the memory behind key into this process; *devPtr is a device address usable here. */
aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags);
/** Importer: unmaps key's memory. Exporter: stops sharing it (after every importer closed it). */
aclError aclrtIpcMemClose(const char *key);

#ifdef __cplusplus
}
#endif

#endif /* XCCL_ACL_RT_SUBSET_H */
