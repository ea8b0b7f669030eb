"""ctypes wrapper of xccl's C ABI (include/xccl.h): enough to run A2E/E2A from Python.

Find the library with XCCL_LIBRARY=/path/to/libxccl.so, else `libxccl.so` on the loader path.
Buffers are anything exposing the buffer protocol (array.array, bytearray, numpy arrays, ...);
numpy is optional. Every call raises XcclError (with the result code and the library's message)
on failure.
"""

import ctypes
import os
from array import array

SUCCESS, INVALID_ARGUMENT, INVALID_USAGE, SYSTEM_ERROR, REMOTE_ERROR, TIMEOUT, ABORTED, \
    UNAVAILABLE, INTERNAL_ERROR = range(9)
FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2
PUSH, PULL = 0, 1
ROLE_ATTENTION, ROLE_EXPERT = 0, 1
CONFIG_MAGIC = 0x6C636378
CONFIG_VERSION = 1
UNDEF = -(2 ** 31)

_lib = ctypes.CDLL(os.environ.get("XCCL_LIBRARY", "libxccl.so"))
_c_int_p = ctypes.POINTER(ctypes.c_int)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("numAttentionRanks", ctypes.c_int),
        ("numExpertRanks", ctypes.c_int),
        ("numExperts", ctypes.c_int),
        ("topk", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("maxTokensPerRank", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("transferMode", ctypes.c_int),
        ("maxInFlight", ctypes.c_int),
        ("timeoutMs", ctypes.c_int),
        ("fabric", ctypes.c_char_p),
        ("placementCounts", _c_int_p),
        ("placementRanks", _c_int_p),
    ]

    def __init__(self, **fields):
        """XCCL_CONFIG_INITIALIZER, then the given fields."""
        super().__init__()
        self.size = ctypes.sizeof(Config)
        self.magic = CONFIG_MAGIC
        self.version = CONFIG_VERSION
        for name, _ in self._fields_[3:13]:
            setattr(self, name, UNDEF)
        for k, v in fields.items():
            setattr(self, k, v)


class ExpertBatchInfo(ctypes.Structure):
    _fields_ = [
        ("numRows", ctypes.c_size_t),
        ("numTokens", ctypes.c_size_t),
        ("numLocalExperts", ctypes.c_size_t),
        ("rows", ctypes.c_void_p),
        ("expertCounts", ctypes.POINTER(ctypes.c_size_t)),
        ("expertOffsets", ctypes.POINTER(ctypes.c_size_t)),
        ("srcRank", ctypes.POINTER(ctypes.c_uint32)),
        ("srcToken", ctypes.POINTER(ctypes.c_uint32)),
        ("weights", ctypes.POINTER(ctypes.c_float)),
    ]


_P = ctypes.c_void_p
_signatures = {
    "xcclGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
    "xcclGetLastError": ([_P], ctypes.c_char_p),
    "xcclGetVersion": ([_c_int_p], ctypes.c_int),
    "xcclGetUniqueId": ([ctypes.POINTER(UniqueId)], ctypes.c_int),
    "xcclCommInitRankConfig": ([ctypes.POINTER(_P), ctypes.c_int, UniqueId, ctypes.c_int,
                                ctypes.POINTER(Config)], ctypes.c_int),
    "xcclCommInitFromEnv": ([ctypes.POINTER(_P), ctypes.POINTER(Config)], ctypes.c_int),
    "xcclCommDestroy": ([_P], ctypes.c_int),
    "xcclCommAbort": ([_P], ctypes.c_int),
    "xcclCommGetAsyncError": ([_P, _c_int_p], ctypes.c_int),
    "xcclCommCount": ([_P, _c_int_p], ctypes.c_int),
    "xcclCommUserRank": ([_P, _c_int_p], ctypes.c_int),
    "xcclCommRole": ([_P, _c_int_p], ctypes.c_int),
    "xcclCommLocalExperts": ([_P, _c_int_p, _c_int_p], ctypes.c_int),
    "xcclCommBufferSizes": ([_P] + [ctypes.POINTER(ctypes.c_size_t)] * 3, ctypes.c_int),
    "xcclA2ESend": ([_P, _P, ctypes.c_int, _P, _P, ctypes.POINTER(_P)], ctypes.c_int),
    "xcclE2ARecv": ([_P, _P, _P], ctypes.c_int),
    "xcclA2ERecv": ([_P, ctypes.POINTER(_P)], ctypes.c_int),
    "xcclExpertBatchGetInfo": ([_P, ctypes.POINTER(ExpertBatchInfo)], ctypes.c_int),
    "xcclE2ASend": ([_P, _P, _P], ctypes.c_int),
}
for _name, (_args, _res) in _signatures.items():
    _f = getattr(_lib, _name)
    _f.argtypes, _f.restype = _args, _res


class XcclError(RuntimeError):
    """A failed xccl call: `code` is the xcclResult_t."""

    def __init__(self, call, code, message):
        name = _lib.xcclGetErrorString(code).decode()
        super().__init__(f"{call}: {name}: {message}")
        self.code = code


def _check(call, code, comm=None):
    if code != SUCCESS:
        raise XcclError(call, code, _lib.xcclGetLastError(comm).decode(errors="replace"))


def _addr(buf):
    """Address of a writable or read-only buffer (array.array, bytearray, numpy array)."""
    if hasattr(buf, "ctypes"):  # numpy
        return buf.ctypes.data
    if isinstance(buf, array):
        return buf.buffer_info()[0]
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def version():
    v = ctypes.c_int()
    _check("xcclGetVersion", _lib.xcclGetVersion(ctypes.byref(v)))
    return v.value


def get_unique_id():
    uid = UniqueId()
    _check("xcclGetUniqueId", _lib.xcclGetUniqueId(ctypes.byref(uid)))
    return uid


class ExpertBatch:
    """An expert-major batch: `rows` (bytes view), per-expert `offsets`, and per-row metadata."""

    def __init__(self, handle, info, row_bytes):
        self.handle = handle
        self.num_rows = info.numRows
        self.num_tokens = info.numTokens
        self.offsets = [info.expertOffsets[j] for j in range(info.numLocalExperts + 1)]
        n = info.numRows * row_bytes
        self.rows = ctypes.string_at(info.rows, n) if n else b""


class Comm:
    """One rank's communicator (a context manager that destroys it)."""

    def __init__(self, config, nranks=None, unique_id=None, rank=None):
        self._c = _P()
        if unique_id is None:
            code = _lib.xcclCommInitFromEnv(ctypes.byref(self._c), ctypes.byref(config))
            _check("xcclCommInitFromEnv", code)
        else:
            code = _lib.xcclCommInitRankConfig(ctypes.byref(self._c), nranks, unique_id, rank,
                                               ctypes.byref(config))
            _check("xcclCommInitRankConfig", code)
        self.rank = self._int("xcclCommUserRank")
        self.size = self._int("xcclCommCount")
        self.role = self._int("xcclCommRole")
        n = ctypes.c_int()
        experts = (ctypes.c_int * 1024)()
        self._call("xcclCommLocalExperts", ctypes.byref(n), experts)
        self.local_experts = list(experts[: n.value])
        sizes = [ctypes.c_size_t() for _ in range(3)]
        self._call("xcclCommBufferSizes", *[ctypes.byref(s) for s in sizes])
        self.row_bytes, self.max_recv_tokens, self.max_recv_rows = (s.value for s in sizes)

    def _call(self, name, *args):
        _check(name, getattr(_lib, name)(self._c, *args), self._c)

    def _int(self, name):
        v = ctypes.c_int()
        self._call(name, ctypes.byref(v))
        return v.value

    def a2e_send(self, x, num_tokens, topk_idx, topk_weights):
        """A2E: x [T, hidden], topk_idx int32 [T, topk], topk_weights float32 [T, topk]."""
        h = _P()
        self._call("xcclA2ESend", _addr(x), num_tokens, _addr(topk_idx), _addr(topk_weights),
                   ctypes.byref(h))
        return h

    def e2a_recv(self, handle, out):
        """E2A: the combined outputs into out [T, hidden] (the handle is consumed)."""
        self._call("xcclE2ARecv", handle, _addr(out))

    def a2e_recv(self):
        """A2E receive on an expert rank: an ExpertBatch."""
        h = _P()
        self._call("xcclA2ERecv", ctypes.byref(h))
        info = ExpertBatchInfo()
        _check("xcclExpertBatchGetInfo", _lib.xcclExpertBatchGetInfo(h, ctypes.byref(info)))
        return ExpertBatch(h, info, self.row_bytes)

    def e2a_send(self, batch, expert_out):
        """E2A send: expert_out holds one output row per batch row (the batch is consumed)."""
        self._call("xcclE2ASend", batch.handle, _addr(expert_out))

    def async_error(self):
        v = ctypes.c_int()
        self._call("xcclCommGetAsyncError", ctypes.byref(v))
        return v.value

    def abort(self):
        self._call("xcclCommAbort")

    def destroy(self):
        if self._c:
            _check("xcclCommDestroy", _lib.xcclCommDestroy(self._c))
            self._c = _P()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
