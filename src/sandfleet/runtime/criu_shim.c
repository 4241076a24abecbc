/*
 * sandfleet-criu-shim.so: preloaded into criu (`ld-linux-x86-64.so.2 --preload <shim> ... criu`),
 * so that criu works with sandboxes whose user namespace is owned by a uid of their own.
 *
 * Every sandbox's user namespace is owned by a uid no host process or file uses (the daemon picks
 * one per sandbox: runtime/launcher.c --owner). The kernel charges the per-user counts of a user
 * namespace (inotify instances, fanotify groups, mqueue bytes, queued signals, namespaces...) to
 * that owner at the level above, so each sandbox has its own, instead of all of them and host
 * root sharing root's. Two of criu's calls need help with that, and nothing else changes:
 *
 *  - restore: the restored tree's user namespace is created by criu's root task with
 *    clone3(CLONE_NEWUSER), by criu running as host root, so host root would own it. With
 *    SANDFLEET_USERNS_OWNER=<uid> in the environment, that one clone3 is made with the effective
 *    uid and gid switched to <uid> (capabilities kept: SECBIT_NO_SETUID_FIXUP; real and saved ids
 *    stay 0), and switched back right after, in criu. The child starts in the new namespace (the
 *    kernel resets its securebits and gives it every capability there, as for any new namespace).
 *    Changing the effective uid also clears the dumpable flag, which the child inherits; the
 *    restored task then could not write its own /proc files (timens_offsets), so the flag is set
 *    for the duration of the call.
 *
 *  - dump: reading another task's rlimits (prlimit64 with no new limit) needs CAP_SYS_RESOURCE in
 *    the task's user namespace, which host root has there as its owner, or through its own
 *    capability set, which lacks CAP_SYS_RESOURCE on some hosts. An EPERM is retried once as the
 *    owner of the target's namespace (NS_GET_OWNER_UID), a read that changes nothing.
 *
 *  - dump of a restored tree: criu checks that the tree's namespaces belong to its user namespace
 *    (criu/namespaces.c check_user_ns) in a child that takes the uid of root inside, enters that
 *    user namespace (left with no capability outside it), then opens /proc/<init>/ns/{net,uts,
 *    ipc,mnt,time} and setns()es into each. Opening a /proc/<pid>/ns link is a ptrace read check:
 *    the init (the agent) is non-dumpable, so it takes CAP_SYS_PTRACE in the user namespace of the
 *    agent's memory (mm->user_ns, set by execve to the caller's). A started agent was exec'd inside
 *    the sandbox's namespace, where the child has every capability. A restored agent has not
 *    exec'd since criu, running in the host's namespace, forked it and mapped its memory back: its
 *    mm->user_ns is the host's, where the child has none, so the open fails with EACCES and criu
 *    refuses the dump ("Can't open <pid>/ns/net on procfs: Permission denied"). With
 *    SANDFLEET_DUMP_ROOT=<pid> (the dumped init) in the environment, a setns() into the user
 *    namespace of <pid> first opens those links (still with the host capabilities the child holds
 *    then), and an open of one of them that fails with EACCES or EPERM afterwards, through
 *    /proc/<pid>, gets a copy of the one opened before. criu's own check still runs: the setns()
 *    into each namespace, which the kernel allows only to a holder of CAP_SYS_ADMIN in the user
 *    namespace that owns it. Nothing changes for the agent, which stays non-dumpable.
 *
 *  - dump of a tree holding a TCP or UDP socket: criu 4.1 reads SO_PASSCRED and SO_PASSSEC of
 *    every socket, and kernels since 6.16 answer EOPNOTSUPP for families without them (inet), so
 *    any server in the sandbox failed its dump. Such a read that fails with EOPNOTSUPP answers 0
 *    (off, which it is: the family has no such option), what criu does itself since it restricted
 *    these reads to unix and netlink sockets (upstream 4b7398595). A restore sets them only when on.
 *
 * criu makes the first two calls through libc's syscall(), which is what this wraps (and setns()
 * and openat() for the third, getsockopt() for the fourth). Any failure to switch back aborts criu
 * rather than let it carry on under another uid.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/nsfs.h>
#include <linux/sched.h>
#include <linux/securebits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef long (*syscall_fn)(long, ...);

static syscall_fn real_syscall(void)
{
	static syscall_fn real;
	if (!real)
		real = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
	if (!real)
		abort();
	return real;
}

struct saved {
	uid_t euid;
	gid_t egid;
	int bits, dumpable;
};

/* Switch the effective ids to `owner`, keeping every capability; 0 on success (errno set otherwise,
 * with nothing changed). */
