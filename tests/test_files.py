"""Tests for sandfleet.runtime.files: fd-relative, openat2-confined sandbox file operations."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet.runtime.files import FileOpError, FileStat, FileTooLargeError, SandboxFS

UID_BASE = 100000
HOST_SECRET = b"HOST SECRET - must never be read or written by the daemon\n"
ROOT_PASSWD = b"root:x:0:0:sandbox root:/root:/bin/sh\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown / mount)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "etc").mkdir(parents=True)
    (r / "etc" / "passwd").write_bytes(ROOT_PASSWD)
    return r


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A 'host' directory outside the sandbox root with a secret file."""
    h = tmp_path / "host"
    h.mkdir()
    (h / "secret").write_bytes(HOST_SECRET)
    return h


@pytest.fixture
def fs(root: Path) -> Iterator[SandboxFS]:
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        yield SandboxFS(fd, uid_base=UID_BASE)
    finally:
        os.close(fd)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
            else:
                t.addfile(ti)
    return buf.getvalue()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.mode = mode
    ti.mtime = 1_700_000_000
    return ti, data


def _sym(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.SYMTYPE
    ti.linkname = target
    return ti, None


def _hard(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.LNKTYPE
    ti.linkname = target
    return ti, None


def _dir(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE
    ti.mode = mode
    return ti, None


# --------------------------------------------------------------------------- basics


def test_write_read_roundtrip_and_ownership(fs: SandboxFS, root: Path) -> None:
    fs.write("/task/a.py", b"print(1)\n", uid=1000, gid=1001, mode=0o640)
    p = root / "task" / "a.py"
    assert p.read_bytes() == b"print(1)\n"
    st = p.stat()
    assert (st.st_uid, st.st_gid) == (UID_BASE + 1000, UID_BASE + 1001)
    assert st.st_mode & 0o7777 == 0o640
    # parent created with make_parents, owned by the sandbox user too
    dst = (root / "task").stat()
    assert (dst.st_uid, dst.st_gid) == (UID_BASE + 1000, UID_BASE + 1001)
    assert fs.read("/task/a.py") == b"print(1)\n"
    assert fs.read("/task/a.py", offset=6) == b"1)\n"
    assert fs.read("/task/a.py", offset=2, length=3) == b"int"


def test_write_default_owner_is_sandbox_root(fs: SandboxFS, root: Path) -> None:
    fs.write("/x", b"1")
    st = (root / "x").stat()
    assert (st.st_uid, st.st_gid) == (UID_BASE, UID_BASE)


def test_write_truncates_existing_in_place_and_append(fs: SandboxFS, root: Path) -> None:
    fs.write("/f", b"hello world", uid=5)
    ino = (root / "f").stat().st_ino
    fs.write("/f", b"bye", uid=7)  # owner of an existing file is kept
    assert (root / "f").read_bytes() == b"bye"
    assert (root / "f").stat().st_ino == ino
    assert (root / "f").stat().st_uid == UID_BASE + 5
    fs.write("/f", b"!!", append=True)
    assert fs.read("/f") == b"bye!!"
    fs.write("/g", b"new", append=True)
    assert fs.read("/g") == b"new"


def test_write_without_make_parents(fs: SandboxFS) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.write("/nodir/f", b"x", make_parents=False)
    assert ei.value.kind == "not_found"
    assert "/nodir/f" in str(ei.value)


def test_write_to_directory_and_root(fs: SandboxFS) -> None:
    fs.mkdir("/d")
    for p in ("/d", "/"):
        with pytest.raises(FileOpError) as ei:
            fs.write(p, b"x")
        assert ei.value.kind == "is_a_directory"


def test_write_refuses_fifo(fs: SandboxFS, root: Path) -> None:
    os.mkfifo(root / "fifo")
    with pytest.raises(FileOpError) as ei:
        fs.write("/fifo", b"x")  # would block forever if the daemon open()ed it
    assert ei.value.kind == "invalid_path"
    with pytest.raises(FileOpError):
        fs.read("/fifo")


def test_read_errors(fs: SandboxFS, root: Path) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.read("/missing")
    assert ei.value.kind == "not_found"
    assert "/missing" in str(ei.value)
    assert isinstance(ei.value.__cause__, OSError)
    with pytest.raises(FileOpError) as ei:
        fs.read("/etc")
    assert ei.value.kind == "is_a_directory"
    with pytest.raises(FileOpError) as ei:
        fs.read("/etc/passwd/x")
    assert ei.value.kind == "not_a_directory"


def test_read_too_large(root: Path) -> None:
    (root / "big").write_bytes(b"a" * 100)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        small = SandboxFS(fd, uid_base=UID_BASE, max_read=10)
        with pytest.raises(FileTooLargeError) as ei:
            small.read("/big")
        assert ei.value.kind == "too_large"
        assert small.read("/big", offset=95, length=10) == b"aaaaa"
        with pytest.raises(FileTooLargeError):
            small.read("/big", length=11)
        assert small.read("/etc/passwd", length=4) == b"root"
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["relative/path", "", "/a/\0b", "/a/../b", "/..", "../etc/passwd"])
def test_invalid_paths(fs: SandboxFS, bad: str) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.read(bad)
    assert ei.value.kind == "invalid_path"


def test_path_normalisation(fs: SandboxFS) -> None:
    fs.write("//task/./b.txt", b"b")
    assert fs.read("/task/b.txt/") == b"b"
    assert fs.stat("/task//b.txt").path == "/task/b.txt"


def test_name_too_long(fs: SandboxFS) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.write("/" + "a" * 300, b"x")
    assert ei.value.kind == "invalid_path"


def test_stat_and_list(fs: SandboxFS, root: Path) -> None:
    fs.write("/d/file", b"12345", uid=3, gid=4, mode=0o600)
    fs.mkdir("/d/sub", uid=3, gid=4, mode=0o750)
    os.symlink("file", root / "d" / "link")
    os.mkfifo(root / "d" / "fifo")
    os.chown(root / "d" / "fifo", 0, 0)  # host root: not mapped into the sandbox

    st = fs.stat("/d/file")
    assert isinstance(st, FileStat)
    assert (st.path, st.name, st.type, st.size, st.mode, st.uid, st.gid) == (
        "/d/file",
        "file",
        "file",
        5,
        0o600,
        3,
        4,
    )
    assert st.link_target is None
    assert st.mtime == pytest.approx((root / "d" / "file").stat().st_mtime)

    ln = fs.stat("/d/link")
    assert ln.type == "symlink" and ln.link_target == "file"
    followed = fs.stat("/d/link", follow_symlinks=True)
    assert followed.type == "file" and followed.size == 5 and followed.path == "/d/link"

    rootst = fs.stat("/")
    assert rootst.type == "dir" and rootst.name == "/"

    entries = fs.list("/d")
    assert [e.name for e in entries] == ["fifo", "file", "link", "sub"]
    by = {e.name: e for e in entries}
    assert by["fifo"].type == "other" and by["fifo"].uid == 65534
    assert by["sub"].type == "dir" and by["sub"].mode == 0o750 and by["sub"].path == "/d/sub"
    assert by["link"].link_target == "file"

    with pytest.raises(FileOpError) as ei:
        fs.list("/d/file")
    assert ei.value.kind == "not_a_directory"
    with pytest.raises(FileOpError) as ei:
        fs.stat("/nope")
    assert ei.value.kind == "not_found"


def test_mkdir(fs: SandboxFS, root: Path) -> None:
    fs.mkdir("/a/b/c", uid=2, gid=2, mode=0o700)
    for p in ("a", "a/b", "a/b/c"):
        st = (root / p).stat()
        assert (st.st_uid, st.st_gid) == (UID_BASE + 2, UID_BASE + 2)
        assert st.st_mode & 0o777 == 0o700
    fs.mkdir("/a/b/c")  # exist_ok
    with pytest.raises(FileOpError) as ei:
        fs.mkdir("/a/b/c", exist_ok=False)
    assert ei.value.kind == "exists"
    with pytest.raises(FileOpError) as ei:
        fs.mkdir("/x/y", parents=False)
    assert ei.value.kind == "not_found"
    fs.write("/file", b"")
    with pytest.raises(FileOpError) as ei:
        fs.mkdir("/file/sub")
    assert ei.value.kind == "not_a_directory"
    with pytest.raises(FileOpError) as ei:
        fs.mkdir("/file")
    assert ei.value.kind in ("exists", "not_a_directory")
    fs.mkdir("/")  # root always exists


def test_remove(fs: SandboxFS, root: Path) -> None:
    fs.write("/d/e/f", b"x")
    fs.write("/g", b"x")
    fs.remove("/g")
    assert not (root / "g").exists()
    with pytest.raises(FileOpError) as ei:
        fs.remove("/d")
    assert ei.value.kind == "exists"  # ENOTEMPTY
    fs.remove("/d", recursive=True)
    assert not (root / "d").exists()
    fs.mkdir("/empty")
    fs.remove("/empty")
    assert not (root / "empty").exists()
    with pytest.raises(FileOpError) as ei:
        fs.remove("/missing")
    assert ei.value.kind == "not_found"
    for p in ("/", "//"):
        with pytest.raises(FileOpError) as ei:
            fs.remove(p, recursive=True)
        assert ei.value.kind == "invalid_path"


def test_remove_deep_tree(fs: SandboxFS, root: Path) -> None:
    deep = "/deep" + "/d" * 200
    fs.write(deep + "/f", b"x")
    fs.remove("/deep", recursive=True)
    assert not (root / "deep").exists()


def test_no_fd_leaks(fs: SandboxFS, root: Path) -> None:
    fs.write("/warm", b"x")
    before = _fd_count()
    for _ in range(20):
        fs.write("/t/f", b"data")
        fs.read("/t/f")
        fs.list("/t")
        fs.stat("/t/f", follow_symlinks=True)
        with pytest.raises(FileOpError):
            fs.read("/t/missing")
        with pytest.raises(FileOpError):
            fs.read("/t")
        data = fs.download_tar("/t")
        fs.upload_tar("/u", data)
        fs.remove("/t", recursive=True)
        fs.remove("/u", recursive=True)
    assert _fd_count() == before


# --------------------------------------------------------------------------- escapes


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../../etc/passwd", "../" * 12 + "etc/passwd"])
def test_read_symlink_escape_stays_in_root(fs: SandboxFS, root: Path, target: str) -> None:
    os.symlink(target, root / "evil")
    assert fs.read("/evil") == ROOT_PASSWD
    assert fs.stat("/evil", follow_symlinks=True).size == len(ROOT_PASSWD)


def test_read_symlink_to_host_file_absent_in_root(fs: SandboxFS, root: Path, host: Path) -> None:
    os.symlink(host / "secret", root / "evil")
    os.symlink("../" * 20 + str(host / "secret").lstrip("/"), root / "evil2")
    for p in ("/evil", "/evil2"):
        with pytest.raises(FileOpError) as ei:
            fs.read(p)
        assert ei.value.kind == "not_found"


def test_write_through_absolute_symlink_lands_in_root(fs: SandboxFS, root: Path, host: Path) -> None:
    # existing host file, pointed at by an absolute symlink; its path doesn't exist in root
    os.symlink(host / "secret", root / "evil")
    with pytest.raises(FileOpError) as ei:
        fs.write("/evil", b"pwned", make_parents=False)
    assert ei.value.kind == "not_found"
    assert (host / "secret").read_bytes() == HOST_SECRET
    # once the directory exists inside the root, the dangling link is followed *inside* it
    fs.mkdir(str(host))
    fs.write("/evil", b"pwned", uid=9)
    assert (host / "secret").read_bytes() == HOST_SECRET
    inside = root / str(host / "secret").lstrip("/")
    assert inside.read_bytes() == b"pwned"
    assert inside.stat().st_uid == UID_BASE + 9
    # relative ../ escape
    os.symlink("../../../../../../../../etc/passwd", root / "evil_rel")
    fs.write("/evil_rel", b"x:x\n")
    assert (root / "etc" / "passwd").read_bytes() == b"x:x\n"


def test_symlinked_directory_component_pointing_outside(fs: SandboxFS, root: Path, host: Path) -> None:
    os.symlink(host, root / "hostdir")  # absolute link to a host dir
    os.symlink("../" * 10 + str(host).lstrip("/"), root / "hostdir_rel")
    for link in ("/hostdir", "/hostdir_rel"):
        with pytest.raises(FileOpError) as ei:
            fs.read(link + "/secret")
        assert ei.value.kind == "not_found"
        with pytest.raises(FileOpError):
            fs.list(link)
        with pytest.raises(FileOpError):
            fs.write(link + "/new", b"x", make_parents=False)
        with pytest.raises(FileOpError):
            fs.remove(link + "/secret")
    assert sorted(os.listdir(host)) == ["secret"]
    assert (host / "secret").read_bytes() == HOST_SECRET
    # like `mkdir -p`, make_parents does not create the target of a dangling symlink component
    with pytest.raises(FileOpError) as ei:
        fs.write("/hostdir/new", b"x")
    assert ei.value.kind == "exists"
    # once the target exists inside the root, the link resolves there
    fs.mkdir(str(host))
    fs.write("/hostdir/new", b"inside")
    assert (root / str(host).lstrip("/") / "new").read_bytes() == b"inside"
    assert sorted(os.listdir(host)) == ["secret"]
    # removing the symlink removes the link, not the target
    fs.remove("/hostdir", recursive=True)
    assert not (root / "hostdir").is_symlink()
    assert (host / "secret").read_bytes() == HOST_SECRET


def test_recursive_remove_does_not_follow_symlinks(fs: SandboxFS, root: Path, host: Path) -> None:
    fs.write("/work/keep/a", b"a")
    os.symlink(host, root / "work" / "hostlink")
    os.symlink(host / "secret", root / "work" / "keep" / "secretlink")
    fs.remove("/work", recursive=True)
    assert not (root / "work").exists()
    assert sorted(os.listdir(host)) == ["secret"]
    assert (host / "secret").read_bytes() == HOST_SECRET


def test_proc_magic_link(fs: SandboxFS, root: Path) -> None:
    os.symlink("/proc/self/root", root / "proc_link")
    with pytest.raises(FileOpError) as ei:
        fs.read("/proc_link/etc/hostname")
    assert ei.value.kind in ("not_found", "crosses_mount", "invalid_path")


@needs_root
def test_proc_magic_link_with_proc_mounted(fs: SandboxFS, root: Path) -> None:
    (root / "proc").mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
    try:
        os.symlink("/proc/self/root", root / "proc_link")
        for p in ("/proc_link/etc/hostname", "/proc/self/root/etc/hostname", "/proc/1/environ"):
            with pytest.raises(FileOpError) as ei:
                fs.read(p)
            assert ei.value.kind in ("crosses_mount", "invalid_path")
        with pytest.raises(FileOpError) as ei:
            fs.list("/proc")
        assert ei.value.kind == "crosses_mount"
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], check=True)


