/*
 * A stand-in for the Ascend runtime (libascendcl.so) for xccl's tests on machines without an NPU.
 *
 * It exports the functions of xccl-sys/include/acl_rt_subset.h (compiled against that header, so
 * the prototypes are checked) and mimics their documented semantics over host shared memory:
 *
 * - "Device memory" is host memory: every aclrtMalloc creates a POSIX shared-memory segment named
 *   /<prefix>-<pid>-<n> (prefix from ACL_STANDIN_SHM_PREFIX, default "xccl-aclstandin") with a
 *   one-page header and the data after it. Device addresses are tracked, and every copy checks
 *   that its kind matches where its addresses live.
 * - IPC: aclrtIpcMemGetExportKey returns the segment name as the key; aclrtIpcMemImportByKey maps
 *   it in another process, only if the importer's pid was allowed with aclrtIpcMemSetImportPid
 *   (whitelist in the segment header; error ACL_ERROR_RT_NO_PERMISSION otherwise) unless the
 *   export disabled pid validation. As documented for imported memory, host<->device copies and
 *   synchronous device-to-device copies touching it are rejected (ACL_ERROR_RT_FEATURE_NOT_SUPPORT),
 *   and memory of another device needs aclrtDeviceEnablePeerAccess (or the import flag).
 * - Streams are queues, run when synchronized: a caller that forgets to synchronize, or reuses a
 *   source buffer before its queued copy ran, sees stale bytes.
 * - aclrtValueWrite is an atomic 64-bit release store; aclrtValueWait spins (acquire) until its
 *   condition holds or the synchronize call's timeout passes (ACL_ERROR_RT_STREAM_SYNC_TIMEOUT).
 * - Device calls need aclInit and a current device on the calling thread (aclrtSetDevice),
 *   else ACL_ERROR_UNINITIALIZE / ACL_ERROR_RT_CONTEXT_NULL.
 * - Failure injection: ACL_STANDIN_FAIL="<function>:<code>[:<skip>]" makes <function> return
 *   <code> after <skip> successful calls (default 0), with a recent-error message naming it.
 * - aclGetRecentErrMsg returns (and clears) the calling thread's last error message.
 *
 * Segments are unlinked by aclrtFree, by the exporter's aclrtIpcMemClose, and at exit; a process
 * killed with SIGKILL leaves its segments behind, and the tests remove them by prefix.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "acl_rt_subset.h"

#define EXPORT __attribute__((visibility("default")))
#define HDR_BYTES 4096
#define MAX_ALLOWED 480
#define MAX_ALLOCS 1024
#define SEG_MAGIC 0x5354414e44494e31ULL /* "STANDIN1" */

struct seg_hdr {
    uint64_t magic;
    uint64_t size;
    int32_t owner_pid;
    int32_t device;
    uint32_t exported;
    uint32_t pid_validation;
    uint32_t n_allowed;
    int32_t allowed[MAX_ALLOWED];
};

struct alloc {
    int used;
    int imported;
    char name[ACL_IPC_MEM_KEY_LEN];
    unsigned char *map; /* mapping start (header) */
    size_t map_len;
    unsigned char *data; /* device address handed out */
    size_t size;
    int device;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc g_allocs[MAX_ALLOCS];
static unsigned long g_seq;
static int g_initialized;
static int g_peer_enabled[64];
static __thread int t_device = -1;
static __thread char t_msg[512];
static __thread int t_has_msg;

static void set_msg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_msg, sizeof t_msg, fmt, ap);
    va_end(ap);
    t_has_msg = 1;
}

