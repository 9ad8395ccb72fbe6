"""An instance's place in the control plane: its role (prefill/decode disaggregation), where it
publishes its KV events, and how it hands KV blocks to a peer instance. All off by default: a
plain `loomserve serve` is role `both`, publishes nothing and transfers nothing."""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.config.units import parse_bytes

ROLES = ("both", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "inproc")


def _replay_default(endpoint: str) -> str | None:
    """tcp://HOST:PORT -> tcp://HOST:PORT+1 (port 0 stays 0: the OS picks); None otherwise."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    base, port = endpoint.rsplit(":", 1)
    return f"{base}:{int(port) + 1 if int(port) else 0}"


@dataclass
class ControlConfig:
    # prefill: computes prompts and hands their KV to decode instances; decode: imports KV and
    # generates; both: does everything (the default, and what a single instance is).
    role: str = "both"
    kv_events_endpoint: str | None = None  # ZMQ PUB bind address, e.g. tcp://*:5557; None: off
    # ZMQ ROUTER bind address for replay requests; default: the PUB port + 1 on TCP.
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000  # batches kept for replay
    kv_transfer_backend: str = "mooncake"  # mooncake (Transfer Engine, TCP/RDMA) | inproc (tests)
    kv_transfer_host: str = "127.0.0.1"  # the address peers reach this instance's transfers at
    kv_transfer_timeout: float = 30.0  # seconds a prefilled KV waits for its decode; a pull's cap
    # Host memory a prefill instance stages finished prompts' pages in (made at the first
    # prefill leg; at most the pool's size). A prompt that does not fit gets null params.
    kv_transfer_buffer: int = 1 << 30

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"kv-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)},"
                             f" got {self.kv_transfer_backend!r}")
        if self.kv_events_endpoint and self.kv_events_replay_endpoint is None:
            self.kv_events_replay_endpoint = _replay_default(self.kv_events_endpoint)
        self.kv_transfer_buffer = parse_bytes(self.kv_transfer_buffer, "kv-transfer-buffer")
        if self.kv_events_buffer_steps < 1 or self.kv_transfer_timeout <= 0:
            raise ValueError("kv-events-buffer-steps and kv-transfer-timeout must be positive")
