"""Which failures of a CLI command the user can fix, and the one line that says so.

Kept apart from `dflash_jax.cli` so that the subcommand modules can use it too (they
import nothing from the top-level parser).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import tempfile
import time


def user_error_message(err: BaseException) -> str | None:
    """One line for a failure the user can act on, or None for one that is a bug.

    A corrupt orbax checkpoint surfaces as whatever orbax or tensorstore raise (a plain
    Exception, a ValueError with the tensorstore spec, a JSON error from its metadata), so
    those are recognised by where they come from before the generic classes."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
        return _os_error_message(err)
    if from_checkpoint_reader(err):
        return (f"a checkpoint could not be read or written ({_checkpoint_detail(err)}); when reading, it is "
                "corrupt or incomplete: convert or write it again.")
    if isinstance(err, json.JSONDecodeError):
        return f"a JSON file is not valid JSON ({err}); fix or recreate it."
    if isinstance(err, OSError):
        return _os_error_message(err)
    if isinstance(err, (ValueError, ImportError)):  # ConfigError and ConversionError are ValueErrors
        return first_line(str(err))
    return None


_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _os_error_message(err: OSError) -> str:
    if err.errno is None or err.strerror is None:  # raised by this project, with its own sentence
        return first_line(str(err))
    where = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    advice = {
        errno.EACCES: "check its permissions or choose another location",
        errno.EPERM: "check its permissions or choose another location",
        errno.EROFS: "the file system is read-only; choose another location",
        errno.ENOSPC: "free some disk space or choose another location",
        errno.EDQUOT: "free some disk space or choose another location",
        errno.ENOENT: "check the path",
        errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
        errno.EISDIR: "it is a folder where a file is expected; check the path",
        errno.EEXIST: "remove it or choose another location",
    }.get(err.errno, "check the path and the file system")
    return f"{err.strerror}: {where}; {advice}."


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def from_checkpoint_reader(err: BaseException) -> bool:
    for link in _chain(err):
        module = type(link).__module__ or ""
        text = str(link)
        if module.startswith(("orbax", "tensorstore")) or "tensorstore" in text.lower() or "OCDBT" in text:
            return True
        tb = link.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if f"{os.sep}orbax{os.sep}" in filename or f"{os.sep}tensorstore{os.sep}" in filename:
                return True
            tb = tb.tb_next
    return False


def _checkpoint_detail(err: BaseException) -> str:
    """The innermost message of the chain, without tensorstore's spec dump."""
    innermost = list(_chain(err))[-1]
    text = first_line(str(innermost))
    text = re.split(r"\s*\[tensorstore_spec=|\s*See full TensorStore details", text)[0]
    return text if len(text) <= 300 else text[:297] + "..."


def silence_stderr() -> None:
    """After a failed checkpoint read, tensorstore's reads still in flight end later on their
    own threads and print tracebacks about orbax's closed event loop; the process is about to
    exit with its one line said, so the rest of stderr goes nowhere. Only for the program
    itself (argv taken from sys.argv), never for a caller of `main`."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stderr.fileno())
    os.close(devnull)


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "no message"


@contextlib.contextmanager
def quiet_checkpoint_reads():
    """Around loading a model: stderr (fd 2) is held in a file and replayed afterwards, unless
    the load failed on a corrupt checkpoint. Then orbax's reads still in flight print
    tracebacks about its closed event loop from their own threads, dozens of lines that say
    nothing the one-line error does not; they are dropped, after a moment for them to end."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        except Exception as err:
            failed = from_checkpoint_reader(err)
            if failed:
                time.sleep(0.5)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                capture.seek(0)
                held = capture.read()
                if held:
                    os.write(2, held)
