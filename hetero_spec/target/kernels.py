"""Which of llama.cpp's CPU matmul kernels this process lets a model use, decided once per machine.

llama.cpp puts each weight in the first "extra" buffer type that can multiply it: ``AMX`` (Intel
AMX tiles), then ``CPU_REPACK`` (weights interleaved for AVX2/AVX-512 GEMM), then plain ``CPU``.
On some VMs the kernel grants the AMX tile permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) but
the tile instructions still fault, and the process dies in ``ggml_backend_amx_mul_mat`` on its
first decode.  Nothing inside llama.cpp can catch that, so the question is asked of a child
process (``kernel_probe``) and the answer cached per CPU, kernel and llama.cpp build.

The modes, from the fastest llama.cpp allows down:

- ``default``: llama.cpp's own choice; AMX where the CPU has it and its tiles work.
- ``no-amx``: this process is denied the AMX tile permission by a one-rule seccomp filter, which
  takes llama.cpp down its own "AMX is not ready" path: AMX off, ``CPU_REPACK`` kept.  The filter
  is inherited by child processes (llama-server, the bench's llama.cpp tools), and it keeps
  oneDNN inside torch off the faulting tiles too.
- ``plain``: extra buffer types off (``use_extra_bufts = false``; ``--no-repack`` for llama.cpp's
  tools): the last resort, where a seccomp filter cannot be installed.  It costs the repacked
  Q4_0 GEMM, which is what makes several verified rows cheap on AVX-512.

``HETERO_SPEC_KERNELS=auto|default|no-amx|plain`` forces a mode (``auto``, the default, probes).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import atomic_file
from ..cpu_features import cpu_info
from ..errors import TargetError

MODES = ("default", "no-amx", "plain")
ENV = "HETERO_SPEC_KERNELS"
PROBE_TIMEOUT_S = 180.0

# seccomp(2) and arch_prctl(2) numbers for x86-64 Linux (asm/unistd_64.h, asm/prctl.h, linux/seccomp.h)
_NR_ARCH_PRCTL = 158
_NR_SECCOMP = 317
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_SECCOMP_FILTER_FLAG_SPEC_ALLOW = 4  # Linux >= 4.17: no speculative-store-bypass mitigation for the filter
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000


@dataclass(frozen=True)
class KernelPlan:
    """The kernels llama.cpp may use in this process, and why."""

    mode: str  # one of MODES
    reason: str  # one clause: what decided the mode

    @property
    def extra_bufts(self) -> bool:
        """``llama_model_params.use_extra_bufts``: off only in ``plain`` mode."""
        return self.mode != "plain"

    def tool_args(self) -> list[str]:
        """Arguments for llama.cpp's own tools (llama-server, llama-speculative-simple).  ``no-amx``
        needs none: the tools run as children of this process and inherit its seccomp filter."""
        return [] if self.extra_bufts else ["--no-repack"]

    def describe(self) -> str:
        return f"{self.mode} ({self.reason})"


def cpu_has_amx() -> bool:
    return "amx_tile" in cpu_info()[1]


def _llama_build_id() -> str:
    """What identifies the llama.cpp build: the version and the shared libraries' sizes and times
    (a source build on another machine compiles other kernels)."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    libs = sorted(lib_dir.glob("*.so*")) if lib_dir.is_dir() else []
    parts = [llama_cpp.__version__] + [f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in libs]
    return ";".join(parts)


def probe_key() -> str:
    name, flags = cpu_info()
    raw = "|".join([name, " ".join(sorted(flags)), platform.release(), _llama_build_id()])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    from .gguf_weights import cache_dir

    return cache_dir() / "kernels" / f"amx-probe-{probe_key()}.json"


@dataclass(frozen=True)
class ProbeResult:
    """What a child process that decoded a tiny model with llama.cpp's own choice of kernels saw."""

    survived: bool
    buffer_types: tuple[str, ...]  # weight buffer types llama.cpp used (empty when it died)
    detail: str  # the signal or error when it did not survive

    @property
    def amx_works(self) -> bool:
        return self.survived and "AMX" in self.buffer_types