static aclError fail(aclError code, const char *fmt, ...) {
    char buf[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    set_msg("EE9999: stand-in runtime: %s (code %d)", buf, code);
    return code;
}

/* ACL_STANDIN_FAIL="<function>:<code>[:<skip>]" */
static aclError injected(const char *fn) {
    static __thread unsigned long calls;
    static __thread char counted_for[64];
    const char *spec = getenv("ACL_STANDIN_FAIL");
    if (spec == NULL) return ACL_SUCCESS;
    size_t n = strlen(fn);
    if (strncmp(spec, fn, n) != 0 || spec[n] != ':') return ACL_SUCCESS;
    char *end = NULL;
    long code = strtol(spec + n + 1, &end, 10);
    unsigned long skip = 0;
    if (end != NULL && *end == ':') skip = strtoul(end + 1, NULL, 10);
    if (strcmp(counted_for, fn) != 0) {
        snprintf(counted_for, sizeof counted_for, "%s", fn);
        calls = 0;
    }
    if (calls++ < skip) return ACL_SUCCESS;
    set_msg("EE1001: stand-in runtime: injected failure of %s (ACL_STANDIN_FAIL), code %ld", fn,
            code);
    return (aclError)code;
}

#define INJECT(fn)                         \
    do {                                   \
        aclError inj__ = injected(fn);     \
        if (inj__ != ACL_SUCCESS) return inj__; \
    } while (0)

static aclError need_device(const char *fn) {
    if (!g_initialized) return fail(ACL_ERROR_UNINITIALIZE, "%s before aclInit", fn);
    if (t_device < 0)
        return fail(ACL_ERROR_RT_CONTEXT_NULL, "%s: no current device on this thread (aclrtSetDevice)",
                    fn);
    return ACL_SUCCESS;
}

/* The allocation holding [p, p+len), or NULL (host memory). Caller holds g_lock. */
static struct alloc *find(const void *p, size_t len) {
    const unsigned char *c = p;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->used && c >= a->data && c < a->data + a->size) {
            if ((size_t)(a->data + a->size - c) < len) return NULL;
            return a;
        }
    }
    return NULL;
}

static struct alloc *find_key(const char *key, int imported) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->used && a->imported == imported && strcmp(a->name, key) == 0) return a;
    }
    return NULL;
}

static struct alloc *free_slot(void) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!g_allocs[i].used) return &g_allocs[i];
    return NULL;
}

static void unlink_all_own(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->used && !a->imported) {
            char path[ACL_IPC_MEM_KEY_LEN + 1];
            snprintf(path, sizeof path, "/%s", a->name);
            shm_unlink(path);
        }
    }
    pthread_mutex_unlock(&g_lock);
}

/* ---- process and device ---- */

EXPORT aclError aclInit(const char *configPath) {
    (void)configPath;
    INJECT("aclInit");
    pthread_mutex_lock(&g_lock);
    int again = g_initialized;
    if (!again) {
        g_initialized = 1;
        atexit(unlink_all_own);
    }
    pthread_mutex_unlock(&g_lock);
    if (again) return fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit called twice");
    return ACL_SUCCESS;
}

EXPORT aclError aclFinalize(void) {
    INJECT("aclFinalize");
    if (!g_initialized) return fail(ACL_ERROR_UNINITIALIZE, "aclFinalize before aclInit");
    g_initialized = 0;
    return ACL_SUCCESS;
}

EXPORT const char *aclGetRecentErrMsg(void) {
    if (!t_has_msg) return NULL;
    t_has_msg = 0;
    return t_msg;
}

EXPORT aclError aclrtSetDevice(int32_t deviceId) {
    INJECT("aclrtSetDevice");
    if (!g_initialized) return fail(ACL_ERROR_UNINITIALIZE, "aclrtSetDevice before aclInit");
    if (deviceId < 0 || deviceId >= 64)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "no device %d (the stand-in has 0..63)", deviceId);
    t_device = deviceId;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtResetDevice(int32_t deviceId) {
    INJECT("aclrtResetDevice");
    if (deviceId != t_device)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtResetDevice(%d) but the current device is %d",
                    deviceId, t_device);
    t_device = -1;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDeviceGetBareTgid(int32_t *pid) {
    INJECT("aclrtDeviceGetBareTgid");
    if (pid == NULL) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceGetBareTgid(NULL)");
    *pid = (int32_t)getpid();
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId,
                                         int32_t peerDeviceId) {
    INJECT("aclrtDeviceCanAccessPeer");
    if (canAccessPeer == NULL || deviceId < 0 || deviceId >= 64 || peerDeviceId < 0 ||
        peerDeviceId >= 64)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceCanAccessPeer(%d, %d)", deviceId,
                    peerDeviceId);
    *canAccessPeer = deviceId != peerDeviceId;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags) {
    INJECT("aclrtDeviceEnablePeerAccess");
    aclError e = need_device("aclrtDeviceEnablePeerAccess");
    if (e) return e;
    if (flags != 0 || peerDeviceId < 0 || peerDeviceId >= 64 || peerDeviceId == t_device)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtDeviceEnablePeerAccess(%d, %u) on device %d",
                    peerDeviceId, flags, t_device);
    g_peer_enabled[peerDeviceId] = 1;
    return ACL_SUCCESS;
}

