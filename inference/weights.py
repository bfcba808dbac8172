"""Weights identified by their tensors, as the engine reads them.

Two checkpoints have the same ``weights`` digest exactly when the engine would
load the same tensors: same names, dtypes, shapes and bytes. How the tensors
are split across files (1 shard or 3), a safetensors ``__metadata__`` block,
and files the engine never opens (optimizer states, a second copy of the
weights in another format) do not count.

Which files count follows vLLM 0.32's ``DefaultModelLoader._prepare_weights``
with ``load_format="auto"`` (``vllm/model_executor/model_loader/default_loader.py``):

1. if any ``consolidated*.safetensors`` exists, the Mistral format: only those
   files, filtered by ``consolidated.safetensors.index.json`` when present;
2. else every top-level ``*.safetensors``, filtered by the ``weight_map`` of
   ``model.safetensors.index.json`` when present (a file it names that is
   missing is an error, as in vLLM);
3. else every top-level ``*.bin``, else every ``*.pt``, minus the training
   files vLLM skips (``training_args.bin``, ``optimizer.bin``,
   ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``).

A GGUF checkpoint is one ``.gguf`` file (a quantization); a folder holding
GGUF files only is refused with the list of files to choose from.
"""

from __future__ import annotations

import fnmatch
import json
import math
import mmap
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
from safetensors import SafetensorError, safe_open

from inference.digest_cache import FileDigestCache
from inference.errors import CheckpointError
from inference.strict_json import unique_pairs

#: Files vLLM's loader drops before loading (``filter_files_not_needed_for_inference``).
TRAINING_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")

#: torch dtypes by the safetensors name of the same element type, so a tensor
#: saved as a pickle and as safetensors has one identity.
_TORCH_TO_SAFETENSORS = {
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}

#: Bytes hashed between two progress reports.
PROGRESS_CHUNK = 64 << 20


