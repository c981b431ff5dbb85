"""Checkpoint files that a crash cannot leave half-written and that refuse to load when damaged.

Owns: ``save_checkpoint(obj, path)`` and ``load_checkpoint(path)`` (and their error,
``CheckpointCorruptError``), the file format below, and the atomic replace.

Why: ``torch.save`` writes in place, so a process killed while saving leaves a truncated file
where the last good checkpoint was; and ``torch.load`` checks no checksum, so a flipped byte in a
tensor's data loads silently as a different number (measured with torch 2.13: a 4 KB checkpoint
with one byte inverted loads, and the tensor differs). A restart from such a file does not
resume the run, it starts another. The chaos soak (benchmarks/chaos.py) injects both.

The file: 8 bytes of magic, the SHA-256 of the payload (32 bytes), the payload's length (8 bytes,
little-endian), then the payload: ``torch.save``'s bytes. It is written to a temporary file in the
same directory, flushed and fsync'ed, then renamed over ``path`` (os.replace is atomic on POSIX
and Windows), and the directory is fsync'ed: after a crash ``path`` holds the old checkpoint or
the new one, whole.

Must not: change what torch.save / torch.load keep; a damaged file raises, it never loads.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"AFCKPT1\n"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(payload), len(payload)


class CheckpointCorruptError(ValueError):
    """A checkpoint file that is truncated, damaged, or was not written by ``save_checkpoint``."""


def save_checkpoint(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically, with a checksum that ``load_checkpoint``
    verifies: a crash while saving leaves the previous file at ``path`` (or none), never part of
    the new one."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getbuffer()
    header = _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload))
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            _write(f, header, payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def load_checkpoint(path: str | os.PathLike, **torch_load_kwargs) -> Any:
    """What ``save_checkpoint`` saved at ``path``, after checking its length and checksum;
    ``torch_load_kwargs`` go to ``torch.load`` (``map_location``, ``weights_only``). Raises
    ``CheckpointCorruptError`` naming the file and what is wrong when it is truncated, damaged or
    not such a file; load the checkpoint before it."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise CheckpointCorruptError(f"{path}: {len(data)} bytes, shorter than a checkpoint's header: truncated; "
                                     "resume from the checkpoint before it")
    magic, digest, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointCorruptError(f"{path}: not written by accum_fused.save_checkpoint (no header); a file "
                                     "written by torch.save loads with torch.load, which checks no checksum")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointCorruptError(f"{path}: {len(payload)} bytes of data where the header says {length}: "
                                     "truncated or extended; resume from the checkpoint before it")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointCorruptError(f"{path}: the data's SHA-256 differs from the one saved with it: the file is "
                                     "damaged; resume from the checkpoint before it")
    return torch.load(io.BytesIO(payload), **torch_load_kwargs)


def _write(f, header: bytes, payload) -> None:
    """(One place for the bytes, where the chaos soak kills a process in the middle of a save.)"""
    f.write(header)
    f.write(payload)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); directories cannot be opened so on Windows."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
