"""Reading a checkpoint archive that another node (or anyone) supplied.

The archive is data from outside: it is read in one pass, in bounded chunks,
by a tar reader that understands only what a podman checkpoint holds -
regular files and directories, with POSIX (pax) or GNU long names - and
refuses everything else before acting on it:

- sparse members (old GNU, or pax `GNU.sparse.*`), symlinks, devices, FIFOs,
  global pax headers, and any type it does not know;
- hard links, but one under `checkpoint/cudahook-gpu/` (GPU-memory chunks
  the checkpoint stored once, `gpu_storage_dedupe`) to an earlier regular
  file of that subtree: no link to a link, a directory, a later member or
  anything outside it. The copy carries it as a link to that canonical name
  (the extractor makes a link between two names of its own tree), and the
  link's name is hashed as its target was;
- names that are absolute or climb out (`..`), or that name the same member
  twice once normalised (`./x`, `a//b` and `a/./b` are `x`, `a/b`);
- more unpacked bytes than the cap (`migrate_max_unpacked_bytes`): each
  member's declared size is checked before its data is read, and the bytes
  inflated are counted as they come (a gzip bomb stops at the cap);
- with a copy: more than the free space where the copy goes, checked before
  each member is written;
- a read past its deadline.

The same pass hashes the raw bytes (the archive's sha256, for its sidecar
and signature), checks the gzip stream's CRC and length at its end, keeps
the few small members cudahook reads, and can write an uncompressed copy
whose headers cudahook wrote itself (normalised names, no extra records).
Without a copy to read them back from (a dry run), it also takes what the
driver helper's rule needs of each file under `checkpoint/cudahook-gpu/`
(GPU-memory chunks): the blake3 of its bytes and, for one that starts as a
zstd frame, the blake3 and size of what the frame decompresses to, as a
stream, never past the largest chunk a manifest may name, nor the deadline.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from cudahook.core.manifest import STORAGE_DIR
from cudahook.platform.errors import EnvironmentProblem, UsageError, one_line

BLOCK = 512
CHUNK = 1 << 20
#: The default cap on an archive's unpacked size (documented in README and
#: config.yaml): larger checkpoints need `migrate_max_unpacked_bytes` raised.
DEFAULT_MAX_BYTES = 256 << 30
MAX_NAME = 4096
MAX_PAX = 1 << 20
MAX_MEMBERS = 1_000_000
#: After the end-of-archive blocks: tar's padding to its record size (10 KiB
#: for GNU tar), not more.
MAX_TRAILING = 1 << 20
#: Room kept free beside the copy (the spec files written last, the log).
RESERVE = 64 << 20
#: Members read into memory must be small (a container spec, a manifest).
SMALL_LIMIT = 64 << 20
#: cudahook's own files in the image (hashed as they stream, for the
#: manifest's checksums): small, never CRIU's `*.img`.
HASHED_LIMIT = 1 << 30
GZIP_MAGIC = b"\x1f\x8b"


class ArchiveRefused(UsageError):
    """The archive is not one cudahook reads: bad input, nothing kept. Its
    message is one escaped line (it names what the archive holds)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class ReadTimedOut(ArchiveRefused):
    """The archive was not read within its deadline."""


def show(text: str) -> str:
    """A name from an archive (or a manifest), quoted and escaped for one
    line: no control character reaches the terminal."""
    return one_line(repr(text), 300)


def canonical(raw: str, archive: str) -> str | None:
    """`raw` as a member name every decision uses: no `.`, no empty parts.
    None for the archive's root (`./`)."""
    if any(not c.isprintable() for c in raw):
        raise ArchiveRefused(f"{archive}: member name {show(raw)} holds control characters")
    if raw.startswith("/"):
        raise ArchiveRefused(f"{archive}: member {show(raw)} has an absolute name")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveRefused(f"{archive}: member {show(raw)} leaves the archive (..)")
    return "/".join(parts) or None


