"""Tests for sandfleet.runtime.sandboxfs: fd-relative, openat2-confined sandbox file operations."""

from __future__ import annotations

import io
import os
import resource
import shlex
import subprocess
import tarfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandfleet.client._base import extract_tar
from sandfleet.runtime.sandboxfs import walk as walk_mod
from sandfleet.runtime.sandboxfs.fs import SandboxFS
from sandfleet.runtime.sandboxfs.paths import MAX_MEMBER_NAME, mount_points
from sandfleet.runtime.sandboxfs.results import FileOpError, FileStat, FileTooLargeError
from sandfleet.runtime.sandboxfs.tar_download import TarStream

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


@pytest.mark.parametrize("bad", ["", "/a/\0b", "/a/../b", "/..", "a/\0b"])
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


def test_user_xattrs_written_replaced_and_reported(fs: SandboxFS, root: Path) -> None:
    fs.write("/x/f", b"1", attrs={"e2b.author": "mish", "tag": "a b"})
    assert os.getxattr(root / "x" / "f", "user.e2b.author") == b"mish"
    assert fs.stat("/x/f").xattrs == {"e2b.author": "mish", "tag": "a b"}
    # the name is always under `user.`: no other namespace is reachable (security., trusted.)
    fs.write("/x/g", b"2", attrs={"security.evil": "1", "trusted.x": "2"})
    assert sorted(os.listxattr(root / "x" / "g")) == ["user.security.evil", "user.trusted.x"]
    os.setxattr(root / "x" / "f", "user.raw", b"\xff\xfe")  # not text: left out, never altered
    os.setxattr(root / "x" / "f", "user.out-of-band", b"set inside")
    assert fs.stat("/x/f").xattrs == {"e2b.author": "mish", "tag": "a b", "out-of-band": "set inside"}
    fs.write("/x/f", b"22")  # no attrs: the file keeps them
    assert fs.stat("/x/f").xattrs is not None
    fs.write("/x/f", b"333", attrs={"tag": "b"})  # attrs: exactly these
    assert fs.stat("/x/f").xattrs == {"tag": "b"}
    assert os.listxattr(root / "x" / "f") == ["user.tag"]
    fs.write("/x/f", b"4", attrs={})
    assert fs.stat("/x/f").xattrs is None
    os.setxattr(root / "x", "user.d", b"dir")
    os.symlink("g", root / "x" / "lnk")
    assert all(e.xattrs is None for e in fs.list("/x"))  # a listing reads them when asked
    by = {e.name: e for e in fs.list("/x", xattrs=True)}
    assert (by["f"].xattrs, by["lnk"].xattrs) == (None, None)  # a symlink carries none
    assert by["g"].xattrs == {"security.evil": "1", "trusted.x": "2"}
    assert fs.stat("/x").xattrs == {"d": "dir"}
    assert fs.stat("/x/lnk", follow_symlinks=True).xattrs == by["g"].xattrs
    fs.write("/x/lnk", b"via link", attrs={"k": "v"})  # through a symlink: its target's
    assert fs.stat("/x/g").xattrs == {"k": "v"}
    # A scope: only the attributes under it are replaced (E2B's layer keeps to `e2b.`).
    fs.write("/x/g", b"5", attrs={"e2b.a": "1"}, attrs_scope="e2b.")
    fs.write("/x/g", b"6", attrs={"e2b.b": "2"}, attrs_scope="e2b.")
    assert fs.stat("/x/g").xattrs == {"k": "v", "e2b.b": "2"}