@needs_root
def test_bind_mount_inside_root_crosses_mount(fs: SandboxFS, root: Path, host: Path) -> None:
    (root / "mnt").mkdir()
    (root / "work").mkdir()
    subprocess.run(["mount", "--bind", str(host), str(root / "mnt")], check=True)
    try:
        os.symlink("/mnt", root / "work" / "mntlink")
        for call in (
            lambda: fs.read("/mnt/secret"),
            lambda: fs.read("/work/mntlink/secret"),
            lambda: fs.write("/mnt/new", b"x"),
            lambda: fs.list("/mnt"),
            lambda: fs.stat("/mnt/secret"),
            lambda: fs.remove("/mnt/secret"),
            lambda: fs.mkdir("/mnt/sub"),
            lambda: fs.upload_tar("/mnt", _tar([_file("f", b"x")])),
            lambda: fs.remove("/", recursive=True),
        ):
            with pytest.raises(FileOpError) as ei:
                call()
            assert ei.value.kind in ("crosses_mount", "invalid_path"), ei.value
        with pytest.raises(FileOpError) as ei:
            fs.read("/mnt/secret")
        assert ei.value.kind == "crosses_mount"
        assert "/mnt/secret" in str(ei.value)
        # recursive remove of a directory containing the mount point refuses to descend
        fs.write("/wrap/x", b"x")
        (root / "wrap" / "m").mkdir()
        subprocess.run(["mount", "--bind", str(host), str(root / "wrap" / "m")], check=True)
        try:
            with pytest.raises(FileOpError) as ei:
                fs.remove("/wrap", recursive=True)
            assert ei.value.kind == "crosses_mount"
            # tar download skips the mount's contents
            with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/wrap"))) as t:
                assert "m/secret" not in t.getnames()
        finally:
            subprocess.run(["umount", str(root / "wrap" / "m")], check=True)
        assert sorted(os.listdir(host)) == ["secret"]
        assert (host / "secret").read_bytes() == HOST_SECRET
    finally:
        subprocess.run(["umount", str(root / "mnt")], check=True)