#: The one subtree whose members may be hard links (to an earlier file of
#: it): GPU memory in storage, deduplicated chunk by chunk.
LINKED_TREE = "checkpoint/" + STORAGE_DIR + "/"


class Member:
    __slots__ = ("gid", "gname", "linkname", "mode", "mtime", "name", "size", "type", "uid",
                 "uname", "xattrs")

    def __init__(self) -> None:
        self.name = ""
        self.linkname = ""  # a hard link's target (canonical once scan keeps it)
        self.type = tarfile.REGTYPE
        self.size = self.mode = self.uid = self.gid = 0
        self.mtime = 0.0
        self.uname = self.gname = ""
        self.xattrs: dict[str, str] = {}

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE

    def islink(self) -> bool:
        return self.type == tarfile.LNKTYPE

    def header(self) -> bytes:
        """This member's header in the copy: written here, from what was checked."""
        info = tarfile.TarInfo(self.name)
        info.type, info.size, info.mode = self.type, self.size, self.mode
        info.linkname = self.linkname
        info.uid, info.gid, info.mtime = self.uid, self.gid, self.mtime
        info.uname, info.gname = self.uname, self.gname
        info.pax_headers = dict(self.xattrs)
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _number(field: bytes, what: str, archive: str) -> int:
    if field[:1] and field[0] & 0x80:
        if field[0] == 0xFF:
            raise ArchiveRefused(f"{archive}: negative {what} in a tar header")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if any(c not in b"01234567" for c in text):
        raise ArchiveRefused(f"{archive}: not a complete checkpoint archive (bad tar {what})")
    return int(text, 8)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, archive: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 20)
        if space < 0 or not data[pos:space].isdigit():
            raise ArchiveRefused(f"{archive}: malformed pax header")
        length = int(data[pos:space])
        record = data[space + 1:pos + length]
        if length <= space - pos or pos + length > len(data) or not record.endswith(b"\n") \
                or b"=" not in record:
            raise ArchiveRefused(f"{archive}: malformed pax header")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


