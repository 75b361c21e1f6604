"""The sandbox for model-written programs: statuses, limits, containment, and that each protection really holds.

Each attack test is built so that it fails if the protection it checks is removed (e.g. the path written to is
first shown to be writable from outside, the port connected to is first shown to accept connections)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from vlm_corl.evaluation import sandbox
from vlm_corl.evaluation.sandbox import Limits, run_io_cases, run_program, run_tests, same_output

ROOT = Path(__file__).resolve().parents[1]
FAST = Limits(wall_s=2, cpu_s=2)


def _reachable_by_others(python: str) -> bool:
    """Whether an unprivileged uid can reach `python`'s installation (every ancestor traversable by others):
    what the uid-only mode, which has no new root to bind it into, needs."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    parts = prefix.strip("/").split("/")
    return all(os.stat("/" + "/".join(parts[:depth])).st_mode & 0o001 for depth in range(1, len(parts)))


try:
    MODE = sandbox.sandbox_layers()["mode"]
except sandbox.SandboxUnavailable as exc:  # root, with neither namespaces nor a world-readable interpreter
    pytest.skip(str(exc), allow_module_level=True)
KERNEL_ISOLATION = pytest.mark.skipif(MODE not in ("namespaces", "userns"), reason=f"no namespaces here ({MODE})")
PER_RUN_UID = pytest.mark.skipif(MODE not in ("namespaces", "uid"), reason=f"no per-run uid here ({MODE})")


