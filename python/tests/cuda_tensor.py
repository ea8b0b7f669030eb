"""CUDA tensors for the tests on machines without a GPU, where torch cannot make any: device
memory allocated and filled with xccl's own CUDA layer (on the stand-in driver of
``tests/cuda_standin/``, whose device memory is host shared memory) and read back with it."""

from __future__ import annotations

from xccl import _xccl


class DeviceTensor:
    """A tensor in memory of CUDA device ``device`` that speaks DLPack as a CUDA producer
    (``__dlpack_device__`` is ``(2, device)``) and records the ``stream`` each export was asked
    for, so that tests see what xccl passed as a consumer."""

    def __init__(self, buf):
        self.buf = buf
        self.device = buf.__dlpack_device__()[1]
        self.streams = []

    @classmethod
    def of(cls, host, device: int) -> DeviceTensor:
        """A copy of the host tensor ``host`` (torch CPU, numpy) on CUDA device ``device``."""
        return cls(_xccl._to_device(host, device))

    @property
    def shape(self):
        return self.buf.shape

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return self.buf.__dlpack__(
            stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )

    def host(self):
        """A host copy, as an ``xccl.Buffer``."""
        return to_host(self.buf, self.device)


class ColumnMajorDeviceTensor(DeviceTensor):
    """A ``DeviceTensor`` whose exports claim column-major strides (``[1, rows]`` elements): a
    CUDA tensor that is not C-contiguous, for the layout checks (never read)."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        import ctypes

        cap = super().__dlpack__(
            stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )
        api = ctypes.pythonapi
        api.PyCapsule_GetName.restype = ctypes.c_char_p
        api.PyCapsule_GetName.argtypes = [ctypes.py_object]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        name = api.PyCapsule_GetName(cap)
        managed = api.PyCapsule_GetPointer(cap, name)
        # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the DLTensor;
        # DLManagedTensor: the DLTensor first. DLTensor: data, device, ndim, dtype, shape,
        # strides (8, 8, 4, 4, 8 bytes before it).
        tensor = managed + (32 if name == b"dltensor_versioned" else 0)
        self._strides = (ctypes.c_int64 * 2)(1, self.shape[0])
        ctypes.c_void_p.from_address(tensor + 32).value = ctypes.addressof(self._strides)
        return cap


def to_host(obj, device: int):
    """A host copy (``xccl.Buffer``) of ``obj``, any CUDA DLPack tensor (or capsule) of
    ``device``, read through xccl's import (device and layout checked)."""
    return _xccl._to_host(obj, device)


def standin_torch_cuda() -> None:
    """Makes torch's two operations on CUDA tensors that ``xccl.adapters`` uses work on the
    stand-in, where torch makes no CUDA tensor: ``torch.from_dlpack`` of a CUDA producer gives a
    ``DeviceTensor`` viewing it (no copy, as torch's view), and ``Tensor.to`` a CUDA device (an
    ordinal, ``"cuda:<id>"`` or a ``torch.device``) gives a ``DeviceTensor`` copy there. Patches
    torch for the whole process: for a test job's rank processes only."""
    import torch

    from_dlpack, to = torch.from_dlpack, torch.Tensor.to

    def cuda_ordinal(target):
        if isinstance(target, int) and not isinstance(target, bool):
            return target
        if isinstance(target, (str, torch.device)):
            d = torch.device(target)
            return d.index or 0 if d.type == "cuda" else None
        return None

    def standin_from_dlpack(obj, *args, **kw):
        if hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] == 2:
            return DeviceTensor(obj)
        return from_dlpack(obj, *args, **kw)

    def standin_to(self, *args, **kw):
        ordinal = cuda_ordinal(args[0] if args else kw.get("device"))
        if ordinal is None:
            return to(self, *args, **kw)
        return DeviceTensor.of(self.contiguous(), ordinal)

    torch.from_dlpack = standin_from_dlpack
    torch.Tensor.to = standin_to
