"""Whose code a stack frame runs: the user's, an installed library's, or the platform's.

Decided from the file's location only, never from names: files of torch, of ddpgraph
and of the standard library are the platform (never the place to fix anything); files
under an installation folder (`site-packages`, `dist-packages`) are libraries, which
the user does not edit; everything else is the user's own code. A host synchronisation
inside a library is then reported as a chain, the user's line first, then the library's
frame and the operation that waited, with a fix that needs no edit of the library.

The user's frame in a stack (`user_frame`) and its line (`location_of`) live here too.
Nothing here imports torch (its folder comes from its import spec), so the `ddpgraph
doctor` command's launching process can name the line a stuck rank waits at without it.
"""

from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from ..findings import Location


def _torch_dir() -> str:
    """torch's folder, found without importing torch (the `ddpgraph` command's launching
    process reads stacks, and never imports it); "" where torch cannot be found."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return ""
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else ""


TORCH_DIR = _torch_dir()
# The package root: this module lives one folder below it.
_OWN_DIR = os.path.dirname(os.path.dirname(__file__))
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")})
_INSTALL_FOLDERS = ("site-packages", "dist-packages")
SITE_DIRS = tuple(
    {os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    | {os.path.abspath(p) for p in sys.path if p.endswith(_INSTALL_FOLDERS)}
)


def under(path: str, dirs: Sequence[str]) -> bool:
    """`path` is one of `dirs` or inside one ("" stands for no folder, and holds nothing)."""
    return any(d and (path == d or path.startswith(d + os.sep)) for d in dirs)


def is_installed_library(path: str) -> bool:
    """A file of an installed package (not torch or ddpgraph): under a site folder, or
    under any folder named like one (a virtual environment's, a vendored copy's)."""
    path = os.path.abspath(path)
    if under(path, (TORCH_DIR, _OWN_DIR)):
        return False
    if under(path, SITE_DIRS):
        return True
    return any(part in _INSTALL_FOLDERS for part in path.split(os.sep))


def is_platform(path: str) -> bool:
    """torch, ddpgraph itself, or the standard library (not third-party packages)."""
    path = os.path.abspath(path)
    if under(path, (TORCH_DIR, _OWN_DIR)):
        return True
    return under(path, _STDLIB_DIRS) and not is_installed_library(path)


@functools.lru_cache(maxsize=4096)
def is_user_file(path: str) -> bool:
    """The user's own code: neither the platform nor an installed library, nor code
    without a file (`<string>`, `<stdin>`)."""
    return not path.startswith("<") and not (is_platform(path) or is_installed_library(path))


def package_of(path: str) -> str:
    """The top-level package of an installed library's file (`transformers` for
    `.../site-packages/transformers/models/llama/modeling_llama.py`)."""
    parts = os.path.abspath(path).split(os.sep)
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] in _INSTALL_FOLDERS and index + 1 < len(parts):
            return os.path.splitext(parts[index + 1])[0]
    for site in SITE_DIRS:
        if under(os.path.abspath(path), (site,)):
            return os.path.relpath(path, site).split(os.sep)[0].removesuffix(".py")
    return os.path.basename(os.path.dirname(path)) or path


def library_relative(path: str) -> str:
    """The path from the package's folder on (`transformers/models/llama/modeling_llama.py`)."""
    parts = os.path.abspath(path).split(os.sep)
    package = package_of(path)
    for index in range(len(parts) - 1, -1, -1):
        if os.path.splitext(parts[index])[0] == package:
            return "/".join(parts[index:])
    return path


@dataclass(frozen=True)
class LibraryCall:
    """Where the user's code called into a library, and the library's line that waited."""

    package: str
    frame: traceback.FrameSummary  # the innermost frame of the library

    @property
    def source(self) -> str:
        if self.frame.lineno is None:
            return ""
        return (
            self.frame.line or linecache.getline(self.frame.filename, self.frame.lineno)
        ).strip()

    def describe(self) -> str:
        where = (
            f"{library_relative(self.frame.filename)}:{self.frame.lineno}, in `{self.frame.name}`"
        )
        return f"`{self.source}` ({where})" if self.source else f"{where}"


def library_call(
    stack: Sequence[traceback.FrameSummary], user: traceback.FrameSummary | None
) -> LibraryCall | None:
    """The innermost library frame called (directly or not) from the user's frame `user`."""
    frames = list(stack)
    start = next((i for i, f in enumerate(frames) if f is user), -1) + 1 if user is not None else 0
    inner = [
        f
        for f in frames[start:]
        if not f.filename.startswith("<") and is_installed_library(f.filename)
    ]
    if not inner:
        return None
    return LibraryCall(package_of(inner[-1].filename), inner[-1])


def code_frames(stack: Sequence[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames of the user's code or of a library: neither torch, ddpgraph, the
    standard library nor generated code (`<...>`)."""
    return [f for f in stack if not f.filename.startswith("<") and not is_platform(f.filename)]


def user_frame(stack: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code.

    Frames in torch, ddpgraph, the standard library and generated code (`<...>`) never
    count; third-party packages count only when no frame outside them does, so a
    script that calls into a training library is pointed at its own line.
    """
    candidates = code_frames(stack)
    for frame in reversed(candidates):
        if not is_installed_library(frame.filename):
            return frame
    return candidates[-1] if candidates else None


def location_of(frame: traceback.FrameSummary | None) -> Location | None:
    if frame is None or frame.lineno is None:
        return None
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return Location(frame.filename, frame.lineno, source)
