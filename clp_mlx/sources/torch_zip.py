"""Read and write PyTorch's zip checkpoints without torch and without running pickle code.

Since PyTorch 1.6, ``torch.save`` writes a zip: ``<archive>/data.pkl`` (a
protocol-2 pickle of the object), ``<archive>/data/<key>`` (raw bytes of each
storage), ``byteorder`` ("little"/"big"; absent in old files: little) and
``version``.  In the pickle every tensor is a call such as
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and every
storage a *persistent id* ``("storage", torch.FloatStorage, key, location, numel)``.
``torch.load`` resolves those names by importing them, which lets a crafted file
call anything (``os.system``...).  :class:`_SafeUnpickler` answers only an
allow-list of names, with local stand-ins that build numpy arrays; any other
name raises :class:`ClpError`.

:func:`load_torch_file` returns a flat ``{dotted.key: numpy array}`` dict:
nested dicts and lists are flattened with ``.`` (``{"state_dict": {"w": t}}`` ->
``"state_dict.w"``) and non-tensor leaves (ints, strings, ``None``...) are dropped.
bfloat16 tensors come back as float32 (exact), since numpy has no bfloat16.
Tensors that shared one storage whole in the file may share memory in the result,
as they do after ``torch.load``.

:func:`save_torch_file` writes the same format (which ``torch.load`` reads) from
numpy arrays, for exporting and for building test checkpoints without torch.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from clp_mlx.errors import ClpError

# Legacy storage class name -> numpy dtype.  "bf16" is kept as raw uint16 until the
# tensor is built, then widened to float32.
_STORAGE_DTYPES: dict[str, Any] = {
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
# numpy dtype -> storage class name, for writing.
_DTYPE_STORAGES = {
    np.dtype(v): k
    for k, v in _STORAGE_DTYPES.items()
    if k not in ("BFloat16Storage", "UntypedStorage")
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
    **{("torch", n): _StorageType(n) for n in _STORAGE_DTYPES},
}


class _SafeUnpickler(pickle.Unpickler):
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
        kind = _STORAGE_DTYPES[type_name]
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


def load_torch_file(path: str | Path) -> dict[str, np.ndarray]:
    """Load the tensors of a zip-format ``torch.save`` file as numpy arrays.

    Never imports torch and never runs code named by the file: a pickle that asks
    for anything but the tensor-rebuild functions raises :class:`ClpError` naming
    it.  Nested dicts/lists are flattened to dotted keys; non-tensor leaves are
    dropped; bfloat16 becomes float32.  Raises :class:`ClpError` for a missing,
    legacy (pre-1.6, non-zip), TorchScript, truncated or corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        raise ClpError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(4) == b"PK\x03\x04":
                raise ClpError(f"{path}: truncated or corrupt zip file")
        raise ClpError(
            f"{path}: not a zip-format PyTorch checkpoint (a legacy torch<1.6 file or "
            "something else); re-save it with a recent torch, or convert it to safetensors"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkls) != 1:
                raise ClpError(f"{path}: a zip file, but not a PyTorch checkpoint (no data.pkl)")
            prefix = pkls[0][: -len("data.pkl")]
            names = set(zf.namelist())
            if f"{prefix}constants.pkl" in names:
                raise ClpError(f"{path}: a TorchScript archive, not a state dict")
            order = zf.read(f"{prefix}byteorder") if f"{prefix}byteorder" in names else b"little"
            if order not in (b"little", b"big"):
                raise ClpError(f"{path}: unknown byte order {order[:20]!r}")
            unpickler = _SafeUnpickler(zf.read(pkls[0]), zf, prefix, order == b"little", str(path))
            obj = unpickler.load()
    except ClpError:
        raise
    except Exception as e:  # a corrupt pickle or zip can fail in many ways
        raise ClpError(f"{path}: corrupt or truncated PyTorch checkpoint ({e})") from e
    if not isinstance(obj, dict):
        raise ClpError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    out: dict[str, np.ndarray] = {}
    _flatten(obj, "", out)
    return out