@needs_root
def test_what_a_sandbox_sets_is_reported_within_bounds(tmp_path: Path) -> None:
    """A sandbox sets what it likes on its own files (on tmpfs, its writable layer's): a stat or a
    listing reports at most READ_COUNT attributes, no value past READ_VALUE, a bounded total per
    listing, and a file with more names than can be listed reports none, never an error."""
    from sandfleet.runtime.sandboxfs import xattrs

    root = tmp_path / "t"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=100000", "t", str(root)], check=True)
    try:
        many, big, flood = root / "many", root / "big", root / "flood"
        for f in (many, big, flood):
            f.write_bytes(b"")
        for i in range(100):
            os.setxattr(many, f"user.n{i:03}", b"v")
        os.setxattr(big, "user.small", b"s")
        os.setxattr(big, "user.huge", b"h" * (xattrs.READ_VALUE + 1))
        for i in range(2000):  # more names than one listxattr returns (E2BIG)
            os.setxattr(flood, "user." + f"{i:04}".ljust(240, "x"), b"")
        fd = os.open(root, os.O_PATH)
        try:
            sfs = SandboxFS(fd, uid_base=0)
            assert len(sfs.stat("/many").xattrs or {}) == xattrs.READ_COUNT
            assert sfs.stat("/big").xattrs == {"small": "s"}
            assert sfs.stat("/flood").xattrs is None
            by = {e.name: e.xattrs for e in sfs.list("/", xattrs=True)}
            assert by["big"] == {"small": "s"} and by["flood"] is None
            budget = xattrs.Budget(64)
            f = os.open(many, os.O_PATH)
            try:
                assert len(xattrs.read(f, budget) or {}) < xattrs.READ_COUNT and budget.left <= 0
                assert xattrs.read(f, budget) is None  # spent: later entries report none
            finally:
                os.close(f)
            with pytest.raises(FileOpError) as refused:
                sfs.write("/flood", b"x", attrs={})
            assert refused.value.kind == "too_large"
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(root)], check=True)


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
            assert ei.value.kind == "permission_denied"
            assert "/wrap/m" in str(ei.value)
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


# --------------------------------------------------------------------------- deep and wide trees


@pytest.fixture
def tmpfs_root(tmp_path: Path) -> Iterator[Path]:
    """A sandbox root on its own tmpfs (what a sandbox's writable layer is), else on tmp_path."""
    r = tmp_path / "troot"
    r.mkdir()
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "sf-test", str(r)]).returncode == 0
    (r / "etc").mkdir()
    (r / "etc" / "passwd").write_bytes(ROOT_PASSWD)
    try:
        yield r
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(r)], check=True)
        elif r.exists():
            subprocess.run(["rm", "-rf", str(r)], check=True)  # copes with any depth


def _fs_of(root: Path, **kw: object) -> tuple[SandboxFS, int]:
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    return SandboxFS(fd, uid_base=UID_BASE, **kw), fd  # type: ignore[arg-type]


