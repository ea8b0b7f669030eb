/*
 * A stand-in for the CUDA driver (libcuda.so.1) for xccl's tests on machines without a GPU.
 * CI tests the cuda fabric and xccl's CUDA layer against it; no GPU behaviour is verified.
 *
 * It exports the driver functions xccl-sys/src/cuda declares, under the same (_v2) symbol names,
 * and mimics their documented semantics over host memory:
 *
 * - Devices: CUDA_STANDIN_DEVICES=<n> (default 1, at most 64) devices of compute capability 9.0
 *   named "xccl stand-in (host memory)". cuInit must come first (else CUDA_ERROR_NOT_INITIALIZED);
 *   calls that need a context need a current one on the calling thread (cuCtxSetCurrent of a
 *   primary context, else CUDA_ERROR_INVALID_CONTEXT).
 * - Memory: every cuMemAlloc creates a POSIX shared-memory segment named
 *   /<prefix>-<pid>-<n> (prefix from CUDA_STANDIN_SHM_PREFIX, default "xccl-cudastandin") and
 *   maps it; the device address handed out IS the host address of that mapping (xccl must still
 *   never dereference it: on a real GPU it is not host memory). Copies and memsets check that
 *   their device side lies inside a live allocation (own or IPC-opened), else
 *   CUDA_ERROR_INVALID_VALUE. CUDA_STANDIN_MEM_LIMIT=<bytes> makes cuMemAlloc fail with
 *   CUDA_ERROR_OUT_OF_MEMORY once the process's allocations would pass it.
 * - IPC: cuIpcGetMemHandle puts {magic, size, exporter pid, device, segment name} into the
 *   64-byte handle; cuIpcOpenMemHandle maps the segment in another process. A handle exported
 *   by the calling process itself is refused with CUDA_ERROR_INVALID_CONTEXT, as the real driver
 *   refuses it; a handle without the magic with CUDA_ERROR_INVALID_VALUE.
 * - Streams and events run every operation when it is enqueued, in order: an async copy is
 *   complete when its call returns, cuStreamQuery and cuEventQuery return CUDA_SUCCESS.
 * - Modules: cuModuleLoadData accepts any non-empty image; cuModuleGetFunction finds kernels by
 *   name in xccl_standin_kernels[] (standin_kernels.h, kernels.c: each CUDA kernel of xccl
 *   written again in C), else CUDA_ERROR_NOT_FOUND; cuLaunchKernel runs it on the host with the
 *   launch's kernelParams.
 * - cuPointerGetAttribute knows the stand-in's allocations (device memory, their device, their
 *   start and size) and
 *   answers CUDA_ERROR_INVALID_VALUE for any other pointer, as the real driver does for host
 *   memory it does not know.
 * - Counters: every successful host-to-device, device-to-host and device-to-device copy (sync
 *   and async, cuMemcpyPeerAsync counted as device-to-device), memset and kernel launch is
 *   counted per process, calls and bytes; cuda_standin_counters() (exported, not a driver call)
 *   reads them, for tests that check what a call moved between host and device.
 * - Failure injection: CUDA_STANDIN_FAIL="<symbol>:<code>[:<skip>]" makes <symbol> (the exported
 *   name, e.g. cuMemAlloc_v2) return <code> after <skip> successful calls (default 0).
 *
 * Segments are unlinked by cuMemFree and at exit; a process killed with SIGKILL leaves its
 * segments behind, and the tests remove them by prefix.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "standin_kernels.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64
#define MAX_ALLOCS 1024
#define NAME_BYTES 40
#define HANDLE_MAGIC 0x4455435843434c31ULL /* "1LCCXCUD" */
#define OBJ_STREAM 0x5354524dU
#define OBJ_EVENT 0x45564e54U
#define OBJ_MODULE 0x4d4f4455U

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

struct ctx {
    int device;
    int retained;
    int peer_enabled[MAX_DEVICES];
};

struct obj {
    unsigned magic;
    int device;
};

struct alloc {
    int used;
    int imported;
    int refs; /* opens of an imported segment */
    char name[NAME_BYTES];
    unsigned char *data; /* mapping start = device address */
    size_t size;
    size_t map_len;
    int device;
};

struct handle {
    uint64_t magic;
    uint64_t size;
    int32_t pid;
    int32_t device;
    char name[NAME_BYTES];
};
_Static_assert(sizeof(struct handle) == 64, "the handle fills CUipcMemHandle");

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc g_allocs[MAX_ALLOCS];
static struct ctx g_ctx[MAX_DEVICES];
static unsigned long g_seq;
static size_t g_allocated;
static int g_initialized;
static unsigned long g_injected_calls;
static __thread struct ctx *t_ctx;

