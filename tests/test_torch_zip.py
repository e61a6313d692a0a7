"""Tests for the torch-free, code-free reader of PyTorch zip checkpoints.

The checkpoints are built here without torch: ``save_torch_file`` for plain state
dicts, and the module's own pickler pieces (``_Global``, ``_TensorOut``...) for
hand-crafted ones (views into shared storages, nested objects, malicious globals).
"""

import collections
import pickle
import zipfile

import numpy as np
import pytest

from clp_mlx.errors import ClpError
from clp_mlx.sources.torch_zip import (
    _Global,
    _StorageOut,
    _TensorOut,
    _write_archive,
    load_torch_file,
    save_torch_file,
)


class _Call:
    """Pickles as ``module.name(*args)``: how a crafted checkpoint runs code."""

    def __init__(self, module, name, *args):
        self.func, self.args = _Global(module, name), args

    def __reduce__(self):
        return self.func, self.args


def test_round_trip_keeps_dtypes_shapes_and_values(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((5,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "i64": np.arange(7, dtype=np.int64),
        "i32": np.array([-1, 2], np.int32),
        "i8": np.array([-128, 127], np.int8),
        "u8": np.array([0, 255], np.uint8),
        "bool": np.array([True, False]),
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 3), np.float32),
        "transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,
    }
    save_torch_file(tmp_path / "m.pt", tensors)
    loaded = load_torch_file(tmp_path / "m.pt")
    assert list(loaded) == list(tensors)
    for name, want in tensors.items():
        want = np.asarray(want)
        assert loaded[name].dtype == want.dtype and loaded[name].shape == want.shape, name
        np.testing.assert_array_equal(loaded[name], want)


def test_bfloat16_is_rounded_to_nearest_even_and_read_back_as_float32(tmp_path):
    # bfloat16 keeps 7 mantissa bits: 1 + 2^-7 is the next value after 1.
    x = np.array(
        [1.0, -2.5, 1 + 2**-7, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12, np.inf, np.nan],
        np.float32,
    )
    save_torch_file(tmp_path / "b.pt", {"x": x}, bfloat16=True)
    y = load_torch_file(tmp_path / "b.pt")["x"]
    assert y.dtype == np.float32
    want = [1.0, -2.5, 1 + 2**-7, 1.0, 1 + 2**-6, 1 + 2**-7, np.inf, np.nan]
    np.testing.assert_array_equal(y, want)


def test_views_share_storage_with_offsets_and_strides(tmp_path):
    base = np.arange(12, dtype=np.float32)
    st = _StorageOut("0", base, "FloatStorage")
    bf = np.array([0x3F80, 0x4000, 0xC040], np.uint16)  # bfloat16 bits of 1, 2, -3
    st_bf = _StorageOut("1", bf, "BFloat16Storage")
    obj = {
        "whole": _TensorOut(st, 0, (3, 4), (4, 1)),
        "transposed": _TensorOut(st, 0, (4, 3), (1, 4)),
        "row": _TensorOut(st, 4, (4,), (1,)),
        "column": _TensorOut(st, 1, (3,), (4,)),
        "bf_tail": _TensorOut(st_bf, 1, (2,), (1,)),
    }
    _write_archive(tmp_path / "v.pt", obj, [st, st_bf])
    out = load_torch_file(tmp_path / "v.pt")
    grid = base.reshape(3, 4)
    np.testing.assert_array_equal(out["whole"], grid)
    np.testing.assert_array_equal(out["transposed"], grid.T)
    np.testing.assert_array_equal(out["row"], grid[1])
    np.testing.assert_array_equal(out["column"], grid[:, 1])
    np.testing.assert_array_equal(out["bf_tail"], [2.0, -3.0])
    out["row"][:] = -1  # partial views are copies: the whole tensor is untouched
    np.testing.assert_array_equal(out["whole"], grid)


def test_nested_objects_are_flattened_and_non_tensors_dropped(tmp_path):
    st = _StorageOut("0", np.ones((2, 2), np.float16), "HalfStorage")
    param = _Call(
        "torch._utils", "_rebuild_parameter", _TensorOut(st), True, collections.OrderedDict()
    )
    obj = {
        "epoch": 3,
        "state_dict": collections.OrderedDict([("layer.weight", param)]),
        "extra": [_TensorOut(st), "note", None],
        "shape": _Call("torch", "Size", (2, 2)),
    }
    _write_archive(tmp_path / "n.pt", obj, [st])
    out = load_torch_file(tmp_path / "n.pt")
    assert sorted(out) == ["extra.0", "state_dict.layer.weight"]
    assert out["state_dict.layer.weight"].dtype == np.float16


