"""Writing an output folder or file so that nothing is lost: staged, then renamed into place.

An output is built in a hidden staging folder beside it, `.NAME.staging.HOST.PID.RANDOM`, and
renamed in only at the end. The rename never replaces something that appeared meanwhile
(another run, a user's folder) unless asked to; with `force`, the old output is moved aside
into the staging folder first and deleted only after the new one is in place, so a reader
sees the old or the new output, never a half-deleted one. The host and PID in the name let a
later run delete the staging folders of processes that were killed outright (SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that `finally` blocks clean up."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def terminate_raises():
    """Within this block, SIGTERM raises `Terminated` (when it would otherwise kill the process
    outright), so staging folders are removed by the code that made them. Only the main
    thread can install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM held back for a few system calls that must not be split."""
    signals = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


_renameat2 = _libc_renameat2()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, or FileExistsError if `dst` exists (a plain rename would replace
    an empty folder or any file there). Atomic where the kernel and file system support it."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def make_folder(folder: Path) -> None:
    """mkdir -p, with ENOTDIR naming the file in the way (mkdir says only "File exists")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(blocker)) from None


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.staging."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_staging(out: Path) -> None:
    """Delete staging folders beside `out` left by dead processes of this host. One killed in
    the middle of a forced swap still holds the old output (`old`): it is put back if `out` is
    missing."""
    pattern = re.compile(re.escape(_staging_prefix(out)) + re.escape(_HOST) + r"\.(\d+)\.")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if not match or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        old = entry / "old"
        if os.path.lexists(old) and not os.path.lexists(out):
            with contextlib.suppress(OSError):
                rename_noreplace(old, out)
        shutil.rmtree(entry, ignore_errors=True)


def refuse_overlap(source: Path, out: Path) -> None:
    """ValueError when writing `out` would delete `source`: the same path, or a folder holding it."""
    source, target = Path(source).resolve(), Path(out).resolve()
    if target == source or target in source.parents:
        raise ValueError(
            f"the output {out} {'is' if target == source else 'contains'} the source {source}; "
            "choose an output folder outside the source."
        )


class StagedOutput:
    """A folder or file written at `staging.path` and moved to `out` by `commit`.

    Made at construction, so an output location that cannot be written is found before any
    work. Use as a context manager: leaving it without `commit` (an error, Ctrl-C, SIGTERM
    under `terminate_raises`) deletes the staging folder.
    """

    def __init__(self, out: str | Path, *, force: bool = False, what: str = "output"):
        self.out, self.force, self.what = Path(out), force, what
        if os.path.lexists(self.out) and not force:
            raise FileExistsError(f"{self.out} already exists; pass --force to replace it, or choose another {what}.")
        make_folder(self.out.parent)
        remove_stale_staging(self.out)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(self.out)}{_HOST}.{os.getpid()}.", dir=self.out.parent))
        self.path = self.dir / "new"

    def __enter__(self) -> "StagedOutput":
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def commit(self) -> Path:
        """Move the staged output into place (replacing an existing one only with force)."""
        aside = self.dir / "old"
        with _signals_deferred():
            if self.force and os.path.lexists(self.out):
                os.rename(self.out, aside)  # a symlink moves as a link; the folder it names stays
            try:
                rename_noreplace(self.path, self.out)
            except FileExistsError:
                kept = self._put_back(aside)
                raise FileExistsError(
                    f"{self.out} appeared while this {self.what} was being written (another run?); it was left "
                    f"alone and nothing was written{kept}. Pass --force to replace it, or choose another location."
                ) from None
            except BaseException:
                self._put_back(aside)
                raise
        if os.path.lexists(aside):
            _remove(aside)
        return self.out

    def _put_back(self, aside: Path) -> str:
        """Return a moved-aside old output to its place, or, if its place is taken, beside it."""
        if not os.path.lexists(aside):
            return ""
        try:
            rename_noreplace(aside, self.out)
            return ""
        except OSError:
            keep = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.rename(aside, keep)
            return f" (the previous one is kept at {keep})"


def write_text_atomically(path: Path, text: str) -> None:
    """Write beside `path`, then rename over it: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
