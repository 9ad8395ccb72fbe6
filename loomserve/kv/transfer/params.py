"""kv_transfer_params: what a prefill instance hands a decode instance (through the router,
which never looks inside), and what a request may carry.

Prefill leg (router -> prefill instance): {"do_remote_decode": true}.
Prefill answer / decode leg (-> decode instance), a TransferParams as plain JSON:
    {"remote_engine": "host:port", "backend": "mooncake", "notify": "tcp://host:port",
     "transfer_id": "...", "expires_at": <unix seconds>, "page_bytes": N, "num_tokens": T,
     "hash_start": P, "hashes": [hex block hash for positions P, P+1, ...],
     "groups": [{"fingerprint": hex, "start": p, "addrs": [int], "checksums": [int]}],
     "tail": {"start": S, "tokens": [int], "addrs": [int], "checksums": [int]} or absent}
Group g's page i is the page of block position start + i (for a state group: the checkpoint
after that block); its tier key is fingerprint + hash, the same key the decode instance makes
from its own prompt, so a different prompt, model or layout can never import it. Its checksum
(xxh3_64 of the page, loomserve.kv.tiers.codec.checksum) is taken when staged: a slot that
was reused, or a torn read, fails it and the page is computed instead.
The optional tail is the block holding the prompt's last tokens (positions S .. S + len(tokens)
- 1, S = num_tokens), one page per group in group order: the decode side copies it into its own
fresh block (never a cached one) and recomputes only the prompt's last token (tail.py).
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_PAGES = 1 << 20


@dataclass
class GroupPages:
    fingerprint: bytes
    start: int
    addrs: list[int]
    checksums: list[int]


@dataclass
class TailPages:
    start: int  # first token position of the tail block
    tokens: list[int]  # the prompt's tokens from start on (1 .. block size of them)
    addrs: list[int]  # one page per group
    checksums: list[int]


@dataclass
class TransferParams:
    remote_engine: str
    backend: str
    notify: str | None
    transfer_id: str
    expires_at: float
    page_bytes: int
    num_tokens: int
    hash_start: int
    hashes: list[bytes]
    groups: list[GroupPages]
    tail: TailPages | None = None

    def pages(self):
        """(key, remote address, checksum) of every page, group by group."""
        for g in self.groups:
            for i, (addr, csum) in enumerate(zip(g.addrs, g.checksums)):
                yield g.fingerprint + self.hashes[g.start + i - self.hash_start], addr, csum

    def to_json(self) -> dict:
        return {"remote_engine": self.remote_engine, "backend": self.backend,
                "notify": self.notify, "transfer_id": self.transfer_id,
                "expires_at": self.expires_at, "page_bytes": self.page_bytes,
                "num_tokens": self.num_tokens, "hash_start": self.hash_start,
                "hashes": [h.hex() for h in self.hashes],
                "groups": [{"fingerprint": g.fingerprint.hex(), "start": g.start,
                            "addrs": g.addrs, "checksums": g.checksums} for g in self.groups],
                **({} if self.tail is None else {"tail": {
                    "start": self.tail.start, "tokens": self.tail.tokens,
                    "addrs": self.tail.addrs, "checksums": self.tail.checksums}})}


def _int(d: dict, name: str, lo: int = 0) -> int:
    v = d.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"kv_transfer_params.{name} must be an integer >= {lo}")
    return v


def _str(d: dict, name: str, optional: bool = False) -> str | None:
    v = d.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > 1000:
        raise ValueError(f"kv_transfer_params.{name} must be a non-empty string")
    return v


def _hex(v, what: str) -> bytes:
    try:
        if not isinstance(v, str):
            raise TypeError
        return bytes.fromhex(v)
    except (TypeError, ValueError):
        raise ValueError(f"kv_transfer_params: {what} must be a hex string") from None


def _ints(v, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) > _MAX_PAGES or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64 for x in v):
        raise ValueError(f"kv_transfer_params: {what} must be a list of unsigned integers")
    return v


def is_prefill_leg(raw: dict | None) -> bool:
    return isinstance(raw, dict) and raw.get("do_remote_decode") is True


def parse(raw) -> TransferParams | None:
    """The decode-leg params of a request body's kv_transfer_params; None for a prefill leg or
    none at all. ValueError (the API's 400) when it is malformed."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object")
    if "do_remote_decode" in raw and not isinstance(raw["do_remote_decode"], bool):
        raise ValueError("kv_transfer_params.do_remote_decode must be a boolean")
    if is_prefill_leg(raw) or "remote_engine" not in raw:
        return None
    expires = raw.get("expires_at")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool):
        raise ValueError("kv_transfer_params.expires_at must be a number")
    hashes = raw.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > _MAX_PAGES:
        raise ValueError("kv_transfer_params.hashes must be a list")
    hashes = [_hex(h, "hashes") for h in hashes]
    hash_start = _int(raw, "hash_start")
    groups = raw.get("groups")
    if not isinstance(groups, list) or len(groups) > 64:
        raise ValueError("kv_transfer_params.groups must be a list")
    out = []
    for g in groups:
        if not isinstance(g, dict):
            raise ValueError("kv_transfer_params.groups entries must be objects")
        start = _int(g, "start")
        addrs = _ints(g.get("addrs"), "addrs")
        csums = _ints(g.get("checksums"), "checksums")
        if len(addrs) != len(csums):
            raise ValueError("kv_transfer_params: addrs and checksums differ in length")
        if addrs and (start < hash_start or start + len(addrs) > hash_start + len(hashes)):
            raise ValueError("kv_transfer_params: a group's pages lie outside its hashes")
        out.append(GroupPages(_hex(g.get("fingerprint"), "fingerprint"), start, addrs, csums))
    num_tokens = _int(raw, "num_tokens")
    return TransferParams(_str(raw, "remote_engine"), _str(raw, "backend"),
                          _str(raw, "notify", optional=True), _str(raw, "transfer_id"),
                          float(expires), _int(raw, "page_bytes", 1), num_tokens,
                          hash_start, hashes, out, _tail(raw.get("tail"), num_tokens, len(out)))


def _tail(t, num_tokens: int, num_groups: int) -> TailPages | None:
    if t is None:
        return None
    if not isinstance(t, dict):
        raise ValueError("kv_transfer_params.tail must be an object")
    tokens = _ints(t.get("tokens"), "tail.tokens")
    addrs, csums = _ints(t.get("addrs"), "tail.addrs"), _ints(t.get("checksums"), "tail.checksums")
    if _int(t, "start") != num_tokens or not 0 < len(tokens) <= 1024 or \
            len(addrs) != num_groups or len(csums) != num_groups:
        raise ValueError("kv_transfer_params.tail: start must be num_tokens, with 1 to 1024 "
                         "tokens and one page and checksum per group")
    return TailPages(num_tokens, tokens, addrs, csums)


def validate(raw) -> None:
    """Raise ValueError if a body's kv_transfer_params is malformed (front ends call this)."""
    parse(raw)