@dataclass(frozen=True)
class Tensor:
    """One tensor as the engine loads it.

    Attributes:
        name: the tensor's name in the checkpoint.
        dtype: element type, safetensors spelling (``"BF16"``) or the GGML
            quantization type for GGUF (``"Q4_K"``).
        shape: dimensions, outermost first.
        digest: 64-hex BLAKE3 of the tensor's bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str

    def summary(self) -> str:
        """``"BF16[4096,128] <digest>"``: what an identity diff shows for it."""
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}] {self.digest}"


def is_gguf(path: Path) -> bool:
    """True for a GGUF file path (checked by suffix; the header is checked on read)."""
    return path.suffix.lower() == ".gguf"


def engine_weight_files(root: Path) -> tuple[str, list[Path]]:
    """The weight files the engine would load from a checkpoint, and their format.

    Args:
        root: a checkpoint directory, or one ``.gguf`` file.

    Returns:
        ``(format, files)``: format is ``"safetensors"``, ``"pickle"`` or
        ``"gguf"``; files sorted by path.

    Raises:
        CheckpointError: no weight files; a folder of GGUF files (name one);
            an index naming a missing file or unreadable.
    """
    if root.is_file():
        if not is_gguf(root):
            raise CheckpointError(f"{root} is a file; a checkpoint is a directory or one .gguf file")
        return "gguf", [root]
    top = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    names = [p.name for p in top]
    nested = [p.name for p in root.rglob("*") if p.is_file()]
    if fnmatch.filter(nested, "consolidated*.safetensors"):
        files = [p for p in top if fnmatch.fnmatch(p.name, "consolidated*.safetensors")]
        return "safetensors", _filter_by_index(root, files, "consolidated.safetensors.index.json")
    safetensors = [p for p in top if p.name.endswith(".safetensors")]
    if safetensors:
        return "safetensors", _filter_by_index(root, safetensors, "model.safetensors.index.json")
    for pattern in ("*.bin", "*.pt"):
        if fnmatch.filter(names, pattern):
            # vLLM takes the first pattern that matches, then drops training files.
            found = [p for p in top if fnmatch.fnmatch(p.name, pattern) and p.name not in TRAINING_FILES]
            if not found:
                raise CheckpointError(f"checkpoint {root} has only training files ({pattern}), no weights the engine reads")
            return "pickle", found
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if ggufs:
        raise CheckpointError(
            f"checkpoint {root} holds {len(ggufs)} GGUF file(s) ({', '.join(ggufs)}); each is its own "
            "quantization, so name the .gguf file to fingerprint"
        )
    raise CheckpointError(f"checkpoint {root} has no weight files the engine reads (*.safetensors, *.bin, *.pt)")


def _filter_by_index(root: Path, files: list[Path], index_name: str) -> list[Path]:
    index = root / index_name
    if not index.is_file():
        return files
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        named = {root / str(v) for v in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not a valid weight index: {exc}") from exc
    missing = sorted(str(p.relative_to(root)) for p in named if p not in set(files))
    if missing:
        raise CheckpointError(f"{index} names weight files that are missing: {', '.join(missing)}")
    return [p for p in files if p in named]


#: Bits per element of each safetensors dtype (``safetensors`` ``Dtype``; F4 and F6 pack below a byte).
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}  # fmt: skip


def read_safetensors_header(path: Path, size: int) -> tuple[int, dict[str, Any]]:
    """Parse and check a safetensors header as the safetensors library does before
    loading: its length, JSON, no duplicate names, a known dtype per tensor,
    ``data_offsets`` spanning exactly ``shape × dtype`` bytes, tensors that tile
    the data with no overlap or hole, and data ending exactly at the end of the file.

    Format: 8-byte little-endian header length, JSON header whose entries carry
    ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the header
    (https://github.com/huggingface/safetensors, "Format").

    Returns:
        ``(header length in bytes, {tensor name: entry})`` without ``__metadata__``.

    Raises:
        CheckpointError: empty, truncated, padded or malformed, or refused by
            ``safetensors.safe_open`` for any other reason.
    """
    if size == 0:
        raise CheckpointError(f"{path} is an empty weight file")
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CheckpointError(f"{path} is truncated: header of {header_len} bytes in a {size}-byte file")
            header = json.loads(fh.read(header_len), object_pairs_hook=unique_pairs)
    except CheckpointError:
        raise  # already says what is wrong with the file (a ValueError too: not wrapped again)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} has a malformed safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a malformed safetensors header: not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 0
    spans: list[tuple[int, int, str]] = []
    for name, entry in tensors.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise CheckpointError(f"{path} has a malformed safetensors header: tensor {name!r} has no valid data_offsets")
        if not isinstance(entry.get("dtype"), str) or not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CheckpointError(f"{path} has a malformed safetensors header: tensor {name!r} has no valid dtype/shape")
        bits = SAFETENSORS_DTYPE_BITS.get(entry["dtype"])
        if bits is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, which safetensors does not define")
        expected_bytes = -(-math.prod(shape) * bits // 8)
        if offsets[1] - offsets[0] != expected_bytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} is {entry['dtype']}{shape} ({expected_bytes} bytes) "
                f"but its data_offsets span {offsets[1] - offsets[0]} bytes"
            )
        spans.append((offsets[0], offsets[1], name))
        end = max(end, offsets[1])
    position = 0
    for start, stop, name in sorted(spans):
        if start != position:
            what = "overlaps the tensor before it" if start < position else f"leaves a gap of {start - position} bytes before it"
            raise CheckpointError(f"{path}: tensor {name!r} {what} (safetensors data must be tiled exactly)")
        position = stop
    expected = 8 + header_len + end
    if expected != size:
        state = "truncated" if expected > size else "longer than its header declares"
        raise CheckpointError(f"{path} is {state}: header declares {expected} bytes, file has {size}")
    # The checks above name the problem; the library's own open is the verdict a
    # loader will reach (it also refuses e.g. __metadata__ values that are not strings).
    try:
        with safe_open(path, framework="numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is refused by the safetensors library: {exc}") from exc
    return header_len, tensors


def _hash_view(
    view: memoryview, on_bytes: Callable[[int], None] | None, prefetch: Callable[[int], None] | None = None, at: int = 0
) -> str:
    """BLAKE3 hex of ``view`` (all cores), in :data:`PROGRESS_CHUNK` pieces.

    Args:
        prefetch: called with the file offset of the piece after the one being
            hashed (``at`` is the view's offset in the file), so the disk reads it
            while the cores hash this one.
    """
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for offset in range(0, max(len(view), 1), PROGRESS_CHUNK):
        if prefetch is not None:
            prefetch(at + offset + PROGRESS_CHUNK)
        chunk = view[offset : offset + PROGRESS_CHUNK]
        hasher.update(chunk)
        if on_bytes is not None and len(chunk):
            on_bytes(len(chunk))
        chunk.release()
    return hasher.hexdigest()


def _mapped(path: Path) -> Iterator[tuple[memoryview, Callable[[int], None]]]:
    """Yield one read-only view of the whole file (empty for an empty file) and a
    prefetch function: ``prefetch(offset)`` asks the kernel to start reading the
    :data:`PROGRESS_CHUNK` bytes at ``offset`` now (``POSIX_FADV_WILLNEED``).

    The mapping is marked sequential (``MADV_SEQUENTIAL``), so page faults read
    ahead aggressively and hashed pages are dropped first: a file not in the page
    cache is hashed at the disk's sequential read speed when the cores keep up.
    """
    with path.open("rb") as fh:
        fd = fh.fileno()
        if os.fstat(fd).st_size == 0:
            yield memoryview(b""), lambda offset: None
            return

        def prefetch(offset: int) -> None:
            os.posix_fadvise(fd, offset, PROGRESS_CHUNK, os.POSIX_FADV_WILLNEED)

        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                yield view, prefetch
            finally:
                view.release()


def _safetensors_tensors(path: Path, on_bytes: Callable[[int], None] | None) -> list[Tensor]:
    size = path.stat().st_size
    header_len, entries = read_safetensors_header(path, size)
    base = 8 + header_len
    out = []
    for view, prefetch in _mapped(path):
        # In file order, so the disk reads sequentially; the digests are listed by name.
        for name in sorted(entries, key=lambda n: entries[n]["data_offsets"][0]):
            entry = entries[name]
            start, stop = entry["data_offsets"]
            tensor_view = view[base + start : base + stop]
            digest = _hash_view(tensor_view, on_bytes, prefetch, base + start)
            tensor_view.release()
            out.append(Tensor(name, entry["dtype"], tuple(entry["shape"]), digest))
    return sorted(out, key=lambda t: t.name)


def _gguf_reader(path: Path) -> Any:
    # Lazy: only GGUF checkpoints need the reader.
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError… on bad input
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from exc


def _gguf_tensors(path: Path, on_bytes: Callable[[int], None] | None) -> list[Tensor]:
    reader = _gguf_reader(path)
    out = []
    for view, _ in _mapped(path):
        for tensor in sorted(reader.tensors, key=lambda t: t.name):
            start = int(tensor.data_offset)
            stop = start + int(tensor.n_bytes)
            if stop > len(view):
                raise CheckpointError(f"{path} is truncated: tensor {tensor.name!r} ends past the end of the file")
            tensor_view = view[start:stop]
            digest = _hash_view(tensor_view, on_bytes)
            tensor_view.release()
            # GGUF lists dimensions innermost first; reverse to the outermost-first convention.
            shape = tuple(int(d) for d in reversed(list(tensor.shape)))
            out.append(Tensor(str(tensor.name), tensor.tensor_type.name, shape, digest))
    return out


def _pickle_tensors(path: Path, on_bytes: Callable[[int], None] | None) -> list[Tensor]:
    # Lazy: importing torch costs seconds; only pickle weight files need it.
    import torch

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # Files from torch < 1.6 are not zip archives and cannot be mapped.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message goes on to advise weights_only=False, i.e. running the
        # file's code: never advice to pass on. Name only what was refused.
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"it names {named.group(1).rstrip('.')}" if named else "it holds objects other than tensors"
        raise CheckpointError(f"{path} is refused: {what}, and loading it would run code") from exc
    except Exception as exc:  # the unpickler raises many kinds; all mean "not a weights file"
        raise CheckpointError(f"{path} is not a loadable weights file: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a mapping of tensor names to tensors")
    out = []
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is not a tensor")
        dtype = _TORCH_TO_SAFETENSORS.get(str(tensor.dtype), str(tensor.dtype))
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.append(Tensor(str(name), dtype, tuple(tensor.shape), _hash_view(raw.data, on_bytes)))
    return out


_READERS: dict[str, Callable[[Path, Callable[[int], None] | None], list[Tensor]]] = {
    "safetensors": _safetensors_tensors,
    "gguf": _gguf_tensors,
    "pickle": _pickle_tensors,
}


def file_tensors(
    path: Path,
    weight_format: str,
    *,
    cache: FileDigestCache | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[list[Tensor], bool]:
    """The tensors of one weight file, with the digest cache.

    Args:
        weight_format: as returned by :func:`engine_weight_files`.
        on_bytes: called with byte counts as the file is read, adding up to
            the file's size (or once with the size when the cache answers).

    Returns:
        ``(tensors sorted by name, hashed)``: ``hashed`` is False when the cache answered.

    Raises:
        CheckpointError: malformed file, an empty file, or the file changed
            (size, mtime, ctime or inode) while it was read.
    """
    before = path.stat()
    if before.st_size == 0:
        raise CheckpointError(f"{path} is an empty weight file")
    if cache is not None:
        cached = cache.get_manifest(path, before)
        if cached is not None:
            if on_bytes is not None:
                on_bytes(before.st_size)
            return [Tensor(t[0], t[1], tuple(t[2]), t[3]) for t in cached], False
    done = 0

    def count(n: int) -> None:
        nonlocal done
        done += n
        if on_bytes is not None:
            on_bytes(n)

    tensors = _READERS[weight_format](path, count)
    after = path.stat()
    if FileDigestCache.stat_key(before) != FileDigestCache.stat_key(after):
        raise CheckpointError(f"{path} changed while it was being hashed; retry once it is written")
    if on_bytes is not None and before.st_size > done:
        on_bytes(before.st_size - done)  # headers and padding: progress ends at the file size
    if cache is not None:
        cache.put_manifest(path, before, [[t.name, t.dtype, list(t.shape), t.digest] for t in tensors])
    return tensors, True


#: GGUF ``general.*`` keys that change the computation; the rest of ``general.*``
#: describes the file (name, author, license, URLs, base models, file type).
GGUF_GENERAL_KEYS = ("general.architecture", "general.quantization_version")


def gguf_metadata(path: Path, *, tokenizer: bool) -> dict[str, Any]:
    """A GGUF file's metadata: the tokenizer part (``tokenizer.*``, chat
    template included) or the model part (the architecture's hyperparameters
    and :data:`GGUF_GENERAL_KEYS`), as plain JSON values.

    Raises:
        CheckpointError: not a readable GGUF file.
    """
    reader = _gguf_reader(path)
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # version and counts of the container format
        is_tokenizer = name.startswith("tokenizer.")
        if is_tokenizer != tokenizer:
            continue
        if name.startswith("general.") and name not in GGUF_GENERAL_KEYS:
            continue
        try:
            value = field.contents()
        except Exception as exc:  # the reader raises ValueError, IndexError… on a corrupt field
            raise CheckpointError(f"{path}: metadata {name!r} cannot be read: {exc}") from exc
        out[name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "item"):
        return value.item()
    return value
