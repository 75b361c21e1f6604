"""Math-verify equivalence under a deadline that holds in any thread and any process.

math-verify 0.9.0 bounds its own work with ``signal.alarm``, which raises outside the main thread, and a
signal cannot stop sympy inside one long C-level operation anyway (``9^{9^{9^9}}``). So every comparison runs
in a long-lived helper process (this file run as a script) that calls ``parse``/``verify`` with their timeouts
off; the caller waits on the helper's pipe with a deadline and, when it passes, kills the helper, which is the
only way to get the CPU back. The next call starts a fresh helper (~1 s).

The helper is a plain ``subprocess`` (not ``multiprocessing``) so that it can be started from daemonic pool
workers too, and it runs by file path so that it imports math-verify only, never the training stack.
One helper per process; threads of that process take turns on it (math-verify holds the GIL anyway).
POSIX only (``select`` on a pipe).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

VERIFY_TIMEOUT_S = 5.0
"""Default deadline of one math-verify comparison (parse of both sides + verify), in seconds."""

_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a busy 2-core machine can take many seconds
_READY = b"ready"


class _Helper:
    """One helper process and the reading end of its pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered pipes: no request or reply can sit in a buffer that select cannot see
        )
        self.pending = b""
        if self.read_line(time.monotonic() + _STARTUP_TIMEOUT_S) != _READY:
            self.kill()
            raise RuntimeError(
                f"the math-verify helper process did not start (exit status {self.proc.returncode}); "
                "its error is printed above. Is math-verify installed in this environment?"
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def read_line(self, deadline: float) -> bytes | None:
        """The helper's next output line, or None when the deadline passes or the helper has died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def ask(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        request = json.dumps([gold, pred]).encode() + b"\n"
        try:
            while request:  # a pipe may take a long request in several writes
                request = request[os.write(self.proc.stdin.fileno(), request) :]
        except BrokenPipeError:
            return None
        line = self.read_line(time.monotonic() + timeout_s)
        return None if line is None else line == b"1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.release()

    def release(self) -> None:
        """Close this process's ends of the pipes (after a fork, the helper belongs to the parent)."""
        self.proc.stdin.close()
        self.proc.stdout.close()


_lock = threading.Lock()
_helper: _Helper | None = None


def math_verify_equivalent(gold: str, pred: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool | None:
    """``verify(parse(gold), parse(pred))`` (gold first) on LaTeX answers without delimiters, under a deadline.

    Both strings are parsed as if written in ``\\boxed{}``. Returns None when the deadline passes or the
    helper dies; the caller decides the fallback. Safe to call from any thread and any process.
    """
    global _helper
    with _lock:
        if _helper is None or not _helper.alive():
            _helper = _Helper()
        verdict = _helper.ask(gold, pred, timeout_s)
        if verdict is None:
            _helper.kill()  # still busy with the pathological input, or dead
            _helper = None
        return verdict


def _forget_parent_helper() -> None:
    # A forked child shares the parent's pipes; talking on them would interleave with the parent's requests,
    # and the lock may have been held by a parent thread that does not exist here.
    global _helper, _lock
    _lock = threading.Lock()
    if _helper is not None:
        _helper.release()
        _helper = None


def _stop_helper() -> None:
    if _helper is not None:
        _helper.kill()


os.register_at_fork(after_in_child=_forget_parent_helper)
atexit.register(_stop_helper)


def _serve() -> None:
    """Helper process: answer one ``[gold, pred]`` JSON line on stdin with "1" or "0" on stdout, until EOF."""
    import logging
    import signal
    from functools import lru_cache

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; the helper ends at stdin's EOF
    logging.disable(logging.WARNING)  # math-verify warns on each call that its own timeout is off: ours is outside

    from math_verify import parse, verify

    @lru_cache(maxsize=8192)  # voting compares the same answers many times
    def parsed(s: str) -> list:
        return parse("\\boxed{" + s + "}", parsing_timeout=None)

    # The first parse compiles math-verify's regexes and grammar: do it before the caller's deadline starts.
    verify(parsed("1"), parsed("1"), timeout_seconds=None)
    # Replies get their own copy of the pipe; whatever a library prints to fd 1 lands on stderr instead,
    # where it cannot be read as a reply.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    out.write(_READY + b"\n")
    out.flush()
    for line in sys.stdin:
        gold, pred = json.loads(line)
        out.write(b"1\n" if verify(parsed(gold), parsed(pred), timeout_seconds=None) else b"0\n")
        out.flush()


if __name__ == "__main__":
    _serve()