/* ---- memory ---- */

EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    INJECT("aclrtMalloc");
    aclError e = need_device("aclrtMalloc");
    if (e) return e;
    if (devPtr == NULL || size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc of %zu bytes", size);
    const char *prefix = getenv("ACL_STANDIN_SHM_PREFIX");
    if (prefix == NULL || *prefix == 0) prefix = "xccl-aclstandin";
    pthread_mutex_lock(&g_lock);
    struct alloc *a = free_slot();
    if (a == NULL) {
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "too many allocations");
    }
    char name[ACL_IPC_MEM_KEY_LEN];
    int n = snprintf(name, sizeof name, "%s-%d-%lu", prefix, (int)getpid(), g_seq++);
    if (n <= 0 || n >= (int)sizeof name) {
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_INVALID_PARAM, "ACL_STANDIN_SHM_PREFIX too long");
    }
    char path[ACL_IPC_MEM_KEY_LEN + 1];
    snprintf(path, sizeof path, "/%s", name);
    int fd = shm_open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "shm_open(%s): %s", path, strerror(errno));
    }
    size_t len = HDR_BYTES + ((size + 4095) / 4096) * 4096;
    void *m = MAP_FAILED;
    if (ftruncate(fd, (off_t)len) == 0)
        m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(path);
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "mapping %zu bytes: %s", len, strerror(err));
    }
    struct seg_hdr *h = m;
    h->magic = SEG_MAGIC;
    h->size = size;
    h->owner_pid = (int32_t)getpid();
    h->device = t_device;
    memset(a, 0, sizeof *a);
    a->used = 1;
    snprintf(a->name, sizeof a->name, "%s", name);
    a->map = m;
    a->map_len = len;
    a->data = (unsigned char *)m + HDR_BYTES;
    a->size = size;
    a->device = t_device;
    *devPtr = a->data;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtFree(void *devPtr) {
    INJECT("aclrtFree");
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(devPtr, 1);
    if (a == NULL || a->data != devPtr || a->imported) {
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree(%p): not an allocation of this process",
                    devPtr);
    }
    char path[ACL_IPC_MEM_KEY_LEN + 1];
    snprintf(path, sizeof path, "/%s", a->name);
    shm_unlink(path);
    munmap(a->map, a->map_len);
    a->used = 0;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

/* Checks a copy's addresses against its kind; `sync` copies may not touch imported memory. */
static aclError check_copy(const char *fn, void *dst, size_t destMax, const void *src, size_t count,
                           aclrtMemcpyKind kind, int sync) {
    if (dst == NULL || src == NULL) return fail(ACL_ERROR_INVALID_PARAM, "%s: NULL address", fn);
    if (count > destMax)
        return fail(ACL_ERROR_INVALID_PARAM, "%s: count %zu > destMax %zu", fn, count, destMax);
    pthread_mutex_lock(&g_lock);
    struct alloc *d = find(dst, count), *s = find(src, count);
    int want_dd = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    int want_sd = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    aclError e = ACL_SUCCESS;
    if (kind == ACL_MEMCPY_DEFAULT || kind == ACL_MEMCPY_HOST_TO_HOST) {
        e = fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "%s: kind %d is not used by xccl", fn, kind);
    } else if ((d != NULL) != want_dd || (s != NULL) != want_sd) {
        e = fail(ACL_ERROR_RT_PARAM_INVALID,
                 "%s: kind %d but destination is %s memory and source is %s memory (or a range "
                 "runs past its allocation)",
                 fn, kind, d ? "device" : "host", s ? "device" : "host");
    } else if (kind != ACL_MEMCPY_DEVICE_TO_DEVICE && ((d && d->imported) || (s && s->imported))) {
        e = fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                 "%s: host<->device copy of IPC-imported memory is not supported", fn);
    } else if (sync && ((d && d->imported) || (s && s->imported))) {
        e = fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                 "%s: synchronous copy of IPC-imported memory is not supported (use "
                 "aclrtMemcpyAsync)",
                 fn);
    } else {
        struct alloc *ends[2] = {d, s};
        for (int i = 0; i < 2 && e == ACL_SUCCESS; i++) {
            struct alloc *x = ends[i];
            if (x && x->device != t_device && !g_peer_enabled[x->device])
                e = fail(ACL_ERROR_RT_NO_PERMISSION,
                         "%s: memory of device %d from device %d without peer access "
                         "(aclrtDeviceEnablePeerAccess)",
                         fn, x->device, t_device);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return e;
}

/* A copy as the device would do it: 8 aligned bytes move atomically (signal slots). */
static void do_copy(void *dst, const void *src, size_t count) {
    if (count == 8 && ((uintptr_t)dst & 7) == 0 && ((uintptr_t)src & 7) == 0) {
        uint64_t v = __atomic_load_n((const uint64_t *)src, __ATOMIC_ACQUIRE);
        __atomic_store_n((uint64_t *)dst, v, __ATOMIC_RELEASE);
    } else {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        memmove(dst, src, count);
        __atomic_thread_fence(__ATOMIC_RELEASE);
    }
}

EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                            aclrtMemcpyKind kind) {
    INJECT("aclrtMemcpy");
    aclError e = need_device("aclrtMemcpy");
    if (e) return e;
    e = check_copy("aclrtMemcpy", dst, destMax, src, count, kind, 1);
    if (e) return e;
    do_copy(dst, src, count);
    return ACL_SUCCESS;
}