# --------------------------------------------------------------------------- tar download


def test_download_tar_dir(fs: SandboxFS, root: Path, host: Path) -> None:
    fs.write("/proj/a.py", b"A", uid=1000, gid=1000, mode=0o755)
    fs.write("/proj/sub/b.txt", b"BB", uid=1000, gid=1000)
    os.symlink(host / "secret", root / "proj" / "hostlink")
    os.symlink(host, root / "proj" / "hostdirlink")
    os.mkfifo(root / "proj" / "fifo")
    with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/proj"))) as t:
        names = sorted(t.getnames())
        assert names == ["a.py", "hostdirlink", "hostlink", "sub", "sub/b.txt"]
        a = t.getmember("a.py")
        assert (a.uid, a.gid, a.mode, a.size) == (1000, 1000, 0o755, 1)
        f = t.extractfile("a.py")
        assert f is not None and f.read() == b"A"
        f = t.extractfile("sub/b.txt")
        assert f is not None and f.read() == b"BB"
        link = t.getmember("hostlink")
        assert link.issym() and link.linkname == str(host / "secret")
        assert t.getmember("sub").isdir()
    chunks = list(fs.iter_tar("/proj", chunk_size=512))
    assert b"".join(chunks) == fs.download_tar("/proj")


def test_download_tar_file_and_errors(fs: SandboxFS) -> None:
    fs.write("/one.txt", b"one", uid=4)
    with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/one.txt"))) as t:
        assert t.getnames() == ["one.txt"]
        assert t.getmember("one.txt").uid == 4
    with pytest.raises(FileOpError) as ei:
        fs.download_tar("/nope")
    assert ei.value.kind == "not_found"