class Stream:
    """The archive's bytes, uncompressed, in chunks of at most CHUNK: the raw
    bytes hashed, the inflated ones counted against the cap, the deadline
    checked between chunks."""

    def __init__(self, fd: int, archive: str, max_bytes: int, deadline: float,
                 timeout_s: float):
        self.fd, self.archive = fd, archive
        self.max_bytes, self.deadline, self.timeout_s = max_bytes, deadline, timeout_s
        self.sha256 = hashlib.sha256()
        self.raw = 0  # bytes read from the file
        self.out = 0  # bytes handed out, uncompressed
        self.buf = b""
        self.off = 0
        self.pending = b""
        first = self._read_raw()
        self.gz: zlib._Decompress | None = None
        if first[:2] == GZIP_MAGIC:
            self.gz = zlib.decompressobj(16 + zlib.MAX_WBITS)
            self.pending = first
        else:
            self.buf = first

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ReadTimedOut(f"{self.archive}: not read within {self.timeout_s:g}s")

    def _read_raw(self) -> bytes:
        self.in_time()
        data = os.read(self.fd, CHUNK)
        self.raw += len(data)
        self.sha256.update(data)
        return data

    def _inflate(self) -> bytes:
        """The next uncompressed piece, b"" at the end of the file."""
        if self.gz is None:
            return self._read_raw()
        try:
            while True:
                gz = self.gz
                # The end of a member first: an ended stream takes no more
                # input (its decompress gives b"" for ever), so what follows
                # it - the next member - must go to a fresh one.
                if gz.eof:
                    rest = gz.unused_data + gz.unconsumed_tail + self.pending
                    self.pending = b""
                    rest = rest or self._read_raw()
                    if not rest:
                        return b""
                    if rest[:2] != GZIP_MAGIC:
                        raise ArchiveRefused(f"{self.archive}: data after the gzip stream")
                    # Concatenated gzip members read as one stream (pigz, cat).
                    self.gz = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    out = self.gz.decompress(rest, CHUNK)
                elif gz.unconsumed_tail:
                    out = gz.decompress(gz.unconsumed_tail, CHUNK)
                else:
                    raw, self.pending = self.pending or self._read_raw(), b""
                    if not raw:
                        raise ArchiveRefused(f"{self.archive}: not a complete checkpoint archive"
                                             " (the gzip stream is cut short)")
                    out = gz.decompress(raw, CHUNK)
                if out:
                    return out
                self.in_time()
        except zlib.error as exc:
            # A changed byte: deflate's own checks, or the CRC/length at the end.
            raise ArchiveRefused(f"{self.archive}: not a complete checkpoint archive "
                                 f"(gzip: {exc})") from exc

    def _fill(self) -> bool:
        data = self._inflate()
        if not data:
            return False
        self.out += len(data)
        if self.out > self.max_bytes:
            raise ArchiveRefused(f"{self.archive}: unpacks to more than {self.max_bytes} bytes "
                                 "(migrate_max_unpacked_bytes)")
        self.buf = self.buf[self.off:] + data if self.off < len(self.buf) else data
        self.off = 0
        return True

    def pieces(self, n: int) -> Iterator[bytes]:
        """The next `n` bytes, in pieces; refused if the archive ends first."""
        while n > 0:
            if self.off >= len(self.buf) and not self._fill():
                raise ArchiveRefused(f"{self.archive}: not a complete checkpoint archive "
                                     "(cut short inside a member)")
            piece = self.buf[self.off:self.off + n]
            self.off += len(piece)
            n -= len(piece)
            yield piece

    def read(self, n: int) -> bytes:
        return b"".join(self.pieces(n))

    def block(self) -> bytes | None:
        """The next 512-byte block; None at the end of the file."""
        if self.off >= len(self.buf) and not self._fill():
            return None
        return self.read(BLOCK)

    def drain(self) -> int:
        """Read to the end (the gzip CRC is checked there): the bytes left."""
        left = len(self.buf) - self.off
        self.buf, self.off = b"", 0
        while self._fill():
            left += len(self.buf)
            self.buf = b""
            if left > MAX_TRAILING:
                raise ArchiveRefused(f"{self.archive}: more than {MAX_TRAILING} bytes after the "
                                     "end of the tar archive")
        return left


class Scan:
    """What one pass over the archive found."""

    def __init__(self) -> None:
        self.small: dict[str, bytes] = {}
        self.hashed: dict[str, tuple[str, int]] = {}  # name: (sha256, size)
        #: Where a hashed member's data lies in the copy (offset, size): its
        #: bytes read back for a digest other than sha256 (a link: its target's).
        self.at: dict[str, tuple[int, int]] = {}
        self.links: dict[str, str] = {}  # hard link: its target
        #: A dry run's digests of the files under LINKED_TREE (a link: its
        #: target's); empty with a copy, or where blake3 or zstandard is missing.
        self.chunks: dict[str, ChunkDigests] = {}
        self.names: set[str] = set()
        self.sha256 = ""
        self.raw_bytes = 0
        self.unpacked_bytes = 0
        self.members = 0