def _alive(pid: int, grace_s: float = 1.0) -> bool:
    """Whether ``pid`` is still a live (non-zombie) process after up to ``grace_s`` for a SIGKILL to land."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)


def _assert_writable_from_outside(path: Path) -> None:
    """The protection is only meaningful if this process (unsandboxed) could create the file."""
    path.write_text("probe")
    path.unlink()


# --- statuses ---
def test_functional_tests_pass_fail_and_crash():
    program = "def add(a, b):\n    return a + b\n"
    assert run_tests(program, "assert add(2, 3) == 5", FAST).status == "passed"
    failed = run_tests(program, "assert add(2, 3) == 6, 'wrong sum'", FAST)
    assert (failed.status, failed.returncode) == ("failed", 1)
    assert failed.detail == "AssertionError: wrong sum" and 'File "tests.py", line 1' in failed.stderr
    crashed = run_tests(program, "add(1, None)", FAST)
    assert crashed.status == "crashed" and crashed.detail.startswith("TypeError")
    assert run_program("import sys; sys.exit(3)", limits=FAST).status == "failed"


def test_exiting_before_the_tests_run_is_not_a_pass():
    outcome = run_tests("def f():\n    return 1\nexit(0)\n", "assert f() == 2", FAST)
    assert (outcome.status, outcome.returncode) == ("failed", 0)
    assert "before the tests finished" in outcome.detail


def test_io_cases_compare_stdout_ignoring_trailing_whitespace():
    program = "n = int(input())\nprint(' '.join(str(i) for i in range(n)) + '  ')\n"
    outcomes = run_io_cases(program, [("3\n", "0 1 2"), ("2", "0 1\n\n"), ("2\n", "0 2\n"), ("x\n", "")], FAST)
    assert [o.status for o in outcomes] == ["passed", "passed", "failed", "crashed"]
    assert outcomes[2].detail.startswith("wrong answer")
    assert same_output("a  \nb\n\n", "a\nb") and same_output("a\nb", "a\n b") and not same_output("a b", "ab")
    assert same_output("1.0 2\n", "1 2.00") and not same_output("1.5 2", "1 2") and not same_output("1 2", "1 2 3")
    assert not same_output("a\n\nb", "a\nb") and not same_output("x 1", "y 1")


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(wall_s=0)


# --- process, directory and environment ---
def test_fresh_workdir_minimal_environment_and_cleanup():
    program = (
        "import os, tempfile\n"
        "open('scratch.txt', 'w').write('kept only during the run')\n"
        "os.mkdir('d'); os.rename('d', 'e'); os.rmdir('e'); open('/dev/null', 'w').write('x')\n"  # all allowed
        "print(os.getcwd(), os.environ['HOME'], tempfile.gettempdir(), sorted(os.environ), os.getuid(), sep='|')\n"
    )
    first, second = (run_program(program, limits=FAST) for _ in range(2))
    assert first.status == second.status == "passed", first.stderr
    cwd, home, tmp, env, uid = first.stdout.strip().split("|")
    assert cwd == home == tmp and cwd != second.stdout.split("|")[0]
    assert env == str(["HOME", "LANG", "PATH", "TMPDIR"])  # nothing of ours leaks (tokens, CUDA, ...)
    assert not os.path.exists(cwd)
    if os.geteuid() == 0:
        assert int(uid) != 0


def test_infinite_loop_times_out_and_the_process_group_is_gone(monkeypatch):
    monkeypatch.setattr(sandbox, "_kill_uid", lambda uid: None)  # killpg alone must do it (the sweep is tested below)
    program = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "print(os.getpid(), child, flush=True)\n"
        "while True:\n"
        "    pass\n"
    )
    outcome = run_program(program, limits=Limits(wall_s=1, cpu_s=10))
    assert (outcome.status, outcome.returncode) == ("timeout", -9)
    assert 1 <= outcome.seconds < 2.5
    for pid in map(int, outcome.stdout.split()):
        assert not _alive(pid), f"pid {pid} survived the timeout"


@PER_RUN_UID
def test_process_that_left_the_group_is_killed_too():
    program = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    os.setsid()\n"  # out of the process group: killpg alone would miss it
        "    os.write(w, b'x')\n"
        "    time.sleep(60)\n"
        "os.read(r, 1)\n"
        "print(child)\n"
    )
    outcome = run_program(program, limits=FAST)
    assert outcome.status == "passed", outcome.stderr
    assert not _alive(int(outcome.stdout))


def test_cpu_limit_stops_a_busy_program():
    outcome = run_program("while True:\n    pass\n", limits=Limits(wall_s=6, cpu_s=1))
    assert outcome.status == "timeout" and "CPU" in outcome.detail
    assert outcome.seconds < 4


# --- resource attacks ---
def test_process_limit_is_enforced():
    program = (
        "import os, time\n"
        "started = 0\n"
        "for _ in range(30):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "    except OSError:\n"
        "        break\n"
        "    started += 1\n"
        "print(started)\n"
    )
    outcome = run_program(program, limits=Limits(wall_s=3, processes=8))
    assert outcome.status == "passed", outcome.stderr
    assert int(outcome.stdout) < 8  # the program itself is one of the 8


def test_fork_bomb_is_contained_and_the_host_stays_usable():
    program = (
        "import os\n"
        "print(os.getuid(), flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    outcome = run_program(program, limits=Limits(wall_s=1.5, processes=32))
    assert outcome.status in ("timeout", "crashed")
    assert outcome.seconds < 4
    if MODE in ("namespaces", "uid"):
        assert sandbox._live_pids_of(int(outcome.stdout.split()[0])) == []
    started = time.monotonic()
    after = run_program("print('still fine')", limits=FAST)
    assert after.status == "passed" and after.stdout == "still fine\n"
    assert time.monotonic() - started < 2


def test_ten_gigabyte_allocation_crashes():
    # The guard keeps this test harmless on a host where the limit went missing: it then fails instead of
    # touching 10 GB.
    program = (
        "import resource\n"
        "assert 0 < resource.getrlimit(resource.RLIMIT_AS)[0] <= 2 << 30, 'no memory limit'\n"
        "data = bytearray(10 << 30)\n"
    )
    outcome = run_program(program, limits=FAST)
    assert outcome.status == "crashed" and outcome.detail == "MemoryError", outcome.stderr
    assert outcome.seconds < 2


def test_file_size_and_disk_limits():
    big_file = run_program("open('big', 'wb').write(b'x' * (2 << 20))", limits=Limits(wall_s=2, file_bytes=1 << 20))
    assert big_file.status == "crashed" and "File too large" in big_file.detail
    if MODE in ("namespaces", "userns"):
        many = "for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
        full = run_program(many, limits=Limits(wall_s=2, disk_bytes=4 << 20))
        assert full.status == "crashed" and "No space left" in full.detail


def test_hundred_megabytes_of_output_are_capped_quickly():
    tracemalloc.start()
    try:
        outcome = run_program("import sys\nsys.stdout.write('x' * 100_000_000)\n", limits=FAST)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.status == "failed" and "output limit" in outcome.detail
    assert len(outcome.stdout) == FAST.output_bytes
    assert outcome.seconds < 2
    assert peak < 8 * FAST.output_bytes  # never the 100 MB


# --- escape attempts ---
@pytest.mark.parametrize("where", ["tmp", "repo"])
def test_write_outside_the_workdir_is_a_violation_and_leaves_nothing(where):
    target = (Path("/tmp") if where == "tmp" else ROOT) / f"sandbox-escape-{uuid.uuid4().hex}"
    _assert_writable_from_outside(target)
    outcome = run_program(f"open({str(target)!r}, 'w').write('escaped')\n", limits=FAST)
    assert outcome.status == "sandbox_violation" and str(target) in outcome.detail
    assert not target.exists()
    # Catching the PermissionError does not hide the attempt.
    caught = run_program(f"try:\n    open({str(target)!r}, 'a')\nexcept OSError:\n    pass\n", limits=FAST)
    assert (caught.status, caught.returncode) == ("sandbox_violation", 0)
    assert not target.exists()


@KERNEL_ISOLATION
def test_kernel_blocks_writes_that_bypass_the_audit_hook():
    targets = [Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}", ROOT / f"sandbox-escape-{uuid.uuid4().hex}"]
    for target in targets:
        _assert_writable_from_outside(target)
    program = (
        "import ctypes, subprocess\n"
        f"print(ctypes.CDLL(None).open({str(targets[0]).encode()!r}, 0o101, 0o644))\n"  # O_WRONLY|O_CREAT
        f"subprocess.run(['/bin/sh', '-c', 'echo x > {targets[1]}'])\n"
    )
    outcome = run_program(program, limits=FAST)
    # the new root is read-only, and the repository is not in it at all
    assert outcome.stdout.strip() == "-1" and (
        "Read-only file system" in outcome.stderr or "nonexistent" in outcome.stderr
    )
    assert not any(t.exists() for t in targets)


@pytest.fixture()
def listener():
    """A TCP server on 127.0.0.1 that this (unsandboxed) process can reach."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    with socket.create_connection(server.getsockname(), timeout=1):
        server.accept()[0].close()  # reachable from outside: the checks below are meaningful
    yield server
    server.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "8.8.8.8"])