/* The transfer counters, in the order cuda_standin_counters() writes them. */
enum {
    CNT_HTOD_CALLS,
    CNT_HTOD_BYTES,
    CNT_DTOH_CALLS,
    CNT_DTOH_BYTES,
    CNT_DTOD_CALLS,
    CNT_DTOD_BYTES,
    CNT_MEMSET_CALLS,
    CNT_MEMSET_BYTES,
    CNT_LAUNCHES,
    CNT_COUNT,
};
static unsigned long long g_counters[CNT_COUNT];

/* Counts one call of kind `calls` (a *_CALLS index) moving `bytes` (counted at calls + 1);
 * launches are counted alone. */
static void count(int calls, size_t bytes) {
    __atomic_fetch_add(&g_counters[calls], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&g_counters[calls + 1], (unsigned long long)bytes, __ATOMIC_RELAXED);
}

/*
 * Not a driver call: writes the first min(n, CNT_COUNT) counters of this process to out (in
 * the enum's order: htod calls, htod bytes, dtoh calls, dtoh bytes, dtod calls, dtod bytes,
 * memset calls, memset bytes, kernel launches) and returns how many counters there are.
 */
EXPORT int cuda_standin_counters(unsigned long long *out, int n) {
    for (int i = 0; out != NULL && i < n && i < CNT_COUNT; i++)
        out[i] = __atomic_load_n(&g_counters[i], __ATOMIC_RELAXED);
    return CNT_COUNT;
}

static void note(const char *fmt, const char *what) {
    if (getenv("CUDA_STANDIN_VERBOSE")) fprintf(stderr, fmt, what);
}

/* CUDA_STANDIN_FAIL="<symbol>:<code>[:<skip>]" */
static CUresult injected(const char *fn) {
    const char *spec = getenv("CUDA_STANDIN_FAIL");
    if (spec == NULL) return CUDA_SUCCESS;
    size_t n = strlen(fn);
    if (strncmp(spec, fn, n) != 0 || spec[n] != ':') return CUDA_SUCCESS;
    char *end = NULL;
    long code = strtol(spec + n + 1, &end, 10);
    unsigned long skip = 0;
    if (end != NULL && *end == ':') skip = strtoul(end + 1, NULL, 10);
    if (__atomic_fetch_add(&g_injected_calls, 1, __ATOMIC_RELAXED) < skip) return CUDA_SUCCESS;
    note("cuda stand-in: injected failure of %s (CUDA_STANDIN_FAIL)\n", fn);
    return (CUresult)code;
}

#define INJECT(fn)                                   \
    do {                                             \
        CUresult inj__ = injected(fn);               \
        if (inj__ != CUDA_SUCCESS) return inj__;     \
    } while (0)

static int device_count(void) {
    const char *s = getenv("CUDA_STANDIN_DEVICES");
    long n = s ? strtol(s, NULL, 10) : 1;
    if (n < 0) n = 0;
    if (n > MAX_DEVICES) n = MAX_DEVICES;
    return (int)n;
}

static CUresult need_ctx(void) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (t_ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

#define NEED_CTX()                                   \
    do {                                             \
        CUresult need__ = need_ctx();                \
        if (need__ != CUDA_SUCCESS) return need__;   \
    } while (0)

/* The live allocation holding [p, p+len), or NULL. Caller holds g_lock. */
static struct alloc *find(CUdeviceptr p, size_t len) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        CUdeviceptr base = (CUdeviceptr)(uintptr_t)a->data;
        if (a->used && p >= base && p < base + a->size) {
            if (base + a->size - p < len) return NULL;
            return a;
        }
    }
    return NULL;
}

/* An unused slot of the allocation table, or NULL. Caller holds g_lock. */
static struct alloc *free_slot(void) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!g_allocs[i].used) return &g_allocs[i];
    return NULL;
}

/* Whether [p, p+len) is device memory of a live allocation (len 0 is always fine). */
static int is_device(CUdeviceptr p, size_t len) {
    if (len == 0) return 1;
    pthread_mutex_lock(&g_lock);
    int ok = find(p, len) != NULL;
    pthread_mutex_unlock(&g_lock);
    return ok;
}

static int valid_obj(const void *o, unsigned magic) {
    return o != NULL && ((const struct obj *)o)->magic == magic;
}

/* A stream argument: NULL (the default stream) or one made by cuStreamCreate. */
static int valid_stream(const void *s) { return s == NULL || valid_obj(s, OBJ_STREAM); }