/* ---- streams ---- */

enum op_kind { OP_COPY, OP_WRITE, OP_WAIT };
struct op {
    enum op_kind kind;
    void *dst;
    const void *src;
    size_t count;
    uint64_t value;
    uint32_t flag;
};
struct stream {
    uint64_t magic;
    int device;
    struct op *ops;
    size_t n, cap;
};
#define STREAM_MAGIC 0x53545245414d3031ULL

static aclError check_stream(const char *fn, aclrtStream s) {
    struct stream *st = s;
    if (st == NULL) return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: the default stream is not supported by the stand-in", fn);
    if (st->magic != STREAM_MAGIC) return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: bad stream %p", fn, s);
    if (st->device != t_device)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: stream of device %d used on device %d", fn,
                    st->device, t_device);
    return ACL_SUCCESS;
}

static aclError enqueue(struct stream *st, struct op op) {
    if (st->n == st->cap) {
        size_t cap = st->cap ? 2 * st->cap : 64;
        struct op *ops = realloc(st->ops, cap * sizeof *ops);
        if (ops == NULL) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "stream queue");
        st->ops = ops;
        st->cap = cap;
    }
    st->ops[st->n++] = op;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtCreateStream(aclrtStream *stream) {
    INJECT("aclrtCreateStream");
    aclError e = need_device("aclrtCreateStream");
    if (e) return e;
    struct stream *st = calloc(1, sizeof *st);
    if (st == NULL) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "stream");
    st->magic = STREAM_MAGIC;
    st->device = t_device;
    *stream = st;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDestroyStream(aclrtStream stream) {
    INJECT("aclrtDestroyStream");
    aclError e = check_stream("aclrtDestroyStream", stream);
    if (e) return e;
    struct stream *st = stream;
    st->magic = 0;
    free(st->ops);
    free(st);
    return ACL_SUCCESS;
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int wait_done(const uint64_t *addr, uint64_t value, uint32_t flag) {
    uint64_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    switch (flag) {
    case ACL_STREAM_WAIT_VALUE_GEQ: return (int64_t)(v - value) >= 0;
    case ACL_STREAM_WAIT_VALUE_EQ: return v == value;
    case ACL_STREAM_WAIT_VALUE_AND: return (v & value) != 0;
    default: return ~(v | value) != 0;
    }
}

/* Runs the queued tasks in order; a wait gives up after timeout_ms (<0: forever). */
static aclError run_stream(struct stream *st, int32_t timeout_ms) {
    uint64_t start = now_ms();
    size_t i = 0;
    aclError e = ACL_SUCCESS;
    for (; i < st->n; i++) {
        struct op *op = &st->ops[i];
        if (op->kind == OP_COPY) {
            do_copy(op->dst, op->src, op->count);
        } else if (op->kind == OP_WRITE) {
            __atomic_store_n((uint64_t *)op->dst, op->value, __ATOMIC_RELEASE);
        } else {
            while (!wait_done(op->dst, op->value, op->flag)) {
                if (timeout_ms >= 0 && now_ms() - start >= (uint64_t)timeout_ms) {
                    e = fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
                             "stream synchronize timed out after %d ms in aclrtValueWait",
                             timeout_ms);
                    goto out;
                }
                usleep(50);
            }
        }
    }
out:
    /* Tasks not run stay queued (as on a device, the stream still holds them). */
    memmove(st->ops, st->ops + i, (st->n - i) * sizeof *st->ops);
    st->n -= i;
    return e;
}

EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
    INJECT("aclrtSynchronizeStream");
    aclError e = check_stream("aclrtSynchronizeStream", stream);
    if (e) return e;
    return run_stream(stream, -1);
}

/* Built without it (-DSTANDIN_NO_SYNC_TIMEOUT), the stand-in plays a runtime whose stream
 * synchronize has no bound, which xccl refuses. */
#ifndef STANDIN_NO_SYNC_TIMEOUT
EXPORT aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
    INJECT("aclrtSynchronizeStreamWithTimeout");
    aclError e = check_stream("aclrtSynchronizeStreamWithTimeout", stream);
    if (e) return e;
    return run_stream(stream, timeout);
}
#endif

EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                 aclrtMemcpyKind kind, aclrtStream stream) {
    INJECT("aclrtMemcpyAsync");
    aclError e = need_device("aclrtMemcpyAsync");
    if (e) return e;
    e = check_stream("aclrtMemcpyAsync", stream);
    if (e) return e;
    e = check_copy("aclrtMemcpyAsync", dst, destMax, src, count, kind, 0);
    if (e) return e;
    struct op op = {OP_COPY, dst, src, count, 0, 0};
    return enqueue(stream, op);
}

static aclError value_op(const char *fn, enum op_kind kind, void *devAddr, uint64_t value,
                         uint32_t flag, aclrtStream stream) {
    aclError e = need_device(fn);
    if (e) return e;
    e = check_stream(fn, stream);
    if (e) return e;
    if (((uintptr_t)devAddr & 7) != 0)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: address %p is not 8-byte aligned", fn, devAddr);
    if (kind == OP_WRITE && flag != 0)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: flag must be 0", fn);
    if (kind == OP_WAIT && flag > ACL_STREAM_WAIT_VALUE_NOR)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: bad flag %u", fn, flag);
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(devAddr, 8);
    int bad = a == NULL || (a->device != t_device && !g_peer_enabled[a->device]);
    pthread_mutex_unlock(&g_lock);
    if (bad)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "%s: %p is not device memory this device may access",
                    fn, devAddr);
    struct op op = {kind, devAddr, NULL, 8, value, flag};
    return enqueue(stream, op);
}

EXPORT aclError aclrtValueWrite(void *devAddr, uint64_t value, uint32_t flag, aclrtStream stream) {
    INJECT("aclrtValueWrite");
    return value_op("aclrtValueWrite", OP_WRITE, devAddr, value, flag, stream);
}

EXPORT aclError aclrtValueWait(void *devAddr, uint64_t value, uint32_t flag, aclrtStream stream) {
    INJECT("aclrtValueWait");
    return value_op("aclrtValueWait", OP_WAIT, devAddr, value, flag, stream);
}

/* ---- IPC ---- */

EXPORT aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len,
                                        uint64_t flags) {
    INJECT("aclrtIpcMemGetExportKey");
    aclError e = need_device("aclrtIpcMemGetExportKey");
    if (e) return e;
    if (key == NULL || len != ACL_IPC_MEM_KEY_LEN || flags > 1)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtIpcMemGetExportKey: len %zu (must be 65), flags %lu",
                    len, (unsigned long)flags);
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(devPtr, size);
    if (a == NULL || a->imported || a->data != devPtr) {
        pthread_mutex_unlock(&g_lock);
        return fail(ACL_ERROR_RT_PARAM_INVALID,
                    "aclrtIpcMemGetExportKey: %p+%zu is not the start of an allocation of this "
                    "process",
                    devPtr, size);
    }
    struct seg_hdr *h = (struct seg_hdr *)a->map;
    h->pid_validation = !(flags & ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION);
    __atomic_store_n(&h->exported, 1, __ATOMIC_RELEASE);
    snprintf(key, len, "%s", a->name);
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num) {
    INJECT("aclrtIpcMemSetImportPid");
    if (key == NULL || (pid == NULL && num > 0))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtIpcMemSetImportPid: NULL argument");
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find_key(key, 0);
    struct seg_hdr *h = a ? (struct seg_hdr *)a->map : NULL;
    aclError e = ACL_SUCCESS;
    if (h == NULL || !h->exported) {
        e = fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemSetImportPid: key %s is not exported by this process",
                 key);
    } else if (h->n_allowed + num > MAX_ALLOWED) {
        e = fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemSetImportPid: more than %d pids", MAX_ALLOWED);
    } else {
        for (size_t i = 0; i < num; i++) h->allowed[h->n_allowed + i] = pid[i];
        __atomic_store_n(&h->n_allowed, h->n_allowed + (uint32_t)num, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_lock);
    return e;
}

