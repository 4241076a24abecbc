/*
 * sandfleet in-sandbox agent: PID 1 of the sandbox's pid namespace.
 *
 * Runs commands for the daemon over a SOCK_SEQPACKET channel inherited as fd 3.
 * Each datagram is `u32 type, u32 id` (little-endian) + payload; see agent.py
 * for the authoritative description of every message.
 *
 * Build: musl-gcc (or gcc) -O2 -static -Wall -Wextra -o agent agent.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wire format is little-endian and encoded with memcpy"
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

enum {
	M_EXEC = 1, M_STDIN = 2, M_SIGNAL = 3, M_PING = 4, M_REOPEN = 5, M_FORGET = 6,
	M_STARTED = 10, M_STDOUT = 11, M_STDERR = 12, M_EXIT = 13, M_ERROR = 14, M_PONG = 15, M_HELLO = 16,
};
enum { F_STDIN_PIPE = 1, F_SETSID = 2 };
enum { X_TIMED_OUT = 1, X_OUT_TRUNC = 2, X_ERR_TRUNC = 4 };
enum { K_CHAN, K_SIG, K_OUT, K_ERR, K_IN }; /* epoll event kinds */

#define VERSION "sandfleet-agent/2" /* 2: REOPEN and FORGET */
#define MAXPAY 65536
#define CHAN 3
#define HANDOFF 4
#define GRACE_US 50000 /* wait for pipe EOF this long after reaping */
#define DEFAULT_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

struct exec {
	uint32_t id, xflags;
	pid_t pid;
	int fd[3]; /* [0] stdin write end, [1] stdout read end, [2] stderr read end; -1 = closed */
	int in_reg, in_close, reaped, status, orphan;
	uint64_t cap, total[2], start, deadline, reaped_at;
	char *ibuf; /* pending stdin bytes [ioff, ilen) */
	size_t ioff, ilen, icap;
};

static struct exec **ex;
static size_t nex;
static int epfd, sigfd, chan_dead, handoff_open, handoff_drop;
static char rbuf[MAXPAY + 64], obuf[MAXPAY];

static uint64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void ep_add(int fd, int kind, size_t slot, uint32_t events)
{
	struct epoll_event ev = { .events = events };
	/* fd is stored too so stale events for a recycled slot can be detected */
	ev.data.u64 = ((uint64_t)slot << 32) | ((uint64_t)kind << 28) | (uint32_t)fd;
	if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
		perror("agent: epoll_ctl");
}

static void ep_close(int *fd)
{
	if (*fd < 0)
		return;
	epoll_ctl(epfd, EPOLL_CTL_DEL, *fd, NULL);
	close(*fd);
	*fd = -1;
}

static void set_nonblock(int fd, int on)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

static void close_from(unsigned lo, unsigned flags)
{
	if (syscall(SYS_close_range, lo, ~0U, flags) == 0)
		return;
	for (unsigned fd = lo; fd < 4096; fd++) /* pre-5.9 kernels */
		if (flags & CLOSE_RANGE_CLOEXEC)
			fcntl((int)fd, F_SETFD, FD_CLOEXEC);
		else
			close((int)fd);
}

/* Blocking send: the daemon always reads, and blocking gives natural backpressure on output. */
static void chan_send(uint32_t type, uint32_t id, const void *a, size_t alen, const void *b, size_t blen)
{
	/* while waiting for a new daemon to pick up the handoff channel only HELLO may be queued (it
	 * knows none of our exec ids); a planned reopen (handoff_drop == 0) queues everything */
	if (chan_dead || (handoff_open && handoff_drop && type != M_HELLO))
		return;
	uint32_t hdr[2] = { type, id };
	struct iovec iov[3] = { { hdr, 8 }, { (void *)a, alen }, { (void *)b, blen } };
	struct msghdr m = { .msg_iov = iov, .msg_iovlen = 3 };
	for (;;) {
		if (sendmsg(CHAN, &m, MSG_NOSIGNAL) >= 0)
			return;
		if (errno == EINTR)
			continue;
		if (errno == EAGAIN || errno == ENOBUFS) {
			struct pollfd p = { CHAN, POLLOUT, 0 };
			poll(&p, 1, 10);
			continue;
		}
		chan_dead = 1;
		return;
	}
}

static void send_error(uint32_t id, int err, const char *msg)
{
	int32_t e = err;
	chan_send(M_ERROR, id, &e, 4, msg, strlen(msg));
}

