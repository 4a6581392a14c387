"""The `uzip` command line: version, a frame file, and what uzip does to a checkpoint."""

import json

import pytest
import torch

import uzip_serve as uz
from uzip_serve import cli

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_version(capsys):
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"uzip-serve {uz.__version__}, frame format v{uz.FORMAT_VERSION}"


def test_info_describes_a_frame_and_refuses_a_corrupt_one(realdata, tmp_path, capsys):
    w = next(iter(realdata("minilm_weights").values())).to(torch.bfloat16)
    frame = bytes(uz.compress(w))
    path = tmp_path / "w.uz"
    path.write_bytes(frame)
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    h = uz.read_header(frame)
    assert f"bfloat16 {list(w.shape)}" in out and f"{w.nbytes} -> {len(frame)} bytes" in out
    assert f"ratio {h.ratio:.4f}" in out

    path.write_bytes(frame[: len(frame) // 2])
    assert cli.main(["info", str(path)]) == 1
    assert "not a valid uzip frame" in capsys.readouterr().err


def _checkpoint(realdata, path):
    minilm = list(realdata("minilm_weights").items())[:4]
    hidden = list(realdata("gemma_activations").items())[:2]
    tensors = {**{n: t.contiguous() for n, t in minilm},
               **{f"{n}.bf16": t.to(torch.bfloat16) for n, t in minilm},
               **{n: t.contiguous() for n, t in hidden},
               "fp8": hidden[0][1][:64].to(torch.float8_e4m3fn),
               "ids": torch.arange(1000, dtype=torch.int64),
               "empty": torch.zeros(0, 3, dtype=torch.float16),
               "scalar": torch.tensor(0.5, dtype=torch.float32)}
    safetensors_torch.save_file(tensors, str(path))
    return tensors


def test_info_on_a_checkpoint_counts_every_tensor(realdata, tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    tensors = _checkpoint(realdata, path)
    assert cli.main(["info", str(path), "--json", "--tensors"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bit_exact"] is True and len(got["tensors"]) == len(tensors)
    want: dict[str, dict[str, int]] = {}
    for t in tensors.values():
        row = want.setdefault(str(t.dtype).removeprefix("torch."), {"tensors": 0, "bytes": 0, "frame_bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.nbytes
        row["frame_bytes"] += len(uz.compress(t))
    assert got["dtypes"] == want
    assert got["bytes"] == sum(t.nbytes for t in tensors.values())
    assert got["frame_bytes"] == sum(r["frame_bytes"] for r in want.values())
    # The real bf16 weights compress; the table says so in its last line.
    assert want["bfloat16"]["frame_bytes"] < 0.75 * want["bfloat16"]["bytes"]
    assert cli.main(["info", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("every tensor round-tripped bit-exactly")
    all_row = next(line for line in lines if line.startswith("all"))
    assert all_row.split()[1] == str(len(tensors))
    assert float(all_row.split()[-1]) == pytest.approx(got["frame_bytes"] / got["bytes"], abs=1e-4)


def test_info_on_a_checkpoint_reports_a_tensor_that_does_not_round_trip(realdata, tmp_path, capsys, monkeypatch):
    path = tmp_path / "model.safetensors"
    _checkpoint(realdata, path)
    real = uz.decompress

    def one_bit_off(frame, **kw):
        t = real(frame, **kw)
        if t.numel():
            t.reshape(-1).view(torch.uint8)[0] ^= 1
        return t

    monkeypatch.setattr(uz, "decompress", one_bit_off)
    assert cli.main(["info", str(path)]) == 1
    assert "did not round-trip bit-exactly" in capsys.readouterr().err


def test_info_on_an_unreadable_checkpoint(tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": trunc")
    assert cli.main(["info", str(path)]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err
