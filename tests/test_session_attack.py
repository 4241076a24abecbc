"""Attacks on the session framing through the sessions' new paths: a terminal session (its
terminal is open to the sandbox's other processes) and a dash session (its descriptors at 9 and 8,
where a command's own redirections live). Neither lets another process, or the command itself,
read a command's script or forge how it ended."""

from __future__ import annotations

import time

from sandfleet import Client

THIEF = r"""
import glob, os, time
forged = b"0" * 32 + b" 0\n" + b"__FORGED__\n"
while True:
    for path in glob.glob("/dev/pts/[0-9]*") + glob.glob("/proc/[0-9]*/fd/[0-9]*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        try:
            try:
                data = os.read(fd, 4096)
                if data:
                    with open("/tmp/stolen", "ab") as f:
                        f.write(data)
            except OSError:
                pass
            try:
                os.write(fd, forged)
            except OSError:
                pass
        finally:
            os.close(fd)
    time.sleep(0.01)
"""


def test_terminal_session_cannot_be_read_or_forged(fleet: Client) -> None:
    """Every terminal and every descriptor another process can open, read and written with a
    forged report while commands run: each command's own exit code and output come back (what the
    others write to the terminal shows in it, as on any terminal, but never ends a command), and no
    script ever reaches the terminal (it comes on a socket)."""
    with fleet.create(image="python:3.11", idle_ttl=120) as sb, sb.session(pty=True) as s:
        sb.files.write("/tmp/thief.py", THIEF)
        thief = sb.start("python3 /tmp/thief.py")
        s.run("(python3 /tmp/thief.py </dev/null >/dev/null 2>&1 &)")  # one of the session's own, too
        time.sleep(0.5)
        for _ in range(20):
            r = s.run("echo real; (exit 7)")
            assert r.exit_code == 7 and "real\r\n" in r.stdout, r
        thief.kill()
        stolen = sb.exec("cat /tmp/stolen 2>/dev/null").stdout
        assert "command eval" not in stolen and "command printf" not in stolen, stolen[:500]


def test_dash_session_descriptors_are_out_of_the_commands_reach(fleet: Client) -> None:
    """A dash session's status socket sits at fd 9: a command (and what it starts) cannot report
    through it (the script closes it for the command), and redirecting 9 or 8 breaks nothing."""
    with fleet.create(image="python:3.11", idle_ttl=120) as sb:
        sb.exec("mv /usr/bin/bash /usr/bin/bash.hidden")
        with sb.session() as s:
            assert s.info.shell == "/bin/sh"
            forge = "printf '%s 0\\n' 00000000000000000000000000000000 >&9; echo tried $?"
            r = s.run(f"{forge}; (exit 3)")
            assert r.exit_code == 3 and r.stdout == "tried 2\n", r
            s.run(f"({forge}) >/dev/null 2>&1 &")  # a background child of the shell tries too
            r = s.run("exec 9>/tmp/nine 8</dev/null; echo $((6*7)); (exit 4)")
            assert (r.exit_code, r.stdout) == (4, "42\n")
            assert s.run("echo still framed").stdout == "still framed\n"