static struct exec *find_id(uint32_t id, size_t *slot)
{
	for (size_t i = 0; i < nex; i++)
		if (ex[i] && !ex[i]->orphan && ex[i]->id == id) { /* orphans are invisible to a new daemon */
			if (slot)
				*slot = i;
			return ex[i];
		}
	return NULL;
}

/* ---- process tree signalling ---------------------------------------------------------- */

struct pidset { pid_t *v; size_t n, cap; };

static int ps_has(const struct pidset *s, pid_t p)
{
	for (size_t i = 0; i < s->n; i++)
		if (s->v[i] == p)
			return 1;
	return 0;
}

static void ps_add(struct pidset *s, pid_t p)
{
	if (s->n == s->cap) {
		size_t nc = s->cap ? s->cap * 2 : 32;
		pid_t *nv = realloc(s->v, nc * sizeof *nv);
		if (!nv)
			return;
		s->v = nv;
		s->cap = nc;
	}
	s->v[s->n++] = p;
}

/* One pass over /proc adding every process whose parent is already in the set. */
static void scan_children(struct pidset *s)
{
	DIR *d = opendir("/proc");
	struct dirent *de;
	if (!d)
		return;
	while ((de = readdir(d))) {
		char *end, path[64], buf[512];
		long pid = strtol(de->d_name, &end, 10), ppid;
		if (*end || pid <= 0 || ps_has(s, (pid_t)pid))
			continue;
		snprintf(path, sizeof path, "/proc/%ld/stat", pid);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t n = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (n <= 0)
			continue;
		buf[n] = 0;
		char *rp = strrchr(buf, ')'), st; /* comm may contain spaces and parens */
		if (rp && sscanf(rp + 1, " %c %ld", &st, &ppid) == 2 && ps_has(s, (pid_t)ppid))
			ps_add(s, (pid_t)pid);
	}
	closedir(d);
}

/* scope 0: process group; 1: group + all descendants; 2: descendants only. */
static void signal_exec(struct exec *e, int sig, uint32_t scope)
{
	/* once reaped the pid may be recycled, and its children were reparented to us anyway */
	if (scope == 0 || e->reaped) {
		if (scope != 2)
			kill(-e->pid, sig);
		return;
	}
	/* For SIGKILL, stop everything found first: a killed parent's children would be
	 * reparented to us mid-scan and escape the ppid-chain walk. */
	int freeze = sig == SIGKILL;
	struct pidset s = { 0 };
	ps_add(&s, e->pid);
	if (freeze && scope == 1)
		kill(e->pid, SIGSTOP);
	for (int round = 0; round < 64; round++) {
		size_t before = s.n;
		scan_children(&s);
		if (freeze)
			for (size_t i = before; i < s.n; i++)
				kill(s.v[i], SIGSTOP);
		if (s.n == before)
			break;
	}
	/* the group and the root go last, so the walk above saw an intact tree */
	for (size_t i = 1; i < s.n; i++)
		kill(s.v[i], sig);
	if (scope == 1) {
		kill(-e->pid, sig);
		kill(e->pid, sig);
	}
	free(s.v);
}

/* ---- exec lifecycle -------------------------------------------------------------------- */

static void stdin_close(struct exec *e)
{
	ep_close(&e->fd[0]);
	e->in_reg = 0;
	free(e->ibuf);
	e->ibuf = NULL;
	e->ioff = e->ilen = e->icap = 0;
}

/* Write as much pending stdin as the pipe takes; park the rest behind EPOLLOUT. */
static void stdin_flush(struct exec *e, size_t slot)
{
	while (e->fd[0] >= 0 && e->ioff < e->ilen) {
		ssize_t n = write(e->fd[0], e->ibuf + e->ioff, e->ilen - e->ioff);
		if (n > 0) {
			e->ioff += (size_t)n;
		} else if (n < 0 && errno == EINTR) {
			continue;
		} else if (n < 0 && errno == EAGAIN) {
			if (!e->in_reg) {
				ep_add(e->fd[0], K_IN, slot, EPOLLOUT);
				e->in_reg = 1;
			}
			return;
		} else { /* EPIPE: the child closed its stdin, drop everything */
			stdin_close(e);
			return;
		}
	}
	e->ioff = e->ilen = 0;
	if (e->in_reg && e->fd[0] >= 0) {
		epoll_ctl(epfd, EPOLL_CTL_DEL, e->fd[0], NULL);
		e->in_reg = 0;
	}
	if (e->in_close)
		stdin_close(e);
}

