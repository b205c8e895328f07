"""Model files from the internet are untrusted: their headers are checked before anything reads them.

Every count, length, shape and offset in a GGUF header, a safetensors header or a JSON config is
checked against the file's size and the format's rules before a byte is allocated for it or
another reader (gguf-py, MLX's loaders, mlx-lm, transformers) sees the file. Whatever does not
fit raises ``BadModelFile`` naming the file, the field and the byte offset. Nothing here runs
code from a file; nothing reads outside the file.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import struct
from pathlib import Path

from .errors import BadModelFile

MAX_JSON_BYTES = 64 << 20  # config.json / tokenizer_config.json (tokenizer.json is mlx-lm's business)
MAX_JSON_DEPTH = 64  # a real config nests a few levels; deeper is crafted
SAFETENSORS_MAX_HEADER = 100 << 20  # the format's own limit
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
MAX_DIMS = 8
GGUF_VERSIONS = (2, 3)
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_MAX_STRING = 1 << 30
GGUF_ARRAY_DEPTH = 2  # arrays of arrays at most (llama.cpp writes none)
# GGUF value types: id -> (name, struct format or None for string/array)
GGUF_TYPES = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<?"),
    8: ("string", None),
    9: ("array", None),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}


# -- JSON ------------------------------------------------------------------------------------------


def json_depth_problem(text: str, limit: int = MAX_JSON_DEPTH) -> int | None:
    """The character offset where ``text`` nests deeper than ``limit`` (None: it does not).
    Brackets inside strings are skipped; runs in one pass, without recursion."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return i
        elif ch in "]}":
            depth -= 1
    return None


