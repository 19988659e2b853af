"""Following files the way `tail -F` does, with offsets a crash cannot lose.

A file is known by its identity (device:inode) and a fingerprint (a hash of its first bytes), not
by its name, so:
- rotation by rename: the open file is read to its end under whatever name it now has, then the
  new file at the path is read from 0;
- rotation by copytruncate (same inode, content restarts): the lines between our offset and the
  truncation are read from the copy (a file in the same folder with the same fingerprint), then
  the truncated file from 0;
- a file deleted while tailed is read to its end through the open handle;
- a partial last line waits for its newline (in `once` mode it is taken as it is);
- a line longer than `max_line` is handed over as too long, never held in memory whole.
Offsets advance only in memory here; `Tailer.checkpoints()` gives the rows the caller saves in
the same transaction as the data read, and `Tailer(…, saved)` resumes from them after a restart,
finding files that were rotated away meanwhile.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO, NotRequired, TypedDict

from servescope.store.validation import MAX_LINE_BYTES

FP_BYTES = 1024
CHUNK_BYTES = 16 * 1024 * 1024
MAX_LINE = MAX_LINE_BYTES  # the store's bound on a line (store.validation): longer ones are skipped


class FileGen(TypedDict):
    """A file's checkpoint state: when this generation of it was first seen."""

    gen: str


class CheckpointRow(TypedDict):
    """A tailed file's checkpoint row (`store.checkpoints`): where it is, how far it was read,
    the fingerprint of what was read (its first `fp_len` bytes), its generation."""

    file_key: str
    path: str
    offset: int
    fp_len: int
    fp: str
    state: NotRequired[FileGen | None]


def _gen(row: CheckpointRow) -> str | None:
    """The generation a checkpoint row saw (none in a row an older collector wrote)."""
    state = row.get("state")
    return state["gen"] if state else None


@dataclass
class FileState:
    key: str  # "device:inode"
    path: str
    offset: int = 0
    fp_len: int = 0
    fp: str = ""
    gen: str = ""  # when this generation of the file was first seen: part of its error source
    fh: BinaryIO | None = None
    detached: bool = False  # no longer at its path (rotated or deleted): read to the end, close

    @property
    def error_source(self) -> str:
        return f"{self.path}#{self.key}@{self.gen}"

    def row(self) -> CheckpointRow:
        return {
            "file_key": self.key,
            "path": self.path,
            "offset": self.offset,
            "fp_len": self.fp_len,
            "fp": self.fp,
            "state": {"gen": self.gen},
        }


@dataclass
class Chunk:
    """Complete lines of one file from byte `start`, or one line too long to keep (`too_long`
    is its length; `data` then holds only its head)."""

    file: FileState
    start: int
    data: bytes
    too_long: int = 0
    year: int = field(default_factory=lambda: datetime.now(UTC).year)


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def _fingerprint(fh: BinaryIO, length: int) -> str:
    fh.seek(0)
    return hashlib.sha1(fh.read(length)).hexdigest() if length else ""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%f")