def _members(stream: Stream, archive: str) -> Iterator[Member]:
    """Each member as its header says, after the checks; the caller reads
    (or skips) exactly `size` bytes of data plus padding."""
    pax: dict[str, str] = {}
    long_name: str | None = None
    count = 0
    while True:
        block = stream.block()
        if block is None:
            raise ArchiveRefused(f"{archive}: not a complete checkpoint archive "
                                 "(no end-of-archive marker)")
        if block == bytes(BLOCK):
            if pax or long_name is not None:
                raise ArchiveRefused(f"{archive}: an extended header without its member")
            return
        magic = block[257:265]
        if magic not in (b"ustar\x0000", b"ustar  \x00"):
            raise ArchiveRefused(f"{archive}: not a complete checkpoint archive (no tar header "
                                 "where one belongs)")
        want = _number(block[148:156], "checksum", archive)
        got = sum(block[:148]) + 8 * 32 + sum(block[156:])
        if want != got:
            raise ArchiveRefused(f"{archive}: not a complete checkpoint archive "
                                 "(tar header checksum)")
        count += 1
        if count > MAX_MEMBERS:
            raise ArchiveRefused(f"{archive}: more than {MAX_MEMBERS} members")
        kind = block[156:157]
        size = _number(block[124:136], "size", archive)
        if kind in (b"x", b"L"):
            limit = MAX_PAX if kind == b"x" else MAX_NAME
            if size > limit:
                raise ArchiveRefused(f"{archive}: an extended header of {size} bytes")
            data = stream.read(size)
            stream.read(-size % BLOCK)
            if kind == b"L":
                long_name = _text(data)
                continue
            records = _pax(data, archive)
            if any(k.startswith("GNU.sparse.") for k in records):
                raise ArchiveRefused(f"{archive}: sparse member (not in a checkpoint)")
            pax.update(records)
            continue
        if kind == b"S":
            raise ArchiveRefused(f"{archive}: sparse member (not in a checkpoint)")
        if kind not in (b"0", b"\0", b"5", b"1"):
            what = {b"1": "a hard link", b"2": "a symlink", b"3": "a device", b"4": "a device",
                    b"6": "a FIFO", b"g": "a global pax header", b"K": "a link"}.get(kind)
            raw = long_name or _text(block[0:100])
            raise ArchiveRefused(f"{archive}: member {show(raw)} is "
                                 f"{what or 'of type ' + show(kind.decode('latin-1'))}: "
                                 "a checkpoint holds only files and directories")
        m = Member()
        if "path" in pax:
            raw = pax["path"]
        elif long_name is not None:
            raw = long_name
        elif magic == b"ustar\x0000" and block[345]:
            raw = _text(block[345:500]) + "/" + _text(block[0:100])
        else:
            raw = _text(block[0:100])
        if len(raw) > MAX_NAME:
            raise ArchiveRefused(f"{archive}: a member name longer than {MAX_NAME}")
        if "size" in pax:
            if not pax["size"].isdigit():
                raise ArchiveRefused(f"{archive}: malformed pax size")
            size = int(pax["size"])
        name = canonical(raw, archive)
        m.type = {b"5": tarfile.DIRTYPE, b"1": tarfile.LNKTYPE}.get(kind, tarfile.REGTYPE)
        if m.isdir() and size:
            raise ArchiveRefused(f"{archive}: directory {show(raw)} with data")
        if m.islink():
            if size:
                raise ArchiveRefused(f"{archive}: hard link {show(raw)} with data")
            # Which links are kept is scan's decision (it knows the earlier members).
            target = pax.get("linkpath", _text(block[157:257]))
            if len(target) > MAX_NAME:
                raise ArchiveRefused(f"{archive}: a link target longer than {MAX_NAME}")
            if name is None or not target:
                raise ArchiveRefused(hard_link_refused(archive, raw))
            m.linkname = target  # as written: scan canonicalises it, if it keeps the link
        m.size = size
        # Permission bits only: setuid, setgid and sticky have no place on
        # the files of a checkpoint image.
        m.mode = _number(block[100:108], "mode", archive) & 0o777
        m.uid = _pax_int(pax, "uid", _number(block[108:116], "uid", archive), archive)
        m.gid = _pax_int(pax, "gid", _number(block[116:124], "gid", archive), archive)
        m.mtime = _number(block[136:148], "mtime", archive)
        m.uname = pax.get("uname", _text(block[265:297]))
        m.gname = pax.get("gname", _text(block[297:329]))
        m.xattrs = {k: v for k, v in pax.items() if k.startswith("SCHILY.xattr.")}
        pax, long_name = {}, None
        if name is None:
            if not m.isdir():
                raise ArchiveRefused(f"{archive}: member {show(raw)} has no name")
            continue  # the archive's root directory: nothing to keep
        m.name = name
        yield m


