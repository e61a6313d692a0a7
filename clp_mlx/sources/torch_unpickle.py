"""The restricted unpickler behind :func:`clp_mlx.sources.torch_zip.load_torch_file`.

In a ``torch.save`` pickle every tensor is a call such as
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and every
storage a *persistent id* ``("storage", torch.FloatStorage, key, location, numel)``.
``torch.load`` resolves those names by importing them, which lets a crafted file
call anything (``os.system``...).  :class:`SafeUnpickler` answers only an
allow-list of names, with local stand-ins that build numpy arrays; any other
name raises :class:`ClpError`.  The objects it hands out are sealed against the
pickle's BUILD opcode, and :func:`flatten_tensors` turns the result into plain
numpy arrays once unpickling is over.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from typing import Any

import numpy as np

from clp_mlx.errors import ClpError

# Legacy storage class name -> numpy dtype.  "bf16" is kept as raw uint16 until the
# tensor is built, then widened to float32.
STORAGE_DTYPES: dict[str, Any] = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": "bf16",
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}


class _Sealed:
    """Base of the objects the unpickler hands out: the pickle's BUILD opcode
    (``__setstate__``) must not be able to change them."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a {type(self).__name__} cannot take pickled state")


class _StorageType(_Sealed):
    """Stand-in for ``torch.FloatStorage`` and friends: only carries the name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Storage(_Sealed):
    """One storage blob as a 1-D numpy array (uint16 bits for bfloat16)."""

    __slots__ = ("bf16", "data")

    def __init__(self, data: np.ndarray, bf16: bool) -> None:
        self.data, self.bf16 = data, bf16


class _Tensor(_Sealed):
    """A rebuilt tensor; unwrapped to numpy only after unpickling is over."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_ignored: Any) -> _Tensor:
    """``_rebuild_tensor`` and ``_rebuild_tensor_v2`` (whose extra arguments,
    requires_grad, hooks and metadata, mean nothing to an array)."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    offset, size, stride = int(offset), tuple(map(int, size)), tuple(map(int, stride))
    if len(size) != len(stride) or offset < 0 or min(size + stride, default=0) < 0:
        raise pickle.UnpicklingError(f"bad tensor geometry size={size} stride={stride}")
    data = storage.data
    if 0 in size:
        view = np.zeros(size, data.dtype)
    else:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= data.size:
            raise pickle.UnpicklingError(
                f"tensor of size {size} at offset {offset} overruns its storage "
                f"of {data.size} elements"
            )
        strides = tuple(s * data.itemsize for s in stride)
        view = np.lib.stride_tricks.as_strided(data[offset:], size, strides)
        # Copy views into part of a storage so no two results alias unexpectedly.
        covers_all = offset == 0 and view.size == data.size and view.flags.c_contiguous
        view = view if covers_all else np.array(view)
    view = view.astype(view.dtype.newbyteorder("="), copy=False)
    if storage.bf16:  # bfloat16 is the top half of a float32
        view = (view.astype(np.uint32) << 16).view(np.float32)
    return _Tensor(view)


def _rebuild_parameter(data: Any, *_ignored: Any) -> _Tensor:
    """``_rebuild_parameter[_with_state]``: a Parameter is just its tensor here."""
    if not isinstance(data, _Tensor):
        raise pickle.UnpicklingError("parameter rebuilt from something that is not a tensor")
    return data


# (module, name) -> what the unpickler gets instead.  Nothing else is importable.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): tuple,
    **{("torch", n): _StorageType(n) for n in STORAGE_DTYPES},
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only :data:`_ALLOWED` and reads storages from the zip."""

    def __init__(
        self, data: bytes, zf: zipfile.ZipFile, prefix: str, little: bool, path: str
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._zf, self._prefix, self._little, self._path = zf, prefix, little, path
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise ClpError(
                f"{self._path}: refusing to load: the file asks for '{module}.{name}', "
                "which is not a tensor-rebuild function (torch.load would run it)"
            ) from None

    def persistent_load(self, pid: Any) -> _Storage:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
        ):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")
        stype, key, numel = pid[1], str(pid[2]), int(pid[4])
        if key not in self._storages:
            self._storages[key] = self._read_storage(key, stype.name)
        storage = self._storages[key]
        if numel > storage.data.size:
            raise pickle.UnpicklingError(f"storage {key} is shorter than its {numel} elements")
        return storage

    def _read_storage(self, key: str, type_name: str) -> _Storage:
        kind = STORAGE_DTYPES[type_name]
        dtype = np.dtype(np.uint16 if kind == "bf16" else kind)
        dtype = dtype.newbyteorder("<" if self._little else ">")
        try:
            info = self._zf.getinfo(f"{self._prefix}data/{key}")
        except KeyError:
            raise pickle.UnpicklingError(f"storage blob data/{key} is missing") from None
        if info.file_size % dtype.itemsize:
            raise pickle.UnpicklingError(f"storage blob data/{key} has a partial element")
        data = np.empty(info.file_size // dtype.itemsize, dtype)
        buf, done = memoryview(data).cast("B"), 0
        with self._zf.open(info) as f:  # straight into the array: one copy, writable
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise pickle.UnpicklingError(f"storage blob data/{key} is truncated")
                done += n
        return _Storage(data, kind == "bf16")


def flatten_tensors(obj: Any) -> dict[str, np.ndarray]:
    """The tensors of an unpickled object under dotted keys; other leaves are dropped."""
    out: dict[str, np.ndarray] = {}
    _flatten(obj, "", out)
    return out


def _flatten(obj: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(obj, _Tensor):
        if prefix in out:
            raise ClpError(f"two tensors flatten to the same key '{prefix}'")
        out[prefix] = obj.array
        return
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return  # ints, strings, None...: not tensors, dropped
    for k, v in items:
        _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
