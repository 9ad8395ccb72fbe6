"""The record a page is stored as outside process memory: a 32-byte header, then the page.

    magic "LSKV" | version u16 | header_len u16 | payload_len u64 | xxh3_64(payload) u64
    | xxh3_64(key) u64

The length and checksum catch torn, truncated and bit-flipped records; the key digest catches a
record stored under (or copied to) the wrong key. A record that fails any check is a miss, never
data.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"LSKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQQ")
HEADER_BYTES = _HEADER.size  # 32


class CorruptRecord(ValueError):
    pass


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def key_digest(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


def pack_header(key: bytes, payload) -> bytes:
    """Header for `payload` (any buffer: bytes, memoryview, a numpy/torch CPU row's buffer)."""
    mv = memoryview(payload)
    return _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, mv.nbytes, checksum(mv), key_digest(key))


def encode(key: bytes, payload) -> bytes:
    return pack_header(key, payload) + memoryview(payload).cast("B")


def check(key: bytes, header, payload, page_bytes: int) -> None:
    """Raise CorruptRecord unless header describes exactly `payload` of `page_bytes` under key."""
    if len(header) < HEADER_BYTES:
        raise CorruptRecord("short header")
    magic, version, hlen, plen, csum, kd = _HEADER.unpack_from(header)
    if magic != MAGIC or version != VERSION or hlen != HEADER_BYTES:
        raise CorruptRecord("bad magic/version")
    if plen != page_bytes or memoryview(payload).nbytes != page_bytes:
        raise CorruptRecord(f"length {plen}/{memoryview(payload).nbytes} != {page_bytes}")
    if kd != key_digest(key):
        raise CorruptRecord("record belongs to another key")
    if checksum(payload) != csum:
        raise CorruptRecord("checksum mismatch")


def decode(key: bytes, record, page_bytes: int) -> memoryview:
    """The payload of a whole record (header + page), checked."""
    mv = memoryview(record).cast("B")
    if mv.nbytes != HEADER_BYTES + page_bytes:
        raise CorruptRecord(f"record length {mv.nbytes} != {HEADER_BYTES + page_bytes}")
    payload = mv[HEADER_BYTES:]
    check(key, mv[:HEADER_BYTES], payload, page_bytes)
    return payload