class Tailer:
    """Every file matched by one pattern (a path or a glob) of one source."""

    def __init__(
        self,
        pattern: str,
        saved: Sequence[CheckpointRow] | None = None,
        *,
        once: bool = False,
        max_line: int = MAX_LINE,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.pattern = pattern
        self.once = once
        self.max_line = max_line
        self.chunk_bytes = chunk_bytes
        self.files: dict[str, FileState] = {}  # open files by key
        self.saved: dict[str, CheckpointRow] = {row["file_key"]: row for row in saved or []}
        self._dirty: dict[str, FileState] = {}
        self._recover_rotated()

    # -- discovery -----------------------------------------------------------------------------

    def _paths(self) -> list[str]:
        if glob.has_magic(self.pattern):
            return sorted(p for p in glob.glob(self.pattern) if os.path.isfile(p))
        return [self.pattern] if os.path.isfile(self.pattern) else []

    def _folder(self) -> Path:
        return Path(self.pattern).parent

    def _recover_rotated(self) -> None:
        """After a restart: finish files saved as read up to an offset that now live elsewhere
        (renamed by rotation, or the copy left by copytruncate), and read from 0 what a known
        file got after a copytruncate while no collector ran (then maybe rotated away too)."""
        current = set()
        for path in self._paths():
            try:
                current.add(_key(os.stat(path)))
            except OSError:
                continue
        rotated = self._rotated_names()
        for key, row in list(self.saved.items()):
            if key in current:
                continue  # at its path: `_discover` resumes it, or finds its copy and restarts
            moved = rotated.get(key)
            if moved is not None and self._matches(self._open_path(moved), row):
                fh = self._open_path(moved)
                if fh is not None:
                    state = FileState(key, moved, row["offset"], row["fp_len"], row["fp"], fh=fh)
                    state.gen = _gen(row) or _now()
                    self._adopt(state, detached=True)
                continue
            found = self._find_copy(row, exclude={key})
            if found is not None:
                self._adopt(found, detached=True)
            if moved is not None:  # same inode, other content: written after a truncation
                fh = self._open_path(moved)
                if fh is not None:
                    self._adopt(FileState(key, moved, fh=fh, gen=_now()), detached=True)

    def _rotated_names(self) -> dict[str, str]:
        """key -> path of the files in the folder named like the pattern plus a suffix
        (`events.jsonl.1`, `vllm.log-20261122`): where rotation puts a tailed file."""
        base = Path(self.pattern).name
        found: dict[str, str] = {}
        try:
            names = sorted(os.listdir(self._folder() or "."))
        except OSError:
            return found
        for name in names:
            if fnmatch.fnmatch(name, base + "*"):
                path = str(self._folder() / name)
                try:
                    found.setdefault(_key(os.stat(path)), path)
                except OSError:
                    continue
        return found

    def _open_path(self, path: str) -> BinaryIO | None:
        try:
            return open(path, "rb")  # noqa: SIM115 - kept open while tailed
        except OSError:
            return None

    @staticmethod
    def _matches(fh: BinaryIO | None, row: CheckpointRow) -> bool:
        if fh is None:
            return False
        try:
            size = os.fstat(fh.fileno()).st_size
            return size >= row["fp_len"] and _fingerprint(fh, row["fp_len"]) == (row["fp"] or "")
        finally:
            fh.close()

    def _find_copy(self, row: CheckpointRow, exclude: set[str]) -> FileState | None:
        """The file in the folder holding the content `row` was read from, beyond its offset
        (none when nothing was read: an empty fingerprint matches any file)."""
        if not row["offset"] or not row["fp_len"]:
            return None
        try:
            names = sorted(os.listdir(self._folder() or "."))
        except OSError:
            return None
        for name in names:
            path = str(self._folder() / name)
            try:
                fh = open(path, "rb")  # noqa: SIM115
            except OSError:
                continue
            st = os.fstat(fh.fileno())
            key = _key(st)
            ok = (
                key not in exclude
                and key not in self.files
                and st.st_size >= row["offset"]
                and st.st_size >= row["fp_len"]
                and _fingerprint(fh, row["fp_len"]) == (row["fp"] or "")
            )
            if not ok:
                fh.close()
                continue
            own = self.saved.get(key)
            state = FileState(key, path, fh=fh)
            if own is not None:
                state.offset, state.fp_len, state.fp = own["offset"], own["fp_len"], own["fp"]
                state.gen = _gen(own) or _now()
            else:
                state.offset, state.fp_len, state.fp = row["offset"], row["fp_len"], row["fp"]
                state.gen = _gen(row) or _now()
            return state
        return None

    def _adopt(self, state: FileState, *, detached: bool) -> None:
        state.detached = detached
        self.files[state.key] = state
        self._dirty[state.key] = state

    def _discover(self) -> None:
        for path in self._paths():
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = _key(st)
            if key in self.files:
                continue
            fh = self._open_path(path)
            if fh is None:
                continue
            if _key(os.fstat(fh.fileno())) != key:  # replaced between stat and open
                fh.close()
                continue
            state = FileState(key, path, fh=fh, gen=_now())
            row = self.saved.get(key)
            if row is not None:
                size = os.fstat(fh.fileno()).st_size
                if size >= row["offset"] and _fingerprint(fh, row["fp_len"]) == (row["fp"] or ""):
                    state.offset, state.fp_len, state.fp = row["offset"], row["fp_len"], row["fp"]
                    state.gen = _gen(row) or state.gen
                else:
                    self._recover_copy(row)  # truncated or replaced while we were away
            self._adopt(state, detached=False)

    def _recover_copy(self, row: CheckpointRow) -> None:
        copy = self._find_copy(row, exclude={row["file_key"]})
        if copy is not None:
            self._adopt(copy, detached=True)

    # -- watching ------------------------------------------------------------------------------

    def _check(self, state: FileState) -> None:
        """Notice rotation, deletion and truncation of an open file."""
        if state.detached or state.fh is None:
            return
        try:
            at_path = _key(os.stat(state.path))
        except OSError:
            at_path = None
        if at_path != state.key:
            state.detached = True  # renamed or deleted: what is left is read through the handle
            return
        size = os.fstat(state.fh.fileno()).st_size
        same = size >= state.fp_len and _fingerprint(state.fh, state.fp_len) == state.fp
        if size < state.offset or not same:
            old = state.row()
            old["offset"] = state.offset
            self._recover_copy({**old, "file_key": state.key})
            state.offset, state.fp_len, state.fp, state.gen = 0, 0, "", _now()
            self._dirty[state.key] = state

    def _grow_fingerprint(self, state: FileState) -> None:
        if state.fp_len >= FP_BYTES or state.fh is None:
            return
        length = min(FP_BYTES, state.offset)
        if length > state.fp_len:
            state.fp_len, state.fp = length, _fingerprint(state.fh, length)

    def poll(self) -> list[Chunk]:
        """Read what is new: at most `chunk_bytes` per file (call again while it returns data)."""
        self._discover()
        chunks = []
        for state in list(self.files.values()):
            self._check(state)
            chunk = self._read(state)
            if chunk is not None:
                chunks.append(chunk)
                self._grow_fingerprint(state)
                self._dirty[state.key] = state
            elif state.detached:
                self._close(state)
        return chunks

    def _close(self, state: FileState) -> None:
        self.saved[state.key] = state.row()
        if state.fh is not None:
            state.fh.close()
            state.fh = None
        self.files.pop(state.key, None)

    def close(self) -> None:
        for state in list(self.files.values()):
            self._close(state)

    def _read(self, state: FileState) -> Chunk | None:
        assert state.fh is not None
        fh = state.fh
        fh.seek(state.offset)
        data = fh.read(self.chunk_bytes)
        if not data:
            return None
        year = datetime.fromtimestamp(os.fstat(fh.fileno()).st_mtime, UTC).year
        cut = data.rfind(b"\n") + 1
        final = self.once or state.detached
        if cut == 0:
            if len(data) > self.max_line:
                return self._too_long(state, year)
            if not final or len(data) == self.chunk_bytes:
                return None  # a partial line: wait for its newline
            cut = len(data)
        data = data[:cut]
        long_at = self._long_line(data)
        if long_at == 0:
            return self._too_long(state, year)
        if long_at is not None:
            data = data[:long_at]
        chunk = Chunk(state, state.offset, data, year=year)
        state.offset += len(data)
        return chunk

    def _long_line(self, data: bytes) -> int | None:
        """Where the first line longer than `max_line` starts in `data`, if any."""
        if len(data) <= self.max_line:
            return None
        half = self.max_line // 2
        if all(data.find(b"\n", i, i + half) >= 0 for i in range(0, len(data) - half, half)):
            return None
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            end = len(data) if end < 0 else end
            if end - pos > self.max_line:
                return pos
            pos = end + 1
        return None

    def _too_long(self, state: FileState, year: int) -> Chunk | None:
        """Skip one over-long line through its newline, keeping its head for the error."""
        assert state.fh is not None
        fh = state.fh
        fh.seek(state.offset)
        head = fh.read(64 * 1024)
        newline = head.find(b"\n")
        length = newline + 1 if newline >= 0 else len(head)
        while newline < 0:
            block = fh.read(1024 * 1024)
            if not block:
                if not (self.once or state.detached):
                    return None  # its end is not written yet
                break
            newline = block.find(b"\n")
            length += newline + 1 if newline >= 0 else len(block)
        chunk = Chunk(state, state.offset, head[:length], too_long=length, year=year)
        state.offset += length
        return chunk

    def checkpoints(self) -> list[CheckpointRow]:
        """Checkpoint rows of the files read since the last call (saved with their data)."""
        rows = [state.row() for state in self._dirty.values()]
        for row in rows:
            self.saved[row["file_key"]] = row
        self._dirty.clear()
        return rows

    def lag_bytes(self) -> int:
        """Bytes written to the tailed files and not read yet."""
        total = 0
        for state in self.files.values():
            if state.fh is not None:
                total += max(0, os.fstat(state.fh.fileno()).st_size - state.offset)
        return total
