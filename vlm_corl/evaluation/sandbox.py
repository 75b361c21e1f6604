"""Sandboxed execution of model-written Python programs, for code benchmarks (HumanEval, MBPP, LiveCodeBench).

Public API
----------
``run_program(source, stdin, limits, python) -> Outcome``
    Run one program; "passed" iff it exits with status 0.
``run_tests(program, test_code, limits, python) -> Outcome``
    Functional tests: the program, then the test code (asserts) in the same namespace. "passed" iff the process
    exits with 0 *and* the test code ran to its end (a program that calls ``exit(0)`` before the asserts fails).
``run_io_cases(program, cases, limits, python) -> list[Outcome]``
    stdin/stdout tests: one run per ``(stdin, expected_stdout)`` case; outputs are compared by ``same_output``
    (trailing whitespace of each line and trailing blank lines ignored). A wrong answer is "failed".
``sandbox_layers(python) -> dict[str, str]``
    Which protection layers are active on this machine (for logs and reports).

Every run gets its own process (``python -I -S -B``: no site-packages, no environment variables, no user site, no
bytecode writes), its own session/process group, a fresh temporary working directory (also HOME and TMPDIR) that is
deleted afterwards, and a minimal environment.

Protection layers (the kernel layers enforce; the audit hook reports)
--------------------------------------------------------------------
1. rlimits, set in the child before exec: CPU, AS (memory), FSIZE (largest file), NPROC (processes), CORE = 0.
2. Unprivileged identity. As root, each run gets a fresh random uid/gid (>= 2**30, never shared between runs), so
   RLIMIT_NPROC counts that run alone (it does not apply to root) and every leftover process of the run can be
   found and killed by uid, even ones that left the process group with setsid(). PR_SET_NO_NEW_PRIVS stops setuid
   binaries from regaining privileges.
3. Namespaces. As root: new network namespace (no interface is up: every connect fails), new IPC namespace and a
   new mount namespace whose root is a new, empty tmpfs (pivot_root, the old root detached): it holds only the
   system's programs and libraries (/usr, /bin, /lib*: the loader and libc), the interpreter's installation (its
   standard library), /dev/null, zero, urandom and random, and the working directory. The repository, the data,
   the benchmark's expected outputs, home directories, /etc and /proc are not there to list or read. *Every*
   mount is read-only (mount_setattr(AT_RECURSIVE)) but the working directory, a size-capped tmpfs
   (``Limits.disk_bytes``). Not root: the same through a user namespace that maps only the caller's own uid.
4. An audit hook (``sys.addaudithook``, installed before the program runs) refuses socket use other than AF_UNIX
   and name lookups, creating/writing/renaming/removing paths outside the working directory, and reading or
   listing paths outside the working directory and the interpreter's own installation. It raises PermissionError
   and reports the attempt on a private pipe, which makes the status "sandbox_violation" even if the program
   catches the error. It is a reporting layer: code can bypass it (ctypes, a child process), which is why layers
   2-3 enforce the same rules in the kernel.

Fallbacks, chosen once per interpreter by a probe run (see ``sandbox_layers``): root without namespaces ("uid"):
layers 1, 2 and 4; writes to world-writable directories such as /tmp and network access are then stopped by the
audit hook only, and every file the unprivileged uid may read (world-readable files: typically the repository,
the data and /etc) is hidden by the audit hook alone, which a child process or ctypes gets around. Not root
without user namespaces ("plain"): layers 1 and 4 only, as the caller's own user: everything the caller can read
and write is behind the audit hook alone; RLIMIT_NPROC then counts all of the caller's processes, and a process
that calls setsid() can outlive the run. As root, if the interpreter is not reachable by an unprivileged uid and
namespaces are unavailable, ``SandboxUnavailable`` is raised rather than run untrusted code as root.

Status mapping (first match wins)
---------------------------------
- "sandbox_violation": the audit hook reported an attempt (detail: the event and its argument).
- "timeout": the wall-clock limit expired (the whole process group is SIGKILLed), or the CPU limit killed it
  (SIGXCPU).
- "failed": output passed ``Limits.output_bytes`` on stdout or stderr (the run is killed at that point, detail
  "output limit ..."); exit status 0 without reaching the end of the tests (run_tests); non-zero exit from an
  AssertionError, from SystemExit/sys.exit or from os._exit; a wrong answer (run_io_cases).
- "crashed": killed by any other signal, or non-zero exit from any other exception (MemoryError, EFBIG from
  RLIMIT_FSIZE, ENOSPC from the tmpfs cap, ...).
- "passed": exit status 0 (and, for run_tests, the tests ran to their end).

Output is read incrementally from the pipes with a cap (``communicate()`` is never used), so a program printing
100 MB costs this process about ``output_bytes`` of memory and is killed as soon as it passes the cap.

Details and known limits
------------------------
- Program, tests and stdin reach the child through memfds (no argv size limit, no pipe to block on); the child
  copies them to main.py/tests.py in its work dir only so that tracebacks show source lines. -S skips site.py, so
  the prelude defines the ``exit``/``quit`` builtins that programs commonly call.
- The prelude reports on an inherited pipe. A program that knows the sandbox can write to that pipe itself (e.g.
  fake "done"); that needs deliberate knowledge of this module, unlike the ``exit(0)``-before-the-asserts hack.
- rlimits are per process: the memory of a whole run is bounded by ``processes * memory_bytes``, not by
  ``memory_bytes`` (a cgroup would bound the total; none is used here).
- The child is set up by ``preexec_fn``, which Python calls unsafe with threads; it only runs syscalls through
  libc functions resolved at import, which is what makes it safe enough here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

STATUSES = ("passed", "failed", "timeout", "crashed", "sandbox_violation")


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Sizes are bytes; ``disk_bytes`` applies only where mount namespaces are available."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    processes: int = 64
    output_bytes: int = 1 << 20

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if value <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class Outcome:
    """The result of one sandboxed run. ``status`` is one of ``STATUSES``; ``returncode`` is negative when a
    signal killed the program (-9 after a timeout); ``stdout``/``stderr`` are truncated to the output cap."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class SandboxUnavailable(RuntimeError):
    """No isolation mode works here that would not run untrusted code as root."""


