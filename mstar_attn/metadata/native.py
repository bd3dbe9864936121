"""The compiled step builder: step_checks.c, per-step checks in one C call each where numpy would make several, each
of which costs a fixed 1-3 µs on a server's host: a StepBatch decode step that lists exactly its pages (`exact_lists`,
twin: listed.twin_exact_lists), a StepRows decode step's lengths and rows (`rows_decode`, twin:
plan._plan_rows_decode's reductions), per-request ranges (`within`, twin: _arrays.within, for Ranges.holds past
SHORT_CHECK values). A call costs about as much as one or two numpy calls (arrays go by object, the C side reads
their data pointer: see step_checks.c), so only work that would take several numpy calls is compiled.

Built with the machine's C compiler (`$CC`, else `cc`) the first time a process needs it (`load()`; warm-up calls
it), into a cache directory (`$MSTAR_ATTN_CACHE`, else `$XDG_CACHE_HOME/mstar_attn` or `~/.cache/mstar_attn`; used
only if it is the user's own and no one else may write it), then loaded through ctypes: plain C, no Python headers,
so one build serves every Python on the machine and nothing is built at install. The file name carries a hash of the
source, the flags, the compiler's command and the machine's architecture; builds of other versions stay beside it.

Where no compiler works, or with `MSTAR_ATTN_NATIVE=0` in the environment, nothing is built: each function returns
None and its caller runs the Python twin, with the same results (tests/metadata/test_native.py holds each pair equal
on random inputs, valid and broken, on the CPU). `disabled()` switches the compiled builder off for a block (tests,
benchmarks).

State: the loaded library, once per process (this module's one mutable value, behind a lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("step_checks.c")
FLAGS = ("-O3", "-funroll-loops", "-std=c99", "-shared", "-fPIC")
ENV_SWITCH = "MSTAR_ATTN_NATIVE"  # "0": never build nor load (the Python twin serves)
ENV_CACHE = "MSTAR_ATTN_CACHE"
_INT32, _UINT32 = np.dtype(np.int32), np.dtype(np.uint32)

_lock = threading.Lock()
_loaded: dict = {"lib": None, "tried": False, "off": 0}  # lib: the loaded library (_Library); off: disabled() depth


def load() -> bool:
    """Build (once per machine) and load the compiled builder now; whether it is in use. Never raises: a failed
    build warns once and leaves the Python twin serving."""
    if _loaded["tried"]:
        return _loaded["lib"] is not None
    with _lock:
        if not _loaded["tried"]:
            try:
                _loaded["lib"] = None if os.environ.get(ENV_SWITCH, "1") == "0" else _build_and_load()
            except Exception as e:  # (never raise here: the twins serve)
                warnings.warn(f"mstar_attn: the compiled step builder failed ({e!r}); the planner's Python twins serve",
                              RuntimeWarning, stacklevel=2)
            _loaded["tried"] = True
    return _loaded["lib"] is not None


def in_use() -> bool:
    """Whether the compiled functions answer (loaded, and not switched off by disabled())."""
    return load() and not _loaded["off"]


def _lib():
    """The loaded library when in use, else None (loading it the first time)."""
    if not _loaded["tried"]:
        load()
    return None if _loaded["off"] else _loaded["lib"]


@contextlib.contextmanager
def disabled():
    """Within the block every function here returns None, in every thread (the Python twins serve): for tests and
    benchmarks."""
    with _lock:
        _loaded["off"] += 1
    try:
        yield
    finally:
        with _lock:
            _loaded["off"] -= 1


def exact_lists(packed: np.ndarray, B: int, n: int, page_size: int, num_pages: int, ownership: bool) -> int | None:
    """step_checks.c's checks of a decode step's packed arrays (packed: numpy int32 [3B + 1 + n] host, C-contiguous:
    q_lens, kv_lens, page_indptr, page_indices back to back; StepBatch.packed): the longest kv_len (>= 1) when
    they pass, 0 when one fails, None when the compiled builder is not in use or cannot tell (the twin decides)."""
    lib = _lib()
    if lib is None or B < 1 or n < 0 or not _readable(packed, 3 * B + 1 + n):
        return None
    hi = lib.exact_lists(packed, B, n, page_size, num_pages, 1 if ownership else 0)
    return None if hi < 0 else hi


def rows_decode(packed: np.ndarray, B: int, page_size: int) -> int | None:
    """A StepRows decode step's checks (packed: numpy int32 [2B] host, C-contiguous: rows, kv_lens; StepRows.packed):
    the longest kv_len when every kv_len >= 1, every row >= 0 and every page count sum fits int32, else 0; None
    when the compiled builder is not in use."""
    lib = _lib()
    return None if lib is None or B < 1 or not _readable(packed, 2 * B) else lib.rows_decode(packed, B, page_size)


def within(values: np.ndarray, low: np.ndarray, span: np.ndarray) -> bool | None:
    """Whether low[i] <= values[i] < low[i] + span[i] for every i (values, low: numpy int32 [B], span: numpy uint32
    [B], host, C-contiguous: low and span as a Ranges keeps them, made so once, values checked per call), as
    _arrays.within computes it; None when the compiled builder is not in use."""
    lib = _lib()
    B = low.shape[0]
    if lib is None or low.dtype is not _INT32 or span.dtype is not _UINT32 or span.shape != (B,) \
            or not _readable(values, B):
        return None
    return lib.within(values, low, span, B) != 0


def _readable(array, size: int) -> bool:
    """Whether the C side may read `size` int32 from array's data pointer: a C-contiguous numpy int32 array of them."""
    return array.__class__ is np.ndarray and array.dtype is _INT32 and array.shape == (size,) and array.flags.c_contiguous