def test_opening_a_socket_is_a_violation(listener, host):
    port = listener.getsockname()[1] if host == "127.0.0.1" else 53
    program = f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=1)\n"
    outcome = run_program(program, limits=FAST)
    assert outcome.status == "sandbox_violation" and "socket" in outcome.detail
    with pytest.raises(socket.timeout):
        listener.accept()


@KERNEL_ISOLATION
def test_network_namespace_blocks_connections_that_bypass_the_audit_hook(listener):
    port = listener.getsockname()[1]
    inner = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    program = f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])\n"
    outcome = run_program(program, limits=FAST)
    assert "Network is unreachable" in outcome.stderr, outcome.stderr
    with pytest.raises(socket.timeout):
        listener.accept()


# --- fallbacks ---
def test_without_pidfd_the_run_still_ends_on_exit_and_on_timeout(monkeypatch):
    monkeypatch.setattr(sandbox, "_pidfd", lambda pid: None)
    assert run_program("print(1)", limits=FAST).stdout == "1\n"
    assert run_program("while True:\n    pass\n", limits=Limits(wall_s=0.5)).status == "timeout"


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid-only mode is root's fallback")
def test_uid_only_fallback_still_reports_violations(monkeypatch):
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None or not _reachable_by_others(python):
        pytest.skip("no interpreter readable by an unprivileged uid")
    monkeypatch.setattr(sandbox, "_isolation_mode", lambda python: "uid")
    target = Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}"
    hello = run_program("import os; print(os.getuid())", limits=FAST, python=python)
    assert hello.status == "passed" and int(hello.stdout) != 0
    wrote = run_program(f"open({str(target)!r}, 'w')", limits=FAST, python=python)
    assert wrote.status == "sandbox_violation" and not target.exists()
    net = run_program("import socket; socket.socket()", limits=FAST, python=python)
    assert net.status == "sandbox_violation"