# --- kernel interface (Linux). Resolved once, here: the child between fork and exec must not load libraries. ---
_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _AT_RECURSIVE, _AT_FDCWD = 0x1, 0x2, 0x8000, -100
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine, 155)
_MNT_DETACH = 2
# What a run's new root holds besides the interpreter's prefix and its work dir: programs and shared libraries
# (the dynamic loader and libc live there), and devices Python or a program may open.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_PR_SET_NO_NEW_PRIVS = 38
_REPORT_CAP = 64 << 10
_UID_RANGE = (1 << 30, 1 << 31)  # far above any real account; one fresh uid per run


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _libc_functions() -> dict[str, object]:
    """libc's unshare, mount, umount2, syscall and prctl, looked up now: a first lookup (dlsym) in the forked child
    could deadlock on a loader lock held by another thread of ours at fork time."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to call: the namespace modes fail their probe and the fallbacks apply
        return {}
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return {name: getattr(libc, name) for name in ("unshare", "mount", "umount2", "syscall", "prctl")}


_LIBC = _libc_functions()


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: {what}: {os.strerror(err)}")


# --- the prelude: the child interpreter's first code. It runs in its own globals (the program gets a clean
# __main__), installs the audit hook, then runs the program and the tests. Passed as a file descriptor, like the
# program; _BOOTSTRAP (the -c argument) only loads it. ---
_BOOTSTRAP = "exec(__import__('os').read(int(__import__('sys').argv[1]), 1 << 20), {'__name__': '__sandbox__'})"
_PRELUDE = r'''
import _thread, builtins, os, posixpath, sys

REPORT_FD, PROGRAM_FD, TESTS_FD, ROOT = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DEVICES = ("/dev/null", "/dev/stdout", "/dev/stderr")
READABLE = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# Reading is allowed in the work dir and the interpreter's own installation (its standard library) only.
PREFIXES = tuple({posixpath.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)})
# audit event -> (index of a path argument, index of its dir_fd argument or None)
PATHS = {"os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
         "os.link": ((1, 3),), "os.symlink": ((1, 2),), "os.truncate": ((0, None),), "os.chmod": ((0, 2),),
         "os.chown": ((0, 3),), "os.utime": ((0, 3),)}
LISTING = ("os.listdir", "os.scandir")
NET = ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
       "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo")
reported, busy = set(), set()


def read(fd):
    with open(fd, "rb") as f:
        return f.read().decode("utf-8", "replace")


def save(name, text):
    """A copy on disk, only so that tracebacks can show source lines."""
    try:
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass


def report(line):
    try:
        os.write(REPORT_FD, (line[:500] + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def deny(event, what):
    if event not in reported:  # once per event: a loop around a caught error must not flood the pipe
        reported.add(event)
        report("violation %s %r" % (event, what))
    raise PermissionError("sandbox: %s is not allowed (%r)" % (event, what))


def real_path(path, dir_fd):
    base = os.getcwd() if dir_fd in (None, -1) else os.readlink("/proc/self/fd/%d" % dir_fd)
    return posixpath.realpath(posixpath.join(base, os.fsdecode(path)))


def under(real, roots):
    return any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots)


def inside(path, dir_fd, roots=()):
    """Whether `path` is in the work dir (or one of `roots`); a path that cannot be resolved is not."""
    if isinstance(path, int) or path in DEVICES:
        return True  # an already open descriptor, or a harmless device
    try:
        real = real_path(path, dir_fd)
    except (OSError, ValueError):
        return False
    return under(real, (ROOT, *roots))


def check(event, args):
    if event == "open" and args[0] is not None:
        mode, flags = args[1], args[2]
        writing = (isinstance(flags, int) and flags & WRITE) or (isinstance(mode, str) and set(mode) & set("wax+"))
        if writing and not inside(args[0], None):
            deny("open", args[0])
        if not writing and args[0] not in READABLE and not inside(args[0], None, PREFIXES):
            deny("read", args[0])
    elif event in LISTING:
        if not inside("." if args[0] is None else args[0], None, PREFIXES):
            deny("list", args[0])
    elif event in PATHS:
        for i, fd_i in PATHS[event]:
            if not inside(args[i], None if fd_i is None else args[fd_i]):
                deny(event, args[i])
    elif event in NET:
        family = args[1] if event == "socket.__new__" else getattr(args[0], "family", None)
        if family != 1:  # AF_UNIX (socketpair) is local; everything else is network
            deny(event, "family %s" % family if event == "socket.__new__" else args[0 if "get" in event else 1])


def hook(event, args):
    me = _thread.get_ident()  # per thread: one thread's check must not open a gap for another
    if me in busy:  # an event raised by this hook's own path resolution
        return
    busy.add(me)
    try:
        check(event, args)
    finally:
        busy.discard(me)


def exit(code=None):
    raise SystemExit(code)


def run(program, tests):
    ns = sys.modules["__main__"].__dict__
    try:
        exec(compile(program, "main.py", "exec"), ns)
        if tests is not None:
            exec(compile(tests, "tests.py", "exec"), ns)
            report("done")
    except SystemExit:
        report("exception SystemExit")
        raise
    except BaseException as exc:
        report("exception " + type(exc).__name__)
        exc.__traceback__ = exc.__traceback__.tb_next  # print it without the prelude's frame
        sys.__excepthook__(type(exc), exc, exc.__traceback__)
        raise SystemExit(1)


os.close(int(sys.argv[1]))  # the prelude itself, read by _BOOTSTRAP
os.set_inheritable(REPORT_FD, False)  # programs the child execs do not get the report channel
PROGRAM, TESTS = read(PROGRAM_FD), (read(TESTS_FD) if TESTS_FD >= 0 else None)
for name, text in (("main.py", PROGRAM), ("tests.py", TESTS)):
    if text is not None:
        save(name, text)
for name in ("exit", "quit"):  # -S skips site.py, which would define them; programs use them
    if not hasattr(builtins, name):
        setattr(builtins, name, exit)
sys.argv[:] = ["main.py"]
sys.addaudithook(hook)
run(PROGRAM, TESTS)
'''


# --- what runs in the child between fork and exec (preexec_fn) ---
@dataclass(frozen=True)
class _Plan:
    mode: str  # "namespaces" | "userns" | "uid" | "plain"
    workdir: str
    limits: Limits
    uid: int | None  # the run's unprivileged uid (= gid); None keeps the caller's identity
    owner: tuple[int, int]  # the caller's uid, gid (mapped into a user namespace)
    root: str | None  # an empty host directory that becomes the run's whole filesystem (namespace modes)
    prefix: str  # the interpreter's installation (bin/, lib/pythonX.Y): bound into the new root


def _child_setup(plan: _Plan):
    """The preexec_fn: namespaces, rlimits, no-new-privs, then the unprivileged identity (last: it needs root)."""

    def setup() -> None:
        if plan.mode in ("namespaces", "userns"):
            _enter_namespaces(plan)
        _set_limits(plan.limits)
        if "prctl" in _LIBC:  # setuid binaries (su, sudo, ...) must not regain privileges
            _check(_LIBC["prctl"](_PR_SET_NO_NEW_PRIVS, *(ctypes.c_ulong(v) for v in (1, 0, 0, 0))), "no_new_privs")
        if plan.uid is not None:
            os.setgroups([])
            os.setresgid(plan.uid, plan.uid, plan.uid)
            os.setresuid(plan.uid, plan.uid, plan.uid)
        os.chdir(plan.workdir)  # again: inside the new tmpfs, as the new user

    return setup


def _enter_namespaces(plan: _Plan) -> None:
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC
    if plan.mode == "userns":
        flags |= _CLONE_NEWUSER
    _check(_LIBC["unshare"](flags), "unshare")
    if plan.mode == "userns":
        uid, gid = plan.owner
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
    # Private first, so that nothing below propagates back to the host's mounts.
    _check(_LIBC["mount"](None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make mounts private")
    _new_root(plan)
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(
        _LIBC["syscall"](
            ctypes.c_long(_SYS_MOUNT_SETATTR),
            ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(b"/"),
            ctypes.c_long(_AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_long(ctypes.sizeof(attr)),
        ),
        "mount_setattr(read-only, recursive)",
    )
    # Mounted after the read-only pass, so it is the one writable place.
    uid, gid = (plan.uid, plan.uid) if plan.uid is not None else plan.owner
    options = f"size={plan.limits.disk_bytes},nr_inodes=16384,mode=0700,uid={uid},gid={gid}"
    _check(
        _LIBC["mount"](b"tmpfs", plan.workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()),
        "tmpfs work dir",
    )


def _new_root(plan: _Plan) -> None:
    """Make `plan.root` the whole filesystem of the run: an empty tmpfs holding only the system's programs and
    libraries (`_SYSTEM_DIRS`, bound), the interpreter's prefix, a few harmless devices and the (empty) work
    directory, then pivot into it and detach the old root. The repository, data, home directories and /etc
    are not there to list or read; /proc neither."""
    root = plan.root
    _check(_LIBC["mount"](b"tmpfs", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755"), "root")
    for source in (*_SYSTEM_DIRS, plan.prefix):
        target = root + source
        if os.path.islink(source):  # /lib -> usr/lib on merged-/usr systems
            if not os.path.lexists(target):
                os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
                os.symlink(os.readlink(source), target)
        elif os.path.isdir(source) and not os.path.exists(target + "/"):
            os.makedirs(target, mode=0o755, exist_ok=True)
            _check(_LIBC["mount"](source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), f"bind {source}")
    os.makedirs(root + "/dev", mode=0o755, exist_ok=True)
    for device in _DEVICES:
        os.close(os.open(root + device, os.O_CREAT | os.O_WRONLY, 0o666))
        _check(_LIBC["mount"](device.encode(), (root + device).encode(), None, _MS_BIND, None), f"bind {device}")
    os.makedirs(root + plan.workdir, mode=0o755, exist_ok=True)
    os.makedirs(root + "/.old", mode=0o700)
    _check(_LIBC["syscall"](ctypes.c_long(_SYS_PIVOT_ROOT), root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_LIBC["umount2"](b"/.old", _MNT_DETACH), "detach the old root")
    os.rmdir("/.old")


def _set_limits(limits: Limits) -> None:
    cpu = max(1, int(limits.cpu_s + 0.999))
    wanted = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.RLIMIT_AS: (limits.memory_bytes,) * 2,
        resource.RLIMIT_FSIZE: (limits.file_bytes,) * 2,
        resource.RLIMIT_NPROC: (limits.processes,) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for res, (soft, hard) in wanted.items():
        current = resource.getrlimit(res)[1]
        if current != resource.RLIM_INFINITY:  # a non-root caller cannot raise its own hard limit
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(res, (soft, hard))


# --- choosing the isolation mode ---
def _resolve(python: str) -> str:
    found = shutil.which(python) if os.sep not in python else python
    if not found or not os.path.exists(found):
        raise FileNotFoundError(f"python interpreter not found: {python!r}")
    return os.path.abspath(found)


@functools.cache
def _isolation_mode(python: str) -> str:
    """The strongest mode in which a trivial program really runs, probed once per interpreter."""
    candidates = ("namespaces", "uid") if os.geteuid() == 0 else ("userns", "plain")
    for mode in candidates:
        try:
            raw = _run_once(mode, python, "", None, "", Limits(wall_s=20))
        except (OSError, subprocess.SubprocessError):
            continue
        if raw.returncode == 0 and not raw.stderr:
            return mode
    if os.geteuid() == 0:
        raise SandboxUnavailable(
            f"neither namespaces nor an unprivileged uid can run {python}: pass python= an interpreter that "
            "every user can read, or allow unshare/mount (CAP_SYS_ADMIN, no seccomp filter)"
        )
    return "plain"


def _make_plan(mode: str, python: str, workdir: str, limits: Limits) -> _Plan:
    uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) if mode in ("namespaces", "uid") else None
    if uid is not None:
        os.chown(workdir, uid, uid)  # used as is in "uid" mode; hidden under the tmpfs otherwise
    root = tempfile.mkdtemp(prefix="sandbox-root-") if mode in ("namespaces", "userns") else None
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    return _Plan(mode, workdir, limits, uid, (os.getuid(), os.getgid()), root, prefix)


_RO_MOUNTS = (
    "mount namespace with a new root (system programs and libraries, the interpreter, the work dir; nothing else), "
    "every mount read-only, size-capped tmpfs work dir"
)
_UID_CLEANUP = "process group, then every process of the run's uid"
_LAYERS = {  # mode -> (identity, network, filesystem, cleanup); no_new_privs, rlimits and audit hook in every mode
    "namespaces": ("fresh unprivileged uid/gid per run", "empty network namespace", _RO_MOUNTS, _UID_CLEANUP),
    "userns": ("caller's uid in a user namespace", "empty network namespace", _RO_MOUNTS, "process group"),
    "uid": (
        "fresh unprivileged uid/gid per run",
        "audit hook only",
        "unprivileged uid + audit hook (world-readable files hidden by the audit hook only)",
        _UID_CLEANUP,
    ),
    "plain": (
        "caller's uid",
        "audit hook only",
        "audit hook only (the caller's files are readable past it)",
        "process group",
    ),
}


def sandbox_layers(python: str = sys.executable) -> dict[str, str]:
    """The protection layers active for ``python`` on this machine: {layer: description}. Runs the probe once."""
    mode = _isolation_mode(_resolve(python))
    identity, network, filesystem, cleanup = _LAYERS[mode]
    per_run_uid = mode in ("namespaces", "uid")
    return {
        "mode": mode,
        "process": "own session and process group; python -I -S -B; minimal environment",
        "rlimits": "CPU, AS, FSIZE, NPROC" + ("" if per_run_uid else " (counted per user)") + ", CORE=0",
        "identity": identity + ", no_new_privs",
        "network": network,
        "filesystem": filesystem,
        "cleanup": cleanup,
        "audit_hook": "reports sockets, writes outside the work dir and reads or listings outside the work dir and "
        "the interpreter's files as sandbox_violation",
    }


# --- running ---
@dataclass(frozen=True)
class _Raw:
    returncode: int
    stdout: bytes
    stderr: bytes
    report: bytes
    stop: str  # "exited" | "timeout" | "output"
    seconds: float


def _data_fd(data: str) -> int:
    """A descriptor at offset 0 holding ``data``: how program, tests and stdin reach the child (never argv, whose
    size is limited, and never a pipe, which could block us on large inputs)."""
    try:
        fd = os.memfd_create("sandbox-input")
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp()
        os.unlink(path)
    view = memoryview(data.encode("utf-8"))
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _child_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _run_once(mode: str, python: str, program: str, tests: str | None, stdin: str, limits: Limits) -> _Raw:
    """One run in a fresh working directory, removed afterwards whatever happens."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-"))
    plan = None
    try:
        plan = _make_plan(mode, python, workdir, limits)
        return _execute(plan, python, program, tests, stdin)
    finally:
        _remove_tree(workdir)
        if plan is not None and plan.root is not None:
            os.rmdir(plan.root)  # empty on the host: the run's root was a tmpfs in its own namespace