def test_download_tar_symlink_top_stays_in_root(fs: SandboxFS, root: Path, host: Path) -> None:
    os.symlink(host, root / "top")
    with pytest.raises(FileOpError) as ei:
        fs.download_tar("/top")
    assert ei.value.kind == "not_found"
    os.symlink("/etc", root / "etclink")
    with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/etclink"))) as t:
        f = t.extractfile("passwd")
        assert f is not None and f.read() == ROOT_PASSWD


# --------------------------------------------------------------------------- tar upload


def test_upload_tar_basic(fs: SandboxFS, root: Path) -> None:
    data = _tar(
        [
            _dir("pkg", 0o750),
            _file("pkg/__init__.py", b"", 0o644),
            _file("./pkg/run.sh", b"#!/bin/sh\n", 0o4755),
            _file("deep/missing/parents.txt", b"p"),
            _sym("pkg/link", "/etc/passwd"),
            _hard("pkg/hard", "pkg/run.sh"),
        ]
    )
    fs.upload_tar("/dst", data, uid=1000, gid=1000)
    d = root / "dst"
    assert (d / "pkg" / "run.sh").read_bytes() == b"#!/bin/sh\n"
    st = (d / "pkg" / "run.sh").stat()
    assert (st.st_uid, st.st_gid) == (UID_BASE + 1000, UID_BASE + 1000)
    assert st.st_mode & 0o7777 == 0o755  # setuid stripped
    assert st.st_mtime == 1_700_000_000
    assert (d / "pkg").stat().st_mode & 0o777 == 0o750
    assert (d / "pkg").stat().st_uid == UID_BASE + 1000
    assert (d / "deep" / "missing" / "parents.txt").read_bytes() == b"p"
    assert (d / "deep" / "missing").stat().st_uid == UID_BASE + 1000
    assert os.readlink(d / "pkg" / "link") == "/etc/passwd"
    assert os.lstat(d / "pkg" / "link").st_uid == UID_BASE + 1000
    assert (d / "pkg" / "hard").stat().st_ino == st.st_ino
    # round trip
    fs.upload_tar("/copy", fs.download_tar("/dst"))
    assert (root / "copy" / "pkg" / "run.sh").read_bytes() == b"#!/bin/sh\n"
    assert fs.stat("/copy/pkg/link").link_target == "/etc/passwd"


