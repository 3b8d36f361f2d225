"""core.hf.safetensors_io: header parsing, memory-mapped reads, FP8 / FP4 dequantisation.

References: ml_dtypes' own float8_e4m3fn / float8_e8m0fnu / float4_e2m1fn decoding (not core's
lookup table), block loops in float64, and files written by the `safetensors` package.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from core.hf import safetensors_io as st
from core.errors import CheckpointError
from tests.hf_checkpoints import quantise_fp4, quantise_fp8


def test_e2m1_table_is_ml_dtypes_float4():
    """All 16 codes: bit 3 = sign, values 0, .5, 1, 1.5, 2, 3, 4, 6 (kernel.py's float4_e2m1fn)."""
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(st.E2M1, want) and np.array_equal(np.signbit(st.E2M1), np.signbit(want))


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (64, 300)])
def test_dequant_fp8_equals_block_loop(shape):
    """W = w * s[r // 128, c // 128], partial edge blocks included."""
    rng = np.random.default_rng(0)
    blocks = np.exp2(rng.integers(-12, 12, (-(-shape[0] // 128), -(-shape[1] // 128))))
    spread = np.repeat(np.repeat(blocks, 128, 0), 128, 1)[:shape[0], :shape[1]]
    w = (rng.standard_normal(shape) * spread).astype(np.float32)
    q, s, ref = quantise_fp8(w)
    out = st.dequant_fp8(q, s)
    assert out.dtype == np.float32 and np.array_equal(out, ref.astype(np.float32)), np.abs(out - ref).max()
    # scales really vary per block (the test would not notice a transposed grid otherwise)
    assert len(np.unique(s.astype(np.float32))) > 1


def test_dequant_fp8_rejects_a_wrong_scale_grid():
    q, s, _ = quantise_fp8(np.ones((256, 128), np.float32))
    with pytest.raises(CheckpointError, match="needs a scale of shape"):
        st.dequant_fp8(q, s.T)


@pytest.mark.parametrize("shape", [(4, 64), (96, 256)])
def test_dequant_fp4_equals_reference(shape):
    """Low nibble = even input column; one e8m0 scale per 32 inputs per row."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, (shape[0], 1))).astype(np.float32)
    packed, s, ref = quantise_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (shape[0], shape[1] // 2)
    out = st.dequant_fp4(packed, s)
    assert np.array_equal(out, ref.astype(np.float32)), np.abs(out - ref).max()
    # nibble order matters: the high nibble of byte j is column 2j + 1
    u = packed.view(np.uint8)
    hi = (u >> 4).view(np.uint8).astype(np.uint8)
    assert np.array_equal(out[:, 1::2] / np.repeat(s.astype(np.float32), 32, 1)[:, 1::2],
                          (hi & 15).view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_read_every_dtype_from_a_safetensors_file(tmp_path):
    """F8_E4M3 / F8_E8M0 (which safetensors' NumPy backend cannot read), BF16, F32, I8, I64."""
    rng = np.random.default_rng(2)
    tensors = {
        "fp8": rng.standard_normal((3, 5)).astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.exp2(rng.integers(-5, 5, (2, 2))).astype(ml_dtypes.float8_e8m0fnu),
        "bf16": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16), "f32": rng.standard_normal((2, 3)).astype(np.float32),
        "i8": rng.integers(-128, 127, (7,)).astype(np.int8), "i64": rng.integers(0, 9, (3, 2)).astype(np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    header = st.read_header(path)
    assert {k: v.shape for k, v in header.items()} == {k: v.shape for k, v in tensors.items()}
    for name, want in tensors.items():
        got = st.read_tensor(path, header[name])
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name


def test_truncated_and_foreign_files_are_one_line_errors(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": np.ones((64, 64), np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="is truncated"):
        st.read_header(path)
    path.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        st.read_header(path)
    path.write_bytes(b"hello world, not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        st.read_header(path)


def test_unsupported_dtype_is_named(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": np.ones((2, 2), ml_dtypes.float8_e5m2)}, str(path))
    with pytest.raises(CheckpointError, match="tensor w in x.safetensors has dtype F8_E5M2"):
        st.read_header(path)


def test_streamed_file_equals_the_safetensors_package(tmp_path):
    """Written tensor by tensor (transposed views included), the file reads back through the
    safetensors package itself and is byte-identical in its tensors to `write_file`'s."""
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16).T,
               "b": rng.standard_normal((3,)).astype(np.float32), "c.tid2eid": rng.integers(0, 9, (4, 2)),
               "empty": np.zeros((0, 3), np.float32)}
    plan = [(n, v.dtype, v.shape) for n, v in tensors.items()]
    writer = st.StreamedFile(tmp_path / "s.safetensors", plan, metadata={"format": "pt"})
    for n, v in tensors.items():
        writer.write(n, v)
    writer.close()
    with safe_open(tmp_path / "s.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
        for n, v in tensors.items():
            got = f.get_tensor(n)
            assert got.dtype == v.dtype and got.shape == v.shape and got.tobytes() == np.ascontiguousarray(v).tobytes()
    st.write_file(tmp_path / "w.safetensors", tensors)
    header = st.read_header(tmp_path / "s.safetensors")
    assert {n: (i.dtype, i.shape, i.nbytes) for n, i in header.items()} == \
           {n: (i.dtype, i.shape, i.nbytes) for n, i in st.read_header(tmp_path / "w.safetensors").items()}


def test_streamed_file_refuses_an_unplanned_tensor(tmp_path):
    writer = st.StreamedFile(tmp_path / "s.safetensors", [("a", np.dtype(np.float32), (2,))])
    with pytest.raises(ValueError, match="not the planned"):
        writer.write("a", np.zeros((3,), np.float32))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