class _Global:
    """A ``module.name`` reference written as a GLOBAL opcode, without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> None:  # pickle wants reduce functions callable
        raise TypeError(f"{self.module}.{self.name} is only a name here")


class _StorageOut:
    """A storage to save; pickled as a persistent id, its bytes go to ``data/<key>``."""

    def __init__(self, key: str, array: np.ndarray, type_name: str) -> None:
        self.key, self.array, self.type_name = key, array, type_name


class _TensorOut:
    """A tensor to save: reduces to ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``.

    By default the tensor is the whole storage array; ``offset``/``size``/``stride``
    (in elements) describe a view into it instead.
    """

    def __init__(
        self,
        storage: _StorageOut,
        offset: int = 0,
        size: tuple[int, ...] | None = None,
        stride: tuple[int, ...] | None = None,
    ) -> None:
        a = storage.array
        self.storage, self.offset = storage, offset
        self.size = a.shape if size is None else size
        self.stride = tuple(s // a.itemsize for s in a.strides) if stride is None else stride

    def __reduce__(self) -> tuple:
        args = (self.storage, self.offset, self.size, self.stride, False, collections.OrderedDict())
        return _Global("torch._utils", "_rebuild_tensor_v2"), args


class _TorchPickler(pickle._Pickler):  # the pure-Python pickler has a patchable dispatch
    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)

    def _save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))

    dispatch[_Global] = _save_global_ref

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageOut):
            return ("storage", _Global("torch", obj.type_name), obj.key, "cpu", obj.array.size)
        return None


def _storage_for(name: str, value: np.ndarray, key: str, bfloat16: bool) -> _StorageOut:
    a = np.asarray(value)
    a = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)
    if bfloat16 and a.dtype.kind == "f":
        f32 = a.astype("<f4")
        bits = f32.view("<u4")
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest, ties to even
        bf16 = np.where(np.isnan(f32), 0x7FC0, bits >> 16).astype("<u2")
        return _StorageOut(key, bf16, "BFloat16Storage")
    type_name = _DTYPE_STORAGES.get(a.dtype.newbyteorder("="))
    if type_name is None:
        raise ClpError(f"cannot save tensor '{name}' of dtype {a.dtype} in a torch file")
    return _StorageOut(key, a, type_name)


def _write_archive(
    path: Path, obj: Any, storages: Iterable[_StorageOut], byteorder: str = "little"
) -> None:
    """Pickle ``obj`` (tensors as :class:`_TensorOut`) and zip it with the storage blobs."""
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    root = path.stem or "archive"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{root}/data.pkl", buf.getvalue())
        zf.writestr(f"{root}/byteorder", byteorder)
        for st in storages:
            info = zipfile.ZipInfo(f"{root}/data/{st.key}")
            # Pad the local header's extra field so the blob starts 64-byte
            # aligned, as torch does (it lets torch.load memory-map storages).
            header_end = zf.fp.tell() + 30 + len(info.filename.encode()) + 4
            pad = -header_end % 64
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            zf.writestr(info, st.array.tobytes())
        zf.writestr(f"{root}/version", "3\n")


def save_torch_file(
    path: str | Path, tensors: Mapping[str, np.ndarray], *, bfloat16: bool = False
) -> None:
    """Write ``tensors`` as a zip-format checkpoint that ``torch.load`` reads.

    Each array gets its own storage.  With ``bfloat16=True`` floating arrays are
    stored as bfloat16 (rounded to nearest even), as many checkpoints are.
    """
    storages = [_storage_for(n, a, str(i), bfloat16) for i, (n, a) in enumerate(tensors.items())]
    state = collections.OrderedDict((name, _TensorOut(st)) for name, st in zip(tensors, storages))
    _write_archive(Path(path), state, storages)
