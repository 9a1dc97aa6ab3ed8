"""Following a file the trainer appends to, replaces and truncates."""

import os

from trinity_train.dashboard.tail import FileTail


def read(tail: FileTail) -> tuple[bool, bytes]:
    poll = tail.poll()
    return poll.reset, b"".join(poll.chunks)


def test_a_partial_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = FileTail(path)
    assert read(tail) == (False, b"")  # not there yet
    path.write_bytes(b'{"a": 1}\n{"a": ')
    assert read(tail) == (False, b'{"a": 1}\n')
    assert read(tail) == (False, b"")
    with open(path, "ab") as f:
        f.write(b'2}\n')
    assert read(tail) == (False, b'{"a": 2}\n')


def test_replaced_truncated_rewritten_and_deleted_files_reset(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"one\ntwo\n")
    tail = FileTail(path)
    assert read(tail) == (False, b"one\ntwo\n")
    new = tmp_path / "new"
    new.write_bytes(b"uno\n")
    os.replace(new, path)  # a new inode
    assert read(tail) == (True, b"uno\n")
    with open(path, "r+b") as f:
        f.truncate(0)
    assert read(tail) == (True, b"")
    path.write_bytes(b"one\n")
    assert read(tail) == (False, b"one\n")
    with open(path, "r+b") as f:  # same inode, same size, other bytes
        f.write(b"ONE\nmore\n")
    assert read(tail) == (True, b"ONE\nmore\n")
    path.unlink()
    assert read(tail) == (True, b"")
    assert read(tail) == (False, b"")


def test_chunks_end_at_newlines_and_a_long_line_is_read_whole(tmp_path):
    path = tmp_path / "m.jsonl"
    long_line = b"x" * 5000 + b"\n"
    path.write_bytes(b"a\n" * 100 + long_line + b"b\n")
    tail = FileTail(path, chunk_bytes=64)
    chunks = list(tail.poll().chunks)
    assert all(c.endswith(b"\n") for c in chunks) and len(chunks) > 3
    assert b"".join(chunks) == path.read_bytes() and tail.offset == path.stat().st_size
