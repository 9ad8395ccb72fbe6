"""Small C kernels for the CPU paths, compiled on first use and loaded with ctypes.

Why C through ctypes and not a torch C++ extension: a plain C file compiles in about a second
(no torch headers), needs only the system C compiler that `pip install` of any sdist needs
too, and a call costs a few microseconds. Each kernel file is `loomserve/execution/kernels/
<name>.c`; `load(name)` builds it once per (source, flags, compiler, CPU) into the cache folder
(`$LOOMSERVE_CACHE/kernels`, default ~/.cache/loomserve/kernels) and returns the library.

Invariants:
- A kernel file may include headers beside it (`#include "x.h"`); they are part of the build's
  cache key, so editing one rebuilds the library.
- `load` never raises: no compiler, a failed build or `LOOMSERVE_KERNELS=0` return None (the
  reason logged once), and every caller keeps a torch path for that case.
- Builds are atomic (compile to a temp name, then rename), so processes starting together
  (an instance and its core, a cluster) never load a half-written library.
- OpenMP: the library links libgomp by soname, which torch already loaded, so kernels and
  torch share one thread pool instead of two pools spinning on the same cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
# -O3 vectorizes the inner loops; -march=native uses the host's vector units (the cache key
# includes the CPU flags, so a library built on one host is never loaded on another).
# -ffp-contract=fast allows FMA; no -ffast-math: the kernels rely on -inf and NaN semantics.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get("LOOMSERVE_KERNELS", "1") not in ("0", "false", "no")


def cache_dir() -> str:
    root = os.environ.get("LOOMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "loomserve"))
    return os.path.join(root, "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (part of every build's cache key;
    benchmarks record them beside their results)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes(default: int = 32 << 20) -> int:
    """The last-level cache's size (the largest cache sysfs lists for cpu0), or default."""
    best = 0
    root = "/sys/devices/system/cpu/cpu0/cache"
    entries = os.listdir(root) if os.path.isdir(root) else []
    for entry in entries:  # index0, index1, ... (and files that are not caches)
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best or default


def _key(source: bytes, cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), version.encode(), cpu_flags().encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(name: str) -> ctypes.CDLL:
    src = os.path.join(_HERE, f"{name}.c")
    with open(src, "rb") as f:
        source = f.read()
    # Local headers (#include "x.h" beside the source) are part of what is built: hash them too.
    for header in re.findall(rb'#include "([^"]+)"', source):
        with open(os.path.join(_HERE, header.decode()), "rb") as f:
            source += b"\0" + f.read()
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    out_dir = cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, f"{name}-{_key(source, cc)}.so")
    if not os.path.exists(lib):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            done = subprocess.run([cc, *CFLAGS, "-o", tmp, src, "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed on {name}.c:\n{done.stderr[-2000:]}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(lib)


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel library `name`, or None when kernels are off or cannot be built."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if enabled():
            try:
                lib = _build(name)
            except Exception as exc:  # noqa: BLE001 - any failure means "use the torch path"
                log.warning("C kernel %r unavailable, using the torch path: %s", name, exc)
        _loaded[name] = lib
        return lib


def bind(name: str, signatures: dict) -> ctypes.CDLL | None:
    """load(name) with each function's ctypes types set: {function: (argtypes, restype)}."""
    lib = load(name)
    if lib is not None:
        for fn, (argtypes, restype) in signatures.items():
            getattr(lib, fn).argtypes = argtypes
            getattr(lib, fn).restype = restype
    return lib


def ptr(t) -> ctypes.c_void_p:
    """A tensor's (or numpy array's) data pointer for a ctypes call."""
    return ctypes.c_void_p(t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data)