static void stdin_data(struct exec *e, size_t slot, const char *p, size_t n)
{
	if (e->fd[0] < 0 || e->in_close)
		return;
	if (n == 0) {
		e->in_close = 1;
	} else {
		size_t pending = e->ilen - e->ioff;
		if (pending + n > e->icap) {
			size_t nc = e->icap ? e->icap : 65536;
			while (nc < pending + n)
				nc *= 2;
			char *nb = malloc(nc);
			if (!nb) {
				stdin_close(e);
				return;
			}
			if (pending)
				memcpy(nb, e->ibuf + e->ioff, pending);
			free(e->ibuf);
			e->ibuf = nb;
			e->icap = nc;
		} else if (e->ioff) {
			memmove(e->ibuf, e->ibuf + e->ioff, pending);
		}
		memcpy(e->ibuf + pending, p, n);
		e->ioff = 0;
		e->ilen = pending + n;
	}
	stdin_flush(e, slot);
}

/* Read up to `reads` chunks from stdout (s=1) or stderr (s=2); forward within out_cap. */
static void drain(struct exec *e, int s, int reads)
{
	while (reads-- > 0 && e->fd[s] >= 0) {
		ssize_t n = read(e->fd[s], obuf, sizeof obuf);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			ep_close(&e->fd[s]);
			return;
		}
		uint64_t before = e->total[s - 1], fwd = (uint64_t)n;
		e->total[s - 1] += (uint64_t)n;
		if (e->cap != UINT64_MAX && before + fwd > e->cap) { /* UINT64_MAX: no cap; 0: keep nothing */
			fwd = before >= e->cap ? 0 : e->cap - before;
			e->xflags |= s == 1 ? X_OUT_TRUNC : X_ERR_TRUNC;
		}
		if (fwd && !e->orphan)
			chan_send(s == 1 ? M_STDOUT : M_STDERR, e->id, obuf, (size_t)fwd, NULL, 0);
	}
}

static void finish(size_t slot)
{
	struct exec *e = ex[slot];
	for (int s = 1; s <= 2; s++) {
		drain(e, s, 16); /* whatever is already buffered; a live grandchild may keep writing */
		ep_close(&e->fd[s]);
	}
	stdin_close(e);
	if (!e->orphan) {
		char p[32];
		int32_t st = e->status;
		uint64_t dur = e->reaped_at - e->start;
		memcpy(p, &st, 4);
		memcpy(p + 4, &e->xflags, 4);
		memcpy(p + 8, &e->total[0], 8);
		memcpy(p + 16, &e->total[1], 8);
		memcpy(p + 24, &dur, 8);
		chan_send(M_EXIT, e->id, p, sizeof p, NULL, 0);
	}
	free(e);
	ex[slot] = NULL;
}

static size_t alloc_slot(void)
{
	for (size_t i = 0; i < nex; i++)
		if (!ex[i])
			return i;
	size_t old = nex, nn = nex ? nex * 2 : 64;
	struct exec **ne = realloc(ex, nn * sizeof *ne);
	if (!ne)
		return (size_t)-1;
	memset(ne + old, 0, (nn - old) * sizeof *ne);
	ex = ne;
	nex = nn;
	return old;
}

struct child_err { int err, stage; };
static const char *stage_names[] = { "setup", "chdir", "setgroups", "setgid", "setuid", "exec" };

/* A file that is neither a binary nor starts with "#!" is run by /bin/sh, as glibc's execvp does
 * (musl's does not, and the agent is built against musl where it can be). `search` is the request's
 * PATH value. Returns only if that fails too, with errno ENOEXEC. */
static void exec_as_script(char **argv, char **envp, const char *search)
{
	static char found[4096];
	const char *file = argv[0];
	if (!strchr(file, '/')) {
		file = NULL;
		for (const char *p = search; *p;) {
			const char *end = strchrnul(p, ':');
			int n = end == p ? snprintf(found, sizeof found, "%s", argv[0])
					 : snprintf(found, sizeof found, "%.*s/%s", (int)(end - p), p, argv[0]);
			if (n > 0 && n < (int)sizeof found && access(found, X_OK) == 0) {
				file = found;
				break;
			}
			p = *end ? end + 1 : end;
		}
	}
	if (file) {
		int argc = 0;
		while (argv[argc])
			argc++;
		char **sh = calloc((size_t)argc + 2, sizeof *sh);
		if (sh) {
			sh[0] = "sh";
			sh[1] = (char *)file;
			for (int i = 1; i < argc; i++)
				sh[i + 1] = argv[i];
			execve("/bin/sh", sh, envp);
		}
	}
	errno = ENOEXEC;
}