def compiler() -> list[str] | None:
    """The C compiler's command (`$CC`, which may carry arguments, e.g. "ccache gcc"; else `cc`), its program
    resolved on PATH; None when there is none."""
    words = shlex.split(os.environ.get("CC") or "cc")
    found = shutil.which(words[0]) if words else None
    return None if found is None else [found, *words[1:]]


def library_path() -> Path | None:
    """Where this machine's build lives (built or not), or None without a C compiler or a private cache directory."""
    cc = compiler()
    if cc is None:
        return None
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), " ".join(cc).encode(),
                                     platform.machine().encode(), platform.system().encode()])).hexdigest()[:16]
    cache = _cache_dir()
    return None if cache is None else cache / f"step_checks-{key}.so"


def _cache_dir() -> Path | None:
    """`$MSTAR_ATTN_CACHE`, else `$XDG_CACHE_HOME/mstar_attn`, else `~/.cache/mstar_attn`: made if missing, used only
    if it is this user's own and no one else may write it (a library found there is loaded and run); None otherwise
    (nothing is built: the twins serve)."""
    d = Path(os.environ.get(ENV_CACHE) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                        "mstar_attn"))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d if _private(d) and os.access(d, os.W_OK) else None


def _private(path: Path) -> bool:
    """Whether `path` is owned by this user and writable by no one else (where os.getuid exists)."""
    st = path.stat()
    return not hasattr(os, "getuid") or (st.st_uid == os.getuid() and not st.st_mode & 0o022)


class _Library:
    """step_checks.c's functions, typed."""

    def __init__(self, path: Path):
        lib, i64, obj = ctypes.PyDLL(str(path)), ctypes.c_int64, ctypes.py_object  # (PyDLL: calls keep the GIL)
        self.exact_lists, self.rows_decode, self.data_of = lib.mstar_exact_lists, lib.mstar_rows_decode, lib.mstar_data_of
        self.within = lib.mstar_within
        self.exact_lists.restype = self.rows_decode.restype = i64
        self.data_of.restype, self.within.restype = ctypes.c_void_p, ctypes.c_int32
        self.exact_lists.argtypes = (obj, i64, i64, i64, i64, ctypes.c_int32)
        self.rows_decode.argtypes = (obj, i64, i64)
        self.data_of.argtypes = (obj,)
        self.within.argtypes = (obj, obj, obj, i64)

    def answers_known_steps(self) -> bool:
        """Whether the C side finds numpy arrays' data where numpy does (arrays, views, read-only ones), and a smoke
        test of each function on a step whose answers are known."""
        base = np.arange(40, dtype=np.int32)
        for a in (base, base[7:], base[13:29], np.concatenate((base[:3], base[5:9])), np.zeros(0, np.int32)):
            a.flags.writeable = False
            if self.data_of(a) != a.ctypes.data:
                return False
        lists = np.array([1, 20, 0, 2, 5, 7], np.int32)  # (one request of 20 tokens on pages 5, 7)
        rows = np.array([3, 20], np.int32)  # (row 3, 20 tokens)
        low, span = np.array([10], np.int32), np.array([5], np.uint32)
        return (self.exact_lists(lists, 1, 2, 16, 8, 1) == 20 and self.exact_lists(lists, 1, 2, 16, 6, 1) == 0
                and self.rows_decode(rows, 1, 16) == 20 and self.rows_decode(-rows, 1, 16) == 0
                and self.within(np.array([14], np.int32), low, span, 1) == 1
                and self.within(np.array([15], np.int32), low, span, 1) == 0)


def _build_and_load() -> _Library | None:
    """The library, built first if this machine has none; None (a warning says why, once) where it cannot be."""
    tmp = None
    try:
        path = library_path()
        if path is None:
            if compiler() is not None:
                warnings.warn("mstar_attn: no cache directory of this user's own that no one else may write "
                              f"(${ENV_CACHE}, ~/.cache/mstar_attn); the planner's Python twins serve", RuntimeWarning,
                              stacklevel=3)
            elif os.environ.get("CC"):
                warnings.warn(f"mstar_attn: CC={os.environ['CC']!r} is not a program on PATH; the planner's Python twins "
                              "serve", RuntimeWarning, stacklevel=3)
            return None
        if not path.exists():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            done = subprocess.run([*compiler(), *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                warnings.warn(f"mstar_attn: building {SOURCE.name} failed ({done.stderr.strip()[:300]}); "
                              "the planner's Python twins serve", RuntimeWarning, stacklevel=3)
                return None
            os.replace(tmp, path)  # (atomic: processes building at once each rename a whole file)
        if not _private(path):
            warnings.warn(f"mstar_attn: {path} is not this user's own, or others may write it; the planner's Python "
                          "twins serve", RuntimeWarning, stacklevel=3)
            return None
        lib = _Library(path)
    except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as e:
        warnings.warn(f"mstar_attn: building or loading {SOURCE.name} failed ({e}); the planner's Python twins serve",
                      RuntimeWarning, stacklevel=3)
        return None
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink(missing_ok=True)
    if not lib.answers_known_steps():
        warnings.warn(f"mstar_attn: {path} reads numpy arrays or answers known steps wrongly; the planner's Python "
                      "twins serve", RuntimeWarning, stacklevel=3)
        return None
    return lib
