"""Read and write PyTorch's zip checkpoints without torch and without running pickle code.

Since PyTorch 1.6, ``torch.save`` writes a zip: ``<archive>/data.pkl`` (a
protocol-2 pickle of the object), ``<archive>/data/<key>`` (raw bytes of each
storage), ``byteorder`` ("little"/"big"; absent in old files: little) and
``version``.  This module handles the zip; the pickle is read by the
allow-list unpickler of :mod:`clp_mlx.sources.torch_unpickle`, which never
imports what the file names.

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
from clp_mlx.sources.torch_unpickle import STORAGE_DTYPES, SafeUnpickler, flatten_tensors


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
            unpickler = SafeUnpickler(zf.read(pkls[0]), zf, prefix, order == b"little", str(path))
            obj = unpickler.load()
    except ClpError:
        raise
    except Exception as e:  # a corrupt pickle or zip can fail in many ways
        raise ClpError(f"{path}: corrupt or truncated PyTorch checkpoint ({e})") from e
    if not isinstance(obj, dict):
        raise ClpError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    return flatten_tensors(obj)


# -- writing: the same format from numpy arrays, without torch ---------------------

# numpy dtype -> storage class name (bfloat16 is written from float arrays on request).
_DTYPE_STORAGES = {
    np.dtype(v): k
    for k, v in STORAGE_DTYPES.items()
    if k not in ("BFloat16Storage", "UntypedStorage")
}


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