static void __attribute__((noreturn)) child_fail(int fd, int stage)
{
	struct child_err ce = { errno, stage };
	if (write(fd, &ce, sizeof ce) < 0)
		_exit(126);
	_exit(127);
}

static void do_exec(uint32_t id, const char *p, size_t n)
{
	uint32_t flags, uid, gid, tmo, argc, envc;
	uint64_t cap;
	if (n < 32) {
		send_error(id, EINVAL, "short exec message");
		return;
	}
	memcpy(&flags, p, 4);
	memcpy(&uid, p + 4, 4);
	memcpy(&gid, p + 8, 4);
	memcpy(&tmo, p + 12, 4);
	memcpy(&cap, p + 16, 8);
	memcpy(&argc, p + 24, 4);
	memcpy(&envc, p + 28, 4);
	if (argc == 0 || argc > n || envc > n) {
		send_error(id, EINVAL, "bad argc/envc");
		return;
	}
	if (find_id(id, NULL)) {
		send_error(id, EEXIST, "exec id in use");
		return;
	}
	/* strings point into rbuf, which stays untouched until the child has exec'd */
	char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 1, sizeof *envp);
	const char *cwd = NULL, *path = DEFAULT_PATH;
	size_t off = 32;
	int ok = argv && envp;
	for (uint32_t i = 0; ok && i < 1 + argc + envc; i++) {
		size_t len = strnlen(p + off, n - off);
		if (off + len >= n) {
			ok = 0;
			break;
		}
		char *str = (char *)p + off;
		if (i == 0)
			cwd = str;
		else if (i <= argc)
			argv[i - 1] = str;
		else {
			envp[i - 1 - argc] = str;
			if (!strncmp(str, "PATH=", 5))
				path = str;
		}
		off += len + 1;
	}
	int in[2] = { -1, -1 }, out[2] = { -1, -1 }, err[2] = { -1, -1 }, ep[2] = { -1, -1 };
	size_t slot = (size_t)-1;
	struct exec *e = NULL;
	if (!ok) {
		send_error(id, EINVAL, "malformed exec strings");
		goto out;
	}
	errno = 0;
	if (((flags & F_STDIN_PIPE) && pipe2(in, O_CLOEXEC) < 0) || pipe2(out, O_CLOEXEC) < 0 ||
	    pipe2(err, O_CLOEXEC) < 0 || pipe2(ep, O_CLOEXEC) < 0 || !(e = calloc(1, sizeof *e)) ||
	    (slot = alloc_slot()) == (size_t)-1) {
		send_error(id, errno ? errno : ENOMEM, "agent: out of resources");
		goto out;
	}
	uint64_t start = now_us();
	pid_t pid = fork();
	if (pid < 0) {
		send_error(id, errno, "fork failed");
		goto out;
	}
	if (pid == 0) {
		struct sigaction sa = { .sa_handler = SIG_DFL };
		for (int s = 1; s < NSIG; s++)
			sigaction(s, &sa, NULL);
		sigset_t none;
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		if (flags & F_SETSID)
			setsid();
		else
			setpgid(0, 0);
		int infd = (flags & F_STDIN_PIPE) ? in[0] : open("/dev/null", O_RDONLY);
		if (infd < 0 || dup2(infd, 0) < 0 || dup2(out[1], 1) < 0 || dup2(err[1], 2) < 0)
			child_fail(ep[1], 0);
		close_from(3, CLOSE_RANGE_CLOEXEC); /* keeps ep[1] open until exec succeeds */
		if (chdir(cwd) < 0)
			child_fail(ep[1], 1);
		if (uid != getuid() || gid != getgid()) {
			if (setgroups(0, NULL) < 0)
				child_fail(ep[1], 2);
			if (setgid(gid) < 0)
				child_fail(ep[1], 3);
			if (setuid(uid) < 0)
				child_fail(ep[1], 4);
		}
		/* execvpe searches the *caller's* PATH, so make ours the one from the request */
		extern char **environ;
		char *penv[2] = { (char *)path, NULL };
		environ = penv;
		execvpe(argv[0], argv, envp);
		if (errno == ENOEXEC)
			exec_as_script(argv, envp, path + 5);
		child_fail(ep[1], 5);
	}
	if (!(flags & F_SETSID))
		setpgid(pid, pid); /* also in the parent, so a SIGNAL right after STARTED can't race */
	close(ep[1]);
	ep[1] = -1;
	struct child_err ce;
	ssize_t r;
	do
		r = read(ep[0], &ce, sizeof ce);
	while (r < 0 && errno == EINTR);
	if (r == (ssize_t)sizeof ce) {
		char msg[512];
		const char *what = ce.stage == 1 ? cwd : ce.stage == 5 ? argv[0] : "";
		int st;
		while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
			;
		snprintf(msg, sizeof msg, "%s %s: %s", stage_names[ce.stage % 6], what, strerror(ce.err));
		send_error(id, ce.err, msg);
		goto out;
	}
	e->id = id;
	e->pid = pid;
	e->cap = cap;
	e->start = start;
	e->deadline = tmo ? start + (uint64_t)tmo * 1000u : 0;
	e->fd[0] = in[1];
	e->fd[1] = out[0];
	e->fd[2] = err[0];
	in[1] = out[0] = err[0] = -1;
	for (int s = 0; s < 3; s++)
		if (e->fd[s] >= 0)
			set_nonblock(e->fd[s], 1);
	ep_add(e->fd[1], K_OUT, slot, EPOLLIN);
	ep_add(e->fd[2], K_ERR, slot, EPOLLIN);
	ex[slot] = e;
	e = NULL;
	int32_t pid32 = pid;
	chan_send(M_STARTED, id, &pid32, 4, NULL, 0);
