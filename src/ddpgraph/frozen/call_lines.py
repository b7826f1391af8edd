"""The user's line of each torch call a watched step makes, read from the live frames.

A Python branch shows as two calls that ran different operations at one place in their
sequences; the useful line is the branch's own, which one of the two calls ran. The
calls are compared only after both ran, so every watched call keeps the line of each of
its operations. Reading a whole stack (`traceback.extract_stack`) for each would cost
tens of microseconds an operation; walking the frames to the first one of the user's,
each file's kind looked up once, costs about one.
"""

from __future__ import annotations

import linecache
from types import FrameType

from ..findings import Location
from ..probe.code_origin import is_installed_library, is_platform

CallLine = tuple[str, int, int]  # (file, first line of its function, line)
_PLATFORM, _LIBRARY, _USER = 0, 1, 2
_kinds: dict[str, int] = {}


def _kind(filename: str) -> int:
    kind = _kinds.get(filename)
    if kind is None:
        if filename.startswith("<") or is_platform(filename):
            kind = _PLATFORM
        else:
            kind = _LIBRARY if is_installed_library(filename) else _USER
        _kinds[filename] = kind
    return kind


def call_line(frame: FrameType | None) -> CallLine | None:
    """The innermost frame of the user's code from `frame` outwards, or the innermost
    library frame when none is the user's (as `probe.code_origin.user_frame` chooses)."""
    library = None
    while frame is not None:
        code = frame.f_code
        kind = _kind(code.co_filename)
        if kind == _USER:
            return code.co_filename, code.co_firstlineno, frame.f_lineno
        if kind == _LIBRARY and library is None:
            library = (code.co_filename, code.co_firstlineno, frame.f_lineno)
        frame = frame.f_back
    return library


def line_location(line: CallLine | None) -> Location | None:
    """`line` as a finding's location, with its source text."""
    if line is None:
        return None
    file, _, lineno = line
    return Location(file, lineno, linecache.getline(file, lineno).strip())
