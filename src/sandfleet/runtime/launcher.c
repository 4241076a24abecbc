/*
 * sandfleet-run: start one sandbox's init (the agent) in fresh namespaces, then exit.
 *
 * The daemon's own OCI-runtime replacement for the hot path: it applies the same isolation steps
 * as `crun run` with the config that backends/container/bundle.py writes, in this order, without JSON, libseccomp
 * or a runtime state directory, in about a millisecond.
 *
 *   launcher worker (real root, the daemon's mount namespace; the seccomp BPF read from fd 5 once,
 *   by the server)
 *     detaches each bind-mount source with open_tree (fds 6..)
 *     makes the sandbox's cgroups and writes their limits (the daemon's plan: --cg-dir, --cg-write)
 *     fork -> stage 1 (real root)
 *       1 cgroups: joins the sandbox's cgroups
 *       2 rlimits, oom_score_adj
 *       server mode: detaches each layer with open_tree, then enters a private copy of the launch
 *       template's mount namespace (make_template) and attaches them at /l/N; standalone: a private
 *       copy of the daemon's mount namespace
 *       3 rootfs: tmpfs scratch (size and inode cap) + overlay over the EROFS layers; bind mounts
 *            attached under the rootfs, resolved with RESOLVE_IN_ROOT. These mounts exist only in
 *            this namespace and its copies: the kernel removes them with the sandbox, and no other
 *            mount namespace ever grows with the number of sandboxes.
 *       4 user namespace: unshare(CLONE_NEWUSER), with --owner as the effective uid so that
 *            uid owns it (the kernel charges the namespace's per-user counts, such as inotify
 *            instances, to its owner: each sandbox gets its own); the worker writes
 *            uid_map/gid_map (root inside = uid_base outside)
 *       5 unshare(mount, pid, uts, ipc, net, cgroup), all owned by the new user namespace, so
 *            the mounts above are locked beneath the sandbox
 *       fork -> stage 2 (PID 1 of the new pid namespace)
 *       6 /proc, /dev (a directory of the scratch tmpfs: bound device nodes, devpts, shm, mqueue),
 *            /sys read-only
 *       7 masked and read-only paths
 *       8 hostname; the rootfs becomes "/": moved over the template's root and chrooted (server
 *            mode), or pivot_root and detach the old root (standalone)
 *       9 capabilities (bounding, permitted, effective; no ambient), no_new_privs, seccomp
 *            (seccomp(2) with SECCOMP_FILTER_FLAG_NEW_LISTENER)
 *      10 stdio to /dev/null, execveat(fd 4): the agent, with its channel at fd 3 and the
 *            filter's listener at fd 5
 *
 * The agent's fds at exec: 0-2 /dev/null, 3 its channel to the daemon (SOCK_SEQPACKET), 4 the agent
 * binary (the agent reuses 4 for the channel it offers at REOPEN), 5 the seccomp listener
 * (LISTENER_FD; absent when the kernel gave none): the filter's SECCOMP_RET_USER_NOTIF rules
 * (attempts on PID 1: runtime/seccomp.py attempt_rules) wait there for the agent's answer, and the
 * agent reports them to the daemon (agent.c, M_ALERT). Nothing else is open.
 *
 * Errors from either stage travel back over a close-on-exec pipe: EOF with no bytes means the
 * agent was exec'd. On success the agent's pid (as the daemon sees it) is printed on stdout.
 *
 * The daemon runs it once as a server (`sandfleet-run --serve --shared DIR`, see serve()) and sends it one
 * message per create; a forked worker of that small static process does the launch, so a create
 * costs neither an exec nor a fork of the daemon's large Python process. Restores (--restore) always
 * start from the daemon's namespace (criu sets up the mounts and pivots itself).
 *
 * Arguments:
 *   --dir D          sandbox directory; D/scratch and D/rootfs are the mount points (standalone;
 *                    restores use D/s, D/r and D/l/N; server launches the template's /s, /r, /l/N)
 *   --pid-file F     also write the agent's pid to F (atomically)
 *   --lower P        a read-only layer, top first (repeatable)
 *   --disk BYTES --inodes N --nofile N --uid BASE --hostname H
 *   --owner UID      the uid that owns the sandbox's user namespace (0: host root, as before); one
 *                    of a range no host process or file uses, a different one per live sandbox
 *   --cgroup DIR     a cgroup directory to join (repeatable)
 *   --cg-dir DIR, --cg-write FILE=VALUE   make the sandbox's cgroups and write their limits first,
 *                    in order (the daemon computes them: runtime/cgroups.py plan())
 *   --qos latency_sensitive|best_effort
 *   --bind FD:ro|rw:TARGET   an O_PATH fd of an already-checked source (repeatable)
 *   --restore SNAP -- CRIU...  restore a snapshot instead of starting an agent (see restore_stage)
 *
 * The scratch tmpfs's root is also mounted at /dev/.sandfleet (mode 0700, owned by the host's root,
 * so the sandbox's root cannot enter it): the one place the daemon reaches the writable layer of a
 * running sandbox from outside (/proc/PID/root/dev/.sandfleet), to snapshot it.
 */
#define PTYS_PER_SANDBOX "32" /* pseudo-terminals one sandbox may hold (devpts max=) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif
#ifndef PR_SCHED_CORE
#define PR_SCHED_CORE 62
#define PR_SCHED_CORE_CREATE 1
#endif
#define PIDTYPE_TGID 1
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_ITEMS 64
#define LISTENER_FD 5 /* the agent's fd for the seccomp listener (agent.c: LISTENER) */
/* The server's own long-lived fds live at or above this, clear of the fds a worker places: the
 * bind sources at 6.. and the received ones at 6 + MAX_ITEMS + 8.. (see serve()). */
#define SERVER_FD_MIN (6 + 3 * MAX_ITEMS + 16)
#define UID_RANGE 65536

static const char *dir, *pid_file, *hostname = "sandbox";
static const char *empty_dir;		     /* server mode: an empty read-only tmpfs masked dirs bind */
static const char *sysfs_template;	     /* server mode: a sysfs every sandbox binds read-only */
static int template_ns = -1;		     /* server mode: the launch template mount namespace (see make_template) */
static int best_effort;			     /* --qos best_effort: SCHED_IDLE for every process */
static const char *lowers[MAX_ITEMS], *cgroups[MAX_ITEMS], *cg_dirs[MAX_ITEMS], *cg_writes[MAX_ITEMS];
static int lower_trees[MAX_ITEMS]; /* template mode: detached copies of the layers (stage 1, open_tree) */
static int n_lowers, n_cgroups, n_cg_dirs, n_cg_writes;
static unsigned long long disk = 256ULL << 20, inodes = 65536;
static unsigned long nofile = 4096, uid_base = 100000, owner;
static struct {
	int src, tree, ro;
	const char *target;
} binds[MAX_ITEMS];
static int n_binds;
static struct sock_filter *bpf;
static unsigned short bpf_len;
static int err_fd = -1;	  /* write end of the error pipe, in both stages */
static int reply_fd = -1; /* server mode: where this launch's result goes, instead of stdout/stderr */
static const char *restore_dir;	  /* --restore: a snapshot directory (fs/upper, fs/dev) */
static char **criu_argv;	  /* --restore: the criu command line, after "--" */
static int host_net = -1;	  /* server mode: the daemon's network namespace (criu probes the kernel there) */