static int become(uid_t owner, struct saved *s)
{
	uid_t ru, su;
	gid_t rg, sg;
	s->bits = prctl(PR_GET_SECUREBITS);
	s->dumpable = prctl(PR_GET_DUMPABLE);
	if (s->bits < 0 || s->dumpable < 0 || getresuid(&ru, &s->euid, &su) < 0 || getresgid(&rg, &s->egid, &sg) < 0)
		return -1;
	if (prctl(PR_SET_SECUREBITS, s->bits | SECBIT_NO_SETUID_FIXUP) < 0)
		return -1;
	if (setresgid(-1, owner, -1) < 0 || setresuid(-1, owner, -1) < 0) {
		int e = errno;
		if (setresgid(-1, s->egid, -1) < 0 || prctl(PR_SET_SECUREBITS, s->bits) < 0)
			abort();
		errno = e;
		return -1;
	}
	return 0;
}

static void restore(const struct saved *s)
{
	int e = errno;
	if (setresuid(-1, s->euid, -1) < 0 || setresgid(-1, s->egid, -1) < 0 || prctl(PR_SET_SECUREBITS, s->bits) < 0 ||
	    prctl(PR_SET_DUMPABLE, s->dumpable) < 0)
		abort(); /* never carry on as the owner */
	errno = e;
}

static long prlimit_as_owner(long a[6])
{
	char path[64];
	uid_t owner;
	struct saved s;
	snprintf(path, sizeof path, "/proc/%ld/ns/user", a[0]);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	int ok = fd >= 0 && ioctl(fd, NS_GET_OWNER_UID, &owner) == 0;
	if (fd >= 0)
		close(fd);
	if (!ok || owner == 0 || become(owner, &s) < 0) {
		errno = EPERM;
		return -1;
	}
	long ret = real_syscall()(SYS_prlimit64, a[0], a[1], a[2], a[3], a[4], a[5]);
	restore(&s);
	return ret;
}

static long clone3_as_owner(uid_t owner, long a[6])
{
	struct saved s;
	if (become(owner, &s) < 0)
		return -1;
	if (prctl(PR_SET_DUMPABLE, 1) < 0) {
		restore(&s);
		return -1;
	}
	long ret = real_syscall()(SYS_clone3, a[0], a[1], a[2], a[3], a[4], a[5]);
	if (ret == 0)
		return 0; /* the child: its credentials now belong to the new namespace */
	restore(&s);
	return ret;
}

