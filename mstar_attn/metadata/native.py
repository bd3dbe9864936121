"""The compiled step builder: exact_lists.c, the checks of a StepBatch decode step that lists exactly its pages
(listed.py) in one C call instead of a dozen numpy calls, each of which costs a fixed 1-3 µs on a server's host.

Built with the machine's C compiler (`$CC`, else `cc`) the first time a process needs it (`load()`; warm-up calls
it), into a cache directory (`$MSTAR_ATTN_CACHE`, else `~/.cache/mstar_attn`), then loaded through ctypes: plain C,
no Python headers, so one build serves every Python on the machine and nothing is built at install. The file name
carries a hash of the source, the flags, the compiler's path and the machine's architecture.

Where no compiler works, or with `MSTAR_ATTN_NATIVE=0` in the environment, nothing is built: `exact_lists` returns
None and the planner runs the Python twin (`listed.twin_exact_lists`), with the same results
(tests/metadata/test_native.py holds the two equal on random steps, valid and broken, on the CPU). `disabled()`
switches the compiled builder off for a block (tests, benchmarks).

State: the loaded library, once per process (this module's one mutable value, behind a lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("exact_lists.c")
FLAGS = ("-O3", "-funroll-loops", "-std=c99", "-shared", "-fPIC")
ENV_SWITCH = "MSTAR_ATTN_NATIVE"  # "0": never build nor load (the Python twin serves)
ENV_CACHE = "MSTAR_ATTN_CACHE"

_lock = threading.Lock()
_loaded: dict = {"fn": None, "tried": False, "off": 0}  # fn: the C function once loaded; off: disabled() depth


def load() -> bool:
    """Build (once per machine) and load the compiled builder now; whether it is in use. Never raises: a failed
    build warns once and leaves the Python twin serving."""
    if _loaded["tried"]:
        return _loaded["fn"] is not None
    with _lock:
        if not _loaded["tried"]:
            _loaded["fn"] = None if os.environ.get(ENV_SWITCH, "1") == "0" else _build_and_load()
            _loaded["tried"] = True
    return _loaded["fn"] is not None


def in_use() -> bool:
    """Whether exact_lists answers (loaded and not switched off by disabled())."""
    return load() and not _loaded["off"]


@contextlib.contextmanager
def disabled():
    """Within the block, exact_lists returns None (the Python twin serves): for tests and benchmarks."""
    with _lock:
        _loaded["off"] += 1
    try:
        yield
    finally:
        with _lock:
            _loaded["off"] -= 1


def exact_lists(packed: np.ndarray, B: int, n: int, page_size: int, num_pages: int, ownership: bool) -> int | None:
    """exact_lists.c's checks of a decode step's packed arrays (packed: int32 [3B + 1 + n] host, C-contiguous:
    q_lens, kv_lens, page_indptr, page_indices back to back; batch.packed_arrays): the longest kv_len (>= 1) when
    they pass, 0 when one fails, None when the compiled builder is not in use or cannot tell (the twin decides)."""
    if not _loaded["tried"]:
        load()
    fn = _loaded["fn"]
    if fn is None or _loaded["off"]:
        return None
    hi = fn(packed.__array_interface__["data"][0], B, n, page_size, num_pages, 1 if ownership else 0)
    return None if hi < 0 else hi


def library_path() -> Path | None:
    """Where this machine's build lives (built or not), or None without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), cc.encode(),
                                     platform.machine().encode(), platform.system().encode()])).hexdigest()[:16]
    return _cache_dir() / f"exact_lists-{key}.so"


def _cache_dir() -> Path:
    home = os.environ.get(ENV_CACHE) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                      "mstar_attn")
    for d in (Path(home), Path(tempfile.gettempdir()) / f"mstar_attn-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="mstar_attn-"))


def _build_and_load():
    path = library_path()
    if path is None:
        return None
    try:
        if not path.exists():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            done = subprocess.run([shutil.which(os.environ.get("CC", "cc")), *FLAGS, "-o", str(tmp), str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                warnings.warn(f"mstar_attn: building {SOURCE.name} failed ({done.stderr.strip()[:300]}); "
                              "the planner's Python twin serves", RuntimeWarning, stacklevel=3)
                return None
            os.replace(tmp, path)  # (atomic: processes building at once each rename a whole file)
        fn = ctypes.CDLL(str(path)).mstar_exact_lists
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        warnings.warn(f"mstar_attn: loading {SOURCE.name} failed ({e}); the planner's Python twin serves",
                      RuntimeWarning, stacklevel=3)
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)
    probe = np.array([1, 20, 0, 2, 5, 7], np.int32)  # (one request of 20 tokens on pages 5, 7: a smoke test)
    if fn(probe.ctypes.data, 1, 2, 16, 8, 1) != 20 or fn(probe.ctypes.data, 1, 2, 16, 6, 1) != 0:
        warnings.warn(f"mstar_attn: {path} answers a known step wrongly; the planner's Python twin serves",
                      RuntimeWarning, stacklevel=3)
        return None
    return fn