def _execute(plan: _Plan, python: str, program: str, tests: str | None, stdin: str) -> _Raw:
    start = time.monotonic()
    proc, report_r = _spawn(plan, python, program, tests, stdin)
    reader = _Reader({"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(), "report": report_r}, plan.limits)
    try:
        stop = reader.wait_for_exit(proc, plan.limits.wall_s)
        _kill_all(proc, plan)
        reader.drain(0.5)  # bounded: in "plain" mode a daemon that left the group may hold the pipes open
        if reader.overflow:
            stop = "output"
    finally:
        reader.close()
        os.close(report_r)
        proc.stdout.close()
        proc.stderr.close()
        _kill_all(proc, plan)  # idempotent; covers an exception while reading
        returncode = proc.wait()
    out = {name: bytes(buf) for name, buf in reader.buffers.items()}
    return _Raw(returncode, out["stdout"], out["stderr"], out["report"], stop, time.monotonic() - start)


def _spawn(plan: _Plan, python: str, program: str, tests: str | None, stdin: str) -> tuple[subprocess.Popen, int]:
    """Start the child; returns it and the read end of its report pipe."""
    inputs = [_data_fd(_PRELUDE), _data_fd(program), _data_fd(tests or ""), _data_fd(stdin)]
    report_r, report_w = os.pipe()
    fds = (inputs[0], report_w, inputs[1], inputs[2] if tests is not None else -1)
    # In a new root only the interpreter's own binary exists (a virtualenv's bin/python link does not): -S needs
    # nothing of the virtualenv.
    binary = os.path.realpath(python) if plan.root is not None else python
    argv = [binary, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP, *map(str, fds), plan.workdir]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=inputs[3],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(report_w, *inputs[:3]),
            cwd=plan.workdir,
            env=_child_env(plan.workdir),
            start_new_session=True,
            # preexec_fn, despite threads: it only makes syscalls through functions resolved at import time.
            preexec_fn=_child_setup(plan),  # noqa: PLW1509
        )
    except BaseException:
        os.close(report_r)
        raise
    finally:
        for fd in (*inputs, report_w):
            os.close(fd)  # the child has its copies; ours would keep the report pipe from reaching EOF
    return proc, report_r


class _Reader:
    """Capped, incremental reading of the child's pipes (plus its pidfd, so that exit wakes us without polling)."""

    def __init__(self, fds: dict[str, int], limits: Limits):
        self.selector = selectors.DefaultSelector()
        self.buffers = {name: bytearray() for name in fds}
        self.caps = {name: (_REPORT_CAP if name == "report" else limits.output_bytes) for name in fds}
        self.overflow = False
        for name, fd in fds.items():
            self.selector.register(fd, selectors.EVENT_READ, name)

    def wait_for_exit(self, proc: subprocess.Popen, wall_s: float) -> str:
        """Read until the child exits ("exited"), the wall clock runs out ("timeout") or a pipe passes its cap."""
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            self.selector.register(pidfd, selectors.EVENT_READ, None)
        deadline = time.monotonic() + wall_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                exited = self._pump(remaining if pidfd is not None else min(remaining, 0.02))
                if self.overflow:
                    return "output"
                if exited or (pidfd is None and proc.poll() is not None):
                    return "exited"
        finally:
            if pidfd is not None:
                self.selector.unregister(pidfd)
                os.close(pidfd)

    def drain(self, seconds: float) -> None:
        """After the kill: collect what is still buffered in the pipes, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while self.selector.get_map() and time.monotonic() < deadline and not self.overflow:
            self._pump(deadline - time.monotonic())

    def _pump(self, timeout: float) -> bool:
        exited = False
        for key, _ in self.selector.select(max(timeout, 0)):
            if key.data is None:
                exited = True
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.selector.unregister(key.fd)
                continue
            buf = self.buffers[key.data]
            room = max(self.caps[key.data] - len(buf), 0)
            buf += chunk[:room]
            self.overflow |= len(chunk) > room  # stop at the first byte past the cap: never hold more than that
        return exited

    def close(self) -> None:
        self.selector.close()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # old kernel or Python: fall back to polling every 20 ms


def _kill_all(proc: subprocess.Popen, plan: _Plan) -> None:
    """SIGKILL the whole process group, then (with a per-run uid) every process of that uid, e.g. a daemon that
    left the group with setsid(). Called before the child is reaped, so its pid (= group id) is still ours."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if plan.uid is not None:
        _kill_uid(plan.uid)


def _kill_uid(uid: int, rounds: int = 100) -> None:
    """Kill every live process whose real uid is ``uid``; repeat until a scan finds none (forks race the scan)."""
    for _ in range(rounds):
        found = _live_pids_of(uid)
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def _live_pids_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited meanwhile
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # a non-root caller may need to undo a program's chmod 000 first
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)
        shutil.rmtree(path, ignore_errors=True)


