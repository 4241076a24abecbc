"""File operations through the agent, for tiers whose sandbox root the host cannot reach (a VM's
filesystem lives in its guest kernel).

Each operation is one command the agent runs inside the sandbox, as its root, with the POSIX tools
every image has (busybox's applets or coreutils and tar): `cat`, `stat -c`, `mkdir`, `rm`, `tar`.
Paths are resolved by the sandbox's own kernel inside its own root, so nothing here can reach the
host; the host-side path (`runtime/sandboxfs/` over an O_PATH root) stays the container tier's. What
the tools print on failure is typed like the host-side errors (not found, exists, is a directory,
...). Names are passed as arguments ("$1"), never spliced into the script.

The container tier's rules hold here too. Only regular files are read or written: a FIFO, device
or socket is refused (`invalid_path`) before it is opened, and a write opens its file read-write
(which never blocks, even on a FIFO swapped in after the check) and checks the opened file again;
/etc/passwd is looked up only when it is a regular file, within its first 4 MiB. A download leaves
FIFOs and devices out of its tar. An upload is checked on the host with `files.check_upload` (names,
types, hard links, the size it expands to) and reaches the guest's tar rewritten from the members
that passed, owned by the caller, in parts where a member lies under a symlink the archive itself
made (the guest's tar makes symlinks last), so it resolves through it as in the container tier.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import errno
import posixpath
import stat as st
import tarfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_wire import OutputChunk
from sandfleet.runtime.sandboxfs.paths import _member_parts
from sandfleet.runtime.sandboxfs.results import FileKind, FileOpError, FileStat, FileTooLargeError, _from_oserror
from sandfleet.runtime.sandboxfs.tar_upload import check_upload

# stderr phrases of coreutils and busybox, and the errno each means
_PHRASES = (
    ("No such file or directory", errno.ENOENT),
    ("Directory nonexistent", errno.ENOENT),  # dash's word for a missing parent
    ("File exists", errno.EEXIST),
    ("Directory not empty", errno.ENOTEMPTY),
    ("Not a directory", errno.ENOTDIR),
    ("Is a directory", errno.EISDIR),
    ("Permission denied", errno.EACCES),
    ("Operation not permitted", errno.EPERM),
    ("Read-only file system", errno.EROFS),
    ("No space left on device", errno.ENOSPC),
    ("File name too long", errno.ENAMETOOLONG),
)
STAT_FORMAT = "%f %s %u %g %Y %n"  # raw mode (hex), size, uid, gid, mtime, name: busybox and GNU alike
CHUNK = 64 * 1024
NOT_REGULAR = "not a regular file"  # what our scripts say of a FIFO, device or socket (invalid_path)
PASSWD_MAX_BYTES = 4 * 1024**2  # of /etc/passwd searched for a user name (as the host-side lookup)
BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class Ran:
    out: bytes
    err: bytes
    code: int


def _error(path: str, err: bytes) -> FileOpError:
    text = err.decode(errors="replace")
    if NOT_REGULAR in text:
        return FileOpError("invalid_path", path, NOT_REGULAR)
    if "too large" in text:
        return FileTooLargeError(path, text.strip()[-300:])
    for phrase, code in _PHRASES:
        if phrase.lower() in text.lower():
            return _from_oserror(OSError(code, phrase), path)
    return FileOpError("io_error", path, text.strip()[-300:] or "the operation failed")


def _parse_stat(line: str, path: str) -> FileStat:
    mode_hex, size, uid, gid, mtime, _name = line.split(" ", 5)
    mode = int(mode_hex, 16)
    kind: FileKind = (
        "dir" if st.S_ISDIR(mode) else "file" if st.S_ISREG(mode) else "symlink" if st.S_ISLNK(mode) else "other"
    )
    return FileStat(
        path=path,
        name=posixpath.basename(path) or "/",
        type=kind,
        size=int(size),
        mode=st.S_IMODE(mode),
        uid=int(uid),
        gid=int(gid),
        mtime=float(mtime),
        link_target=None,
    )


class AgentFS:
    """One sandbox's files, reached through its agent."""

    def __init__(self, channel: AgentChannel, *, cwd: str = "/", max_read: int = 64 * 1024**2) -> None:
        self.channel = channel
        self.cwd = cwd
        self.max_read = max_read

    def norm(self, path: str) -> str:
        if "\0" in path:
            raise FileOpError("invalid_path", path, "NUL byte in path")
        return posixpath.normpath(posixpath.join(self.cwd, path))

    async def run(self, script: str, *args: str, stdin: bytes | None = None, cap: int | None = None) -> Ran:
        """`sh -c script sh args...` as the sandbox's root; output kept up to `cap` per stream."""
        proc = await self.channel.start(
            ["/bin/sh", "-c", script, "sh", *args], stdin=stdin is not None, out_cap=cap, timeout=300
        )
        if stdin is not None:
            await proc.write_stdin(stdin)
            await proc.close_stdin()
        out, err, ex = await proc.wait()
        return Ran(out, err, ex.exit_code)

    async def _checked(self, path: str, script: str, *args: str, stdin: bytes | None = None) -> Ran:
        r = await self.run(script, *args, stdin=stdin, cap=self.max_read + 1)
        if r.code != 0:
            raise _error(path, r.err)
        return r

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> FileStat:
        p = self.norm(path)
        flag = "-L " if follow_symlinks else ""
        r = await self._checked(
            p, f'stat {flag}-c "{STAT_FORMAT}" -- "$1" && if [ -L "$1" ]; then readlink -- "$1"; fi', p
        )
        lines = r.out.decode(errors="replace").split("\n")
        info = _parse_stat(lines[0], p)
        if info.type == "symlink" and len(lines) > 1:
            info = dataclasses.replace(info, link_target=lines[1])
        return info

    async def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        p = self.norm(path)
        if offset < 0 or (length is not None and length < 0):
            raise FileOpError("invalid_path", p, "offset and length must be non-negative")
        if length is not None and length > self.max_read:
            raise FileTooLargeError(p, f"requested length {length} exceeds the limit of {self.max_read}")
        info = await self.stat(p)
        if info.type == "dir":
            raise _from_oserror(OSError(errno.EISDIR, "Is a directory"), p)
        if info.type != "file":
            raise FileOpError("invalid_path", p, NOT_REGULAR)
        if length is None and info.size - offset > self.max_read:
            raise FileTooLargeError(p, f"file of {info.size} bytes exceeds the limit of {self.max_read}")
        count = length if length is not None else max(0, info.size - offset)
        script = f'[ -f "$1" ] || {{ echo "$1: {NOT_REGULAR}" >&2; exit 1; }}; tail -c +"$2" -- "$1" | head -c "$3"'
        r = await self._checked(p, script, p, str(offset + 1), str(count))
        return r.out[:count]

    async def write(self, path: str, data: bytes, *, mode: int, uid: int, gid: int, append: bool) -> None:
        """As the host-side write: missing parents made (owned like the file); a new file gets the
        mode and owner, an existing one is truncated (or appended to) in place, keeping both; only a
        regular file is written, and a FIFO never blocks it (opened read-write, then checked)."""
        p = self.norm(path)
        redirect = ">>" if append else ">"
        script = 'd=$(dirname -- "$1"); if [ ! -d "$d" ]; then mkdir -p -- "$d" && chown "$3" -- "$d" || exit 1; fi; '
        script += '[ ! -d "$1" ] || { echo "$1: Is a directory" >&2; exit 1; }; '
        script += f'new=1; if [ -e "$1" ]; then new=0; [ -f "$1" ] || {{ echo "$1: {NOT_REGULAR}" >&2; exit 1; }}; fi; '
        script += f'exec 3<>"$1" || exit 1; [ -f /proc/self/fd/3 ] || {{ echo "$1: {NOT_REGULAR}" >&2; exit 1; }}; '
        script += f"cat {redirect} /proc/self/fd/3 || exit 1; "
        script += '[ "$new" = 0 ] || { chmod "$2" /proc/self/fd/3 && chown "$3" /proc/self/fd/3; }'
        await self._checked(p, script, p, format(mode & 0o7777, "o"), f"{uid}:{gid}", stdin=data)

    async def list(self, path: str) -> list[FileStat]:
        p = self.norm(path)
        info = await self.stat(p)
        if info.type != "dir":
            raise _from_oserror(OSError(errno.ENOTDIR, "Not a directory"), p)
        r = await self._checked(p, f'find "$1" -mindepth 1 -maxdepth 1 -exec stat -c "{STAT_FORMAT}" {{}} +', p)
        out = []
        for line in r.out.decode(errors="replace").splitlines():
            if line.count(" ") >= 5:
                name = line.split(" ", 5)[5]
                out.append(_parse_stat(line, name))
        return sorted(out, key=lambda f: f.name)

    async def mkdir(self, path: str, *, parents: bool, mode: int, uid: int, gid: int) -> None:
        p = self.norm(path)
        flag = "-p " if parents else ""
        await self._checked(
            p, f'mkdir {flag}-m "$2" -- "$1" && chown "$3" -- "$1"', p, format(mode & 0o7777, "o"), f"{uid}:{gid}"
        )

    async def remove(self, path: str, *, recursive: bool) -> None:
        p = self.norm(path)
        if p == "/":
            raise FileOpError("invalid_path", p, "refusing to remove the root")
        one = 'if [ -d "$1" ] && [ ! -L "$1" ]; then rmdir -- "$1"; else rm -- "$1"; fi'
        script = 'rm -r -- "$1"' if recursive else one
        await self._checked(p, script, p)

    async def lookup_user(self, name: str) -> tuple[int, int, str] | None:
        """(uid, gid, home) of `name` from the sandbox's /etc/passwd (None: no such user, or no
        /etc/passwd); FileOpError if it is no regular file, or larger than the search reads and
        the name is not in what it read."""
        script = "[ -e /etc/passwd ] || exit 1; "
        script += f'[ -f /etc/passwd ] || {{ echo "/etc/passwd: {NOT_REGULAR}" >&2; exit 2; }}; '
        script += 'head -c "$2" /etc/passwd | grep -m1 -- "^$1:" && exit 0; '
        script += '[ "$(stat -L -c %s /etc/passwd)" -le "$2" ] || '
        script += '{ echo "/etc/passwd: too large: searched its first $2 bytes" >&2; exit 2; }; exit 1'
        r = await self.run(script, name, str(PASSWD_MAX_BYTES), cap=64 * 1024)
        if r.code == 2:
            raise _error("/etc/passwd", r.err)
        fields = r.out.decode(errors="replace").strip().split(":")
        if r.code != 0 or len(fields) < 6:
            return None
        try:
            return int(fields[2]), int(fields[3]), fields[5] or "/"
        except ValueError:
            return None

    async def tar_out(self, path: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """A tar of `path` (a directory's contents, or one file), streamed; FIFOs and devices left out."""
        p = self.norm(path)
        info = await self.stat(p)
        if info.type == "dir":
            argv = ["tar", "-C", p, "-cf", "-", "."]
        elif info.type == "other":
            raise FileOpError("invalid_path", p, NOT_REGULAR)
        else:
            argv = ["tar", "-C", posixpath.dirname(p) or "/", "-cf", "-", posixpath.basename(p)]
        proc = await self.channel.start(argv, out_cap=max_bytes, timeout=3600)
        return _without_special(_stdout_chunks(proc.events(), p))

    async def tar_in(self, path: str, tar: BinaryIO, *, uid: int, gid: int, max_bytes: int) -> None:
        """Extract an uploaded tar (seekable: checked whole first, see the module docstring) into
        directory `path` (made if missing, owned by uid:gid); every member owned by uid:gid."""
        p = self.norm(path)
        try:
            src = await asyncio.to_thread(tarfile.open, fileobj=tar, mode="r:*")
        except tarfile.TarError as exc:
            raise FileOpError("invalid_path", p, f"not a valid tar archive: {exc}") from exc
        with src:
            try:
                parts = await asyncio.to_thread(_checked_parts, src, p, max_bytes)
                for members in parts:
                    await self._extract(p, _tar_stream(src, members, uid, gid, max_bytes), uid, gid)
            except tarfile.TarError as exc:
                raise FileOpError("invalid_path", p, f"corrupt tar archive: {exc}") from exc

    async def _extract(self, path: str, stream: Iterator[bytes], uid: int, gid: int) -> None:
        """One run of the guest's tar (as root: it keeps the members' owners and modes) over `stream`."""
        script = 'if [ ! -d "$1" ]; then mkdir -p -- "$1" && chown "$2" -- "$1" || exit 1; fi; exec tar -C "$1" -xf -'
        proc = await self.channel.start(
            ["/bin/sh", "-c", script, "sh", path, f"{uid}:{gid}"], stdin=True, out_cap=64 * 1024, timeout=3600
        )
        try:
            while chunk := await asyncio.to_thread(next, stream, b""):
                await proc.write_stdin(chunk)
        except BaseException:
            self.channel.kill_nowait(proc.id)
            raise
        await proc.close_stdin()
        _out, err, ex = await proc.wait()
        if ex.exit_code != 0:
            raise _error(path, err)


def _checked_parts(src: tarfile.TarFile, dest: str, max_bytes: int) -> list[list[tarfile.TarInfo]]:
    """The upload's members (blocking), checked by the shared rules (a truncated archive fails
    there, before the guest has any of it), cut into parts: a new part where a member lies under
    (or is) a symlink an earlier member of this part made."""
    parts: list[list[tarfile.TarInfo]] = [[]]
    links: set[str] = set()  # symlinks the current part makes
    for m, names in check_upload(src, dest, max_bytes=max_bytes):
        if not names:
            continue  # the "." entry
        rel = "/".join(names)
        if any("/".join(names[:i]) in links for i in range(1, len(names) + 1)):
            parts.append([])
            links = set()
        parts[-1].append(m)
        if m.issym():
            links.add(rel)
    return [x for x in parts if x]


def _tar_stream(
    src: tarfile.TarFile, members: list[tarfile.TarInfo], uid: int, gid: int, max_bytes: int
) -> Iterator[bytes]:
    """A tar of checked members rewritten for the guest (blocking): normalised names, owned by
    uid:gid (numerically), setuid/setgid bits dropped, hard links by their normalised target, file
    data streamed (at most max_bytes in all: a sparse member is sent whole)."""
    sent = 0
    for m in members:
        ti = copy.copy(m)
        ti.name = "/".join(_member_parts(m.name))
        ti.uid, ti.gid, ti.uname, ti.gname = uid, gid, "", ""
        ti.mode = m.mode & 0o1777
        ti.pax_headers = {}
        if m.islnk():
            ti.linkname = "/".join(_member_parts(m.linkname))
        if not m.isreg():
            ti.size = 0
            yield ti.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            continue
        ti.type = tarfile.REGTYPE  # a sparse member arrives whole
        ti.sparse = None
        yield ti.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        data = src.extractfile(m)
        left = ti.size
        while data is not None and left > 0:
            chunk = data.read(min(CHUNK * 16, left))
            if not chunk:
                raise tarfile.ReadError("unexpected end of data")
            sent += len(chunk)
            if sent > max_bytes:
                raise FileTooLargeError(ti.name, f"the archive's files hold more than {max_bytes} bytes")
            left -= len(chunk)
            yield chunk
        if ti.size % BLOCK:
            yield bytes(BLOCK - ti.size % BLOCK)
    yield bytes(2 * BLOCK)


def _header_size(field: bytes) -> int:
    """A tar header's size field: octal digits, or base-256 (GNU) when its first bit is set."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.replace(b"\0", b" ").strip() or b"0", 8)
    except ValueError:
        raise FileOpError("io_error", "", "the sandbox's tar wrote a malformed header") from None


async def _without_special(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A tar stream with its FIFO and device members left out (the container tier's download skips
    them, and an SDK's data filter would refuse them), header by header: the rest passes unchanged."""
    buf = bytearray()
    prefix = bytearray()  # pax or GNU long-name records that belong to the next member
    passing = 0  # bytes of the current member's data still to pass through
    dropping = 0  # bytes of a left-out member's data still to drop (none, from an honest tar)
    ended = False
    async for chunk in chunks:
        if ended:
            yield chunk
            continue
        buf += chunk
        out = bytearray()
        while True:
            if passing or dropping:
                n = min(passing or dropping, len(buf))
                if passing:
                    out += buf[:n]
                    passing -= n
                else:
                    dropping -= n
                del buf[:n]
                if passing or dropping:
                    break
            if len(buf) < BLOCK:
                break
            header = bytes(buf[:BLOCK])
            if not header.strip(b"\0"):  # the end-of-archive blocks: the rest as it comes
                out += prefix + buf
                buf.clear()
                ended = True
                break
            kind = header[156:157]
            size = _header_size(header[124:136])
            padded = -(-size // BLOCK) * BLOCK
            if kind in (b"x", b"L", b"K"):  # describes the next member: kept with it
                if len(prefix) + BLOCK + padded > 1024**2:  # the guest's tar is the sandbox's: bounded
                    raise FileOpError("io_error", "", "the sandbox's tar wrote header records of over 1 MiB")
                if len(buf) < BLOCK + padded:
                    break
                prefix += buf[: BLOCK + padded]
                del buf[: BLOCK + padded]
                continue
            del buf[:BLOCK]
            if kind in (b"3", b"4", b"6"):  # character device, block device, FIFO
                prefix.clear()
                dropping = padded
                continue
            out += prefix + header
            prefix.clear()
            passing = padded
        if out:
            yield bytes(out)
    if buf or prefix:
        yield bytes(prefix + buf)


async def _stdout_chunks(events: AsyncIterator[object], path: str) -> AsyncIterator[bytes]:
    err = b""
    async for ev in events:
        if isinstance(ev, OutputChunk):
            if ev.stream == "stdout":
                yield ev.data
            else:
                err += ev.data[: 4096 - len(err)]
        elif getattr(ev, "exit_code", 0) != 0:
            raise _error(path, err)