/* Docker's default set minus NET_RAW and MKNOD (backends/container/bundle.py: DEFAULT_CAPABILITIES). */
static const int keep_caps[] = {
	CAP_CHOWN,  CAP_DAC_OVERRIDE, CAP_FSETID,	    CAP_FOWNER,	 CAP_SETGID,	  CAP_SETUID,
	CAP_SETFCAP, CAP_SETPCAP,      CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT, CAP_KILL, CAP_AUDIT_WRITE,
};
/* backends/container/bundle.py: MASKED_PATHS and READONLY_PATHS, relative to the rootfs. */
static const char *masked[] = {
	"proc/acpi",	   "proc/asound",	 "proc/kcore",	       "proc/keys",	   "proc/latency_stats",
	"proc/timer_list", "proc/timer_stats", "proc/sched_debug",    "proc/scsi",	   "proc/kpagecgroup",
	"proc/kpagecount", "proc/kpageflags",  "proc/kmsg",	       "proc/sysrq-trigger", "sys/firmware",
	"sys/devices/virtual/powercap",	   "sys/kernel/debug", "sys/fs/cgroup",	"sys/kernel/vmcoreinfo",
};
static const char *readonly[] = {"proc/bus", "proc/fs", "proc/irq", "proc/sys"};
static const char *devices[] = {"null", "zero", "full", "random", "urandom", "tty"};

/* Report an error and exit. The first byte on the error pipe says whose fault it is: 'I' for the
 * request (exit 3, the daemon answers invalid_argument), 'E' for everything else (exit 1). */
static void vfail(char kind, const char *fmt, va_list ap)
{
	char msg[1024];
	int e = errno, n;
	msg[0] = kind;
	n = 1 + vsnprintf(msg + 1, sizeof msg - 65, fmt, ap);
	if (n < 1)
		n = 1;
	if (n > (int)sizeof msg - 64)
		n = sizeof msg - 64;
	n += snprintf(msg + n, sizeof msg - n, ": %s", strerror(e));
	if (n > (int)sizeof msg - 1)
		n = sizeof msg - 1;
	if (err_fd >= 0 || reply_fd >= 0) {
		if (write(err_fd >= 0 ? err_fd : reply_fd, msg, n) < 0) {
		}
	} else {
		fprintf(stderr, "sandfleet-run: %s\n", msg + 1);
	}
	_exit(kind == 'I' ? 3 : 1);
}

static void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail('E', fmt, ap);
	va_end(ap);
}

static void fail_input(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail('I', fmt, ap);
	va_end(ap);
}

static void usage(const char *msg)
{
	errno = EINVAL;
	fail("usage: %s", msg);
}

static long sys_openat2(int dirfd, const char *path, int flags, unsigned long long resolve)
{
	struct open_how how = {.flags = (unsigned long long)flags, .resolve = resolve};
	return syscall(SYS_openat2, dirfd, path, &how, sizeof how);
}

/* Resolve `rel` inside the directory `root` as if it were "/", never following a symlink out. */
static int in_root(int root, const char *rel, int flags)
{
	return (int)sys_openat2(root, rel, flags | O_CLOEXEC, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS);
}

/* mkdir -p `rel` under `root` (each component resolved in the root); return an O_PATH fd to it. */
static int mkdirs_in_root(int root, const char *rel, uid_t owner, int last_is_file)
{
	char buf[PATH_MAX], *p;
	if (snprintf(buf, sizeof buf, "%s", rel) >= (int)sizeof buf)
		return errno = ENAMETOOLONG, -1;
	for (p = buf; *p == '/'; p++)
		;
	for (char *s = p;; s++) {
		int last = *s == '\0';
		if (*s != '/' && !last)
			continue;
		*s = '\0';
		if (*p) {
			int fd = in_root(root, p, O_PATH);
			if (fd < 0 && errno == ENOENT) {
				int parent = root;
				char *slash = strrchr(p, '/');
				const char *name = p;
				if (slash) {
					*slash = '\0';
					parent = in_root(root, p, O_PATH | O_DIRECTORY);
					*slash = '/';
					name = slash + 1;
					if (parent < 0)
						return -1;
				}
				int rc;
				if (last && last_is_file) {
					rc = openat(parent, name, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0644);
					if (rc >= 0)
						close(rc), rc = 0;
				} else {
					rc = mkdirat(parent, name, 0755);
				}
				if (rc == 0 && fchownat(parent, name, owner, owner, AT_SYMLINK_NOFOLLOW) < 0)
					rc = -1;
				if (parent != root)
					close(parent);
				if (rc < 0 && errno != EEXIST)
					return -1;
				fd = in_root(root, p, O_PATH);
			}
			if (fd < 0)
				return -1;
			if (last)
				return fd;
			close(fd);
		}
		if (last)
			return in_root(root, ".", O_PATH);
		*s = '/';
	}
}

/* Mount on a directory of the new root (our cwd) that must not be a symlink (a hostile image could
 * point /proc anywhere); created if the image lacks it. Checked with openat2, then named by the same
 * relative path: nothing else runs in this mount namespace yet, so it cannot change in between. */