def test_upload_tar_from_stream(fs: SandboxFS, root: Path) -> None:
    data = _tar([_file("a", b"A"), _file("b/c", b"C")])

    class NonSeekable(io.RawIOBase):
        def __init__(self, raw: bytes) -> None:
            self._b = io.BytesIO(raw)

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return False

        def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
            n = self._b.readinto(buf)
            return n

    fs.upload_tar("/s", NonSeekable(data))  # type: ignore[arg-type]
    assert (root / "s" / "b" / "c").read_bytes() == b"C"
    fs.upload_tar("/s2", io.BytesIO(data))
    assert (root / "s2" / "a").read_bytes() == b"A"


def test_upload_tar_overwrites_existing_symlink_instead_of_following(fs: SandboxFS, root: Path, host: Path) -> None:
    fs.mkdir("/dst")
    os.symlink(host / "secret", root / "dst" / "f")  # planted by the sandbox
    fs.upload_tar("/dst", _tar([_file("f", b"replaced")]))
    assert not (root / "dst" / "f").is_symlink()
    assert (root / "dst" / "f").read_bytes() == b"replaced"
    assert (host / "secret").read_bytes() == HOST_SECRET


@pytest.mark.parametrize(
    "members",
    [
        [_file("../x", b"x")],
        [_file("a/../../x", b"x")],
        [_file("/abs", b"x")],
        [_file("ok", b"x"), _file("/etc/evil", b"x")],
        [_hard("h", "../../etc/passwd")],
        [_hard("h", "/etc/passwd")],
        [_hard("h", "never_extracted")],
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "absolute-later", "hard-dotdot", "hard-abs", "hard-unknown"],
)
def test_upload_tar_rejects_bad_names(fs: SandboxFS, root: Path, tmp_path: Path, members: list) -> None:  # type: ignore[type-arg]
    with pytest.raises(FileOpError) as ei:
        fs.upload_tar("/dst", _tar(members))
    assert ei.value.kind == "invalid_path"
    assert not (tmp_path / "x").exists()
    assert not (root / "x").exists()
    assert not (root / "dst" / "h").exists()
    assert (root / "etc" / "passwd").read_bytes() == ROOT_PASSWD