EXPORT aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags) {
    INJECT("aclrtIpcMemImportByKey");
    aclError e = need_device("aclrtIpcMemImportByKey");
    if (e) return e;
    if (devPtr == NULL || key == NULL || strlen(key) >= ACL_IPC_MEM_KEY_LEN || flags > 1)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtIpcMemImportByKey: bad argument");
    char path[ACL_IPC_MEM_KEY_LEN + 1];
    snprintf(path, sizeof path, "/%s", key);
    int fd = shm_open(path, O_RDWR, 0);
    if (fd < 0)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemImportByKey: no memory exported as %s (%s)",
                    key, strerror(errno));
    struct stat sb;
    void *m = MAP_FAILED;
    if (fstat(fd, &sb) == 0 && sb.st_size >= HDR_BYTES)
        m = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemImportByKey: cannot map %s", key);
    struct seg_hdr *h = m;
    int32_t me = (int32_t)getpid();
    int allowed = !h->pid_validation;
    uint32_t n = __atomic_load_n(&h->n_allowed, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n && i < MAX_ALLOWED; i++)
        if (h->allowed[i] == me) allowed = 1;
    if (h->magic != SEG_MAGIC || !__atomic_load_n(&h->exported, __ATOMIC_ACQUIRE)) {
        munmap(m, (size_t)sb.st_size);
        return fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemImportByKey: %s is not exported", key);
    }
    if (!allowed) {
        munmap(m, (size_t)sb.st_size);
        return fail(ACL_ERROR_RT_NO_PERMISSION,
                    "aclrtIpcMemImportByKey: process %d is not in the import whitelist of %s "
                    "(aclrtIpcMemSetImportPid)",
                    (int)me, key);
    }
    pthread_mutex_lock(&g_lock);
    struct alloc *a = free_slot();
    if (a == NULL) {
        pthread_mutex_unlock(&g_lock);
        munmap(m, (size_t)sb.st_size);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "too many allocations");
    }
    memset(a, 0, sizeof *a);
    a->used = 1;
    a->imported = 1;
    snprintf(a->name, sizeof a->name, "%s", key);
    a->map = m;
    a->map_len = (size_t)sb.st_size;
    a->data = (unsigned char *)m + HDR_BYTES;
    a->size = h->size;
    a->device = h->device;
    if (flags & ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS && a->device != t_device)
        g_peer_enabled[a->device] = 1;
    *devPtr = a->data;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcMemClose(const char *key) {
    INJECT("aclrtIpcMemClose");
    if (key == NULL) return fail(ACL_ERROR_INVALID_PARAM, "aclrtIpcMemClose(NULL)");
    pthread_mutex_lock(&g_lock);
    aclError e = ACL_SUCCESS;
    struct alloc *a = find_key(key, 1);
    if (a != NULL) {
        munmap(a->map, a->map_len);
        a->used = 0;
    } else if ((a = find_key(key, 0)) != NULL && ((struct seg_hdr *)a->map)->exported) {
        ((struct seg_hdr *)a->map)->exported = 0;
        char path[ACL_IPC_MEM_KEY_LEN + 1];
        snprintf(path, sizeof path, "/%s", key);
        shm_unlink(path);
    } else {
        e = fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtIpcMemClose: key %s is neither imported nor exported here",
                 key);
    }
    pthread_mutex_unlock(&g_lock);
    return e;
}