# --- classifying ---
def _classify(raw: _Raw, limits: Limits, expect_done: bool) -> tuple[str, str]:
    """(status, detail) from how the run ended; the order is the precedence documented in the module docstring."""
    report = raw.report.decode("utf-8", "replace").splitlines()
    violations = [line.split(" ", 1)[1] for line in report if line.startswith("violation ")]
    exceptions = [line.split(" ", 1)[1] for line in report if line.startswith("exception ")]
    if violations:
        return "sandbox_violation", "; ".join(violations)
    if raw.stop == "timeout":
        return "timeout", f"wall-clock limit of {limits.wall_s:g} s exceeded"
    if raw.stop == "output":
        return "failed", f"output limit of {limits.output_bytes} bytes exceeded"
    rc = raw.returncode
    if rc < 0:
        if -rc == signal.SIGXCPU:
            return "timeout", f"CPU limit of {limits.cpu_s:g} s exceeded"
        return "crashed", f"killed by {_signal_name(-rc)}"
    if rc == 0:
        if expect_done and "done" not in report:
            return "failed", "exited with status 0 before the tests finished"
        return "passed", ""
    exception = exceptions[-1] if exceptions else None
    if exception in (None, "SystemExit"):
        return "failed", f"exit status {rc}"
    last = _last_line(raw.stderr) or exception
    return ("failed" if exception == "AssertionError" else "crashed"), last


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _normalise(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def same_output(got: str, expected: str) -> bool:
    """stdout comparison for I/O cases, as LiveCodeBench's checker does it: the same lines once each is stripped
    (and blank lines at both ends dropped), a line that differs as text still matching when it holds the same
    numbers ("1.0 2" and "1 2.00"); everything else matters."""
    a, b = _normalise(got), _normalise(expected)
    return len(a) == len(b) and all(x == y or _same_numbers(x, y) for x, y in zip(a, b))


def _same_numbers(x: str, y: str) -> bool:
    xs, ys = x.split(), y.split()
    try:
        return len(xs) == len(ys) and all(Decimal(p) == Decimal(q) for p, q in zip(xs, ys))
    except InvalidOperation:  # a token that is not a number (or a signalling NaN)
        return False


# --- public entry points ---
def _run(program: str, tests: str | None, stdin: str, limits: Limits, python: str) -> Outcome:
    python = _resolve(python)
    raw = _run_once(_isolation_mode(python), python, program, tests, stdin, limits)
    status, detail = _classify(raw, limits, expect_done=tests is not None)
    stdout, stderr = (data.decode("utf-8", "replace") for data in (raw.stdout, raw.stderr))
    return Outcome(status, raw.returncode, stdout, stderr, raw.seconds, detail)


def run_program(source: str, stdin: str = "", limits: Limits = Limits(), python: str = sys.executable) -> Outcome:
    """Run ``source`` as ``__main__`` in the sandbox with ``stdin``; "passed" iff it exits with status 0.

    ``python`` is the interpreter to use (``-I -S``: the standard library only). See the module docstring for the
    layers and the status mapping."""
    return _run(source, None, stdin, limits, python)


def run_tests(program: str, test_code: str, limits: Limits = Limits(), python: str = sys.executable) -> Outcome:
    """Functional tests: run ``program`` then ``test_code`` in the same ``__main__`` namespace (as HumanEval and
    MBPP expect). "passed" iff the process exits with 0 and the test code ran to its end; a failing assert is
    "failed", any other exception "crashed"."""
    return _run(program, test_code, "", limits, python)


def run_io_cases(
    program: str, cases: list[tuple[str, str]], limits: Limits = Limits(), python: str = sys.executable
) -> list[Outcome]:
    """stdin/stdout tests (LiveCodeBench style): one sandboxed run per ``(stdin, expected_stdout)``; an outcome is
    "passed" iff the run passed and ``same_output(stdout, expected)``, else "failed" with detail "wrong answer"."""
    outcomes = []
    for stdin, expected in cases:
        outcome = run_program(program, stdin, limits, python)
        if outcome.passed and not same_output(outcome.stdout, expected):
            outcome = dataclasses.replace(outcome, status="failed", detail=f"wrong answer: expected {expected[:100]!r}")
        outcomes.append(outcome)
    return outcomes