def test_upload_tar_rejects_devices_and_fifos(fs: SandboxFS, root: Path) -> None:
    for typ in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
        ti = tarfile.TarInfo("dev")
        ti.type = typ
        ti.devmajor, ti.devminor = 8, 0
        with pytest.raises(FileOpError) as ei:
            fs.upload_tar("/dst", _tar([(ti, None)]))
        assert ei.value.kind == "invalid_path"
    assert not (root / "dst" / "dev").exists()


def test_upload_tar_hardlink_to_host_file_refused(fs: SandboxFS, root: Path, host: Path) -> None:
    with pytest.raises(FileOpError):
        fs.upload_tar("/dst", _tar([_hard("h", str(host / "secret"))]))
    with pytest.raises(FileOpError):
        fs.upload_tar("/dst", _tar([_hard("h", "../" * 10 + str(host / "secret").lstrip("/"))]))
    assert os.stat(host / "secret").st_nlink == 1
    assert not (root / "dst" / "h").exists()


def test_upload_tar_hardlink_after_symlink_swap_refused(fs: SandboxFS, root: Path, host: Path) -> None:
    # file "f", then symlink "f" replaces it pointing at a host file, then hard link "h" -> "f"
    data = _tar([_file("f", b"x"), _sym("f", str(host / "secret")), _hard("h", "f")])
    with pytest.raises(FileOpError) as ei:
        fs.upload_tar("/dst", data)
    assert ei.value.kind == "invalid_path"
    assert os.stat(host / "secret").st_nlink == 1