def loads(raw: bytes, path, what: str = "JSON", *, limit: int = MAX_JSON_DEPTH) -> object:
    """Parse untrusted JSON bytes: UTF-8, bounded depth, named errors."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadModelFile(path, f"{what} is not UTF-8", offset=e.start) from None
    if (at := json_depth_problem(text, limit)) is not None:
        raise BadModelFile(path, f"{what} nests deeper than {limit} levels", offset=at)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadModelFile(path, f"{what} is not valid JSON: {e.msg}", offset=e.pos) from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of 5,000 digits
        raise BadModelFile(path, f"{what} is not usable JSON: {e}") from None


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a model folder's config file (``config.json``, ``tokenizer_config.json``)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise BadModelFile(path, f"{size} bytes is larger than any config ({max_bytes} bytes at most)")
    data = loads(path.read_bytes(), path)
    if not isinstance(data, dict):
        raise BadModelFile(path, f"expected a JSON object, got {type(data).__name__}", offset=0)
    return data


# -- safetensors -----------------------------------------------------------------------------------


def safetensors_header(path: str | Path) -> dict:
    """The checked header of a safetensors file: ``{name: (dtype, shape, (begin, end))}`` with
    ``"__metadata__"`` (str -> str, or null as MLX writes it) if present. Checked: the header length fits the file (and
    the format's 100 MiB), every dtype is known, every shape is a list of non-negative ints,
    every tensor's byte range lies inside the data section, matches its shape and dtype, and no
    two ranges overlap."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadModelFile(path, f"only {size} bytes: too short for a safetensors header", "header length", 0)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > SAFETENSORS_MAX_HEADER:
            raise BadModelFile(
                path,
                f"header length {n} does not fit the file ({size} bytes; at most "
                f"{SAFETENSORS_MAX_HEADER} by the format)",
                "header length",
                0,
            )
        raw = f.read(n)
    header = loads(raw, path, "the safetensors header", limit=4)
    if not isinstance(header, dict):
        raise BadModelFile(path, "the safetensors header is not a JSON object", "header", 8)
    data = size - 8 - n
    out, spans = {}, []
    for name, v in header.items():
        if name == "__metadata__":
            if v is not None and (not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values())):
                raise BadModelFile(path, "__metadata__ must map strings to strings", "__metadata__", 8)
            out[name] = v
            continue
        field = f"tensor {name!r}"
        if not isinstance(v, dict) or set(v) - {"dtype", "shape", "data_offsets"} or len(v) != 3:
            raise BadModelFile(path, "a tensor entry needs exactly dtype, shape and data_offsets", field, 8)
        dtype, shape, offs = v["dtype"], v["shape"], v["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise BadModelFile(path, f"unknown dtype {dtype!r}", f"{field} dtype", 8)
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_uint(d) for d in shape):
            raise BadModelFile(
                path, f"shape {shape!r} is not a list of at most {MAX_DIMS} non-negative integers", f"{field} shape", 8
            )
        if not (isinstance(offs, list) and len(offs) == 2 and all(_uint(o) for o in offs)):
            raise BadModelFile(path, f"data_offsets {offs!r} is not [begin, end]", f"{field} data_offsets", 8)
        begin, end = offs
        if not begin <= end <= data:
            raise BadModelFile(
                path,
                f"data_offsets [{begin}, {end}] lie outside the {data}-byte data section",
                f"{field} data_offsets",
                8 + n + min(begin, data),
            )
        want = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if end - begin != want:
            raise BadModelFile(
                path,
                f"{end - begin} bytes for a {dtype} tensor of shape {shape} ({want} bytes)",
                f"{field} data_offsets",
                8 + n + begin,
            )
        out[name] = (dtype, tuple(shape), (begin, end))
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, n0), (b1, e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise BadModelFile(
                path,
                f"tensors {n0!r} and {n1!r} overlap (bytes {b1}..{min(e0, e1)})",
                f"tensor {n1!r} data_offsets",
                8 + n + b1,
            )
    return out


def _uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


# -- GGUF ------------------------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reads over a mapped file."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise BadModelFile(
                self.path, f"{field} needs {n} bytes but the file ends at {self.size} (cut short?)", field, self.pos
            )
        out = self.buf[self.pos : self.pos + n]  # (a copy of n bytes: callers bound n first)
        self.pos += n
        return out

    def skip(self, n: int, field: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise BadModelFile(
                self.path, f"{field} needs {n} bytes but the file ends at {self.size} (cut short?)", field, self.pos
            )
        self.pos += n

    def unpack(self, fmt: str, field: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def string(self, field: str, limit: int = GGUF_MAX_STRING, decode: bool = True) -> str | None:
        at = self.pos
        n = self.unpack("<Q", f"{field} length")
        if n > min(limit, self.size - self.pos):
            raise BadModelFile(self.path, f"string length {n} does not fit the file", field, at)
        if not decode:  # (array elements: a tokenizer's byte tokens need not be UTF-8)
            self.skip(n, field)
            return None
        raw = self.take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadModelFile(self.path, "string is not UTF-8", field, at + 8) from None


def check_gguf(path: str | Path) -> dict:
    """Walk a GGUF file's header and check it against the file before any reader parses it:
    magic and version; key/value and tensor counts that the file can hold; every string length
    and array count inside the file; known value and tensor types; at most 4 positive dims per
    tensor, whole quantization blocks; every tensor's data aligned, inside the file and not
    overlapping another. Returns ``{"version", "kv", "tensors": {name: (type, dims, offset,
    bytes)}, "alignment", "data_start"}`` (scalar metadata only in ``kv``)."""
    # (startup: models loads this module; importing gguf takes ~0.5 s)
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise BadModelFile(path, f"only {size} bytes: too short for a GGUF header", "magic", 0)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        c = _Cursor(m, path)
        try:
            if bytes(c.take(4, "magic")) != b"GGUF":
                raise BadModelFile(path, "not a GGUF file (magic is not 'GGUF')", "magic", 0)
            version = c.unpack("<I", "version")
            if version not in GGUF_VERSIONS:
                raise BadModelFile(path, f"GGUF version {version} is not supported (2 or 3)", "version", 4)
            n_tensors = c.unpack("<Q", "tensor_count")
            n_kv = c.unpack("<Q", "metadata_kv_count")
            if n_tensors * 28 > size or n_kv * 13 > size:  # the smallest entry of each kind
                raise BadModelFile(
                    path,
                    f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in {size} bytes",
                    "tensor_count" if n_tensors * 28 > size else "metadata_kv_count",
                    8,
                )
            kv: dict = {}
            for i in range(n_kv):
                key = c.string(f"metadata key #{i}", limit=1 << 16)
                kv[key] = _gguf_value(c, c.unpack("<I", f"type of {key}"), key, 0)
            alignment = kv.get("general.alignment", 32)
            if (
                not isinstance(alignment, int)
                or isinstance(alignment, bool)
                or alignment < 1
                or alignment > 1 << 16
                or alignment & (alignment - 1)
            ):
                raise BadModelFile(
                    path, f"general.alignment {alignment!r} is not a power of two up to 65536", "general.alignment"
                )
            tensors = {}
            for i in range(n_tensors):
                at = c.pos
                name = c.string(f"tensor #{i} name", limit=1 << 16)
                field = f"tensor {name!r}"
                if name in tensors:
                    raise BadModelFile(path, "tensor name appears twice", field, at)
                n_dims = c.unpack("<I", f"{field} n_dims")
                if not 1 <= n_dims <= GGUF_MAX_DIMS:
                    raise BadModelFile(
                        path, f"{n_dims} dimensions (1 to {GGUF_MAX_DIMS})", f"{field} n_dims", c.pos - 4
                    )
                dims = [c.unpack("<Q", f"{field} dims") for _ in range(n_dims)]
                kind = c.unpack("<I", f"{field} type")
                try:
                    qtype = GGMLQuantizationType(kind)
                    block, type_size = GGML_QUANT_SIZES[qtype]
                except (ValueError, KeyError):
                    raise BadModelFile(path, f"unknown tensor type {kind}", f"{field} type", c.pos - 4) from None
                offset = c.unpack("<Q", f"{field} offset")
                if any(d < 1 or d > size * block for d in dims) or math.prod(dims) > size * block:
                    raise BadModelFile(path, f"dims {dims} cannot fit in {size} bytes", f"{field} dims", at)
                if dims[0] % block:
                    raise BadModelFile(
                        path, f"first dim {dims[0]} is not whole {qtype.name} blocks of {block}", f"{field} dims", at
                    )
                if offset % alignment:
                    raise BadModelFile(
                        path, f"offset {offset} is not aligned to {alignment}", f"{field} offset", c.pos - 8
                    )
                tensors[name] = (qtype.name, tuple(dims), offset, math.prod(dims) // block * type_size)
            data_start = -(-c.pos // alignment) * alignment
        except BadModelFile:
            raise
        except (struct.error, OverflowError, ValueError) as e:  # (belt and braces: every read is bounded)
            raise BadModelFile(path, f"unreadable GGUF header ({type(e).__name__}: {e})", offset=c.pos) from None
    spans = []
    for name, (_, _, offset, nbytes) in tensors.items():
        if data_start + offset + nbytes > size:
            raise BadModelFile(
                path,
                f"data of {nbytes} bytes at {data_start + offset} runs past the end of the "
                f"file ({size} bytes; cut short?)",
                f"tensor {name!r} offset",
                data_start + offset,
            )
        spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise BadModelFile(path, f"tensors {n0!r} and {n1!r} overlap", f"tensor {n1!r} offset", data_start + b1)
    return {"version": version, "kv": kv, "tensors": tensors, "alignment": alignment, "data_start": data_start}


def _gguf_value(c: _Cursor, kind: int, key: str, depth: int):
    """One metadata value; arrays are checked and skipped (their count against the bytes left),
    scalars and strings returned."""
    if kind not in GGUF_TYPES:
        raise BadModelFile(c.path, f"unknown value type {kind}", key, c.pos - 4)
    name, fmt = GGUF_TYPES[kind]
    if fmt is not None:
        return c.unpack(fmt, key)
    if name == "string":
        return c.string(key, decode=depth == 0)
    if depth >= GGUF_ARRAY_DEPTH:
        raise BadModelFile(c.path, f"arrays nested deeper than {GGUF_ARRAY_DEPTH}", key, c.pos)
    at = c.pos
    elem = c.unpack("<I", f"{key} element type")
    count = c.unpack("<Q", f"{key} count")
    if elem not in GGUF_TYPES:
        raise BadModelFile(c.path, f"unknown array element type {elem}", key, at)
    ename, efmt = GGUF_TYPES[elem]
    least = struct.calcsize(efmt) if efmt is not None else (8 if ename == "string" else 12)
    if count * least > c.size - c.pos:
        raise BadModelFile(
            c.path, f"array of {count} {ename} values cannot fit in the {c.size - c.pos} bytes left", key, at
        )
    if efmt is not None:
        c.skip(count * least, key)
    else:
        for _ in range(count):
            _gguf_value(c, elem, key, depth + 1)
    return None