def run_probe(mode: str = "default", timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Load and decode a tiny Q4_0 model in a child process under ``mode``; a crash stays in the child."""
    import resource

    env = dict(os.environ, **{ENV: mode})

    def no_core_dump() -> None:  # a faulting probe is the expected outcome on some VMs
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    try:
        proc = subprocess.run([sys.executable, "-m", "hetero_spec.target.kernel_probe"], env=env,
                              capture_output=True, text=True, timeout=timeout_s, preexec_fn=no_core_dump)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, (), f"no answer in {timeout_s:.0f} s")
    if proc.returncode != 0:
        detail = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                  else f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return ProbeResult(False, (), detail)
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ProbeResult(False, (), f"unreadable answer {proc.stdout[-200:]!r}")
    return ProbeResult(True, tuple(answer["buffer_types"]), "")


def _cached_probe() -> ProbeResult:
    path = _cache_file()
    try:
        d = json.loads(path.read_text())
        return ProbeResult(bool(d["survived"]), tuple(d["buffer_types"]), str(d["detail"]))
    except (OSError, ValueError, KeyError):
        pass
    result = run_probe("default")
    atomic_file.write_text(path, json.dumps({"survived": result.survived, "buffer_types": list(result.buffer_types),
                                             "detail": result.detail}))
    return result


def decide(forced: str | None = None) -> KernelPlan:
    """The plan for this machine: forced by ``$HETERO_SPEC_KERNELS``, else from the (cached) probe."""
    forced = forced if forced is not None else os.environ.get(ENV, "auto")
    if forced != "auto":
        if forced not in MODES:
            raise TargetError(f"{ENV}={forced!r}: expected auto, {', '.join(MODES)}")
        return KernelPlan(forced, f"set by {ENV}")
    if not (sys.platform == "linux" and platform.machine() == "x86_64" and cpu_has_amx()):
        return KernelPlan("default", "no AMX on this CPU")
    probe = _cached_probe()
    if probe.amx_works:
        return KernelPlan("default", "AMX tiles work here")
    if probe.survived:
        return KernelPlan("default", "llama.cpp did not take AMX here")
    return KernelPlan("no-amx", f"AMX tiles fault on this CPU: probe {probe.detail}")


def deny_amx_permission() -> None:
    """Make ``arch_prctl(ARCH_REQ_XCOMP_PERM, ...)`` fail with EPERM in every thread of this process
    and its children, and allow every other system call (one seccomp BPF rule).  Raises OSError
    where the kernel refuses the filter."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        raise OSError(errno.ENOSYS, "seccomp filters are only installed on x86-64 Linux")

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    # struct seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low 32 bits, little-endian)
    program = [
        (ld_w_abs, 0, 0, 4), (jeq_k, 0, 5, _AUDIT_ARCH_X86_64),
        (ld_w_abs, 0, 0, 0), (jeq_k, 0, 3, _NR_ARCH_PRCTL),
        (ld_w_abs, 0, 0, 16), (jeq_k, 0, 1, _ARCH_REQ_XCOMP_PERM),
        (ret_k, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM),
        (ret_k, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*[SockFilter(*ins) for ins in program])
    prog = SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    # WHY SPEC_ALLOW: by default a seccomp filter also turns on the speculative-store-bypass mitigation
    # (SSBD) for the process, which slows compute on CPUs that need it; this rule guards nothing
    rc = libc.syscall(_NR_SECCOMP, _SECCOMP_SET_MODE_FILTER,
                      _SECCOMP_FILTER_FLAG_TSYNC | _SECCOMP_FILTER_FLAG_SPEC_ALLOW, ctypes.byref(prog))
    if rc != 0 and ctypes.get_errno() == errno.EINVAL:  # a kernel before 4.17
        rc = libc.syscall(_NR_SECCOMP, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp(SET_MODE_FILTER): {os.strerror(err) if rc < 0 else f'thread {rc} did not sync'}")


def request_amx_permission() -> int:
    """What llama.cpp's AMX buffer type asks the kernel first: 0 when granted, else the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_NR_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    return 0 if rc == 0 else ctypes.get_errno()


def cpu_extra_buffer_types() -> tuple[str, ...]:
    """Names of the CPU backend's extra buffer types in this llama.cpp build and process, e.g.
    ``("AMX", "CPU_REPACK")``, through ggml's registry (llama-cpp-python binds none of it).

    The first call fixes the list for the life of the process (a static in ggml-cpu), which is why
    it runs only after the plan is in force; llama.cpp's "AMX is not ready to be used!" line, printed
    on stderr where the permission is denied, is swallowed here so a one-line error stays one line."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so"))
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_buft_name.argtypes, base.ggml_backend_buft_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return ()
    fn = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return ()
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            bufts = get_extra(dev)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    names = []
    i = 0
    while bufts and bufts[i]:
        names.append(base.ggml_backend_buft_name(bufts[i]).decode())
        i += 1
    return tuple(names)


_lock = threading.Lock()
_applied: KernelPlan | None = None


def applied_plan() -> KernelPlan | None:
    """The plan in force in this process, or None before llama.cpp was first initialised."""
    return _applied


def apply_kernel_plan() -> KernelPlan:
    """Decide (once per process) and put the plan in force before llama.cpp first picks buffer types.
    Idempotent; ``ensure_backend`` calls it, and so does whatever starts a llama.cpp tool."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        plan = decide()
        if plan.mode == "no-amx":
            try:
                deny_amx_permission()
                if "AMX" in cpu_extra_buffer_types():  # llama.cpp chose its buffer types before this plan
                    plan = KernelPlan("plain", f"{plan.reason}; llama.cpp had taken AMX before it could be denied")
            except OSError as err:
                plan = KernelPlan("plain", f"{plan.reason}; AMX could not be denied alone ({err.strerror})")
        _applied = plan
        return plan


class extra_bufts_off:
    """For llama-cpp-python's high-level ``Llama`` in ``plain`` mode: its constructor takes no
    ``use_extra_bufts`` argument, so the default model parameters it starts from are patched while
    it loads.  Does nothing in the other modes."""

    def __init__(self, plan: KernelPlan) -> None:
        self.active = not plan.extra_bufts
        self._saved = None

    def __enter__(self):
        if self.active:
            import llama_cpp.llama_cpp as C

            self._saved = original = C.llama_model_default_params

            def params_without_extra_bufts():
                p = original()
                p.use_extra_bufts = False
                return p

            C.llama_model_default_params = params_without_extra_bufts
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            import llama_cpp.llama_cpp as C

            C.llama_model_default_params = self._saved
            self._saved = None