def hard_link_refused(archive: str, name: str) -> str:
    """The one line for a hard link the reader does not keep."""
    return (f"{archive}: member {show(name)} is a hard link: a checkpoint holds only files and "
            "directories")


def _pax_int(pax: dict[str, str], key: str, default: int, archive: str) -> int:
    if key not in pax:
        return default
    if not pax[key].isdigit():
        raise ArchiveRefused(f"{archive}: malformed pax {key}")
    return int(pax[key])


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def scan(archive: Path, *, small: frozenset[str], skip_in_copy: frozenset[str] = frozenset(),
         copy: BinaryIO | None = None, room: int | None = None,
         max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 3600.0,
         chunk_digests: bool = False) -> Scan:
    """One pass over `archive` (see the module's docstring). `small`: the
    members kept in memory; with `copy`, every member but `skip_in_copy` is
    written there (no end-of-archive: the caller adds what it leaves out,
    then `end_copy`), within `room` bytes. `chunk_digests`: the GPU-memory
    chunks' digests too (`Scan.chunks`), for a pass that writes no copy."""
    from cudahook.platform import safeio

    what = one_line(str(archive))  # in messages: the path as given, escaped
    deadline = time.monotonic() + timeout_s
    try:
        fd = safeio.open_regular(str(archive), 1 << 62)
    except safeio.FileRefused as exc:
        raise ArchiveRefused(one_line(str(exc))) from exc
    except OSError as exc:
        raise ArchiveRefused(f"{what}: unreadable ({exc.strerror})") from exc
    out = Scan()
    written = 0
    tools: _ChunkTools | None = None
    try:
        stream = Stream(fd, what, max_bytes, deadline, timeout_s)
        files: set[str] = set()
        regular: set[str] = set()  # files that are no link: what a link may name
        for m in _members(stream, what):
            if m.name in out.names:
                raise ArchiveRefused(f"{what}: member {show(m.name)} appears twice")
            parts = m.name.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in files:
                    raise ArchiveRefused(f"{what}: member {show(m.name)} is under a file")
            if m.islink():
                _check_link(m, regular, what)
                out.links[m.name] = m.linkname
            out.names.add(m.name)
            if not m.isdir():
                files.add(m.name)
                if not m.islink():
                    regular.add(m.name)
            # Stop at the first member past the cap, before reading its data.
            if stream.out + m.size > max_bytes:
                raise ArchiveRefused(f"{what}: member {show(m.name)} ({m.size} bytes) takes the "
                                     f"archive past {max_bytes} bytes unpacked "
                                     "(migrate_max_unpacked_bytes)")
            to_copy = copy is not None and m.name not in skip_in_copy
            header = m.header() if to_copy else b""
            if to_copy and room is not None:
                need = written + len(header) + m.size + BLOCK
                if need > room:
                    raise EnvironmentProblem(
                        f"no room for the restore's copy of {show(archive.name)}: it needs more than "
                        f"{need} bytes, {room} are free (after a {RESERVE} byte reserve); "
                        "free space or use --work-dir")
            if to_copy:
                assert copy is not None
                copy.write(header)
                written += len(header)
            if m.islink():
                # No data: the link's name holds its target's bytes.
                if m.linkname in out.hashed:
                    out.hashed[m.name] = out.hashed[m.linkname]
                if m.linkname in out.at:
                    out.at[m.name] = out.at[m.linkname]
                if m.linkname in out.chunks:
                    out.chunks[m.name] = out.chunks[m.linkname]
                out.members += 1
                continue
            keep = m.name in small
            if keep and m.size > SMALL_LIMIT:
                raise ArchiveRefused(f"{what}: {show(m.name)} is {m.size} bytes, past "
                                     f"{SMALL_LIMIT}")
            hashed = (not keep and m.name.startswith("checkpoint/") and not m.isdir()
                      and not m.name.endswith(".img") and m.size <= HASHED_LIMIT)
            h = hashlib.sha256() if hashed or keep else None
            # Every regular file of the GPU tree, not only `*.chunk`: a chunk
            # may be a link to any of them (the dedupe index's, say).
            if chunk_digests and hashed and m.name.startswith(LINKED_TREE):
                tools, chunk_digests = _ChunkTools.load(), False  # imported once
            raw_b3 = tools.blake3() if tools is not None and hashed \
                and m.name.startswith(LINKED_TREE) else None
            kept: list[bytes] = []
            sinks: list[Callable[[bytes], object]] = []
            if to_copy:
                assert copy is not None
                sinks.append(copy.write)
            sinks += [x.update for x in (h, raw_b3) if x is not None]
            if keep:
                sinks.append(kept.append)
            data = _Pieces(stream.pieces(m.size), sinks)
            unpacked = None
            if raw_b3 is not None and _zstd_start(data.peek(4)):
                assert tools is not None
                unpacked = tools.unpacked(data, stream)
            data.drain()
            if raw_b3 is not None:
                out.chunks[m.name] = ChunkDigests(raw_b3.hexdigest(), unpacked)
            pad = -m.size % BLOCK
            stream.read(pad)
            if to_copy:
                assert copy is not None
                copy.write(bytes(pad))
                written += m.size + pad
            if keep:
                out.small[m.name] = b"".join(kept)
            if h is not None:
                out.hashed[m.name] = (h.hexdigest(), m.size)
                if to_copy:
                    out.at[m.name] = (written - pad - m.size, m.size)
            out.members += 1
        stream.drain()
        out.sha256 = stream.sha256.hexdigest()
        out.raw_bytes, out.unpacked_bytes = stream.raw, stream.out
        return out
    except OSError as exc:
        raise ArchiveRefused(f"{what}: unreadable ({exc.strerror})") from exc
    finally:
        os.close(fd)


