"""The load-time check of every picture (decode, size and bomb checks: `images.load_image`) and its content digest,
cached on disk and run in parallel, so that a relaunch or a resume of a 40k-picture dataset skips both.

A picture is cached under its identity: a file by its resolved path, device, inode, size, modification and change
times (the change time is the kernel's: any write to the file moves it, and no tool sets it back), so a file
rewritten, replaced or moved is checked and hashed again; embedded bytes by their sha256; a picture in a mapped
Arrow table (`mapped.TableImage`) by its place there and the file's identity when it was mapped, so a relaunch
reads none of its bytes. An entry holds the sha256 of the bytes and the check's outcome (None, or the `BadImage`
reason and detail), exactly what an uncached check gives: the loaders' skips, counts and messages and the resume
fingerprint (`training.checkpoint`) are the same with or without the cache. A missing or unreadable file is never
cached (it is checked again each time).

The cache is a JSON file per dataset (loader, resolved path and split: `image_checks-<hash>.json`, so a launch reads
its own data's entries only) in `$VLM_CORL_DATA_CACHE` (default: `$XDG_CACHE_HOME/vlm_corl`, or `~/.cache/vlm_corl`;
"off" turns it off), written atomically (a new file renamed over the old, merged with what another process wrote
meanwhile). A launch's world rank 0 checks first and the other ranks read its entries
(`training.setup`); a rank whose cache folder is not rank 0's (another node's local disk) checks for itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from vlm_corl.data.images import BadImage, load_image
from vlm_corl.data.mapped import TableImage

log = logging.getLogger(__name__)

CACHE_ENV = "VLM_CORL_DATA_CACHE"
WORKERS_ENV = "VLM_CORL_DATA_WORKERS"
PARALLEL_FROM = 64
"""Uncached pictures below which they are checked in this process (a process pool costs more than it saves)."""
MAX_WORKERS = 16
MAX_ENTRIES = 500_000
"""Entries a dataset's file keeps (the newest): about 100 MB of JSON at most, however often its files change."""
_CHUNK = 1 << 20


def cache_file(dataset: str) -> Path | None:
    """The cache's file for a dataset (any string naming it), or None when `$VLM_CORL_DATA_CACHE` is "off"."""
    folder = os.environ.get(CACHE_ENV)
    if folder == "off":
        return None
    if not folder:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_corl"
    return Path(folder) / f"image_checks-{hashlib.sha256(dataset.encode()).hexdigest()[:16]}.json"


def identity(src: str | os.PathLike | bytes | TableImage) -> str | None:
    """The cache key of a picture: "file:<path, device, inode, size, mtime, ctime>", "sha256:<hex>", or a mapped
    table's picture: its file's key, row, column and list index; None for a path that is not a readable file's
    (never cached: its check is cheap and its error must stay current)."""
    if isinstance(src, bytes):
        return "sha256:" + hashlib.sha256(src).hexdigest()
    if isinstance(src, TableImage):
        return f"{src.stamp}\0{src.row}\0{src.column}\0{src.index}"
    try:
        path = os.path.realpath(src)
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return None
    return f"file:{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"


def check_image(
    src: str | os.PathLike | bytes | TableImage, load: Callable = load_image
) -> tuple[str | None, tuple | None]:
    """(sha256 hex of the bytes, or None when they cannot be read; the `BadImage` (reason, detail), or None), the
    picture decoded in full by `load` (`images.load_image`, or what the caller decodes with)."""
    if isinstance(src, TableImage):
        src = src.read()  # once, for the decode and the digest
    try:
        load(src, max_pixels=None)
        problem = None
    except BadImage as e:
        problem = (e.reason, e.detail)
    return _digest(src), problem


def _digest(src: str | os.PathLike | bytes) -> str | None:
    if isinstance(src, bytes):
        return hashlib.sha256(src).hexdigest()
    digest = hashlib.sha256()
    try:
        with open(src, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


class ImageChecks:
    """The cache's entries in this process: key -> [sha256 hex, [reason, detail] or None]; `check` fills it."""

    def __init__(self, file: Path | None):
        self.file = file
        self.entries: dict[str, list] = _read(file)
        self.new: dict[str, list] = {}
        self.checked = 0  # pictures this process decoded (the rest came from the cache)
        self._pool: ProcessPoolExecutor | None = None  # the load's workers, from its first many pictures to `save`

    def check(self, sources: Iterable[str | os.PathLike | bytes | TableImage], load: Callable = load_image) -> dict:
        """src -> `BadImage` or None for each distinct source, from the cache or checked with `load` (`check_image`;
        in parallel when many)."""
        keys = {src: identity(src) for src in dict.fromkeys(sources)}
        missing = [src for src, key in keys.items() if key is None or key not in self.entries]
        found = dict(zip(missing, self._run(missing, load)))
        self.checked += len(missing)
        for src, (digest, problem) in found.items():
            if keys[src] is not None and digest is not None:
                self.new[keys[src]] = self.entries[keys[src]] = [digest, problem and list(problem)]
        outcome = {}
        for src, key in keys.items():
            problem = found[src][1] if src in found else self.entries[key][1]
            outcome[src] = None if problem is None else BadImage(*problem)
        return outcome

    def _run(self, sources: list, load: Callable) -> list:
        """`check_image` of each source, in order: in a process pool when there are many and more than one CPU."""
        workers = int(os.environ.get(WORKERS_ENV) or min(MAX_WORKERS, len(os.sched_getaffinity(0))))
        if len(sources) < PARALLEL_FROM or workers < 2:
            return [check_image(src, load) for src in sources]
        if self._pool is None:
            # forkserver: a trainer has threads (NCCL's, the launcher's) that a forked child must not inherit mid-lock
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))
        chunk = max(1, len(sources) // (4 * workers))
        return list(self._pool.map(functools.partial(check_image, load=load), sources, chunksize=chunk))

    def save(self) -> None:
        """End a load: stop its workers, write the new entries (merged with the file's current ones) atomically; a
        failure to write is logged, not raised."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.file is None or not self.new:
            return
        try:
            merged = {**_read(self.file), **self.new}
            kept = dict(list(merged.items())[-MAX_ENTRIES:])
            self.file.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".image_checks.")
            with os.fdopen(handle, "w") as out:
                json.dump(kept, out)
            os.replace(tmp, self.file)
            self.new = {}
        except OSError as e:
            log.warning("cannot write the picture check cache %s (%s): the next launch checks them again", self.file, e)


def _read(file: Path | None) -> dict:
    """The cache file's entries; {} when there is none or it cannot be read (a torn or foreign file)."""
    if file is None:
        return {}
    try:
        entries = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


_OPEN: dict[Path | None, ImageChecks] = {}


def image_checks(dataset: str) -> ImageChecks:
    """This process's view of a dataset's cache (`cache_file`; read once per file)."""
    file = cache_file(dataset)
    if file not in _OPEN:
        _OPEN[file] = ImageChecks(file)
    return _OPEN[file]


def cached_digest(src: str | os.PathLike | bytes | TableImage) -> bytes | None:
    """The sha256 of a picture file's (or a mapped table's picture's) bytes when a cache this process read holds it
    (no read of the bytes), else None (embedded bytes are hashed where they are: that is as cheap as their key)."""
    key = None if isinstance(src, bytes) else identity(src)
    entry = next((c.entries[key] for c in _OPEN.values() if key in c.entries), None) if key else None
    return bytes.fromhex(entry[0]) if entry else None


def pictures_checked() -> int:
    """Pictures this process decoded to check them (the others' checks came from a cache)."""
    return sum(checks.checked for checks in _OPEN.values())