def _chain(root: Path, top: str, depth: int, *, files: bool = False, below: int = 0) -> None:
    """root/top/d/d/.../d (``depth`` levels below top), made through fds at any depth, with a file
    "f" in each directory on the way if ``files``; with ``below``, top and that many levels
    already exist and the chain is extended below them."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    existing = [top] + ["d"] * below if below else []
    try:
        for i, name in enumerate(existing + ["d"] * depth if below else [top] + ["d"] * depth):
            if i >= len(existing):
                os.mkdir(name, dir_fd=fd)
                if files:
                    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


class _FdCap:
    """Caps RLIMIT_NOFILE at the fds open now plus ``extra`` (the old walk needed one per level)."""

    def __init__(self, extra: int) -> None:
        self.extra = extra

    def __enter__(self) -> int:
        self.saved = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.before = _fd_count()
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.before + self.extra, self.saved[1]))
        return self.before

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, self.saved)


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def _measure(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, bytes the peak RSS grew by) of fn(): the kernel's high-water mark is reset first
    (clear_refs 5), so earlier tests do not hide growth; tracemalloc where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        base = _vm("VmRSS")
    except OSError:
        base = -1
    if base < 0:
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
    t = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - t
        if tracemalloc.is_tracing():
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        else:
            peak = _vm("VmHWM")
    return elapsed, peak - base


def test_remove_20000_deep_chain_bounded_fds_and_memory(tmpfs_root: Path, request: pytest.FixtureRequest) -> None:
    _chain(tmpfs_root, "deep", 20_000, files=True)
    fs, fd = _fs_of(tmpfs_root)
    try:
        with _FdCap(16) as before:
            elapsed, peak = _measure(lambda: fs.remove("/deep", recursive=True))
        assert _fd_count() == before
    finally:
        os.close(fd)
    assert not (tmpfs_root / "deep").exists()
    request.node.user_properties.append(("seconds", round(elapsed, 2)))
    request.node.user_properties.append(("rss_peak_growth_kib", peak // 1024))
    assert peak < 16 * 1024**2  # ~20 bytes of names and offsets per level (the old walk: ~240 MiB at 15,000)
    assert elapsed < 60


def test_download_2000_deep_tree(tmpfs_root: Path, request: pytest.FixtureRequest) -> None:
    _chain(tmpfs_root, "deep", 2000, files=True)
    fs, fd = _fs_of(tmpfs_root)
    try:
        with _FdCap(16) as before:
            elapsed, peak = _measure(lambda: fs.download_tar("/deep"))
            data = fs.download_tar("/deep")
        assert _fd_count() == before
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            names = t.getnames()
            assert "/".join(["d"] * 2000) in names  # 3,999 bytes
            f = t.extractfile("/".join(["d"] * 1999) + "/f")
            assert f is not None and f.read() == b""
        assert len(names) == 2 * 2000
        request.node.user_properties.append(("seconds", round(elapsed, 2)))
        request.node.user_properties.append(("rss_peak_growth_kib", peak // 1024))
        assert peak < 64 * 1024**2  # the archive itself is ~14 MB here (bytes); the walk adds little
        # Deeper than a tar member name can be: a clean typed refusal before any byte, not a crash.
        _chain(tmpfs_root, "deep", 100, below=2000)
        with _FdCap(16), pytest.raises(FileTooLargeError) as ei:
            fs.iter_tar("/deep")
        assert ei.value.kind == "too_large"
        assert f"more than {MAX_MEMBER_NAME}" in str(ei.value) and len(str(ei.value)) < 1000
        assert _fd_count() == before
        # a subdirectory of it is fine
        sub = "/deep/" + "/".join(["d"] * 1000)
        with tarfile.open(fileobj=io.BytesIO(fs.download_tar(sub))) as t:
            assert max(len(n) for n in t.getnames()) < MAX_MEMBER_NAME
    finally:
        os.close(fd)


def _tree(root: Path, depth: int, width: int, files: int) -> set[str]:
    """A tree ``depth`` deep with ``width`` subdirectories and ``files`` files per directory on the
    first path; returns the member names a download of it must have."""
    expect: set[str] = set()
    cur, rel = root, ""
    for level in range(depth):
        for i in range(files):
            (cur / f"f{i}").write_bytes(f"{level}/{i}".encode())
            expect.add(f"{rel}f{i}")
        for i in range(width):
            (cur / f"s{i}").mkdir()
            expect.add(f"{rel}s{i}")
            (cur / f"s{i}" / "leaf").write_bytes(b"leaf")
            expect.add(f"{rel}s{i}/leaf")
        cur, rel = cur / "s0", f"{rel}s0/"
    return expect


@pytest.mark.parametrize("getdents", [True, False], ids=["getdents64", "listdir-fallback"])
def test_wide_and_deep_tree_walks(tmpfs_root: Path, monkeypatch: pytest.MonkeyPatch, getdents: bool) -> None:
    if not getdents:
        monkeypatch.setattr(walk_mod, "_GETDENTS64", None)
    top = tmpfs_root / "t"
    top.mkdir()
    expect = _tree(top, depth=3 * 8 + 3, width=40, files=30)  # deeper than the fd window, wide levels
    os.symlink("/etc/passwd", top / "s1" / "link")
    os.mkfifo(top / "s2" / "fifo")
    expect.add("s1/link")
    fs, fd = _fs_of(tmpfs_root)
    try:
        with _FdCap(16) as before:
            with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/t"))) as t:
                members = {m.name: m for m in t.getmembers()}
                assert set(members) == expect
                assert members["s1/link"].issym() and members["s1/link"].linkname == "/etc/passwd"
                f = t.extractfile("s0/s0/s0/f7")
                assert f is not None and f.read() == b"3/7"
            fs.remove("/t", recursive=True)
        assert _fd_count() == before
    finally:
        os.close(fd)
    assert not top.exists()


def test_walk_stops_when_the_sandbox_moves_a_directory_out(tmpfs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory moved elsewhere while a recursive remove is below it: the walk stops with
    'changed' when climbing back, and nothing in the place it was moved to is touched."""
    real_descend = walk_mod._Walk.descend
    for moved_level in (3, 25):  # an fd the walk closed (reopened as ..), and one it kept
        _chain(tmpfs_root, "t", 30, files=True)
        (tmpfs_root / "elsewhere").mkdir()
        (tmpfs_root / "elsewhere" / "keep").write_bytes(b"keep")
        moved = tmpfs_root / "t" / "/".join(["d"] * moved_level)
        done: list[int] = []

        def descend(self: walk_mod._Walk, name: bytes, moved: Path = moved, done: list[int] = done) -> None:
            real_descend(self, name)
            if self.depth == 29 and not done:
                done.append(1)
                os.rename(moved, tmpfs_root / "elsewhere" / "moved")

        monkeypatch.setattr(walk_mod._Walk, "descend", descend)
        fs, fd = _fs_of(tmpfs_root)
        try:
            before = _fd_count()
            with pytest.raises(FileOpError) as ei:
                fs.remove("/t", recursive=True)
            assert ei.value.kind == "changed", ei.value
            assert _fd_count() == before
        finally:
            os.close(fd)
        monkeypatch.undo()
        assert done
        assert (tmpfs_root / "elsewhere" / "keep").read_bytes() == b"keep"
        assert (tmpfs_root / "elsewhere" / "moved").is_dir()
        assert (tmpfs_root / "t").is_dir()  # the walk stopped: it did not continue elsewhere
        subprocess.run(["rm", "-rf", str(tmpfs_root / "t"), str(tmpfs_root / "elsewhere")], check=True)