out:
	for (int i = 0; i < 2; i++) {
		if (in[i] >= 0) close(in[i]);
		if (out[i] >= 0) close(out[i]);
		if (err[i] >= 0) close(err[i]);
		if (ep[i] >= 0) close(ep[i]);
	}
	free(e);
	free(argv);
	free(envp);
}

static void reap(void)
{
	struct signalfd_siginfo si;
	while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si)
		;
	int st;
	pid_t p;
	while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
		for (size_t i = 0; i < nex; i++) {
			struct exec *e = ex[i];
			if (e && e->pid == p && !e->reaped) {
				e->reaped = 1;
				e->status = st;
				e->reaped_at = now_us();
				break;
			}
		}
	}
}

/* ---- channel --------------------------------------------------------------------------- */

static void placeholder_handoff(void)
{
	/* Keep fd 4 occupied so no pipe ever lands there and gets clobbered by a later handoff. */
	int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (fd >= 0 && fd != HANDOFF) {
		dup3(fd, HANDOFF, O_CLOEXEC);
		close(fd);
	}
}

static void send_hello(void) { chan_send(M_HELLO, 0, VERSION, strlen(VERSION), NULL, 0); }

/* Offer a fresh channel on fd 4, replacing the one at fd 3 (which closes). `orphan`: the daemon went
 * away, so no one will ever read our running execs' output; otherwise the same daemon asked
 * (M_REOPEN, before a snapshot: the old channel crossed namespaces, this pair is ours alone) and
 * carries on with the same execs over the new channel. */
static void reconnect(int orphan)
{
	int sv[2];
	for (size_t i = 0; orphan && i < nex; i++)
		if (ex[i])
			ex[i]->orphan = 1;
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
		perror("agent: socketpair");
		return; /* retried on the next loop iteration */
	}
	epoll_ctl(epfd, EPOLL_CTL_DEL, CHAN, NULL);
	dup3(sv[1], HANDOFF, O_CLOEXEC);
	dup3(sv[0], CHAN, O_CLOEXEC);
	close(sv[0]);
	close(sv[1]);
	ep_add(CHAN, K_CHAN, 0, EPOLLIN);
	chan_dead = 0;
	handoff_open = 1;
	handoff_drop = orphan;
	send_hello(); /* queued in the socket until the new daemon reads it */
}

