"""The transfer backends on their own: reads copy exactly the registered bytes asked for,
anything outside registered memory is refused (never a stray copy), an injected fault stops a
read mid-way, and release notices reach the peer. Mooncake runs two real Transfer Engines over
loopback TCP."""

from __future__ import annotations

import time

import pytest
import torch

from loomserve.kv.transfer import InProcTransfer, TransferFailed, make_transfer
from loomserve.kv.transfer.params import parse


def pair(backend: str):
    a, b = make_transfer(backend), make_transfer(backend)
    src = torch.randint(0, 255, (4, 4096), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    a.register(src)
    b.register(dst)
    return a, b, src, dst


def notices(t, want: int, timeout: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += t.take_notifies()
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("backend", ["inproc", "mooncake"])
def test_read_copies_registered_pages_and_notifies(backend):
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine")
    a, b, src, dst = pair(backend)
    try:
        ops = [(src[2].data_ptr(), dst[0].data_ptr(), 4096),
               (src[0].data_ptr(), dst[3].data_ptr(), 4096)]
        b.read(a.session_id, ops)
        assert torch.equal(dst[0], src[2]) and torch.equal(dst[3], src[0])
        assert not dst[1].any()  # nothing else written
        with pytest.raises(TransferFailed):  # past the end of a's registered buffer
            b.read(a.session_id, [(src[3].data_ptr() + 100, dst[1].data_ptr(), 4096)])
        with pytest.raises(TransferFailed):  # an engine that does not exist
            b.read("127.0.0.1:1" if backend == "mooncake" else "inproc:0",
                   [(src[0].data_ptr(), dst[1].data_ptr(), 4096)])
        b.notify(a.notify_address, b"t1")
        b.notify(a.notify_address, b"t2")
        assert notices(a, 2) == [b"t1", b"t2"]
    finally:
        a.close()
        b.close()


def test_inproc_refuses_unregistered_local_memory_and_fails_midway():
    a, b, src, dst = pair("inproc")
    other = torch.zeros(4096, dtype=torch.uint8)  # not registered with b
    try:
        with pytest.raises(TransferFailed, match="local"):
            b.read(a.session_id, [(src[0].data_ptr(), other.data_ptr(), 4096)])
        assert not other.any()
        b.fail_after_bytes = 4096 + 10
        ops = [(src[i].data_ptr(), dst[i].data_ptr(), 4096) for i in range(3)]
        with pytest.raises(TransferFailed, match="mid-way"):
            b.read(a.session_id, ops)
        assert torch.equal(dst[0], src[0]) and torch.equal(dst[1, :10], src[1, :10])
        assert not dst[2].any()
    finally:
        a.close()
        b.close()
    assert isinstance(a, InProcTransfer)


def test_params_round_trip_and_keys():
    raw = {"remote_engine": "h:1", "backend": "mooncake", "notify": None, "transfer_id": "t",
           "expires_at": 5.0, "page_bytes": 64, "num_tokens": 32, "hash_start": 1,
           "hashes": ["aa" * 16, "bb" * 16],
           "groups": [{"fingerprint": "01" * 16, "start": 1, "addrs": [10, 20],
                       "checksums": [1, 2]},
                      {"fingerprint": "02" * 16, "start": 2, "addrs": [30], "checksums": [3]}]}
    p = parse(raw)
    assert p.to_json() == raw
    assert list(p.pages()) == [(b"\x01" * 16 + b"\xaa" * 16, 10, 1),
                               (b"\x01" * 16 + b"\xbb" * 16, 20, 2),
                               (b"\x02" * 16 + b"\xbb" * 16, 30, 3)]
    bad = dict(raw, groups=[dict(raw["groups"][0], start=2)])  # past the hashes
    with pytest.raises(ValueError, match="outside"):
        parse(bad)
    assert parse({"do_remote_decode": True}) is None and parse(None) is None
