"""File operations inside a sandbox's root filesystem, performed by the (real root) daemon.

`fs.SandboxFS` is the one class: `fileops` (single files and directories), `tar_download`,
`tar_upload`; beneath them `walk`, `paths`, `results`, `syscalls`, and `runtime.openat2`.

Paths given to :class:`SandboxFS` are paths *as seen from inside the sandbox*: absolute, or
relative to the ``cwd`` the instance was made with (default ``/``). The daemon runs as real root
on the host, so a symlink planted by sandboxed code must never make it touch a host file. All
resolution therefore goes through ``openat2(2)`` relative to an ``O_PATH`` fd of the sandbox root
with::

    RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

* ``RESOLVE_IN_ROOT``: absolute symlinks and ``..`` are clamped to the sandbox root, exactly
  as the sandbox itself would resolve them (the kernel does this atomically, no TOCTOU).
* ``RESOLVE_NO_MAGICLINKS``: ``/proc/<pid>/root``-style magic links are refused.
* ``RESOLVE_NO_XDEV``: resolution never crosses into another mount (the sandbox's
  ``/proc``, ``/dev``, ``/sys`` and any bind mount); such paths fail with ``crosses_mount``.

An operation resolves the *parent* directory this way and then acts on the final component
with ``*at`` syscalls relative to the parent fd (never following a final symlink), or opens
the full path with ``openat2`` when following a final symlink inside the root is wanted
(read, write of an existing file, listing a directory). Regular files are always opened
``O_PATH`` first, checked with ``fstat`` and only then re-opened for I/O through
``/proc/self/fd/N``, so the daemon never ``open()``s a FIFO or device node planted in the
sandbox.

Mount points. The daemon reaches the sandbox through ``/proc/<agent>/root`` from another mount
namespace, where the kernel's "is this a mount point?" checks of ``rmdir``/``unlink``/``rename``
do not see the sandbox's mounts: removing ``/proc`` would succeed and detach the sandbox's
mounts. Every remove or replace therefore checks its target first with ``statx``
(``STATX_ATTR_MOUNT_ROOT``, and a mount id different from the root's) and against the
``mount_points`` the caller passed (from the sandbox's mountinfo, see :func:`mount_points`), and
refuses with ``permission_denied``.

Tree walks (recursive remove, tar download) are iterative and go down one component at a time
with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``; they keep at most
``_FD_WINDOW`` directory fds open below their top whatever the depth, and per level only the
name, the inode number and a directory offset (about 20 bytes). Climbing back to a directory
whose fd was closed reopens it as ``..`` of the child (``RESOLVE_NO_XDEV``) and checks its
(``st_dev``, ``st_ino``) against the one recorded on the way down; every climb also checks that
the child still sits in the directory it was entered from. A directory renamed or replaced by
the sandbox during a walk stops it with ``changed``: a walk never goes above its top, never
leaves its mount, and never continues somewhere it did not come from.

All functions are synchronous (the daemon calls them from a worker thread) and close every
fd they open, including on errors; a :class:`TarStream` holds its own fds (never the root fd)
until it is exhausted or closed.
"""