class ChunkDigests(NamedTuple):
    """What the driver helper's rule needs of a chunk, taken as it streamed
    by: the blake3 of its bytes, and for one that starts as a zstd frame the
    blake3 and size of what it decompresses to (None: not zstd, a damaged
    frame, or more than any chunk holds)."""

    raw: str
    unpacked: tuple[str, int] | None


#: The first bytes of a zstd frame, and of its skippable frames (the low
#: four bits any value), which a decoder reads past as the helper's does.
ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50


def _zstd_start(head: bytes) -> bool:
    if len(head) < 4:
        return False
    magic = int.from_bytes(head[:4], "little")
    return magic == ZSTD_MAGIC or magic & ~0xF == ZSTD_SKIPPABLE


class _Pieces:
    """A member's data as a file a decompressor pulls from: each piece goes
    to every one of `sinks` (the copy, the hashes) once, whoever consumes
    it, and `drain` takes what the decompressor left."""

    def __init__(self, pieces: Iterator[bytes], sinks: list[Callable[[bytes], object]]) -> None:
        self.pieces, self.sinks = pieces, sinks
        self.ahead: list[bytes] = []  # taken already, not yet handed out

    def _next(self) -> bytes:
        piece = next(self.pieces, b"")
        for sink in self.sinks if piece else ():
            sink(piece)
        return piece

    def peek(self, n: int) -> bytes:
        """The first `n` bytes (fewer at the end), still to be read."""
        while sum(map(len, self.ahead)) < n and (piece := self._next()):
            self.ahead.append(piece)
        return b"".join(self.ahead)[:n]

    def read(self, _size: int = -1) -> bytes:
        return self.ahead.pop(0) if self.ahead else self._next()

    def drain(self) -> None:
        self.ahead.clear()
        while self._next():
            pass


