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
 * criu makes both calls through libc's syscall(), which is what this wraps. Any failure to switch
 * back aborts criu rather than let it carry on under another uid.
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
#include <sys/ioctl.h>
#include <sys/prctl.h>
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