long syscall(long nr, ...)
{
	va_list ap;
	long a[6];
	va_start(ap, nr);
	for (int i = 0; i < 6; i++)
		a[i] = va_arg(ap, long);
	va_end(ap);
	if (nr == SYS_clone3 && a[0] && (((struct clone_args *)a[0])->flags & CLONE_NEWUSER)) {
		const char *o = getenv("SANDFLEET_USERNS_OWNER");
		char *end;
		unsigned long owner = o ? strtoul(o, &end, 10) : 0;
		if (owner && !*end && owner < UINT32_MAX)
			return clone3_as_owner((uid_t)owner, a);
	}
	long ret = real_syscall()(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
	if (nr == SYS_prlimit64 && ret < 0 && errno == EPERM && a[0] > 0 && a[2] == 0)
		return prlimit_as_owner(a);
	return ret;
}

/* ---- dump: the namespaces of a restored tree's init, opened before entering its user namespace */

static const char *const ns_names[] = {"net", "uts", "ipc", "mnt", "time"}; /* check_user_ns's */
#define N_NS (sizeof ns_names / sizeof ns_names[0])

static struct {
	int active;
	dev_t dev; /* /proc/<pid> of the dumped init, as opened here */
	ino_t ino;
	int fd[N_NS];
} pre;

static int same_file(const struct stat *a, const struct stat *b)
{
	return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* Before setns(userns_fd, CLONE_NEWUSER): if that is the user namespace of SANDFLEET_DUMP_ROOT's
 * pid, open its other namespaces now. Failures leave things as they were (criu then reports). */
static void preopen_namespaces(int userns_fd)
{
	const char *root = getenv("SANDFLEET_DUMP_ROOT");
	char *end, path[32];
	unsigned long pid = root ? strtoul(root, &end, 10) : 0;
	struct stat target, st;
	if (pre.active || !pid || *end || pid > INT32_MAX || fstat(userns_fd, &target) < 0)
		return;
	snprintf(path, sizeof path, "/proc/%lu", pid);
	int dir = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (dir < 0)
		return;
	if (fstatat(dir, "ns/user", &st, 0) == 0 && same_file(&st, &target) && fstat(dir, &st) == 0) {
		pre.dev = st.st_dev;
		pre.ino = st.st_ino;
		for (size_t i = 0; i < N_NS; i++) {
			snprintf(path, sizeof path, "ns/%s", ns_names[i]);
			pre.fd[i] = openat(dir, path, O_RDONLY | O_CLOEXEC);
		}
		pre.active = 1;
	}
	close(dir);
}

int setns(int fd, int nstype)
{
	static int (*real)(int, int);
	if (!real)
		real = (int (*)(int, int))dlsym(RTLD_NEXT, "setns");
	if (!real)
		abort();
	if (nstype == CLONE_NEWUSER)
		preopen_namespaces(fd);
	return real(fd, nstype);
}

/* A copy of the namespace `path` (ns/<name>) opened before, if `dirfd` is the dumped init's
 * /proc/<pid>; -1 otherwise. */
static int preopened(int dirfd, const char *path, int flags)
{
	struct stat st;
	if (!pre.active || strncmp(path, "ns/", 3) || fstat(dirfd, &st) < 0 || st.st_dev != pre.dev ||
	    st.st_ino != pre.ino)
		return -1;
	for (size_t i = 0; i < N_NS; i++)
		if (!strcmp(path + 3, ns_names[i]) && pre.fd[i] >= 0)
			return fcntl(pre.fd[i], (flags & O_CLOEXEC) ? F_DUPFD_CLOEXEC : F_DUPFD, 0);
	return -1;
}

static int openat_common(const char *name, int dirfd, const char *path, int flags, mode_t mode)
{
	typedef int (*openat_fn)(int, const char *, int, ...);
	static openat_fn real[2];
	int i = name[6] != 0; /* "openat" or "openat64" */
	if (!real[i])
		real[i] = (openat_fn)dlsym(RTLD_NEXT, name);
	if (!real[i])
		abort();
	int ret = real[i](dirfd, path, flags, mode);
	if (ret < 0 && (errno == EACCES || errno == EPERM) && pre.active) {
		int e = errno, fd = preopened(dirfd, path, flags);
		if (fd >= 0)
			return fd;
		errno = e;
	}
	return ret;
}

#define MODE_ARG(flags, mode)                                                                                   \
	do {                                                                                                    \
		if ((flags) & (O_CREAT | O_TMPFILE)) {                                                          \
			va_list ap;                                                                             \
			va_start(ap, flags);                                                                    \
			mode = va_arg(ap, mode_t);                                                              \
			va_end(ap);                                                                             \
		}                                                                                               \
	} while (0)

int openat(int dirfd, const char *path, int flags, ...)
{
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	return openat_common("openat", dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	return openat_common("openat64", dirfd, path, flags, mode);
}

/* ---- dump: socket options a socket's family does not have -------------------------------------- */

#ifndef SO_PASSSEC
#define SO_PASSSEC 34
#endif

int getsockopt(int fd, int level, int name, void *restrict val, socklen_t *restrict len)
{
	static int (*real)(int, int, int, void *restrict, socklen_t *restrict);
	if (!real)
		real = (int (*)(int, int, int, void *restrict, socklen_t *restrict))dlsym(RTLD_NEXT, "getsockopt");
	if (!real)
		abort();
	int ret = real(fd, level, name, val, len);
	if (ret < 0 && errno == EOPNOTSUPP && level == SOL_SOCKET && (name == SO_PASSCRED || name == SO_PASSSEC) &&
	    len && *len >= (socklen_t)sizeof(int)) {
		*(int *)val = 0;
		*len = sizeof(int);
		return 0;
	}
	return ret;
}