static void handle_chan(void)
{
	for (int i = 0; i < 64 && !chan_dead; i++) {
		ssize_t n = recv(CHAN, rbuf, sizeof rbuf, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			chan_dead = 1;
			return;
		}
		if (handoff_open) { /* the new daemon has its copy now */
			handoff_open = 0;
			handoff_drop = 0;
			placeholder_handoff();
		}
		if (n < 8)
			continue;
		uint32_t type, id;
		memcpy(&type, rbuf, 4);
		memcpy(&id, rbuf + 4, 4);
		const char *p = rbuf + 8;
		size_t len = (size_t)n - 8, slot;
		struct exec *e;
		switch (type) {
		case M_EXEC:
			do_exec(id, p, len);
			break;
		case M_STDIN:
			if ((e = find_id(id, &slot)))
				stdin_data(e, slot, p, len);
			break;
		case M_SIGNAL:
			if (len >= 8 && (e = find_id(id, NULL))) {
				int32_t sig;
				uint32_t scope;
				memcpy(&sig, p, 4);
				memcpy(&scope, p + 4, 4);
				signal_exec(e, sig, scope);
			}
			break;
		case M_PING:
			chan_send(M_PONG, id, NULL, 0, NULL, 0);
			break;
		case M_FORGET: /* a daemon that never knew our running execs (adopted, restored) */
			for (size_t i = 0; i < nex; i++)
				if (ex[i])
					ex[i]->orphan = 1;
			break;
		case M_REOPEN:
			reconnect(0);
			return; /* fd 3 is the new channel now: nothing more to read from the old one */
		default:
			break;
		}
	}
}

/* Timeouts and completion; returns the epoll timeout in ms. */
static int service(void)
{
	uint64_t now = now_us(), next = UINT64_MAX;
	for (size_t i = 0; i < nex; i++) {
		struct exec *e = ex[i];
		if (!e)
			continue;
		if (!e->reaped && e->deadline && !(e->xflags & X_TIMED_OUT)) {
			if (now >= e->deadline) {
				e->xflags |= X_TIMED_OUT;
				signal_exec(e, SIGKILL, 1);
			} else if (e->deadline < next) {
				next = e->deadline;
			}
		}
		if (e->reaped) {
			if ((e->fd[1] < 0 && e->fd[2] < 0) || now >= e->reaped_at + GRACE_US)
				finish(i);
			else if (e->reaped_at + GRACE_US < next)
				next = e->reaped_at + GRACE_US;
		}
	}
	if (next == UINT64_MAX)
		return -1;
	return (int)((next - now + 999) / 1000);
}

int main(void)
{
	/* A name the daemon's orphan reaper knows (exec'd from fd 4, we would be called "4"). */
	prctl(PR_SET_NAME, "sandfleet-agent");
	prctl(PR_SET_DUMPABLE, 0);
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	signal(SIGPIPE, SIG_IGN);
	sigset_t ss;
	sigemptyset(&ss);
	sigaddset(&ss, SIGCHLD);
	sigprocmask(SIG_BLOCK, &ss, NULL);
	/* make sure 0-2 are taken so pipes never land there and break the child's dup2s */
	for (;;) {
		int fd = open("/dev/null", O_RDWR | O_CLOEXEC);
		if (fd < 0)
			break;
		if (fd > 2) {
			close(fd);
			break;
		}
	}
	close_from(HANDOFF, 0);
	placeholder_handoff();
	int type = 0;
	socklen_t tl = sizeof type;
	if (getsockopt(CHAN, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_SEQPACKET) {
		fprintf(stderr, "agent: fd 3 must be a SOCK_SEQPACKET socket\n");
		return 2;
	}
	fcntl(CHAN, F_SETFD, FD_CLOEXEC);
	set_nonblock(CHAN, 0);
	epfd = epoll_create1(EPOLL_CLOEXEC);
	sigfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC);
	if (epfd < 0 || sigfd < 0) {
		perror("agent: epoll/signalfd");
		return 2;
	}
	ep_add(CHAN, K_CHAN, 0, EPOLLIN);
	ep_add(sigfd, K_SIG, 0, EPOLLIN);
	send_hello();
	struct epoll_event evs[64];
	for (;;) {
		if (chan_dead)
			reconnect(1);
		int tmo = service();
		if (chan_dead && tmo < 0)
			tmo = 100; /* socketpair failed: retry soon */
		int n = epoll_wait(epfd, evs, 64, tmo);
		for (int i = 0; i < n; i++) {
			uint64_t d = evs[i].data.u64;
			int kind = (int)((d >> 28) & 0xf), fd = (int)(d & 0xfffffff);
			size_t slot = (size_t)(d >> 32);
			struct exec *e = slot < nex ? ex[slot] : NULL;
			switch (kind) {
			case K_CHAN:
				handle_chan();
				break;
			case K_SIG:
				reap();
				break;
			case K_OUT:
			case K_ERR:
				if (e && e->fd[kind - K_OUT + 1] == fd)
					drain(e, kind - K_OUT + 1, 4);
				break;
			case K_IN:
				if (e && e->fd[0] == fd)
					stdin_flush(e, slot);
				break;
			}
		}
	}
}
