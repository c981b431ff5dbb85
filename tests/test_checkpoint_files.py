"""accum_fused.save_checkpoint / load_checkpoint (issue 45): a crash while saving leaves the
previous checkpoint whole, and a truncated or damaged file refuses to load, loudly (torch.load
loads a file with an inverted byte in a tensor's data silently: the first test shows it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import accum_fused
from accum_fused import CheckpointCorruptError, checkpoint_files, load_checkpoint, save_checkpoint

from _helpers import make_batches, make_model


def _checkpoint():
    model = make_model(seed=3)
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=2)
    for x, y in make_batches([3, 2, 4]):  # one update and an open window
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "next": 3}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_torch_load_takes_a_damaged_file_silently_which_is_why(tmp_path):
    tensor = torch.arange(1000, dtype=torch.float32)
    torch.save({"t": tensor}, tmp_path / "plain.pt")
    data = bytearray((tmp_path / "plain.pt").read_bytes())
    data[data.find(tensor.numpy().tobytes()[:16]) + 400] ^= 0xFF
    (tmp_path / "plain.pt").write_bytes(bytes(data))
    assert not torch.equal(torch.load(tmp_path / "plain.pt")["t"], tensor)  # loaded, and wrong


def test_a_checkpoint_round_trips_bit_for_bit(tmp_path):
    saved = _checkpoint()
    save_checkpoint(saved, tmp_path / "c.pt")
    assert _equal(load_checkpoint(tmp_path / "c.pt", weights_only=True), saved)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # (no temporary left)


def test_every_truncation_and_every_inverted_byte_is_refused(tmp_path):
    save_checkpoint(_checkpoint(), tmp_path / "c.pt")
    good = (tmp_path / "c.pt").read_bytes()
    header = checkpoint_files._HEADER.size
    lengths = sorted({0, 1, header - 1, header, header + 1, len(good) // 2, len(good) - 1})
    bytes_to_invert = sorted({0, 7, 8, 39, 40, 47, header, len(good) // 2, len(good) - 1})
    for length in lengths:
        (tmp_path / "c.pt").write_bytes(good[:length])
        with pytest.raises(CheckpointCorruptError, match="c.pt: .*(truncated|header)"):
            load_checkpoint(tmp_path / "c.pt")
    for at in bytes_to_invert:
        damaged = bytearray(good)
        damaged[at] ^= 0xFF
        (tmp_path / "c.pt").write_bytes(bytes(damaged))
        with pytest.raises(CheckpointCorruptError, match="c.pt: "):
            load_checkpoint(tmp_path / "c.pt")
    assert issubclass(CheckpointCorruptError, ValueError)


def test_a_file_torch_save_wrote_is_refused_naming_torch_load(tmp_path):
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointCorruptError, match="not written by accum_fused.save_checkpoint.*torch.load"):
        load_checkpoint(tmp_path / "plain.pt")


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    save_checkpoint({"n": 1}, tmp_path / "c.pt")

    def disk_full(f, header, payload):
        f.write(header)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "_write", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint({"n": 2}, tmp_path / "c.pt")
    assert load_checkpoint(tmp_path / "c.pt") == {"n": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_whole(tmp_path):
    """SIGKILL after half the new file was written: the old one is still at the path, whole."""
    save_checkpoint({"n": 1}, tmp_path / "c.pt")
    script = textwrap.dedent(f"""
        import os, signal, torch
        from accum_fused import checkpoint_files, save_checkpoint
        def half_then_die(f, header, payload):
            f.write(header); f.write(payload[: len(payload) // 2]); f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_files._write = half_then_die
        save_checkpoint({{"n": 2, "big": torch.zeros(100000)}}, {str(tmp_path / "c.pt")!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", script], env=env).returncode == -signal.SIGKILL
    assert load_checkpoint(tmp_path / "c.pt") == {"n": 1}
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "c.pt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".c.pt.") and leftovers[0].endswith(".tmp")