def test_layers_are_reported():
    layers = sandbox.sandbox_layers(sys.executable)
    assert layers["mode"] in ("namespaces", "userns", "uid", "plain")
    assert {"rlimits", "identity", "network", "filesystem", "audit_hook"} <= set(layers)


SNOOPER = """
import os
found = []
for path in {paths!r}:
    try:
        found.append((path, os.listdir(path) if os.path.isdir(path) else open(path).read(50)))
    except OSError:
        pass
print(found)
"""
# The repository, its data and tests' expected outputs, the home directory and /etc
SECRETS = [str(ROOT), str(ROOT / "README.md"), str(ROOT / "tests" / "fixtures"), os.path.expanduser("~"), "/etc",
           "/etc/passwd", "/home"]  # fmt: skip
MODES = ["namespaces", "userns", "uid", "plain"]


def _in_mode(monkeypatch, mode: str) -> str:
    """The interpreter to run in `mode` (forced): the uid-only mode needs one an unprivileged uid can read."""
    if mode in ("namespaces", "uid") and os.geteuid() != 0:
        pytest.skip(f"{mode} is root's mode")
    python = sys.executable
    if mode == "uid":
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None or not _reachable_by_others(python):
            pytest.skip("no interpreter readable by an unprivileged uid")
    monkeypatch.setattr(sandbox, "_isolation_mode", lambda python: mode)
    return python


@pytest.mark.parametrize("mode", MODES)
def test_a_program_cannot_list_or_read_the_repository_data_home_or_etc(monkeypatch, mode):
    """Issue 23: in RL on code, a policy that finds the expected outputs on disk is rewarded for printing them. In
    every mode the audit hook refuses reading and listing outside the work dir and the interpreter's own files."""
    python = _in_mode(monkeypatch, mode)
    out = run_program(SNOOPER.format(paths=SECRETS), limits=FAST, python=python)
    assert out.stdout == "[]\n", out
    assert out.status == "sandbox_violation" and ("read" in out.detail or "list" in out.detail)
    # the standard library and the work dir stay readable
    ok = run_program("import json, re, collections; print(open('main.py').read()[:6])", limits=FAST, python=python)
    assert ok.status == "passed" and ok.stdout == "import\n", ok


PROBE = """
import json, os
print(json.dumps({{"top": sorted(os.listdir("/")), "found": [p for p in {paths!r} if os.path.exists(p)],
                  "root": sorted(os.listdir("/root")) if os.path.isdir("/root") else []}}))
"""


@pytest.mark.parametrize("mode", ["namespaces", "userns"])
def test_in_the_namespace_modes_the_filesystem_itself_holds_nothing_else(monkeypatch, mode):
    """A child process escapes the audit hook; the kernel still shows it a root holding only the system's
    programs and libraries, the interpreter and the work dir: the repository, home, /etc and /proc are not there."""
    import json

    python = _in_mode(monkeypatch, mode)
    probe = PROBE.format(paths=SECRETS)
    program = f"import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', {probe!r}], capture_output=True, text=True).stdout)"  # noqa: E501
    out = run_program(program, limits=FAST, python=python)
    assert out.status == "passed", out
    seen = json.loads(out.stdout)
    assert set(seen["top"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "tmp", "root"}, seen
    # the home directory is there only when it holds the interpreter, and then holds nothing else
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    home = os.path.expanduser("~")
    expected_found = [home] if prefix.startswith(home + "/") else []
    assert seen["found"] == expected_found, seen
    assert seen["root"] in ([], [prefix.removeprefix("/root/").split("/")[0]]), seen
