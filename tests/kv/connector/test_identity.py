"""model_identity: every byte of the weights is in the tier key's identity (pages of different
weights never hit each other), and a file's digest is memoized by (path, size, mtime_ns, inode)
so a restart does not hash a multi-GB checkpoint again."""

from __future__ import annotations

import json
import os

import pytest

from loomserve.kv.connector import factory, model_identity

SIZE = 5 << 20  # the old identity read only the first and last MiB


def checkpoint(folder, flip_middle: bool = False, config: str = '{"rope_theta": 10000}'):
    os.makedirs(folder, exist_ok=True)
    data = bytearray(os.urandom(1 << 16) * (SIZE >> 16))
    if flip_middle:
        data[SIZE // 2] ^= 0xFF
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(config)
    return str(folder)


@pytest.fixture
def counted(monkeypatch):
    """Paths hashed by factory.hash_file, in call order."""
    calls = []
    real = factory.hash_file

    def hash_file(path):
        calls.append(path)
        return real(path)
    monkeypatch.setattr(factory, "hash_file", hash_file)
    return calls


def test_one_byte_in_the_middle_changes_the_identity(tmp_path):
    a = checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    os.makedirs(b)
    with open(os.path.join(a, "model.safetensors"), "rb") as f:
        data = bytearray(f.read())
    data[SIZE // 2] ^= 0x01
    (b / "model.safetensors").write_bytes(bytes(data))
    (b / "config.json").write_text('{"rope_theta": 10000}')
    memo = str(tmp_path / "cache")
    ida, idb = model_identity("m", a, memo), model_identity("m", str(b), memo)
    assert ida != idb
    assert ida.startswith("m@") and ida == model_identity("m", a, memo)
    # the KV of the same weights under another config (rope, norms) is not the same either
    c = checkpoint(tmp_path / "c", config='{"rope_theta": 500000}')
    d = checkpoint(tmp_path / "d", config='{"rope_theta": 10000}')
    assert model_identity("m", c, memo) != model_identity("m", d, memo)


def test_unchanged_files_are_not_read_again(tmp_path, counted):
    folder = checkpoint(tmp_path / "m")
    memo = str(tmp_path / "cache")
    first = model_identity("m", folder, memo)
    assert len(counted) == 2  # model.safetensors and config.json
    entries = json.loads((tmp_path / "cache" / factory.DIGEST_MEMO).read_text())
    weights = os.path.realpath(os.path.join(folder, "model.safetensors"))
    assert entries[weights]["size"] == SIZE and set(entries[weights]) == {
        "size", "mtime_ns", "ino", "xxh3_128"}
    assert model_identity("m", folder, memo) == first  # a restart: the memo answers
    assert len(counted) == 2
    # rewritten in place (a new mtime): hashed again, and the identity follows the content
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(SIZE // 2)
        f.write(b"\x00\x01\x02")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    changed = model_identity("m", folder, memo)
    assert counted[2:] == [os.path.realpath(path)] and changed != first


def test_memo_is_only_a_cache(tmp_path, counted):
    folder = checkpoint(tmp_path / "m")
    blocker = tmp_path / "file"
    blocker.write_text("")
    unwritable = str(blocker / "cache")  # a folder below a file: cannot be created
    first = model_identity("m", folder, unwritable)
    assert model_identity("m", folder, unwritable) == first and len(counted) == 4
    memo = tmp_path / "cache"
    memo.mkdir()
    (memo / factory.DIGEST_MEMO).write_text("{not json")  # corrupt: ignored, rewritten
    assert model_identity("m", folder, str(memo)) == first
    assert json.loads((memo / factory.DIGEST_MEMO).read_text())
    # a wrong digest under a stale stamp is not trusted
    entries = json.loads((memo / factory.DIGEST_MEMO).read_text())
    for e in entries.values():
        e["xxh3_128"], e["ino"] = "0" * 32, -1
    (memo / factory.DIGEST_MEMO).write_text(json.dumps(entries))
    assert model_identity("m", folder, str(memo)) == first


def test_single_file_model_and_no_folder(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    memo = str(tmp_path / "cache")
    ident = model_identity("g", str(gguf), memo)
    mtime = gguf.stat().st_mtime_ns
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\x01")  # same size and inode
    os.utime(gguf, ns=(mtime, mtime + 1_000_000))  # past a coarse file-system clock tick
    assert model_identity("g", str(gguf), memo) != ident
    assert model_identity("x", None, memo) == model_identity("x", None, memo) != \
        model_identity("y", None, memo)
