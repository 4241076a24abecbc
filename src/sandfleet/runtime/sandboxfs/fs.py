"""`SandboxFS`: file operations confined to one sandbox root, single-file operations and tar together."""

from __future__ import annotations

from sandfleet.runtime.sandboxfs.tar_download import _TarDownload
from sandfleet.runtime.sandboxfs.tar_upload import _TarUpload


class SandboxFS(_TarUpload, _TarDownload):
    """File operations confined to one sandbox root.

    ``root_fd`` is an ``O_PATH | O_DIRECTORY`` fd of the sandbox root (e.g. from
    ``open("/proc/<pid>/root")``); it is borrowed, not closed. Files and directories created
    here are owned by ``uid_base + uid`` / ``uid_base + gid`` on the host; reported ids are
    translated back (host ids outside ``[uid_base, uid_base + id_count)`` show as 65534).

    ``cwd``: relative paths resolve against it (absolute, inside the sandbox; ``..`` of a
    relative path is applied lexically and clamped at ``/``). ``mount_points``: the sandbox's
    mount points (absolute paths inside it, e.g. :func:`mount_points` of
    ``/proc/<agent>/mountinfo``); removing or replacing one of them, or recursively removing a
    directory holding one, is refused before anything is touched (``permission_denied``); mount
    points are also detected with ``statx`` whether or not they were passed. ``max_entries``
    bounds the entries one tree walk (recursive remove, tar download) visits. ``max_archive``
    is the default ``max_bytes`` of tar downloads.
    """


__all__ = ["SandboxFS"]