static void mount_at(int root, const char *rel, const char *src, const char *type, unsigned long flags,
		     const char *data)
{
	int fd = (int)sys_openat2(root, rel, O_PATH | O_DIRECTORY | O_CLOEXEC,
				  RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
	if (fd < 0 && errno == ENOENT) {
		fd = mkdirs_in_root(root, rel, 0, 0);
		if (fd >= 0) {
			close(fd);
			fd = (int)sys_openat2(root, rel, O_PATH | O_DIRECTORY | O_CLOEXEC,
					      RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
		}
	}
	if (fd < 0)
		fail("open /%s", rel);
	if (mount(src, rel, type, flags, data) < 0)
		fail("mount %s on /%s", type ? type : src, rel);
	close(fd);
}

static void write_file(const char *path, const char *data)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		fail("open %s", path);
	ssize_t n = write(fd, data, strlen(data));
	if (n != (ssize_t)strlen(data))
		fail("write %s", path);
	close(fd);
}

/* ---- stage 2: PID 1 of the sandbox ---------------------------------------------------------- */

static void setup_dev(int root)
{
	char buf[64], target[64];
	int dev = (int)sys_openat2(root, "dev", O_PATH | O_DIRECTORY | O_CLOEXEC,
				   RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
	if (dev < 0)
		fail("open /dev");
	/* No mknod in a user namespace: bind the host's harmless character devices instead. */
	for (size_t i = 0; i < sizeof devices / sizeof *devices; i++) {
		int fd = openat(dev, devices[i], O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
		if (fd < 0)
			fail("create /dev/%s", devices[i]);
		close(fd);
		snprintf(buf, sizeof buf, "/dev/%s", devices[i]);
		snprintf(target, sizeof target, "dev/%s", devices[i]);
		if (mount(buf, target, NULL, MS_BIND, NULL) < 0)
			fail("bind %s", buf);
	}
	/* max: the node's pseudo-terminals (kernel.pty.max) are shared by every sandbox's devpts */
	mount_at(root, "dev/pts", "devpts", "devpts", MS_NOSUID | MS_NOEXEC,
		 "newinstance,ptmxmode=0666,mode=0620,max=" PTYS_PER_SANDBOX);
	/* /dev/shm is a directory of /dev, so it shares the writable layer's size cap; bound onto
	 * itself to be noexec as crun's shm tmpfs is (nosuid and nodev come locked from the scratch). */
	if (mount("dev/shm", "dev/shm", NULL, MS_BIND, NULL) < 0 ||
	    mount(NULL, "dev/shm", NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		fail("mount /dev/shm noexec");
	mount_at(root, "dev/mqueue", "mqueue", "mqueue", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
	static const char *links[][2] = {{"ptmx", "pts/ptmx"},
					 {"fd", "/proc/self/fd"},
					 {"stdin", "/proc/self/fd/0"},
					 {"stdout", "/proc/self/fd/1"},
					 {"stderr", "/proc/self/fd/2"}};
	for (size_t i = 0; i < sizeof links / sizeof *links; i++)
		if (symlinkat(links[i][1], dev, links[i][0]) < 0)
			fail("symlink /dev/%s", links[i][0]);
	close(dev);
}

static void mask_paths(int root)
{
	for (size_t i = 0; i < sizeof masked / sizeof *masked; i++) {
		int fd = (int)sys_openat2(root, masked[i], O_PATH | O_CLOEXEC | O_NOFOLLOW,
					  RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
		if (fd < 0) {
			if (errno == ENOENT)
				continue;
			fail("open /%s", masked[i]);
		}
		struct stat st;
		if (fstat(fd, &st) < 0)
			fail("stat /%s", masked[i]);
		const char *target = masked[i];
		/* Directories get a bind of one empty directory, files /dev/null: binds add no superblock
		 * (crun mounts a tmpfs per masked directory). A bind keeps its source mount's flags, and the
		 * shared empty tmpfs is mounted read-only, nosuid, nodev and noexec: no remount needed. */
		int rc;
		if (S_ISDIR(st.st_mode) && !empty_dir) /* standalone: no shared empty tmpfs, crun's way */
			rc = mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0,mode=555");
		else
			rc = mount(S_ISDIR(st.st_mode) ? empty_dir : "/dev/null", target, NULL, MS_BIND, NULL);
		if (rc < 0)
			fail("mask /%s", masked[i]);
		close(fd);
	}
	for (size_t i = 0; i < sizeof readonly / sizeof *readonly; i++) {
		int fd = (int)sys_openat2(root, readonly[i], O_PATH | O_CLOEXEC | O_DIRECTORY,
					  RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
		if (fd < 0) {
			if (errno == ENOENT)
				continue;
			fail("open /%s", readonly[i]);
		}
		close(fd);
		const char *target = readonly[i];
		if (mount(target, target, NULL, MS_BIND | MS_REC, NULL) < 0)
			fail("bind /%s", readonly[i]);
		struct statvfs sv;
		if (statvfs(target, &sv) < 0)
			fail("statvfs /%s", readonly[i]);
		unsigned long keep = sv.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC);
		if (mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | keep, NULL) < 0)
			fail("remount /%s read-only", readonly[i]);
	}
}

static void drop_capabilities(void)
{
	int last = 63; /* every capability the kernel might know; EINVAL for the ones it does not */
	uint64_t keep = 0;
	for (size_t i = 0; i < sizeof keep_caps / sizeof *keep_caps; i++)
		keep |= 1ULL << keep_caps[i];
	for (int cap = 0; cap <= last; cap++)
		if (!(keep & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
			fail("drop capability %d from the bounding set", cap);
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		fail("clear ambient capabilities");
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
	struct __user_cap_data_struct data[2] = {{0}};
	data[0].effective = data[0].permitted = (uint32_t)keep;
	data[1].effective = data[1].permitted = (uint32_t)(keep >> 32);
	if (syscall(SYS_capset, &hdr, data) < 0)
		fail("capset");
}

static void stage2(const char *rootfs)
{
	/* The overlay came from a more privileged namespace, so it is locked here and pivot_root
	 * refuses it; a recursive bind of it onto itself is ours (the mounts beneath stay locked). */
	if (mount(rootfs, rootfs, NULL, MS_BIND | MS_REC, NULL) < 0)
		fail("bind rootfs");
	/* Opened after the bind, not inherited: an fd from stage 1 names stage 1's mount. */
	int root = open(rootfs, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (root < 0)
		fail("open rootfs");
	if (fchdir(root) < 0)
		fail("chdir rootfs");
	mount_at(root, "proc", "proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
	setup_dev(root);
	if (sysfs_template) {
		/* One read-only sysfs of an empty network namespace, shared by bind: a sysfs per sandbox
		 * would be a superblock per sandbox, and finding one scans all of them. */
		mount_at(root, "sys", sysfs_template, NULL, MS_BIND, NULL);
	} else {
		/* sysfs needs a network namespace owned by our user namespace, which we have. */
		mount_at(root, "sys", "sysfs", "sysfs", MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
	}
	mask_paths(root);
	if (sethostname(hostname, strlen(hostname)) < 0)
		fail("sethostname");
	if (template_ns >= 0) {
		/* Our mount namespace is a copy of the launch template: its root is a small tmpfs holding
		 * nothing but mount points, the layers of this sandbox, device nodes, a sysfs of an empty
		 * network namespace and an empty tmpfs. Move the rootfs over it and chroot, as switch_root
		 * does: ".." at the top of the rootfs leads back to the rootfs (the kernel follows the
		 * mount stacked on the old root), /proc/self/mountinfo lists only mounts under the chroot,
		 * and the sandbox has neither the capability nor (seccomp) the calls (setns, umount,
		 * move_mount, new user namespaces) to get underneath. pivot_root would also do, but it
		 * visits every thread on the node (to move roots and cwds that point at the old root):
		 * ~0.35 us each, over a millisecond per create with 4,000 sandboxes alive. */
		if (mount(".", "/", NULL, MS_MOVE, NULL) < 0)
			fail("move the rootfs to /");
		if (chroot(".") < 0)
			fail("chroot");
	} else {
		/* pivot_root(".", "."): the old root ends up stacked on the new one; detach it. */
		if (syscall(SYS_pivot_root, ".", ".") < 0)
			fail("pivot_root");
		if (umount2(".", MNT_DETACH) < 0)
			fail("detach the old root");
	}
	if (chdir("/") < 0)
		fail("chdir /");
	close(root);

	int null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null < 0)
		fail("open /dev/null");
	/* A session of its own: no controlling terminal, so /dev/tty leads nowhere (the daemon may
	 * have been started from an operator's terminal). */
	if (setsid() < 0)
		fail("setsid");
	/* QoS, inherited by every process of the sandbox: best effort only runs when a CPU would
	 * otherwise idle; latency-sensitive sandboxes get a core-scheduling cookie of their own, so on
	 * an SMT host no other sandbox's code shares their physical core (EINVAL without SMT). */
	if (best_effort) {
		struct sched_param param = {0};
		if (sched_setscheduler(0, SCHED_IDLE, &param) < 0)
			fail("SCHED_IDLE");
	} else if (prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, 0, PIDTYPE_TGID, 0) < 0 && errno != EINVAL &&
		   errno != ENODEV) {
		fail("core scheduling cookie");
	}
	drop_capabilities();
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		fail("no_new_privs");
	/* stdio first, so the listener cannot land on a free fd below 3 */
	for (int fd = 0; fd < 3; fd++)
		if (dup2(null, fd) < 0)
			fail("dup2 /dev/null");
	int listener = -1;
	if (bpf_len) {
		/* With a listener: the filter's SECCOMP_RET_USER_NOTIF rules (attempts on PID 1, see
		 * runtime/seccomp.py) wait for the agent's answer. A kernel without listeners (EINVAL) or
		 * one already listened on above us (EBUSY, a nested sandfleet) gets the filter alone:
		 * those calls then fail with ENOSYS, unseen. */
		struct sock_fprog prog = {.len = bpf_len, .filter = bpf};
		listener = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
		if (listener < 0) {
			if (errno != EINVAL && errno != EBUSY)
				fail("seccomp");
			if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
				fail("seccomp");
			listener = -1;
		}
	}
	/* Everything but stdio, the channel (3), the agent binary (4), the seccomp listener (5) and the
	 * error pipe (closes at exec). */
	if (err_fd == LISTENER_FD && (err_fd = fcntl(err_fd, F_DUPFD_CLOEXEC, LISTENER_FD + 1)) < 0)
		fail("move the error pipe");
	if (syscall(SYS_close_range, LISTENER_FD, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
		fail("close_range");
	if (listener == LISTENER_FD) {
		if (fcntl(listener, F_SETFD, 0) < 0)
			fail("keep the seccomp listener");
	} else if (listener >= 0) {
		if (dup2(listener, LISTENER_FD) < 0) /* clears close-on-exec on fd 5 only */
			fail("place the seccomp listener");
		close(listener);
	}
	char *argv[] = {"/proc/self/fd/4", NULL};
	char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
	syscall(SYS_execveat, 4, "", argv, envp, AT_EMPTY_PATH);
	fail("exec the agent");
}

/* ---- stage 1: real root in a private mount namespace ---------------------------------------- */

static int same_file(const struct stat *a, const struct stat *b)
{
	return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* A bind mount may not replace the root or land in /proc, /sys or /dev, also not through a symlink
 * of the image: those are set up next, by path, and must be ours. `target` is an O_PATH fd of the
 * target as the mount will see it, `rel` its path, both resolved in the rootfs `root`. The check
 * walks up with ".." (which crosses mounts) from the target's real directory to the rootfs,
 * comparing each directory with those three: for a directory, its own ".."; for a file, the
 * directory named by `rel`, whose last component must then be the file itself, not a symlink to a
 * file elsewhere. No /proc needed: in server mode this runs in the launch template's namespace. */
static int allowed_bind_target(int root, int target, const char *rel)
{
	static const char *reserved[] = {"proc", "sys", "dev"};
	struct stat top, st, res[3];
	int have[3], cur;
	if (fstat(root, &top) < 0 || fstat(target, &st) < 0 || same_file(&st, &top))
		return 0;
	for (int i = 0; i < 3; i++) {
		int fd = in_root(root, reserved[i], O_PATH | O_DIRECTORY);
		have[i] = fd >= 0 && fstat(fd, &res[i]) == 0;
		if (fd >= 0)
			close(fd);
		if (have[i] && same_file(&st, &res[i]))
			return 0;
	}
	if (S_ISDIR(st.st_mode)) {
		cur = openat(target, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
	} else {
		char parent[PATH_MAX];
		struct stat last;
		snprintf(parent, sizeof parent, "%s", rel);
		for (size_t n = strlen(parent); n > 1 && parent[n - 1] == '/'; n--)
			parent[n - 1] = '\0';
		char *slash = strrchr(parent, '/');
		const char *base = slash ? slash + 1 : parent;
		if (slash)
			*slash = '\0';
		cur = in_root(root, slash && parent[0] ? parent : ".", O_PATH | O_DIRECTORY);
		if (cur >= 0 && (fstatat(cur, base, &last, AT_SYMLINK_NOFOLLOW) < 0 || !same_file(&last, &st))) {
			close(cur);
			return 0;
		}
	}
	for (int depth = 0; cur >= 0 && depth < 4096; depth++) {
		if (fstat(cur, &st) < 0)
			break;
		if (same_file(&st, &top)) {
			close(cur);
			return 1; /* reached the rootfs without passing /proc, /sys or /dev */
		}
		for (int i = 0; i < 3; i++)
			if (have[i] && same_file(&st, &res[i])) {
				close(cur);
				return 0;
			}
		int up = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
		close(cur);
		cur = up;
	}
	if (cur >= 0)
		close(cur);
	return 0;
}

/* The overlay rootfs over the layers, upper and work dirs in `scratch`; returns an O_PATH fd of it. */
static int mount_rootfs(const char *scratch, const char *rootfs)
{
	char *opts = malloc(PATH_MAX * (n_lowers + 3));
	if (!opts)
		fail("malloc");
	int n = sprintf(opts, "lowerdir=");
	for (int i = 0; i < n_lowers; i++)
		n += sprintf(opts + n, "%s%s", i ? ":" : "", lowers[i]);
	sprintf(opts + n, ",upperdir=%s/upper,workdir=%s/work", scratch, scratch);
	if (mount("overlay", rootfs, "overlay", MS_NODEV, opts) < 0)
		fail("mount overlay rootfs");
	free(opts);
	int root = open(rootfs, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (root < 0)
		fail("open rootfs");
	return root;
}

/* Bind `source` (a path in our namespace) at `rel` under the rootfs (made if `make`, else it must
 * exist: dev/.sandfleet is a directory of the /dev just bound). */
static void attach_tree(int root, const char *source, const char *rel, int make)
{
	int tree = (int)syscall(SYS_open_tree, AT_FDCWD, source, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
	int target = tree < 0 ? -1 : make ? mkdirs_in_root(root, rel, uid_base, 0) : in_root(root, rel, O_PATH | O_DIRECTORY);
	if (target < 0 || syscall(SYS_move_mount, tree, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
		fail("mount /%s", rel);
	close(tree);
	close(target);
}

/* Step 4: the sandbox's user namespace. The kernel makes the effective uid of its creator its
 * owner, and charges the namespace's per-user counts (inotify instances and watches, fanotify
 * groups and marks, mqueue bytes, queued signals, namespaces) to that owner at the level above: with
 * host root as every sandbox's owner, one sandbox could take them all from the others and from the
 * host. So stage 1 creates it with --owner as its effective uid and gid, keeping its capabilities
 * (SECBIT_NO_SETUID_FIXUP; unshare needs none, but a host that restricts unprivileged user
 * namespaces would refuse it without); real and saved ids stay root, which keeps RLIMIT_NPROC
 * unlimited at the owner's level. Inside, the kernel gives us every capability and resets the
 * securebits, so nothing of this outlives the call. */
static void unshare_userns(void)
{
	if (owner) {
		int bits = prctl(PR_GET_SECUREBITS);
		if (bits < 0 || prctl(PR_SET_SECUREBITS, bits | SECBIT_NO_SETUID_FIXUP) < 0)
			fail("keep capabilities across a change of the effective uid");
		if (setresgid(-1, (gid_t)owner, -1) < 0 || setresuid(-1, (uid_t)owner, -1) < 0)
			fail("take the owner uid %lu", owner);
	}
	if (unshare(CLONE_NEWUSER) < 0)
		fail("unshare user namespace");
	if (owner && prctl(PR_GET_SECUREBITS) != 0 && prctl(PR_SET_SECUREBITS, 0) < 0)
		fail("reset securebits in the new user namespace");
}

/* Steps 1 and 2 (cgroups, rlimits, oom_score_adj) for the calling process and its children. */
static void join_and_limit(void)
{
	char buf[PATH_MAX + 64];
	for (int i = 0; i < n_cgroups; i++) {
		snprintf(buf, sizeof buf, "%s/cgroup.procs", cgroups[i]);
		write_file(buf, "0");
	}
	struct rlimit nf = {.rlim_cur = nofile < 1024 ? nofile : 1024, .rlim_max = nofile}, core = {0, 0};
	if (setrlimit(RLIMIT_NOFILE, &nf) < 0 || setrlimit(RLIMIT_CORE, &core) < 0)
		fail("setrlimit");
	write_file("/proc/self/oom_score_adj", "500");
}

/* A new network namespace has only a loopback device, and it is down: servers a task starts on
 * 127.0.0.1 (test suites, tool servers, notebook kernels) need it. Nothing beyond it exists. */
static void loopback_up(void)
{
	struct ifreq ifr = {0};
	int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
	if (fd < 0 || ioctl(fd, SIOCGIFFLAGS, &ifr) < 0)
		fail("read the loopback device's flags");
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0)
		fail("bring the loopback device up");
	close(fd);
}

static int stage1(int to_launcher, int from_launcher)
{
	char buf[PATH_MAX + 64], scratch[PATH_MAX], rootfs[PATH_MAX];
	if (template_ns >= 0) {
		/* Still in the daemon's namespace (with /proc and the cgroup filesystems): join the
		 * cgroups, take the limits and detach a copy of each layer mount. Then a private copy of
		 * the launch template, where the layers are attached at /l/N and the scratch and the
		 * rootfs go on /s and /r. */
		static char lower_paths[MAX_ITEMS][16];
		join_and_limit();
		for (int i = 0; i < n_lowers; i++) {
			lower_trees[i] = (int)syscall(SYS_open_tree, AT_FDCWD, lowers[i], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
			if (lower_trees[i] < 0)
				fail("open_tree layer %s", lowers[i]);
		}
		if (setns(template_ns, CLONE_NEWNS) < 0 || unshare(CLONE_NEWNS) < 0)
			fail("enter a copy of the launch template");
		for (int i = 0; i < n_lowers; i++) {
			snprintf(lower_paths[i], sizeof lower_paths[i], "/l/%d", i);
			if (syscall(SYS_move_mount, lower_trees[i], "", AT_FDCWD, lower_paths[i], MOVE_MOUNT_F_EMPTY_PATH) < 0)
				fail("attach layer %s", lowers[i]);
			close(lower_trees[i]);
			lowers[i] = lower_paths[i];
		}
		snprintf(scratch, sizeof scratch, "/s");
		snprintf(rootfs, sizeof rootfs, "/r");
	} else {
		if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
			fail("make mounts private");
		join_and_limit();
		snprintf(scratch, sizeof scratch, "%s/scratch", dir);
		snprintf(rootfs, sizeof rootfs, "%s/rootfs", dir);
	}
	snprintf(buf, sizeof buf, "size=%llu,nr_inodes=%llu,mode=0700", disk, inodes);
	if (mount("sandfleet-scratch", scratch, "tmpfs", MS_NOSUID | MS_NODEV, buf) < 0)
		fail("mount scratch tmpfs");
	int sfd = open(scratch, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (sfd < 0 || mkdirat(sfd, "upper", 0755) < 0 || mkdirat(sfd, "work", 0700) < 0)
		fail("make upper and work dirs");
	/* The overlay's root takes its owner from the upper dir: root inside must own "/". */
	if (fchownat(sfd, "upper", uid_base, uid_base, 0) < 0)
		fail("chown upper");
	if (mkdirat(sfd, "dev", 0755) < 0 || fchownat(sfd, "dev", uid_base, uid_base, 0) < 0 ||
	    mkdirat(sfd, "dev/shm", 01777) < 0 || fchmodat(sfd, "dev/shm", 01777, 0) < 0 ||
	    fchownat(sfd, "dev/shm", uid_base, uid_base, 0) < 0 || mkdirat(sfd, "dev/.sandfleet", 0) < 0)
		fail("make /dev");
	close(sfd);
	int root = mount_rootfs(scratch, rootfs);
	/* /dev is a directory of the scratch tmpfs, not a tmpfs of its own: every superblock a sandbox
	 * adds costs kernel work that grows with the number of sandboxes alive. Bound here, as real
	 * root: the scratch tmpfs is not traversable by the sandbox's root. */
	snprintf(buf, sizeof buf, "%s/dev", scratch);
	attach_tree(root, buf, "dev", 1);
	attach_tree(root, scratch, "dev/.sandfleet", 0);
	for (int i = 0; i < n_binds; i++) {
		struct stat st;
		if (fstat(binds[i].src, &st) < 0)
			fail("stat bind source");
		int target = mkdirs_in_root(root, binds[i].target, uid_base, !S_ISDIR(st.st_mode));
		if (target < 0)
			fail_input("mount target %s cannot be made", binds[i].target);
		if (!allowed_bind_target(root, target, binds[i].target))
			fail_input("mount target %s resolves to /, /proc, /sys or /dev", binds[i].target);
		if (syscall(SYS_move_mount, binds[i].tree, "", target, "",
			    MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
			fail_input("mount target %s cannot take the mount", binds[i].target);
		close(target);
	}

	close(root);
	unshare_userns();
	char c = 'u';
	if (write(to_launcher, &c, 1) != 1 || read(from_launcher, &c, 1) != 1 || c != 'm')
		fail("uid map handshake");
	if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0 || setgroups(0, NULL) < 0)
		fail("become root in the user namespace");
	if (unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWCGROUP) < 0)
		fail("unshare namespaces");
	loopback_up();
	pid_t pid = fork();
	if (pid < 0)
		fail("fork the sandbox init");
	if (pid == 0) {
		close(to_launcher);
		close(from_launcher);
		stage2(rootfs);
	}
	int32_t p = pid;
	if (write(to_launcher, &p, sizeof p) != sizeof p)
		fail("report pid");
	_exit(0);
}

/* ---- restore: a snapshot into fresh namespaces (criu) ------------------------------------------ */

/* Run argv to completion; returns its wait status. */
/* Run argv to completion; returns its wait status. `merge`: mark the child's memory (and that of
 * every process it forks, so criu's restored tree) for the kernel's same-page merging, so the
 * children of one snapshot share their identical pages (KSM; a no-op before Linux 6.4). */
static int run_wait(char *const argv[], int merge)
{
	pid_t pid = fork();
	if (pid < 0)
		fail("fork %s", argv[0]);
	if (pid == 0) {
		/* criu inherits the agent binary at fd 4 (--inherit-fd): the restored agent's executable */
		fcntl(4, F_SETFD, 0);
		if (merge)
			prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0);
		execv(argv[0], argv);
		_exit(127);
	}
	int status;
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			fail("wait %s", argv[0]);
	return status;
}

/* Where criu binds a restored sandbox's /dev, /dev/shm and /dev/.sandfleet from (--external
 * mnt[...]:<dir>/s/...) must be a real directory of the new scratch, reached without a symlink:
 * criu mounts it as host root, and what is under "s" was copied from the snapshot of a sandbox. */
static void check_scratch_sources(int sfd)
{
	char prefix[PATH_MAX];
	size_t n = (size_t)snprintf(prefix, sizeof prefix, "%s/s", dir);
	for (char **a = criu_argv; *a && a[1]; a++) {
		const char *src = strncmp(a[0], "--external", 11) ? NULL : strstr(a[1], "]:");
		if (!src || strncmp(a[1], "mnt[", 4) || strncmp(src + 2, prefix, n) || (src[2 + n] && src[2 + n] != '/'))
			continue;
		const char *rel = src[2 + n] ? src + 3 + n : ".";
		int fd = (int)sys_openat2(sfd, *rel ? rel : ".", O_PATH | O_DIRECTORY | O_CLOEXEC,
					  RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
		if (fd < 0)
			fail("the snapshot's %s is not a directory of the writable layer", rel);
		close(fd);
	}
}

/* Stage 1 of a restore (real root, a private copy of the daemon's mount namespace): the sandbox's
 * cgroups, a scratch tmpfs holding a copy of the snapshot's writable layer and /dev, the overlay
 * rootfs over the same layers; then criu recreates the namespaces, mounts (the /dev, sysfs and
 * mask binds as externals the daemon names on its command line) and the process tree, and this
 * stage reports the restored agent's pid.
 *
 * Everything is mounted at short paths relative to the sandbox directory (the working directory
 * here): the layers at l/N, the scratch at s, the rootfs at r. The kernel shows an overlay's
 * options as they were given, in the restored sandbox's /proc/self/mountinfo too, so they name
 * "l/0" and "s/upper", never a host path (a fresh sandbox's name the template's /l/0 and /s). */
static int restore_stage(int to_launcher)
{
	char buf[PATH_MAX + 64], upper[PATH_MAX], devdir[PATH_MAX];
	static char lower_paths[MAX_ITEMS][16];
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		fail("make mounts private");
	for (int i = 0; i < n_cgroups; i++) {
		snprintf(buf, sizeof buf, "%s/cgroup.procs", cgroups[i]);
		write_file(buf, "0");
	}
	snprintf(upper, sizeof upper, "%s/fs/upper", restore_dir);
	snprintf(devdir, sizeof devdir, "%s/fs/dev", restore_dir);
	if (chdir(dir) < 0)
		fail("chdir %s", dir);
	if (mkdir("l", 0700) < 0 && errno != EEXIST)
		fail("mkdir %s/l", dir);
	for (int i = 0; i < n_lowers; i++) {
		snprintf(lower_paths[i], sizeof lower_paths[i], "l/%d", i);
		if ((mkdir(lower_paths[i], 0700) < 0 && errno != EEXIST) ||
		    mount(lowers[i], lower_paths[i], NULL, MS_BIND, NULL) < 0)
			fail("bind layer %s", lowers[i]);
		lowers[i] = lower_paths[i];
	}
	/* Mounted 0700 (what its mount options show, as in a fresh sandbox), opened to 0711 while
	 * criu binds /dev from it as the restored root (whose uid does not own it). */
	snprintf(buf, sizeof buf, "size=%llu,nr_inodes=%llu,mode=0700", disk, inodes);
	if (mount("sandfleet-scratch", "s", "tmpfs", MS_NOSUID | MS_NODEV, buf) < 0)
		fail("mount scratch tmpfs");
	if (chmod("s", 0711) < 0)
		fail("open the scratch tmpfs for the restore");
	char *cp[] = {"/bin/cp", "-a", "--", upper, devdir, "s", NULL};
	int status = run_wait(cp, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status)) {
		errno = EIO;
		fail("copy the snapshot's writable layer (cp status %d; is the disk size too small?)", status);
	}
	if (mkdir("s/work", 0700) < 0)
		fail("make work dir");
	int sfd = open("s", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (sfd < 0)
		fail("open the scratch tmpfs");
	check_scratch_sources(sfd);
	close(sfd);
	close(mount_rootfs("s", "r"));
	/* criu's kernel probes need a working network stack (the server's own namespace is empty); the
	 * restored tree gets the network namespace from the snapshot either way. */
	if (host_net >= 0 && setns(host_net, CLONE_NEWNET) < 0)
		fail("setns to the daemon's network namespace");
	/* For the criu preload shim: the user namespace criu makes is owned by the sandbox's uid. */
	if (owner) {
		snprintf(buf, sizeof buf, "%lu", owner);
		if (setenv("SANDFLEET_USERNS_OWNER", buf, 1) < 0)
			fail("setenv");
	}
	status = run_wait(criu_argv, 1);
	if (!WIFEXITED(status) || WEXITSTATUS(status)) {
		errno = EIO;
		fail("criu restore failed (status %d)", status);
	}
	if (chmod("s", 0700) < 0) /* criu's pre-resume script did already; never leave it open */
		fail("close the scratch tmpfs");
	int fd = open(pid_file, O_RDONLY | O_CLOEXEC);
	ssize_t n = fd < 0 ? -1 : read(fd, buf, 32);
	if (n <= 0)
		fail("read criu's pid file");
	buf[n] = '\0';
	int32_t p = (int32_t)strtol(buf, NULL, 10);
	char c = 'r';
	if (p <= 0 || write(to_launcher, &c, 1) != 1 || write(to_launcher, &p, sizeof p) != sizeof p)
		fail("report pid");
	_exit(0);
}

/* ---- launcher ---------------------------------------------------------------------------------- */

static void write_map(pid_t pid, const char *name)
{
	char path[64], map[64];
	snprintf(path, sizeof path, "/proc/%d/%s", pid, name);
	snprintf(map, sizeof map, "0 %lu %d\n", uid_base, UID_RANGE);
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, map, strlen(map)) != (ssize_t)strlen(map))
		fail("write %s", path);
	close(fd);
}

static unsigned long long number(const char *s)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end || !*s)
		usage("bad number");
	return v;
}

static void read_bpf(int fd)
{
	size_t cap = 1 << 16, len = 0;
	char *buf = malloc(cap);
	if (!buf)
		usage("malloc");
	for (;;) {
		ssize_t n = pread(fd, buf + len, cap - len, (off_t)len); /* the daemon shares one fd */
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			fail("read seccomp filter");
		if (n == 0)
			break;
		len += n;
		if (len == cap)
			usage("seccomp filter too large");
	}
	close(fd);
	if (len % sizeof(struct sock_filter) || len / sizeof(struct sock_filter) > BPF_MAXINSNS)
		usage("malformed seccomp filter");
	bpf = (struct sock_filter *)buf;
	bpf_len = len / sizeof(struct sock_filter);
}

static void parse_args(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--")) {
			criu_argv = argv + i + 1;
			break;
		}
		if (!v)
			usage("missing value");
		i++;
		if (!strcmp(a, "--dir"))
			dir = v;
		else if (!strcmp(a, "--restore"))
			restore_dir = v;
		else if (!strcmp(a, "--pid-file"))
			pid_file = v;
		else if (!strcmp(a, "--lower") && n_lowers < MAX_ITEMS)
			lowers[n_lowers++] = v;
		else if (!strcmp(a, "--cg-dir") && n_cg_dirs < MAX_ITEMS)
			cg_dirs[n_cg_dirs++] = v;
		else if (!strcmp(a, "--cg-write") && n_cg_writes < MAX_ITEMS && strchr(v, '='))
			cg_writes[n_cg_writes++] = v;
		else if (!strcmp(a, "--cgroup") && n_cgroups < MAX_ITEMS)
			cgroups[n_cgroups++] = v;
		else if (!strcmp(a, "--disk"))
			disk = number(v);
		else if (!strcmp(a, "--inodes"))
			inodes = number(v);
		else if (!strcmp(a, "--nofile"))
			nofile = number(v);
		else if (!strcmp(a, "--uid"))
			uid_base = number(v);
		else if (!strcmp(a, "--owner"))
			owner = number(v);
		else if (!strcmp(a, "--hostname"))
			hostname = v;
		else if (!strcmp(a, "--qos"))
			best_effort = !strcmp(v, "best_effort");
		else if (!strcmp(a, "--bind") && n_binds < MAX_ITEMS) {
			char *end;
			long fd = strtol(v, &end, 10);
			if (fd < 6 || (strncmp(end, ":ro:", 4) && strncmp(end, ":rw:", 4)) || !end[4])
				usage("bad --bind");
			binds[n_binds].src = (int)fd;
			binds[n_binds].ro = end[2] == 'o';
			binds[n_binds].target = end + 4;
			n_binds++;
		} else
			usage("unknown or repeated-too-often option");
	}
	if (!n_lowers || (!dir && (template_ns < 0 || restore_dir)))
		usage("--lower is required, and --dir unless the server launches from its template");
	if (restore_dir && (!criu_argv || !criu_argv[0] || !pid_file))
		usage("--restore needs --pid-file and a criu command line after --");
	if (owner >= UINT32_MAX || (owner && owner >= uid_base && owner < uid_base + UID_RANGE))
		usage("--owner must be a uid outside the sandbox's range");
}

/* Start one sandbox (fds: 3 channel, 4 agent binary, 6.. bind sources; the filter already read)
 * and report its agent's pid. Returns the exit status. */
/* The sandbox's cgroups with their limits (the daemon removes them if the launch fails). */
static void make_cgroups(void)
{
	for (int i = 0; i < n_cg_dirs; i++) {
		if (mkdir(cg_dirs[i], 0755) == 0 || errno == EEXIST)
			continue;
		/* The first sandbox under the daemon's parent (or the parent went with an idle daemon's
		 * close): mkdir -p. */
		char path[PATH_MAX];
		snprintf(path, sizeof path, "%s", cg_dirs[i]);
		int ok = errno == ENOENT;
		for (char *p = path + 1; ok && (p = strchr(p, '/')); p++) {
			*p = '\0';
			ok = mkdir(path, 0755) == 0 || errno == EEXIST;
			*p = '/';
		}
		if (!ok || (mkdir(cg_dirs[i], 0755) < 0 && errno != EEXIST))
			fail("make cgroup %s", cg_dirs[i]);
	}
	for (int i = 0; i < n_cg_writes; i++) {
		char path[PATH_MAX];
		const char *eq = strchr(cg_writes[i], '=');
		snprintf(path, sizeof path, "%.*s", (int)(eq - cg_writes[i]), cg_writes[i]);
		write_file(path, eq + 1);
	}
}

static int launch(void)
{
	make_cgroups();
	/* Detached copies of the bind sources, made here in the daemon's mount namespace where the
	 * daemon pinned them; stage 1 attaches them under the new root. */
	for (int i = 0; i < n_binds; i++) {
		int tree = (int)syscall(SYS_open_tree, binds[i].src, "",
					OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE);
		if (tree < 0)
			fail("open_tree bind source %s", binds[i].target);
		struct mount_attr attr = {
			.attr_set = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (binds[i].ro ? MOUNT_ATTR_RDONLY : 0),
			.propagation = MS_PRIVATE,
		};
		if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) < 0)
			fail("mount_setattr bind %s", binds[i].target);
		binds[i].tree = tree;
	}

	int up[2], down[2], errp[2];
	if (pipe2(up, O_CLOEXEC) < 0 || pipe2(down, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0)
		fail("pipe");
	pid_t child = fork();
	if (child < 0)
		fail("fork");
	if (child == 0) {
		if ((template_ns < 0 || restore_dir) && unshare(CLONE_NEWNS) < 0)
			fail("unshare mount namespace");
		close(up[0]);
		close(down[1]);
		close(errp[0]);
		err_fd = errp[1];
		if (restore_dir)
			restore_stage(up[1]);
		stage1(up[1], down[0]);
	}
	close(up[1]);
	close(down[0]);
	close(errp[1]);

	char c;
	int32_t agent = -1;
	if (restore_dir) {
		if (read(up[0], &c, 1) != 1 || c != 'r' || read(up[0], &agent, sizeof agent) != sizeof agent)
			agent = -1;
	} else if (read(up[0], &c, 1) == 1 && c == 'u') {
		/* As real root we may map any range; "deny" setgroups is not needed for a privileged writer. */
		write_map(child, "uid_map");
		write_map(child, "gid_map");
		c = 'm';
		if (write(down[1], &c, 1) != 1)
			fail("uid map handshake");
		if (read(up[0], &agent, sizeof agent) != sizeof agent)
			agent = -1;
	}
	int status;
	while (waitpid(child, &status, 0) < 0 && errno == EINTR)
		;
	/* Until exec or failure of stage 2; both stages write their error here. */
	char msg[1024];
	size_t len = 0;
	for (;;) {
		ssize_t n = read(errp[0], msg + len, sizeof msg - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		len += n;
		if (len == sizeof msg - 1)
			break;
	}
	msg[len] = '\0';
	if (len) {
		/* Stage 2 reported and exited (its pid may already be reaped and reused): nothing to kill. */
		if (reply_fd >= 0) {
			if (write(reply_fd, msg, len) < 0) {
			}
		} else {
			fprintf(stderr, "%s\n", msg + 1);
		}
		return msg[0] == 'I' ? 3 : 1;
	}
	if (agent <= 0) {
		errno = ECHILD;
		fail("sandbox setup exited with status %d before starting the agent", status);
	}
	if (pid_file) {
		char tmp[PATH_MAX], num[16];
		snprintf(tmp, sizeof tmp, "%s.tmp", pid_file);
		snprintf(num, sizeof num, "%d\n", agent);
		int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		if (fd < 0 || write(fd, num, strlen(num)) != (ssize_t)strlen(num) || close(fd) < 0 ||
		    rename(tmp, pid_file) < 0) {
			kill(agent, SIGKILL);
			fail("write %s", pid_file);
		}
	}
	if (reply_fd >= 0) {
		char out[16];
		int n = snprintf(out, sizeof out, "P%d", agent);
		if (write(reply_fd, out, n) != n) {
			kill(agent, SIGKILL);
			return 1;
		}
	} else {
		printf("%d\n", agent);
	}
	return 0;
}

/* Server mode: fd 3 is a SOCK_SEQPACKET connection to the daemon, fd 4 the agent binary, fd 5 the
 * filter. Each message is one launch: its payload the NUL-separated arguments above, its
 * SCM_RIGHTS fds [reply, channel, bind sources...]. A forked worker carries it out and writes
 * "P<pid>" or the error to the reply fd; the server itself never waits, so launches overlap. */
static void mount_sysfs_and_empty(const char *sys_path, const char *empty_path)
{
	if (mount("sysfs", sys_path, "sysfs", MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) < 0)
		fail("mount a sysfs on %s", sys_path);
	if (mount("sandfleet-empty", empty_path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV,
		  "size=4k,nr_inodes=1,mode=0555") < 0)
		fail("mount the empty tmpfs on %s", empty_path);
}

static int high_fd(int fd, const char *what)
{
	int high = fd < 0 ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, SERVER_FD_MIN);
	if (high < 0)
		fail("keep %s at fd %d or above (is RLIMIT_NOFILE that low?)", what, SERVER_FD_MIN);
	close(fd);
	return high;
}

/* The launch template: a mount namespace, made once, whose root is a small read-only tmpfs holding
 * only what a launch needs: mount points for the scratch (/s), the rootfs (/r) and the layers
 * (/l/0..), the host's harmless device nodes (/dev/null, ...: bound, so a snapshot sees them as the
 * host's), a sysfs of the server's empty network namespace (/sys), the empty tmpfs (/empty) and a
 * procfs of an empty pid namespace (/proc). Stage 1 starts from a copy of it instead of the
 * daemon's namespace: copying it is cheap whatever the host mounts, and stage 2 can move the rootfs
 * over its root and chroot (no pivot_root, which costs in proportion to every thread on the node)
 * with nothing of the host's filesystem underneath. A builder child makes it and pivots into it;
 * the server keeps the namespace by an fd. */
static void make_template(const char *shared_dir)
{
	int p[2];
	if (pipe2(p, O_CLOEXEC) < 0)
		fail("pipe");
	pid_t builder = fork();
	if (builder < 0)
		fail("fork the launch template's builder");
	if (builder == 0) {
		char root[PATH_MAX], path[PATH_MAX + 32];
		close(p[0]);
		snprintf(root, sizeof root, "%s/template", shared_dir);
		if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
			fail("unshare the launch template's mount namespace");
		if (mount("sandfleet-template", root, "tmpfs", MS_NOSUID, "size=64k,nr_inodes=256,mode=0755") < 0)
			fail("mount the launch template's root on %s", root);
		static const char *dirs[] = {"s", "r", "l", "dev", "sys", "empty", "proc"};
		for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
			snprintf(path, sizeof path, "%s/%s", root, dirs[i]);
			if (mkdir(path, 0755) < 0)
				fail("mkdir %s", path);
		}
		for (int i = 0; i < MAX_ITEMS; i++) {
			snprintf(path, sizeof path, "%s/l/%d", root, i);
			if (mkdir(path, 0755) < 0)
				fail("mkdir %s", path);
		}
		for (size_t i = 0; i < sizeof devices / sizeof *devices; i++) {
			char host[64];
			snprintf(host, sizeof host, "/dev/%s", devices[i]);
			snprintf(path, sizeof path, "%s/dev/%s", root, devices[i]);
			int fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
			if (fd < 0 || close(fd) < 0 || mount(host, path, NULL, MS_BIND, NULL) < 0)
				fail("bind %s into the launch template", host);
		}
		char sys_path[PATH_MAX + 8], empty_path[PATH_MAX + 8];
		snprintf(sys_path, sizeof sys_path, "%s/sys", root);
		snprintf(empty_path, sizeof empty_path, "%s/empty", root);
		mount_sysfs_and_empty(sys_path, empty_path);
		/* The kernel lets a user namespace mount a procfs only where one is already fully visible:
		 * a procfs of a pid namespace of its own, empty once its first process exits. */
		snprintf(path, sizeof path, "%s/proc", root);
		if (unshare(CLONE_NEWPID) < 0)
			fail("unshare a pid namespace for the launch template's procfs");
		pid_t first = fork();
		if (first == 0)
			_exit(mount("proc", path, "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) < 0);
		int status;
		if (first < 0 || waitpid(first, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) {
			errno = EPERM;
			fail("mount a procfs in the launch template");
		}
		if (chdir(root) < 0 || syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 ||
		    chdir("/") < 0)
			fail("pivot into the launch template");
		if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, NULL) < 0)
			fail("make the launch template's root read-only");
		char c = 'k';
		if (write(p[1], &c, 1) != 1)
			fail("report the launch template");
		pause(); /* until the server has opened our namespace and kills us */
		_exit(0);
	}
	close(p[1]);
	char c, ns_path[64];
	if (read(p[0], &c, 1) != 1) {
		errno = EIO;
		fail("building the launch template failed");
	}
	close(p[0]);
	snprintf(ns_path, sizeof ns_path, "/proc/%d/ns/mnt", builder);
	int ns = open(ns_path, O_RDONLY | O_CLOEXEC);
	kill(builder, SIGKILL);
	waitpid(builder, NULL, 0);
	if (ns < 0)
		fail("open the launch template's namespace");
	template_ns = high_fd(ns, "the launch template's namespace");
	sysfs_template = "/sys"; /* paths in the template, where stage 2 runs */
	empty_dir = "/empty";
}

/* Made once at server start: the server moves into a network namespace with nothing in it but
 * loopback (so keeping it, and its `lo`, alive; every sandbox still gets a network namespace of its
 * own in stage 1), builds the launch template there, and mounts a read-only sysfs of that namespace
 * and an empty read-only tmpfs in the daemon's mount namespace too, for restores to bind. */
static void mount_shared(const char *shared_dir)
{
	char sys_path[PATH_MAX], empty_path[PATH_MAX];
	snprintf(sys_path, sizeof sys_path, "%s/sysfs", shared_dir);
	snprintf(empty_path, sizeof empty_path, "%s/empty", shared_dir);
	host_net = high_fd(open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC), "the daemon's network namespace");
	if (unshare(CLONE_NEWNET) < 0)
		fail("unshare the shared sysfs's network namespace");
	make_template(shared_dir);
	/* The same two in the daemon's namespace, for criu restores (which start there) and as the
	 * sign the daemon waits for: once the empty tmpfs is mounted, the server is ready. */
	mount_sysfs_and_empty(sys_path, empty_path);
}

static int serve(const char *shared_dir)
{
	static char buf[65536];
	union {
		char space[CMSG_SPACE(sizeof(int) * (MAX_ITEMS + 2))];
		struct cmsghdr align;
	} ctl;
	if (shared_dir)
		mount_shared(shared_dir);
	struct sigaction sa = {.sa_handler = SIG_IGN, .sa_flags = SA_NOCLDWAIT};
	sigaction(SIGCHLD, &sa, NULL); /* workers reap themselves */
	/* A reply to a daemon that gave up must fail with EPIPE (and the worker then kill the agent it
	 * started), not kill the worker silently. */
	signal(SIGPIPE, SIG_IGN);
	for (;;) {
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf - 1};
		struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space,
				    .msg_controllen = sizeof ctl.space};
		ssize_t n = recvmsg(3, &mh, MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n == 0 ? 0 : 1; /* the daemon is gone */
		int fds[MAX_ITEMS + 2], nfds = 0;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
			if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
				int k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
				for (int i = 0; i < k && nfds < MAX_ITEMS + 2; i++)
					memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			}
		if (nfds < 2 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
			for (int i = 0; i < nfds; i++)
				close(fds[i]);
			continue; /* malformed: the daemon's reply fd closes unanswered, which it reports */
		}
		pid_t worker = fork();
		if (worker == 0) {
			signal(SIGCHLD, SIG_DFL);
			close(3);
			int high[MAX_ITEMS + 2];
			for (int i = 0; i < nfds; i++) {
				high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 6 + MAX_ITEMS + 8); /* above every bind */
				close(fds[i]);
			}
			reply_fd = high[0];
			if (dup2(high[1], 3) < 0)
				fail("dup2 channel");
			for (int i = 2; i < nfds; i++)
				if (dup2(high[i], 6 + i - 2) < 0)
					fail("dup2 bind source");
			buf[n] = '\0';
			char *argv[4 * MAX_ITEMS + 32];
			int argc = 0;
			argv[argc++] = "sandfleet-run";
			for (char *p = buf; p < buf + n && argc < (int)(sizeof argv / sizeof *argv) - 1; p += strlen(p) + 1)
				argv[argc++] = p;
			argv[argc] = NULL;
			parse_args(argc, argv);
			_exit(launch());
		}
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
	}
}

int main(int argc, char **argv)
{
	read_bpf(5);
	if (argc >= 2 && !strcmp(argv[1], "--serve"))
		return serve(argc == 4 && !strcmp(argv[2], "--shared") ? argv[3] : NULL);
	parse_args(argc, argv);
	return launch();
}