@pytest.mark.parametrize("target_kind", ["absolute", "relative"])
def test_upload_tar_symlink_then_file_through_it(fs: SandboxFS, root: Path, host: Path, target_kind: str) -> None:
    target = str(host) if target_kind == "absolute" else "../" * 12 + str(host).lstrip("/")
    data = _tar([_sym("link", target), _file("link/pwned", b"pwned"), _file("link/secret", b"overwritten")])
    try:
        fs.upload_tar("/dst", data)
    except FileOpError as exc:
        assert exc.kind in ("not_found", "exists", "not_a_directory", "crosses_mount", "invalid_path")
    else:  # resolved inside the root: files landed under root/<host path>
        assert (root / str(host).lstrip("/") / "pwned").read_bytes() == b"pwned"
    assert sorted(os.listdir(host)) == ["secret"]
    assert (host / "secret").read_bytes() == HOST_SECRET


def test_upload_tar_symlink_then_file_resolves_inside_root(fs: SandboxFS, root: Path, host: Path) -> None:
    mirror = root / str(host).lstrip("/")
    mirror.mkdir(parents=True)  # the host dir's path also exists inside the root
    host_rel = str(host / "secret").lstrip("/")
    data = _tar(
        [
            _sym("abs", str(host)),
            _file("abs/secret", b"via-abs"),
            _sym("slash", "/"),
            _file("slash/" + host_rel, b"via-slash"),
            _sym("up", "../" * 12),
            _file("up/" + str(host).lstrip("/") + "/up.txt", b"via-up"),
        ]
    )
    fs.upload_tar("/dst", data, uid=1)
    assert (host / "secret").read_bytes() == HOST_SECRET
    assert sorted(os.listdir(host)) == ["secret"]
    assert (mirror / "secret").read_bytes() == b"via-slash"
    assert (mirror / "up.txt").read_bytes() == b"via-up"
    assert (mirror / "secret").stat().st_uid == UID_BASE + 1


def test_upload_tar_file_through_file_symlink(fs: SandboxFS, root: Path, host: Path) -> None:
    # symlink to a host *file*, then a regular member with the same name: replaced, not written through
    data = _tar([_sym("s", str(host / "secret")), _file("s", b"replaced")])
    fs.upload_tar("/dst", data)
    assert (root / "dst" / "s").read_bytes() == b"replaced"
    assert (host / "secret").read_bytes() == HOST_SECRET


def test_upload_tar_dest_is_symlink_outside(fs: SandboxFS, root: Path, host: Path) -> None:
    os.symlink(host, root / "dst")
    try:
        fs.upload_tar("/dst", _tar([_file("f", b"x")]))
    except FileOpError:
        pass
    else:
        assert (root / str(host).lstrip("/") / "f").read_bytes() == b"x"
    assert sorted(os.listdir(host)) == ["secret"]


def test_upload_tar_garbage(fs: SandboxFS) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.upload_tar("/dst", b"this is not a tar archive" * 40)
    assert ei.value.kind == "invalid_path"


def test_uid_out_of_range(fs: SandboxFS) -> None:
    with pytest.raises(FileOpError) as ei:
        fs.write("/f", b"x", uid=-1)
    assert ei.value.kind == "invalid_path"
    with pytest.raises(FileOpError):
        fs.mkdir("/d", gid=1 << 20)
