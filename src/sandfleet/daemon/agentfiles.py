"""File operations through the agent, for tiers whose sandbox root the host cannot reach (a VM's
filesystem lives in its guest kernel).

Each operation is one command the agent runs inside the sandbox, as its root, with the POSIX tools
every image has (busybox's applets or coreutils and tar): `cat`, `stat -c`, `mkdir`, `rm`, `tar`.
Paths are resolved by the sandbox's own kernel inside its own root, so nothing here can reach the
host; the host-side path (`runtime/files.py` over an O_PATH root) stays the container tier's. What
the tools print on failure is typed like the host-side errors (not found, exists, is a directory,
...). Names are passed as arguments ("$1"), never spliced into the script.
"""

from __future__ import annotations

import dataclasses
import errno
import posixpath
import stat as st
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sandfleet.runtime.agent import AgentChannel, OutputChunk
from sandfleet.runtime.files import FileKind, FileOpError, FileStat, FileTooLargeError, _from_oserror

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


@dataclass(frozen=True)
class Ran:
    out: bytes
    err: bytes
    code: int


def _error(path: str, err: bytes) -> FileOpError:
    text = err.decode(errors="replace")
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
            raise FileOpError("invalid_path", p, "not a regular file")
        if length is None and info.size - offset > self.max_read:
            raise FileTooLargeError(p, f"file of {info.size} bytes exceeds the limit of {self.max_read}")
        count = length if length is not None else max(0, info.size - offset)
        r = await self._checked(p, 'tail -c +"$2" -- "$1" | head -c "$3"', p, str(offset + 1), str(count))
        return r.out[:count]

    async def write(self, path: str, data: bytes, *, mode: int, uid: int, gid: int, append: bool) -> None:
        p = self.norm(path)
        redirect = ">>" if append else ">"
        # Missing parents are made, owned like the file (as the host-side write does).
        script = 'd=$(dirname -- "$1"); if [ ! -d "$d" ]; then mkdir -p -- "$d" && chown "$3" -- "$d" || exit 1; fi; '
        script += f'[ ! -d "$1" ] || {{ echo "$1: Is a directory" >&2; exit 1; }}; cat {redirect} "$1" && '
        script += 'chmod "$2" -- "$1" && chown "$3" -- "$1"'
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
        r = await self.run('grep -m1 -- "^$1:" /etc/passwd', name, cap=64 * 1024)
        fields = r.out.decode(errors="replace").strip().split(":")
        if r.code != 0 or len(fields) < 6:
            return None
        try:
            return int(fields[2]), int(fields[3]), fields[5] or "/"
        except ValueError:
            return None

    async def tar_out(self, path: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """A tar of `path` (a directory's contents, or one file), streamed."""
        p = self.norm(path)
        info = await self.stat(p)
        if info.type == "dir":
            argv = ["tar", "-C", p, "-cf", "-", "."]
        else:
            argv = ["tar", "-C", posixpath.dirname(p) or "/", "-cf", "-", posixpath.basename(p)]
        proc = await self.channel.start(argv, out_cap=max_bytes, timeout=3600)
        return _stdout_chunks(proc.events(), p)

    async def tar_in(self, path: str, data: Sequence[bytes], *, uid: int, gid: int) -> None:
        """Extract a tar into directory `path` (made if missing), owned by uid:gid."""
        p = self.norm(path)
        proc = await self.channel.start(
            [
                "/bin/sh",
                "-c",
                'mkdir -p -- "$1" && tar -C "$1" -xf - --no-same-owner && chown -R "$2" -- "$1"',
                "sh",
                p,
                f"{uid}:{gid}",
            ],
            stdin=True,
            out_cap=64 * 1024,
            timeout=3600,
        )
        for chunk in data:
            await proc.write_stdin(chunk)
        await proc.close_stdin()
        _out, err, ex = await proc.wait()
        if ex.exit_code != 0:
            raise _error(p, err)


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