static void unlink_all_own(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->used && !a->imported) shm_unlink(a->name);
    }
    pthread_mutex_unlock(&g_lock);
}

/* ---- init, devices, contexts ---- */

EXPORT CUresult cuInit(unsigned flags) {
    INJECT("cuInit");
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        g_initialized = 1;
        atexit(unlink_all_own);
    }
    pthread_mutex_unlock(&g_lock);
    return device_count() == 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    INJECT("cuDeviceGetCount");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    INJECT("cuDeviceGet");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *value, unsigned attrib, CUdevice dev) {
    INJECT("cuDeviceGetAttribute");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 75: *value = 9; return CUDA_SUCCESS; /* compute capability major */
    case 76: *value = 0; return CUDA_SUCCESS; /* minor */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    INJECT("cuDeviceGetName");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (name == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", "xccl stand-in (host memory)");
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(void **pctx, CUdevice dev) {
    INJECT("cuDevicePrimaryCtxRetain");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    g_ctx[dev].device = dev;
    g_ctx[dev].retained++;
    pthread_mutex_unlock(&g_lock);
    *pctx = &g_ctx[dev];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    INJECT("cuDevicePrimaryCtxRelease_v2");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_ctx[dev].retained > 0)
        g_ctx[dev].retained--;
    else
        r = CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_unlock(&g_lock);
    return r;
}

static int valid_ctx(const void *c) {
    const struct ctx *p = c;
    return p >= &g_ctx[0] && p < &g_ctx[MAX_DEVICES] && p->retained > 0;
}

EXPORT CUresult cuCtxSetCurrent(void *ctx) {
    INJECT("cuCtxSetCurrent");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != NULL && !valid_ctx(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    t_ctx = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(void **pctx) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    INJECT("cuDeviceCanAccessPeer");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (can == NULL) return CUDA_ERROR_INVALID_VALUE;
    int n = device_count();
    if (dev < 0 || dev >= n || peer < 0 || peer >= n) return CUDA_ERROR_INVALID_DEVICE;
    *can = dev != peer;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
    INJECT("cuCtxEnablePeerAccess");
    NEED_CTX();
    if (flags != 0 || !valid_ctx(peer) || peer == t_ctx) return CUDA_ERROR_INVALID_VALUE;
    int d = ((struct ctx *)peer)->device;
    if (t_ctx->peer_enabled[d]) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    t_ctx->peer_enabled[d] = 1;
    return CUDA_SUCCESS;
}

/* ---- memory ---- */

static size_t page_round(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    INJECT("cuMemAlloc_v2");
    NEED_CTX();
    if (dptr == NULL || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    const char *limit = getenv("CUDA_STANDIN_MEM_LIMIT");
    const char *prefix = getenv("CUDA_STANDIN_SHM_PREFIX");
    if (prefix == NULL || prefix[0] == 0) prefix = "xccl-cudastandin";
    pthread_mutex_lock(&g_lock);
    if (limit != NULL && g_allocated + bytes > strtoull(limit, NULL, 10)) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct alloc *a = free_slot();
    if (a == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    char name[NAME_BYTES];
    int w = snprintf(name, sizeof name, "/%s-%d-%lu", prefix, (int)getpid(), g_seq++);
    if (w < 0 || (size_t)w >= sizeof name) {
        pthread_mutex_unlock(&g_lock);
        fprintf(stderr, "cuda stand-in: CUDA_STANDIN_SHM_PREFIX %s is too long\n", prefix);
        return CUDA_ERROR_INVALID_VALUE;
    }
    size_t map_len = page_round(bytes);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    void *m = MAP_FAILED;
    if (fd >= 0) {
        if (ftruncate(fd, (off_t)map_len) == 0)
            m = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    if (m == MAP_FAILED) {
        if (fd >= 0) shm_unlink(name);
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(a, 0, sizeof *a);
    a->used = 1;
    snprintf(a->name, sizeof a->name, "%s", name);
    a->data = m;
    a->size = bytes;
    a->map_len = map_len;
    a->device = t_ctx->device;
    g_allocated += bytes;
    pthread_mutex_unlock(&g_lock);
    *dptr = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    INJECT("cuMemFree_v2");
    NEED_CTX();
    if (p == 0) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(p, 1);
    if (a == NULL || a->imported || (CUdeviceptr)(uintptr_t)a->data != p) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    shm_unlink(a->name);
    munmap(a->data, a->map_len);
    g_allocated -= a->size;
    memset(a, 0, sizeof *a);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    INJECT("cuMemsetD8_v2");
    NEED_CTX();
    if (!is_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memset((void *)(uintptr_t)dst, v, n);
    count(CNT_MEMSET_CALLS, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *stream) {
    INJECT("cuMemsetD8Async");
    NEED_CTX();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    if (!is_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memset((void *)(uintptr_t)dst, v, n);
    count(CNT_MEMSET_CALLS, n);
    return CUDA_SUCCESS;
}

static CUresult htod(CUdeviceptr dst, const void *src, size_t n) {
    if (n && src == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!is_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memcpy((void *)(uintptr_t)dst, src, n);
    count(CNT_HTOD_CALLS, n);
    return CUDA_SUCCESS;
}

static CUresult dtoh(void *dst, CUdeviceptr src, size_t n) {
    if (n && dst == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!is_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memcpy(dst, (const void *)(uintptr_t)src, n);
    count(CNT_DTOH_CALLS, n);
    return CUDA_SUCCESS;
}

static CUresult dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (!is_device(dst, n) || !is_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    count(CNT_DTOD_CALLS, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    INJECT("cuMemcpyHtoD_v2");
    NEED_CTX();
    return htod(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    INJECT("cuMemcpyDtoH_v2");
    NEED_CTX();
    return dtoh(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    INJECT("cuMemcpyDtoD_v2");
    NEED_CTX();
    return dtod(dst, src, n);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    INJECT("cuMemcpyHtoDAsync_v2");
    NEED_CTX();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    return htod(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    INJECT("cuMemcpyDtoHAsync_v2");
    NEED_CTX();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    return dtoh(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    INJECT("cuMemcpyDtoDAsync_v2");
    NEED_CTX();
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    return dtod(dst, src, n);
}

EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void *dst_ctx, CUdeviceptr src, void *src_ctx,
                                  size_t n, void *stream) {
    INJECT("cuMemcpyPeerAsync");
    NEED_CTX();
    if (!valid_ctx(dst_ctx) || !valid_ctx(src_ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    return dtod(dst, src, n);
}

EXPORT CUresult cuPointerGetAttribute(void *data, unsigned attribute, CUdeviceptr p) {
    INJECT("cuPointerGetAttribute");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (data == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(p, 1);
    int device = a ? a->device : -1;
    CUdeviceptr start = a ? (CUdeviceptr)(uintptr_t)a->data : 0;
    size_t size = a ? a->size : 0;
    pthread_mutex_unlock(&g_lock);
    if (a == NULL) return CUDA_ERROR_INVALID_VALUE; /* host memory the driver does not know */
    switch (attribute) {
    case 2: *(unsigned *)data = 2; return CUDA_SUCCESS;         /* MEMORY_TYPE: DEVICE */
    case 9: *(int *)data = device; return CUDA_SUCCESS;         /* DEVICE_ORDINAL */
    case 11: *(CUdeviceptr *)data = start; return CUDA_SUCCESS; /* RANGE_START_ADDR */
    case 12: *(size_t *)data = size; return CUDA_SUCCESS;       /* RANGE_SIZE */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* ---- IPC ---- */

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr p) {
    INJECT("cuIpcGetMemHandle");
    NEED_CTX();
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(p, 1);
    if (a == NULL || a->imported) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct handle h;
    memset(&h, 0, sizeof h);
    h.magic = HANDLE_MAGIC;
    h.size = a->size;
    h.pid = (int32_t)getpid();
    h.device = a->device;
    memcpy(h.name, a->name, NAME_BYTES);
    pthread_mutex_unlock(&g_lock);
    memcpy(out, &h, sizeof h);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned flags) {
    INJECT("cuIpcOpenMemHandle_v2");
    NEED_CTX();
    (void)flags;
    struct handle h;
    memcpy(&h, &handle, sizeof h);
    if (pdptr == NULL || h.magic != HANDLE_MAGIC || h.name[NAME_BYTES - 1] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* The real driver cannot open a handle in the process that exported it. */
    if (h.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->used && a->imported && strcmp(a->name, h.name) == 0) {
            a->refs++;
            *pdptr = (CUdeviceptr)(uintptr_t)a->data;
            pthread_mutex_unlock(&g_lock);
            return CUDA_SUCCESS;
        }
    }
    struct alloc *a = free_slot();
    if (a == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t map_len = page_round((size_t)h.size);
    int fd = shm_open(h.name, O_RDWR, 0);
    void *m = MAP_FAILED;
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && (size_t)st.st_size >= map_len)
            m = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    if (m == MAP_FAILED) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE; /* gone: freed by its exporter, or never existed */
    }
    memset(a, 0, sizeof *a);
    a->used = 1;
    a->imported = 1;
    a->refs = 1;
    memcpy(a->name, h.name, NAME_BYTES);
    a->data = m;
    a->size = (size_t)h.size;
    a->map_len = map_len;
    a->device = h.device;
    pthread_mutex_unlock(&g_lock);
    *pdptr = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    INJECT("cuIpcCloseMemHandle");
    NEED_CTX();
    pthread_mutex_lock(&g_lock);
    struct alloc *a = find(p, 1);
    if (a == NULL || !a->imported || (CUdeviceptr)(uintptr_t)a->data != p) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (--a->refs == 0) {
        munmap(a->data, a->map_len);
        memset(a, 0, sizeof *a);
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* ---- streams and events: every operation ran when it was enqueued ---- */

static CUresult new_obj(void **out, unsigned magic) {
    NEED_CTX();
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    struct obj *o = calloc(1, sizeof *o);
    if (o == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    o->magic = magic;
    o->device = t_ctx->device;
    *out = o;
    return CUDA_SUCCESS;
}

static CUresult free_obj(void *o, unsigned magic) {
    NEED_CTX();
    if (!valid_obj(o, magic)) return CUDA_ERROR_INVALID_HANDLE;
    ((struct obj *)o)->magic = 0;
    free(o);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(void **stream, unsigned flags) {
    INJECT("cuStreamCreate");
    (void)flags;
    return new_obj(stream, OBJ_STREAM);
}

EXPORT CUresult cuStreamDestroy_v2(void *stream) {
    INJECT("cuStreamDestroy_v2");
    return free_obj(stream, OBJ_STREAM);
}

EXPORT CUresult cuStreamQuery(void *stream) {
    INJECT("cuStreamQuery");
    NEED_CTX();
    return valid_stream(stream) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    INJECT("cuStreamWaitEvent");
    NEED_CTX();
    (void)flags;
    if (!valid_stream(stream) || !valid_obj(event, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(void **event, unsigned flags) {
    INJECT("cuEventCreate");
    (void)flags;
    return new_obj(event, OBJ_EVENT);
}

EXPORT CUresult cuEventRecord(void *event, void *stream) {
    INJECT("cuEventRecord");
    NEED_CTX();
    if (!valid_obj(event, OBJ_EVENT) || !valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(void *event) {
    INJECT("cuEventQuery");
    NEED_CTX();
    return valid_obj(event, OBJ_EVENT) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuEventDestroy_v2(void *event) {
    INJECT("cuEventDestroy_v2");
    return free_obj(event, OBJ_EVENT);
}

/* ---- modules and kernels ---- */

EXPORT CUresult cuModuleLoadData(void **module, const void *image) {
    INJECT("cuModuleLoadData");
    NEED_CTX();
    if (module == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (image == NULL || *(const unsigned char *)image == 0) return CUDA_ERROR_INVALID_IMAGE;
    return new_obj(module, OBJ_MODULE);
}

EXPORT CUresult cuModuleUnload(void *module) {
    INJECT("cuModuleUnload");
    return free_obj(module, OBJ_MODULE);
}

EXPORT CUresult cuModuleGetFunction(void **func, void *module, const char *name) {
    INJECT("cuModuleGetFunction");
    NEED_CTX();
    if (func == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_obj(module, OBJ_MODULE)) return CUDA_ERROR_INVALID_HANDLE;
    for (const struct xccl_standin_kernel *k = xccl_standin_kernels; k->name != NULL; k++) {
        if (strcmp(k->name, name) == 0) {
            *func = (void *)k;
            return CUDA_SUCCESS;
        }
    }
    note("cuda stand-in: no kernel named %s in xccl_standin_kernels\n", name);
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuLaunchKernel(void *func, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shared, void *stream,
                               void **params, void **extra) {
    INJECT("cuLaunchKernel");
    NEED_CTX();
    (void)shared;
    const struct xccl_standin_kernel *k = func;
    int known = 0;
    for (const struct xccl_standin_kernel *t = xccl_standin_kernels; t->name != NULL; t++)
        if (t == k) known = 1;
    if (!known) return CUDA_ERROR_INVALID_HANDLE;
    if (!valid_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (extra != NULL || params == NULL) return CUDA_ERROR_INVALID_VALUE;
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    k->run(params, grid, block);
    __atomic_fetch_add(&g_counters[CNT_LAUNCHES], 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* ---- errors ---- */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* Writes the name (which 0) or the description (which 1) of `code`. */
static CUresult error_text(CUresult code, const char **out, int which) {
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == code) {
            *out = which ? g_errors[i].text : g_errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **name) {
    return error_text(code, name, 0);
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **text) {
    return error_text(code, text, 1);
}
