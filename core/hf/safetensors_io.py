"""safetensors at the byte level, and DeepSeek-V4's FP8 / FP4 weight encodings (DESIGN.md, "Real checkpoints").

safetensors' NumPy backend cannot build float8 arrays (it asks NumPy itself for `float8_e4m3fn`;
safetensors issue #682), so tensors are read here from the file format directly: an 8-byte
little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets: [b, e]}}`,
then the data; tensor bytes live at file offset 8 + N + b. Each tensor is a read-only memory map
viewed with the ml_dtypes type, so reading one tensor touches only its bytes. Writing a dict of
arrays goes through the `safetensors` package; `StreamedFile` writes a file tensor by tensor
(the exporter: one tensor in memory at a time).

Encodings (official `inference/model.py` Linear, `convert.py`, `kernel.py`; notes/checkpoint-format.md):
  FP8 weight w [O, I] float8_e4m3fn with scale s [ceil(O/128), ceil(I/128)] float8_e8m0fnu (2^(b-127)):
      W[r, c] = w[r, c] * s[r // 128, c // 128]
  FP4 weight p [O, I/2] int8, two e2m1 codes per byte along the input dim, LOW nibble = even column,
  scale s [O, I/32] e8m0:   W[r, c] = E2M1[nibble(r, c)] * s[r, c // 32]
  with E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6 for codes 0-7 and their negatives for 8-15 (bit 3 = sign).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from core.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
FP8_BLOCK = 128
FP4_BLOCK = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_MAX_HEADER = 100 * 2**20  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    name: str
    dtype: str                 # safetensors code, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int                 # absolute file offset of the first byte
    nbytes: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of a safetensors file, checked against its size.

    Raises:
      CheckpointError: unreadable, not safetensors, an unsupported dtype, or truncated (a tensor's
        bytes extend past the end of the file, or its byte count disagrees with its shape).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = f.read(n) if 0 < n <= min(_MAX_HEADER, size - 8) else b""
    except OSError as e:
        raise CheckpointError(f"{str(path)!r} cannot be read ({e.strerror}): check the path and permissions.") from None
    try:
        header = json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{str(path)!r} is not a safetensors file (bad or truncated header): "
                              "download it again.")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{str(path)!r} has a malformed header entry for {name}: the file is corrupted.") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"tensor {name} in {path.name} has dtype {dtype}, which dsv4 cannot read: "
                                  f"supported are {', '.join(DTYPES)}.")
        if e - b != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"tensor {name} in {path.name} holds {e - b} bytes but its {dtype} shape "
                                  f"{list(shape)} needs {math.prod(shape) * DTYPES[dtype].itemsize}: the file is corrupted.")
        start = 8 + n + b
        if start + (e - b) > size:
            raise CheckpointError(f"{str(path)!r} is truncated ({size} bytes, tensor {name} ends at byte "
                                  f"{start + e - b}): download it again.")
        out[name] = TensorInfo(name, dtype, shape, start, e - b)
    return out


def read_tensor(path: str | Path, info: TensorInfo) -> np.ndarray:
    """The tensor as a read-only memory map in its own dtype (no copy; only its bytes are touched)."""
    if info.nbytes == 0:
        return np.zeros(info.shape, DTYPES[info.dtype])
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.nbytes,))
    return raw.view(DTYPES[info.dtype]).reshape(info.shape)


# ----------------------------------------------------------------------------- FP8 / FP4


def dequant_fp8(w: np.ndarray, s: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Block-scaled FP8 -> float32: W[r, c] = w[r, c] * s[r // block, c // block].

    Shapes: w [O, I] float8_e4m3fn; s [ceil(O/block), ceil(I/block)] float8_e8m0fnu -> [O, I].
    """
    o, i = w.shape
    want = (-(-o // block), -(-i // block))
    if tuple(s.shape) != want:
        raise CheckpointError(f"an FP8 weight of shape {list(w.shape)} needs a scale of shape {list(want)} "
                              f"({block}x{block} blocks), got {list(s.shape)}.")
    scale_oi = np.repeat(np.repeat(s.astype(np.float32), block, 0)[:o], block, 1)[:, :i]
    return w.astype(np.float32) * scale_oi


def unpack_fp4(p: np.ndarray) -> np.ndarray:
    """[O, I/2] int8 (two e2m1 codes per byte, low nibble first) -> [O, I] float32 values."""
    u = p.view(np.uint8)
    return np.stack([E2M1[u & 15], E2M1[u >> 4]], axis=-1).reshape(u.shape[0], -1)


def dequant_fp4(p: np.ndarray, s: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """FP4 experts -> float32: W[r, c] = E2M1[nibble(r, c)] * s[r, c // block].

    Shapes: p [O, I/2] int8 packed; s [O, I/block] float8_e8m0fnu -> [O, I].
    """
    o, half = p.shape
    if tuple(s.shape) != (o, 2 * half // block):
        raise CheckpointError(f"an FP4 weight packed as {list(p.shape)} (logical {[o, 2 * half]}) needs a scale of "
                              f"shape {[o, 2 * half // block]} (one per {block} inputs), got {list(s.shape)}.")
    return unpack_fp4(p) * np.repeat(s.astype(np.float32), block, 1)


# ----------------------------------------------------------------------------- writing


def write_file(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file (through the `safetensors` package; every dtype in DTYPES works)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(path), metadata=metadata)


_CODES = {v: k for k, v in DTYPES.items()}


class StreamedFile:
    """One safetensors file written tensor by tensor: the header first, from the planned
    (name, dtype, shape) list, then each tensor's bytes in that order. Holds no tensor itself.

    Args:
      path: the file to create.
      plan: [(name, NumPy dtype, shape)] in file order.
      metadata: the header's `__metadata__` strings.
    """

    def __init__(self, path: str | Path, plan: list[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header, offset = {"__metadata__": dict(metadata)} if metadata else {}, 0
        for name, dtype, shape in plan:
            n = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8 bytes
        self.plan, self.next, self.file = plan, 0, open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, value: np.ndarray) -> None:
        """Append the next planned tensor (its name, dtype and shape must be the planned ones)."""
        want = self.plan[self.next]
        if (name, np.dtype(value.dtype), tuple(value.shape)) != (want[0], np.dtype(want[1]), tuple(want[2])):
            raise ValueError(f"tensor {name} {value.dtype} {list(value.shape)} is not the planned {want}")
        np.ascontiguousarray(value).reshape(-1).view(np.uint8).tofile(self.file)
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.plan):
            raise ValueError(f"{len(self.plan) - self.next} planned tensors were never written")


def write_index(path: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json`: {"metadata": {"total_size"}, "weight_map": {name: shard}}."""
    Path(path).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")
