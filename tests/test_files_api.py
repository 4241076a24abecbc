"""Functional tests of the files API (`sb.files`) against a real daemon, including path escapes."""

from __future__ import annotations

import dataclasses
import filecmp
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sandfleet import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    Resources,
    SandboxError,
    WrongStateError,
)
from sandfleet.client._base import call_write

if TYPE_CHECKING:
    from sandfleet import Client, Sandbox

MiB = 1024**2
HOST_SECRET = b"HOST MARKER - the sandbox API must never read or write this\n"


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A host file outside any sandbox; every escape test checks it is untouched."""
    host = tmp_path / "host"
    host.mkdir()
    m = host / "shadow-host-marker"
    m.write_bytes(HOST_SECRET)
    return m


def _host_untouched(marker: Path) -> None:
    assert marker.read_bytes() == HOST_SECRET
    assert sorted(p.name for p in marker.parent.iterdir()) == ["shadow-host-marker"]


def _sh(sb: Sandbox, cmd: str) -> str:
    r = sb.exec(cmd)
    assert r.exit_code == 0, (cmd, r.stderr)
    return r.stdout


# -- read / write ---------------------------------------------------------------------------------


def test_write_read_binary_empty_large(sandbox: Sandbox) -> None:
    binary = bytes(range(256)) * 16
    info = sandbox.files.write("/tmp/bin", binary)
    assert (info.path, info.type, info.size) == ("/tmp/bin", "file", len(binary))
    assert sandbox.files.read("/tmp/bin") == binary

    sandbox.files.write("/tmp/empty", b"")
    assert sandbox.files.read("/tmp/empty") == b""
    assert sandbox.files.stat("/tmp/empty").size == 0

    big = os.urandom(5 * MiB)
    assert sandbox.files.write("/tmp/big", big).size == 5 * MiB
    assert sandbox.files.read("/tmp/big") == big
    assert _sh(sandbox, "wc -c < /tmp/big").strip() == str(5 * MiB)

    # partial reads
    assert sandbox.files.read("/tmp/bin", offset=10, length=5) == binary[10:15]
    assert sandbox.files.read("/tmp/bin", offset=len(binary)) == b""

    # text, overwrite (truncates), append
    sandbox.files.write("/tmp/t", "héllo\n")
    assert sandbox.files.read_text("/tmp/t") == "héllo\n"
    sandbox.files.write("/tmp/t", "hi")
    assert sandbox.files.read("/tmp/t") == b"hi"
    sandbox.files.write("/tmp/t", b"!", append=True)
    assert sandbox.files.read("/tmp/t") == b"hi!"


def test_write_creates_parents_and_mode(sandbox: Sandbox) -> None:
    info = sandbox.files.write("/task/deep/er/a.sh", b"#!/bin/sh\necho run\n", mode=0o755)
    assert info.mode == 0o755
    assert _sh(sandbox, "/task/deep/er/a.sh") == "run\n"
    assert _sh(sandbox, "stat -c %a /task/deep/er/a.sh /task/deep") == "755\n755\n"
    sandbox.files.write("/tmp/secret", b"s", mode=0o600)
    assert _sh(sandbox, "stat -c %a /tmp/secret") == "600\n"


def test_api_and_exec_see_each_others_files(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/from-api", b"api\n")
    assert _sh(sandbox, "cat /tmp/from-api") == "api\n"
    _sh(sandbox, "mkdir -p /srv/x && printf 'exec' > /srv/x/from-exec && ln -s from-exec /srv/x/link")
    assert sandbox.files.read("/srv/x/from-exec") == b"exec"
    assert sandbox.files.read("/srv/x/link") == b"exec"  # relative symlink followed inside the sandbox
    assert sandbox.files.exists("/srv/x/from-exec")
    _sh(sandbox, "rm /srv/x/from-exec")
    assert not sandbox.files.exists("/srv/x/from-exec")
    assert sandbox.files.stat("/srv/x/link").type == "symlink"  # dangling now, still listed


def test_ownership_seen_inside(sandbox: Sandbox) -> None:
    assert sandbox.files.write("/tmp/root-owned", b"r").uid == 0
    assert _sh(sandbox, "stat -c %u:%g /tmp/root-owned") == "0:0\n"
    info = sandbox.files.write("/tmp/nobody-owned", b"n", user="nobody")
    assert (info.uid, info.gid) == (65534, 65534)
    assert _sh(sandbox, "stat -c %u:%g /tmp/nobody-owned") == "65534:65534\n"
    # nobody can write the file the API gave them
    assert sandbox.exec("echo more >> /tmp/nobody-owned", user="nobody").exit_code == 0
    d = sandbox.files.mkdir("/home/nb/sub", user="nobody")
    assert d.uid == 65534
    assert _sh(sandbox, "stat -c %u /home/nb /home/nb/sub") == "65534\n65534\n"
    # files created by a command are reported with inside-sandbox ids
    sandbox.exec("touch /tmp/made-by-nobody", user="nobody")
    st = sandbox.files.stat("/tmp/made-by-nobody")
    assert (st.uid, st.gid) == (65534, 65534)
    sandbox.exec("touch /tmp/made-by-1234 && chown 1234:4321 /tmp/made-by-1234")
    st = sandbox.files.stat("/tmp/made-by-1234")
    assert (st.uid, st.gid) == (1234, 4321)


def test_list_stat_mkdir_remove(sandbox: Sandbox) -> None:
    d = sandbox.files.mkdir("/work/a/b")
    assert (d.type, d.path, d.name) == ("dir", "/work/a/b", "b")
    sandbox.files.write("/work/a/f1", b"1")
    sandbox.files.write("/work/a/b/f2", b"22")
    _sh(sandbox, "ln -s f1 /work/a/lnk")
    entries = {f.name: f for f in sandbox.files.list("/work/a")}
    assert set(entries) == {"b", "f1", "lnk"}
    assert entries["b"].type == "dir"
    assert (entries["f1"].type, entries["f1"].size, entries["f1"].path) == ("file", 1, "/work/a/f1")
    assert (entries["lnk"].type, entries["lnk"].link_target) == ("symlink", "f1")
    assert sandbox.files.stat("/work/a/lnk", follow_symlinks=True).type == "file"
    assert sandbox.files.stat("/").type == "dir"

    # mkdir is idempotent on an existing dir; without parents a missing parent is an error
    sandbox.files.mkdir("/work/a/b")
    with pytest.raises(NotFoundError):
        sandbox.files.mkdir("/work/none/x", parents=False)
    with pytest.raises(SandboxError):
        sandbox.files.mkdir("/work/a/f1")  # a file is in the way
    with pytest.raises(NotFoundError):
        sandbox.files.list("/work/missing")
    with pytest.raises(InvalidArgumentError):
        sandbox.files.list("/work/a/f1")  # not a directory

    with pytest.raises(WrongStateError):
        sandbox.files.remove("/work/a")  # not empty
    sandbox.files.remove("/work/a/lnk")
    assert sandbox.files.read("/work/a/f1") == b"1"  # removing a symlink never removes its target
    sandbox.files.remove("/work/a/f1")
    assert not sandbox.files.exists("/work/a/f1")
    sandbox.files.remove("/work/a", recursive=True)
    assert not sandbox.files.exists("/work/a")
    assert _sh(sandbox, "ls -A /work") == ""
    with pytest.raises(NotFoundError):
        sandbox.files.remove("/work/a")
    with pytest.raises(InvalidArgumentError):
        sandbox.files.remove("/", recursive=True)
    assert sandbox.exec("ls /bin/sh").exit_code == 0


def test_xattrs_kept_on_files(sandbox: Sandbox) -> None:
    info = sandbox.files.write("/etc/group", b"root:x:0:\n", xattrs={"e2b.author": "mish"})  # a lower file
    assert info.xattrs == {"e2b.author": "mish"}
    assert sandbox.files.stat("/etc/group").xattrs == {"e2b.author": "mish"}
    assert {f.name: f.xattrs for f in sandbox.files.list("/etc", xattrs=True)}["group"] == {"e2b.author": "mish"}
    assert {f.name: f.xattrs for f in sandbox.files.list("/etc")}["group"] is None  # asked for, or not read
    assert sandbox.files.write("/etc/group", b"root:x:0:\n").xattrs == {"e2b.author": "mish"}
    assert sandbox.files.write("/etc/group", b"root:x:0:\n", xattrs={}).xattrs is None
    assert sandbox.files.stat("/etc/passwd").xattrs is None
    for bad in ("[1]", "{", '{"a": 1}', '{"": "x"}', '{"a\\u0000b": "x"}', '{"%s": "x"}' % ("n" * 201)):
        with pytest.raises(InvalidArgumentError, match="xattrs"):
            call = call_write(sandbox.id, "/tmp/x", b"", 0o644, None, False, {})
            sandbox._c._send(dataclasses.replace(call, params={**dict(call.params or {}), "xattrs": bad}))
    with pytest.raises(InvalidArgumentError, match="longer than 1024"):
        sandbox.files.write("/tmp/x", b"", xattrs={"a": "v" * 1025})
    with pytest.raises(InvalidArgumentError):  # more than a URL carries (2,048 characters of JSON)
        sandbox.files.write("/tmp/x", b"", xattrs={f"k{i}": "v" * 100 for i in range(30)})
    assert not sandbox.files.exists("/tmp/x")  # a refused write writes nothing


def test_read_errors(sandbox: Sandbox) -> None:
    with pytest.raises(NotFoundError):
        sandbox.files.read("/no/such/file")
    with pytest.raises(NotFoundError):
        sandbox.files.stat("/no/such/file")
    assert not sandbox.files.exists("/no/such/file")
    with pytest.raises(InvalidArgumentError):
        sandbox.files.read("/etc")  # a directory
    with pytest.raises(InvalidArgumentError):
        sandbox.files.write("/etc", b"x")
    with pytest.raises(PermissionDeniedError):
        sandbox.files.read("/dev/null")  # another mount
    _sh(sandbox, "mkfifo /tmp/fifo")
    with pytest.raises(InvalidArgumentError):
        sandbox.files.read("/tmp/fifo")  # never blocks on a FIFO
    with pytest.raises(InvalidArgumentError):
        sandbox.files.write("/tmp/fifo", b"x")


@pytest.mark.parametrize("path", ["", "/etc/../etc/passwd", "/tmp/a\0b"])
def test_invalid_paths(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(InvalidArgumentError):
        sandbox.files.read(path)
    with pytest.raises(InvalidArgumentError):
        sandbox.files.write(path, b"x")


@pytest.mark.parametrize(
    "path", ["/proc/self/status", "/proc/1/environ", "/proc/1/root/etc/passwd", "/sys/kernel/uevent_seqnum"]
)
def test_other_mounts_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(PermissionDeniedError):
        sandbox.files.read(path)
    with pytest.raises(PermissionDeniedError):
        sandbox.files.write(path, b"x")


def test_proc_listing_and_write_refused(sandbox: Sandbox) -> None:
    with pytest.raises(PermissionDeniedError):
        sandbox.files.list("/proc")
    with pytest.raises(PermissionDeniedError):
        sandbox.files.write("/proc/sys/kernel/hostname", b"pwned")
    with pytest.raises(PermissionDeniedError):
        sandbox.files.mkdir("/proc/newdir")
    assert _sh(sandbox, "hostname") == f"{sandbox.id}\n"


# -- upload / download ------------------------------------------------------------------------------


def _tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "empty").write_bytes(b"")
    (root / "sub" / "bin.dat").write_bytes(os.urandom(300_000))
    (root / "sub" / "deeper" / "run.sh").write_text("#!/bin/sh\necho deep\n")
    os.chmod(root / "sub" / "deeper" / "run.sh", 0o755)
    (root / "sub" / "link").symlink_to("bin.dat")


def _same_tree(a: Path, b: Path) -> None:
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only and not cmp.funny_files, (cmp.left_only, cmp.right_only)
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    for name in cmp.common_files:
        assert (a / name).is_symlink() == (b / name).is_symlink(), name
        if (a / name).is_symlink():
            assert os.readlink(a / name) == os.readlink(b / name)
        assert os.stat(a / name).st_mode & 0o100 == os.stat(b / name).st_mode & 0o100, name
    for sub in cmp.common_dirs:
        _same_tree(a / sub, b / sub)


def test_upload_and_download_tree(sandbox: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _tree(src)
    sandbox.files.upload(src, "/up")
    assert _sh(sandbox, "cat /up/a.txt; /up/sub/deeper/run.sh; readlink /up/sub/link") == "alpha\ndeep\nbin.dat\n"
    assert _sh(sandbox, "stat -c %u /up/a.txt /up/sub") == "0\n0\n"
    assert sandbox.files.read("/up/sub/bin.dat") == (src / "sub" / "bin.dat").read_bytes()

    dst = tmp_path / "dst"
    sandbox.files.download("/up", dst)
    _same_tree(src, dst)

    # a single file downloads as its basename
    one = tmp_path / "one"
    sandbox.files.download("/up/a.txt", one)
    assert [p.name for p in one.iterdir()] == ["a.txt"] and (one / "a.txt").read_text() == "alpha\n"

    # files made inside show up in the download too
    _sh(sandbox, "echo new > /up/sub/new.txt")
    dst2 = tmp_path / "dst2"
    sandbox.files.download("/up", dst2)
    assert (dst2 / "sub" / "new.txt").read_text() == "new\n"


def test_upload_as_user_and_single_file(sandbox: Sandbox, tmp_path: Path) -> None:
    f = tmp_path / "single.txt"
    f.write_text("one\n")
    sandbox.files.upload(f, "/home/in", user="nobody")
    assert _sh(sandbox, "cat /home/in/single.txt; stat -c %u /home/in/single.txt /home/in") == "one\n65534\n65534\n"


@pytest.mark.parametrize("user", ["\u00b9", "\u0663", "no such user!"])
def test_upload_as_a_user_no_system_has_is_refused(sandbox: Sandbox, tmp_path: Path, user: str) -> None:
    """Found by the fuzzer: "¹" passes str.isdigit() but not int(); it was a 500."""
    f = tmp_path / "one.txt"
    f.write_text("one\n")
    with pytest.raises(InvalidArgumentError, match="invalid user"):
        sandbox.files.upload(f, "/home/in", user=user)


def test_download_missing(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        sandbox.files.download("/no/such/dir", tmp_path / "x")
    with pytest.raises(FileNotFoundError):  # the local side is checked before anything is sent
        sandbox.files.upload(tmp_path / "does-not-exist", "/x")
    assert not sandbox.files.exists("/x")


# -- escapes ------------------------------------------------------------------------------------


def test_symlink_to_host_file_is_resolved_inside(sandbox: Sandbox, marker: Path) -> None:
    _sh(sandbox, f"ln -s {marker} /x && ln -s ../../../../../../../../..{marker} /rel")
    for link in ("/x", "/rel"):
        with pytest.raises(NotFoundError):
            sandbox.files.read(link)
        assert sandbox.files.stat(link).link_target is not None
        with pytest.raises(NotFoundError):
            sandbox.files.stat(link, follow_symlinks=True)
    # writing through the dangling link creates its target inside the sandbox, or is refused
    for link in ("/x", "/rel"):
        try:
            sandbox.files.write(link, b"pwned\n")
        except NotFoundError:
            pass
    _host_untouched(marker)
    r = sandbox.exec(f"cat {marker}")
    assert r.stdout in ("", "pwned\n")


def test_symlink_to_host_dir_is_resolved_inside(sandbox: Sandbox, marker: Path, tmp_path: Path) -> None:
    host_dir = marker.parent
    _sh(sandbox, f"ln -s {host_dir} /d && mkdir /rm && ln -s {host_dir} /rm/link && ln -s {marker} /rm/flink")
    with pytest.raises(NotFoundError):
        sandbox.files.read("/d/shadow-host-marker")
    with pytest.raises(NotFoundError):
        sandbox.files.list("/d")
    for op in (
        lambda: sandbox.files.write("/d/new", b"x"),
        lambda: sandbox.files.mkdir("/d/newdir"),
        lambda: sandbox.files.remove("/d/shadow-host-marker"),
        lambda: sandbox.files.download("/d", tmp_path / "dl"),
    ):
        try:
            op()
        except SandboxError:
            pass
    assert not (tmp_path / "dl").exists() or not any((tmp_path / "dl").rglob("*shadow*"))
    _host_untouched(marker)

    # upload into a symlinked destination stays inside
    up = tmp_path / "up"
    up.mkdir()
    (up / "dropped").write_text("x")
    try:
        sandbox.files.upload(up, "/d")
    except SandboxError:
        pass
    _host_untouched(marker)

    # recursive remove does not follow the symlinks it finds
    sandbox.files.remove("/rm", recursive=True)
    assert not sandbox.files.exists("/rm")
    _host_untouched(marker)


def test_download_does_not_follow_inner_symlinks(sandbox: Sandbox, marker: Path, tmp_path: Path) -> None:
    _sh(sandbox, f"mkdir /dl && ln -s {marker} /dl/abs && echo in > /dl/inner")
    data = sandbox.files.download_tar("/dl")
    assert HOST_SECRET not in data
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"abs", "inner"}
    assert members["abs"].issym() and members["abs"].linkname == str(marker)


def test_proc_root_symlink_refused(sandbox: Sandbox, marker: Path) -> None:
    _sh(sandbox, "ln -s /proc/1/root /pr && ln -s /proc/self/cwd /pc")
    for path in ("/pr/etc/passwd", f"/pr{marker}", "/pc/etc/passwd"):
        with pytest.raises((PermissionDeniedError, NotFoundError, InvalidArgumentError)):
            sandbox.files.read(path)
        with pytest.raises((PermissionDeniedError, NotFoundError, InvalidArgumentError)):
            sandbox.files.write(path, b"x")
    _host_untouched(marker)


# -- disk quota ---------------------------------------------------------------------------------------


def test_disk_quota(fleet: Client) -> None:
    with fleet.create(image="busybox", resources=Resources(disk="8MiB")) as sb:
        with pytest.raises(ResourceExhaustedError):
            sb.files.write("/tmp/huge", b"\0" * (16 * MiB))
        sb.files.remove("/tmp/huge")  # the partial file, if any
        r = sb.exec("dd if=/dev/zero of=/tmp/dd bs=1M count=16")
        assert r.exit_code != 0
        assert "No space left" in r.stderr
        size = int(_sh(sb, "wc -c < /tmp/dd"))
        assert 4 * MiB <= size <= 8 * MiB
        # the sandbox works and space comes back
        _sh(sb, "rm /tmp/dd")
        sb.files.write("/tmp/ok", b"x" * MiB)
        assert _sh(sb, "wc -c < /tmp/ok").strip() == str(MiB)
        # another sandbox has its own quota
        with fleet.create(image="busybox", resources=Resources(disk="32MiB")) as other:
            other.files.write("/tmp/big", b"\0" * (16 * MiB))
            assert other.files.stat("/tmp/big").size == 16 * MiB