def test_big_endian_files_are_read(tmp_path):
    st = _StorageOut("0", np.array([1.5, -2.0], ">f4"), "FloatStorage")
    _write_archive(tmp_path / "be.pt", {"x": _TensorOut(st)}, [st], byteorder="big")
    np.testing.assert_array_equal(load_torch_file(tmp_path / "be.pt")["x"], [1.5, -2.0])


@pytest.mark.parametrize(
    "module,name,args",
    [
        ("os", "system", ("touch {marker}",)),
        ("builtins", "eval", ("__import__('os').system('touch {marker}')",)),
        ("subprocess", "call", (["touch", "{marker}"],)),
    ],
)
def test_code_in_the_pickle_is_refused_and_never_runs(tmp_path, module, name, args):
    marker = tmp_path / "pwned"
    args = [
        [x.format(marker=marker) for x in a] if isinstance(a, list) else a.format(marker=marker)
        for a in args
    ]
    _write_archive(tmp_path / "evil.pt", {"payload": _Call(module, name, *args)}, [])
    with pytest.raises(ClpError, match=f"'{module}.{name}'"):
        load_torch_file(tmp_path / "evil.pt")
    assert not marker.exists()

    # Control: the stock unpickler (as torch.load without weights_only) runs it.
    with zipfile.ZipFile(tmp_path / "evil.pt") as zf:
        pickle.loads(zf.read("evil/data.pkl"))
    assert marker.exists()


class _TensorWithState(_TensorOut):
    """A tensor followed by a BUILD opcode that tries to overwrite its fields."""

    def __reduce__(self):
        return (*super().__reduce__(), {"array": "replaced"})


def test_rebuild_functions_reject_tricks(tmp_path):
    fake = _Call("torch._utils", "_rebuild_tensor_v2", "not a storage", 0, (1,), (1,), False, None)
    _write_archive(tmp_path / "trick.pt", {"w": fake}, [])
    with pytest.raises(ClpError, match="corrupt"):
        load_torch_file(tmp_path / "trick.pt")

    st = _StorageOut("0", np.zeros(2, np.float32), "FloatStorage")
    _write_archive(tmp_path / "state.pt", {"w": _TensorWithState(st)}, [st])
    with pytest.raises(ClpError, match="cannot take pickled state"):
        load_torch_file(tmp_path / "state.pt")


def test_tensor_overrunning_its_storage_is_refused(tmp_path):
    st = _StorageOut("0", np.zeros(4, np.float32), "FloatStorage")
    _write_archive(tmp_path / "o.pt", {"w": _TensorOut(st, 2, (3,), (1,))}, [st])
    with pytest.raises(ClpError, match="overruns"):
        load_torch_file(tmp_path / "o.pt")


def test_legacy_and_broken_files_give_clear_errors(tmp_path):
    with pytest.raises(ClpError, match="no such file"):
        load_torch_file(tmp_path / "missing.pt")

    legacy = tmp_path / "legacy.pt"  # pre-1.6 torch: a bare pickle stream
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"\x80\x02}q\x00.")
    with pytest.raises(ClpError, match="legacy"):
        load_torch_file(legacy)

    save_torch_file(tmp_path / "good.pt", {"w": np.arange(64, dtype=np.float32)})
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ClpError, match="truncated or corrupt"):
        load_torch_file(tmp_path / "cut.pt")

    blob = data.index(np.arange(64, dtype=np.float32).tobytes())
    flipped = data[:blob] + b"\xff" * 16 + data[blob + 16 :]  # fails the CRC check
    (tmp_path / "flip.pt").write_bytes(flipped)
    with pytest.raises(ClpError, match="corrupt"):
        load_torch_file(tmp_path / "flip.pt")

    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(ClpError, match="no data.pkl"):
        load_torch_file(tmp_path / "other.zip")


def test_top_level_must_be_a_dict(tmp_path):
    st = _StorageOut("0", np.zeros(2, np.float32), "FloatStorage")
    _write_archive(tmp_path / "t.pt", _TensorOut(st), [st])
    with pytest.raises(ClpError, match="expected a dict"):
        load_torch_file(tmp_path / "t.pt")