def test_remove_picks_up_entries_created_meanwhile(tmpfs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _chain(tmpfs_root, "t", 20, files=True)
    real_descend = walk_mod._Walk.descend
    made: list[int] = []

    def descend(self: walk_mod._Walk, name: bytes) -> None:
        real_descend(self, name)
        if self.depth == 20 and not made:  # the sandbox adds files in a directory already walked
            made.append(1)
            for i in range(50):
                (tmpfs_root / "t" / "d" / "d" / f"new{i}").write_bytes(b"x")

    monkeypatch.setattr(walk_mod._Walk, "descend", descend)
    fs, fd = _fs_of(tmpfs_root)
    try:
        fs.remove("/t", recursive=True)
    finally:
        os.close(fd)
    assert made and not (tmpfs_root / "t").exists()


def test_walk_entry_cap(tmpfs_root: Path) -> None:
    (tmpfs_root / "t").mkdir()
    _tree(tmpfs_root / "t", depth=2, width=10, files=10)
    fs, fd = _fs_of(tmpfs_root, max_entries=50)
    try:
        with pytest.raises(FileTooLargeError):
            fs.iter_tar("/t")
        with pytest.raises(FileTooLargeError):
            fs.remove("/t", recursive=True)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- streaming and sparse files


def test_sparse_1gib_file_against_64mib_cap(fs: SandboxFS, root: Path, tmp_path: Path) -> None:
    (root / "w").mkdir()
    with open(root / "w" / "big", "wb") as f:  # 1 GiB apparent, a few KiB stored
        f.truncate(1 << 30)
        f.write(b"head")
        f.seek(512 << 20)
        f.write(b"middle" * 1000)
        f.seek((1 << 30) - 3)
        f.write(b"end")
    (root / "w" / "small").write_bytes(b"small\n")
    for i in range(10):  # ten more: 10 GiB apparent in all
        with open(root / "w" / f"hole{i}", "wb") as f:
            f.truncate(1 << 30)
    stream = fs.iter_tar("/w", chunk_size=4096, max_bytes=64 << 20)
    assert isinstance(stream, TarStream)
    assert stream.content_bytes < 1 << 20  # charged by what is stored
    chunks = list(stream)
    assert all(len(c) == 4096 for c in chunks[:-1])
    data = b"".join(chunks)
    assert len(data) < 1 << 20  # holes cost nothing in the stream either
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        big = t.getmember("big")
        assert big.size == 1 << 30 and big.sparse
        member = t.extractfile(big)
        assert member is not None
        assert member.read(4) == b"head"
        member.seek(512 << 20)
        assert member.read(12) == b"middlemiddle"
        member.seek((1 << 30) - 3)
        assert member.read() == b"end"
        assert t.getmember("hole3").size == 1 << 30
    # what the SDK does with a download: the holes come back as holes
    out = tmp_path / "out"
    extract_tar(data, out)
    st = os.stat(out / "big")
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < 1 << 20
    with open(out / "big", "rb") as fh:
        fh.seek(512 << 20)
        assert fh.read(6) == b"middle"
    assert (out / "small").read_bytes() == b"small\n"
    # GNU tar agrees
    (tmp_path / "a.tar").write_bytes(data)
    listing = subprocess.run(["tar", "-tvf", str(tmp_path / "a.tar")], capture_output=True, text=True, check=True)
    assert "1073741824 " in listing.stdout and "GNUSparseFile" not in listing.stdout
    # and an upload of it writes the holes as holes
    fs.upload_tar("/copy", data)
    st = os.stat(root / "copy" / "big")
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < 1 << 20
    with open(root / "copy" / "big", "rb") as fh:
        fh.seek((1 << 30) - 3)
        assert fh.read() == b"end"


def test_download_over_cap_refused_before_any_chunk(fs: SandboxFS, root: Path) -> None:
    (root / "w").mkdir()
    (root / "w" / "a").write_bytes(os.urandom(600 << 10))
    (root / "w" / "b").write_bytes(os.urandom(600 << 10))
    before = _fd_count()
    with pytest.raises(FileTooLargeError) as ei:
        fs.iter_tar("/w", max_bytes=1 << 20)
    assert ei.value.kind == "too_large" and "archive would exceed" in str(ei.value)
    with pytest.raises(FileTooLargeError):
        fs.download_tar("/w/a", max_bytes=512 << 10)
    assert _fd_count() == before
    assert len(fs.download_tar("/w", max_bytes=2 << 20)) > 1 << 20
    # the instance default (max_archive) applies when max_bytes is not given
    small = SandboxFS(fs.root_fd, uid_base=UID_BASE, max_archive=1 << 20)
    with pytest.raises(FileTooLargeError):
        small.download_tar("/w")


def test_iter_tar_streams_and_outlives_the_root_fd(root: Path) -> None:
    (root / "w").mkdir()
    payload = os.urandom(3 << 20)
    (root / "w" / "f").write_bytes(payload)
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    fs = SandboxFS(rfd, uid_base=UID_BASE)
    stream = fs.iter_tar("/w", chunk_size=64 << 10)
    os.close(rfd)  # the daemon closes the root fd once the op returned
    first = next(stream)
    assert len(first) == 64 << 10  # produced while walking: no spooling of the whole archive
    data = first + b"".join(stream)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        f = t.extractfile("f")
        assert f is not None and f.read() == payload
    before = _fd_count()
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    s2 = SandboxFS(rfd, uid_base=UID_BASE).iter_tar("/w", chunk_size=4096)
    os.close(rfd)
    next(s2)
    s2.close()  # abandoned mid-way (client went away): its fds are closed
    assert _fd_count() == before
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    with SandboxFS(rfd, uid_base=UID_BASE).iter_tar("/w") as s3:  # a context manager too
        os.close(rfd)
        assert next(s3)
    assert _fd_count() == before
    # write_tar still works on a file object
    buf = io.BytesIO()
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        SandboxFS(rfd, uid_base=UID_BASE).write_tar("/w", buf)
    finally:
        os.close(rfd)
    assert buf.getvalue() == data


# --------------------------------------------------------------------------- mount points


def test_mount_points_parsing() -> None:
    text = (
        "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l/1\n"
        "23 22 0:22 / /proc rw,nosuid - proc proc rw\n"
        "24 22 0:23 /dev /dev rw - tmpfs sandfleet-scratch rw\n"
        "25 22 0:24 / /my\\040dir/with\\011tab rw - tmpfs x rw\n"
        "26 22 0:25 / /back\\134slash/new\\012line rw - tmpfs x rw\n"
        "27 22 254:0 /hosts /etc/hosts ro - ext4 /dev/vda ro\n"
        "\n"
        "garbage\n"
    )
    assert mount_points(text) == {
        "/",
        "/proc",
        "/dev",
        "/my dir/with\ttab",
        "/back\\slash/new\nline",
        "/etc/hosts",
    }
    assert mount_points(text.encode()) == mount_points(text)
    assert mount_points(Path("/proc/self/mountinfo").read_text()) >= {"/"}


@pytest.fixture
def foreign_mounts(root: Path, tmp_path: Path) -> Iterator[tuple[int, int, frozenset[str]]]:
    """The sandbox root as the daemon sees it: through /proc/<pid>/root of a process in another
    mount namespace that has mounts inside the root, which are no mount points in ours (so the
    kernel's own EBUSY checks of rmdir/unlink do not apply). Yields (pid, root fd, mount points)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount namespaces)")
    (root / "m").mkdir()
    (root / "m2").mkdir()
    (root / "work" / "inner" / "mnt").mkdir(parents=True)
    (root / "work" / "keep").write_bytes(b"keep")
    (root / "etc" / "hosts").write_bytes(b"image hosts\n")
    src = tmp_path / "hosts.src"
    src.write_bytes(b"bound hosts\n")
    r = shlex.quote(str(root))
    script = (
        f"mount -t tmpfs sf-a {r}/m && mount -t tmpfs sf-b {r}/work/inner/mnt && mount -t tmpfs sf-c {r}/m2"
        f" && mount --bind {shlex.quote(str(src))} {r}/etc/hosts && echo ready && exec sleep 600"
    )
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"ready\n"
        fd = os.open(f"/proc/{proc.pid}/root{root}", os.O_PATH | os.O_DIRECTORY)
        host = mount_points(Path(f"/proc/{proc.pid}/mountinfo").read_bytes())
        inside = frozenset("/" + m[len(str(root)) :].lstrip("/") for m in host if m.startswith(f"{root}/"))
        try:
            yield proc.pid, fd, inside | {"/"}
        finally:
            os.close(fd)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _still_mounted(pid: int, root: Path) -> set[str]:
    return {m for m in mount_points(Path(f"/proc/{pid}/mountinfo").read_text()) if m.startswith(f"{root}/")}


def test_mount_points_refused_by_statx(foreign_mounts: tuple[int, int, frozenset[str]], root: Path) -> None:
    pid, rfd, points = foreign_mounts
    assert points == {"/", "/m", "/m2", "/work/inner/mnt", "/etc/hosts"}
    mounted = _still_mounted(pid, root)
    assert len(mounted) == 4
    fs = SandboxFS(rfd, uid_base=UID_BASE)  # no mount_points given: statx alone must catch them
    calls: list[Callable[[], object]] = [
        lambda: fs.remove("/m"),
        lambda: fs.remove("/m", recursive=True),
        lambda: fs.remove("/etc/hosts"),
        lambda: fs.upload_tar("/etc", _tar([_file("hosts", b"replaced")])),
        lambda: fs.upload_tar("/", _tar([_file("m", b"a file over a mount point")])),
        lambda: fs.upload_tar("/", _tar([_sym("m2", "/tmp")])),
        lambda: fs.remove("/work", recursive=True),  # found during the walk
    ]
    for call in calls:
        with pytest.raises(FileOpError) as ei:
            call()
        assert ei.value.kind == "permission_denied", ei.value
        assert "mount point" in str(ei.value)
    for call in (lambda: fs.write("/etc/hosts", b"x"), lambda: fs.mkdir("/m/sub")):
        with pytest.raises(FileOpError) as ei:
            call()
        assert ei.value.kind in ("crosses_mount", "permission_denied")
    assert _still_mounted(pid, root) == mounted
    with open(f"/proc/{pid}/root{root}/etc/hosts", "rb") as f:
        assert f.read() == b"bound hosts\n"


def test_mount_points_refused_up_front(foreign_mounts: tuple[int, int, frozenset[str]], root: Path) -> None:
    pid, rfd, points = foreign_mounts
    mounted = _still_mounted(pid, root)
    fs = SandboxFS(rfd, uid_base=UID_BASE, mount_points=points)
    with pytest.raises(FileOpError) as ei:
        fs.remove("/work", recursive=True)
    assert ei.value.kind == "permission_denied" and "/work/inner/mnt" in str(ei.value)
    assert (root / "work" / "keep").read_bytes() == b"keep"  # refused before anything was removed
    for p in ("/m", "/etc/hosts"):
        calls: list[Callable[[str], None]] = [
            lambda p: fs.remove(p, recursive=True),
            lambda p: fs.mkdir(p),
            lambda p: fs.write(p, b""),
        ]
        for call in calls:
            with pytest.raises(FileOpError) as ei:
                call(p)
            assert ei.value.kind == "permission_denied", ei.value
    for p in ("/", ".", "..", "/.."):
        with pytest.raises(FileOpError) as ei:
            fs.remove(p, recursive=True)
        assert ei.value.kind == "invalid_path"
    # "/" being a mount point does not stop work inside it
    fs.upload_tar("/", _tar([_file("new.txt", b"new")]))
    fs.write("/w/x", b"x")
    fs.remove("/w", recursive=True)
    assert fs.read("/new.txt") == b"new"
    assert _still_mounted(pid, root) == mounted


# --------------------------------------------------------------------------- relative paths


def test_relative_paths_resolve_against_cwd(root: Path) -> None:
    (root / "work").mkdir()
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fs = SandboxFS(fd, uid_base=UID_BASE, cwd="/work")
        fs.write("a.txt", b"A")
        assert (root / "work" / "a.txt").read_bytes() == b"A"
        assert fs.read("a.txt") == b"A" == fs.read("./a.txt") == fs.read("/work/a.txt")
        assert fs.stat("a.txt").path == "/work/a.txt"
        assert fs.read("../etc/passwd") == ROOT_PASSWD
        assert fs.read("../../../../../etc/passwd") == ROOT_PASSWD  # '..' clamped at the root
        fs.mkdir("sub/deeper")
        assert [e.name for e in fs.list(".")] == ["a.txt", "sub"]
        assert [e.path for e in fs.list("sub")] == ["/work/sub/deeper"]
        fs.upload_tar("up", _tar([_file("f", b"F")]))
        assert (root / "work" / "up" / "f").read_bytes() == b"F"
        with tarfile.open(fileobj=io.BytesIO(fs.download_tar("."))) as t:
            assert {"a.txt", "sub", "sub/deeper", "up", "up/f"} <= set(t.getnames())
        fs.remove("sub", recursive=True)
        assert not (root / "work" / "sub").exists()
        with pytest.raises(FileOpError) as ei:
            fs.read("/work/../etc/passwd")  # absolute paths still may not use '..'
        assert ei.value.kind == "invalid_path"
        # a symlinked cwd is resolved by the kernel, inside the root
        os.symlink("/work", root / "wl")
        assert SandboxFS(fd, uid_base=UID_BASE, cwd="/wl").read("a.txt") == b"A"
        # the default cwd is the root
        assert SandboxFS(fd, uid_base=UID_BASE).read("etc/passwd") == ROOT_PASSWD
        with pytest.raises(FileOpError):
            SandboxFS(fd, uid_base=UID_BASE, cwd="work")
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- users


def _big_passwd(path: Path, size: int, last: bytes) -> None:
    with open(path, "wb") as f:
        f.write(ROOT_PASSWD)
        line = 0
        written = len(ROOT_PASSWD)
        while written < size:
            block = b"".join(
                b"user%d:x:%d:%d:gecos:/home/user%d:/bin/sh\n" % (i, i, i, i) for i in range(line, line + 5000)
            )
            f.write(block)
            written += len(block)
            line += 5000
        f.write(last)


def test_lookup_user_streams_a_10mb_passwd(fs: SandboxFS, root: Path, request: pytest.FixtureRequest) -> None:
    passwd = root / "etc" / "passwd"
    _big_passwd(passwd, 10 << 20, b"alice:x:1234:4321:Alice:/home/alice:/bin/sh\n")
    assert passwd.stat().st_size > 10 << 20
    result: list[object] = []
    elapsed, peak = _measure(lambda: result.append(fs.lookup_user("alice", max_bytes=16 << 20)))
    assert result == [(1234, 4321, "/home/alice")]
    request.node.user_properties.append(("seconds", round(elapsed, 2)))
    request.node.user_properties.append(("rss_peak_growth_kib", peak // 1024))
    assert peak < 4 << 20  # 64 KiB reads, one line at a time (reading it whole: ~30 MiB)
    assert fs.lookup_user("root") == (0, 0, "/root")
    assert fs.lookup_user("user17") == (17, 17, "/home/user17")
    with pytest.raises(FileTooLargeError) as ei:  # past max_bytes (default 4 MiB) without finding it
        fs.lookup_user("alice")
    assert ei.value.kind == "too_large" and "alice" in str(ei.value)
    assert fs.lookup_user("nobody-here", max_bytes=16 << 20) is None


def test_lookup_user_edge_cases(fs: SandboxFS, root: Path) -> None:
    passwd = root / "etc" / "passwd"
    passwd.write_bytes(
        b"bob:" + b"y" * (100 << 10) + b":1:1::/x:/bin/sh\n"  # a line longer than 64 KiB: skipped
        b"x" * (200 << 10) + b"\n"
        b"bob:x:notanumber:1::/bad:/bin/sh\n"  # malformed: the next bob wins
        b"bob:x:\xd9\xa3:1::/bad:/bin/sh\n"  # non-ASCII digits are no ids
        b"bob:x:99999999999:1::/bad:/bin/sh\n"
        b"bob:x:7:8::/home/b\xffb:/bin/sh\n"
        b"bob:x:9:9::/second:/bin/sh\n"
        b"nohome:x:5:5:::/bin/sh\n"
        b"last:x:3:4::/l:/bin/sh"  # no final newline
    )
    assert fs.lookup_user("bob") == (7, 8, "/home/b\ufffdb")
    assert fs.lookup_user("nohome") == (5, 5, "/")
    assert fs.lookup_user("last") == (3, 4, "/l")
    for bad in ("", "bo:b", "x\ny", "yyy"):
        assert fs.lookup_user(bad) is None
    (root / "etc" / "group").write_bytes(b"wheel:x:10:root\nstaff:x:50:\n")
    assert fs.lookup_group("staff") == 50
    assert fs.lookup_group("nope") is None
    passwd.unlink()
    assert fs.lookup_user("bob") is None
    os.mkfifo(passwd)  # never opened for reading (would block)
    with pytest.raises(FileOpError) as ei:
        fs.lookup_user("bob")
    assert ei.value.kind == "invalid_path"
    passwd.unlink()
    os.symlink("/" + "../" * 5 + "etc/group", passwd)  # followed inside the root only
    assert fs.lookup_user("wheel") is None


def test_lookup_user_across_read_boundaries(fs: SandboxFS, root: Path) -> None:
    """The scanner reads 64 KiB at a time: a line may start, or its name be cut, anywhere."""
    passwd = root / "etc" / "passwd"
    for start in [*range(65536 - 12, 65536 + 3), 2 * 65536 - 5, 3 * 65536 - 1]:
        filler = b""
        while len(filler) < start - 40:
            filler += b"f%d:x:1:1::/f:/bin/sh\n" % len(filler)
        filler += b"#" * (start - len(filler) - 1) + b"\n"
        assert len(filler) == start
        passwd.write_bytes(filler + b"alice:x:11:12::/home/alice:/bin/sh\nzed:x:3:3::/z:/bin/sh")
        assert fs.lookup_user("alice") == (11, 12, "/home/alice"), start
        assert fs.lookup_user("zed") == (3, 3, "/z"), start
        assert fs.lookup_user("lice") is None