class _ChunkTools:
    """blake3 and zstandard, imported only when a dry run meets GPU memory
    (never on a hook's path), and the helper's largest chunk."""

    def __init__(self, blake3: Any, zstd: Any, cap: int) -> None:
        self.b3, self.zstd, self.cap = blake3, zstd, cap

    @classmethod
    def load(cls) -> _ChunkTools | None:
        """None where either is missing: the chunks stay unverified here."""
        try:
            import blake3
            import zstandard
        except ImportError:
            return None
        from cudahook.core.backends.driver_helper import CHUNK_MAX

        return cls(blake3, zstandard, CHUNK_MAX)

    def blake3(self) -> Any:
        return self.b3.blake3()

    def unpacked(self, data: _Pieces, stream: Stream) -> tuple[str, int] | None:
        """The blake3 and size of what `data` decompresses to, read as the
        driver helper's `_decompress` reads a frame (frame by frame, until
        the decoder gives nothing more), or None: a damaged frame, or past
        `cap` - the largest chunk a manifest may name, which the helper
        would refuse as well - where a bomb stops, a piece at a time."""
        h, n = self.b3.blake3(), 0
        buf = memoryview(bytearray(CHUNK))
        try:
            reader = self.zstd.ZstdDecompressor().stream_reader(
                data, read_size=CHUNK, read_across_frames=False)
            while got := reader.readinto(buf):
                n += got
                if n > self.cap:
                    return None
                stream.in_time()
                h.update(buf[:got])
        except self.zstd.ZstdError:
            return None
        return h.hexdigest(), n


def _check_link(m: Member, regular: set[str], archive: str) -> None:
    """A hard link is kept only inside LINKED_TREE, to an earlier regular
    file there (`regular`: those seen so far, links excluded): never to a
    link, a directory, a later member or anything outside."""
    if not m.name.startswith(LINKED_TREE):
        raise ArchiveRefused(hard_link_refused(archive, m.name))
    m.linkname = canonical(m.linkname, archive) or ""
    if not m.linkname.startswith(LINKED_TREE) or m.linkname not in regular:
        raise ArchiveRefused(f"{archive}: member {show(m.name)} is a hard link to "
                             f"{show(m.linkname)}: only a link to an earlier file of "
                             f"{LINKED_TREE} is kept")


def read_member(archive: Path, name: str, limit: int, timeout_s: float = 60.0) -> bytes | None:
    """One member's data (None if absent), reading only up to it."""
    from cudahook.platform import safeio

    fd = safeio.open_regular(str(archive), 1 << 62)
    what = one_line(str(archive))
    try:
        stream = Stream(fd, what, DEFAULT_MAX_BYTES, time.monotonic() + timeout_s, timeout_s)
        for m in _members(stream, what):
            if m.name == name and not m.isdir() and not m.islink():
                if m.size > limit:
                    raise ArchiveRefused(f"{what}: {show(name)} is past {limit} bytes")
                return stream.read(m.size)
            for _ in stream.pieces(m.size + -m.size % BLOCK):
                pass
        return None
    except OSError as exc:
        raise ArchiveRefused(f"{what}: unreadable ({exc.strerror})") from exc
    finally:
        os.close(fd)


def rest_sha256(archive: Path, timeout_s: float) -> str | None:
    """The whole file's sha256 (None if unreadable or past `timeout_s`): to
    tell a damaged copy from a hostile one when a member was refused."""
    from cudahook.platform import safeio

    try:
        return safeio.sha256_file(archive, 1 << 62, timeout_s)[0]
    except (OSError, safeio.FileRefused):
        return None


def add_file(copy: BinaryIO, name: str, data: bytes, mode: int = 0o600) -> None:
    m = Member()
    m.name, m.size, m.mode, m.mtime = name, len(data), mode, int(time.time())
    copy.write(m.header())
    copy.write(data)
    copy.write(bytes(-len(data) % BLOCK))


def end_copy(copy: BinaryIO) -> None:
    copy.write(bytes(2 * BLOCK))
