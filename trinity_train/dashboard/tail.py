"""Follow a JSON-lines file that another process appends to, rewrites or truncates.

`FileTail.poll()` hands out the complete lines written since the last poll, in chunks of at most
about `chunk_bytes` (so a 700 MB file is parsed without holding it in memory twice). A line
without its newline yet is left for the next poll. When the file was replaced (a new inode: the
trainer rewrites metrics.jsonl by renaming a new file over it on a resume), truncated (smaller
than what was read), rewritten in place (its first bytes changed) or deleted, the poll says
`reset` and reading starts again from the first byte: what was read before no longer describes
the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HEAD_BYTES = 256  # compared on every poll to notice a file rewritten in place


@dataclass
class Poll:
    reset: bool               # what was read before is void; start over with `chunks`
    chunks: Iterator[bytes]   # complete lines (each chunk ends with b"\n")


class FileTail:
    def __init__(self, path: str | Path, chunk_bytes: int = 64 << 20):
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file being read
        self._offset = 0                               # bytes of complete lines handed out
        self._head = b""                               # the file's first bytes, as read

    @property
    def offset(self) -> int:
        return self._offset

    def start_at(self, offset: int, identity: tuple[int, int]) -> bool:
        """Take the file's lines before `offset` as read already (they came from elsewhere, e.g.
        the columnar mirror), if the file is still the one with `identity`; returns whether it is."""
        try:
            with open(self.path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != identity or st.st_size < offset:
                    return False
                self._identity, self._offset = identity, offset
                self._head = os.pread(f.fileno(), min(HEAD_BYTES, offset), 0)
                return True
        except FileNotFoundError:
            return False

    def poll(self) -> Poll:
        """What changed since the last poll. The file is opened here and read through the same
        descriptor, so a replacement between the check and the read cannot mix two files."""
        try:
            f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            reset = self._identity is not None
            self._forget()
            return Poll(reset, iter(()))
        st = os.fstat(f.fileno())
        identity = (st.st_dev, st.st_ino)
        reset = self._identity is not None and (
            identity != self._identity or st.st_size < self._offset or not self._same_head(f))
        if reset:
            self._forget()
        self._identity = identity
        return Poll(reset, self._read(f, st.st_size))

    def _same_head(self, f) -> bool:
        return os.pread(f.fileno(), len(self._head), 0) == self._head

    def _forget(self) -> None:
        self._identity, self._offset, self._head = None, 0, b""

    def _read(self, f, size: int) -> Iterator[bytes]:
        with f:
            while self._offset < size:
                want = min(self.chunk_bytes, size - self._offset)
                data = os.pread(f.fileno(), want, self._offset)
                end = data.rfind(b"\n") + 1
                while end == 0 and len(data) == want and self._offset + len(data) < size:
                    # one line longer than a chunk: read on until its newline
                    more = os.pread(f.fileno(), self.chunk_bytes, self._offset + len(data))
                    if not more:
                        break
                    data += more
                    want = len(data)
                    end = data.rfind(b"\n") + 1
                if end == 0:
                    return  # only a partial line is left: wait for its newline
                if self._offset < HEAD_BYTES:
                    self._head = (self._head + data[:end])[:HEAD_BYTES]
                self._offset += end
                yield data[:end]
