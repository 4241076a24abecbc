/*
 * sandfleet in-sandbox agent: PID 1 of the sandbox's pid namespace.
 *
 * Runs commands for the daemon over a SOCK_SEQPACKET channel inherited as fd 3.
 * Each datagram is `u32 type, u32 id` (little-endian) + payload; see agent.py
 * for the authoritative description of every message.
 *
 * Sessions (F_SESSION) are shells whose commands the agent frames itself: the daemon sends SRUN
 * with a per-command nonce, then the script on the shell's stdin; the shell reports the exit status
 * as one datagram on a socket at fd STATUS_FD, accepted only with the nonce and only when the kernel
 * says the shell process itself sent it (SCM_CREDENTIALS). The shell's stdin, stdout and stderr are
 * socketpairs (a socket cannot be reopened through /proc/PID/fd, a pipe can), so no other process of
 * the sandbox can read the script (and its nonce) or forge the report; output is forwarded only
 * while a command runs, capped per command, and drained and counted between commands. Shells that
 * cannot name a descriptor above 9 (dash: "Bad fd number") get those two at LOW_STATUS_FD and
 * LOW_CMDIN_FD instead (F_LOWFD); the daemon's script then hides them from the command.
 *
 * A terminal session (F_SESSION | F_PTY): the shell still reads its script from its socket, but its
 * stdout, stderr and controlling terminal are a new pseudo-terminal, and the command's stdin (the
 * CMDIN descriptor) is that terminal too; CMDIN bytes are typed into it (^C is the line discipline's
 * SIGINT to the foreground job), an empty CMDIN types the terminal's end-of-file character. Its
 * output is the master's, one stream. After a command killed by a signal (a pager ^C'd, killed at its
 * timeout) the terminal's modes go back to those before it, as an interactive shell restores them.
 *
 * Attempts on the agent: the sandbox's seccomp filter (runtime/seccomp.py attempt_rules) returns
 * SECCOMP_RET_USER_NOTIF for signals, ptrace, pidfd_open and process_vm_readv aimed at pid 1, and
 * the launcher hands the filter's listener over at fd 5 (LISTENER). The agent serves it from its
 * event loop: a caller in a nested pid namespace (NSpid has more than one entry: its "1" is another
 * init) is let through (SECCOMP_USER_NOTIF_FLAG_CONTINUE); any other gets EPERM, and the daemon an
 * M_ALERT (JSON: syscall, caller pid, uid, comm, signal or ptrace request), at most ALERT_RATE a
 * second, then one count of those suppressed. The agent is filtered too, so it must never signal or
 * trace pid 1 itself (it would wait on its own listener forever): signal_exec() goes through
 * sig_pid(). The listener is closed at an M_REOPEN that announces a criu checkpoint (criu cannot
 * dump it): from then on, and in sandboxes restored by criu, the same calls fail with ENOSYS and are
 * not reported. Without fd 5 (crun,
 * runc, tests running the agent directly) there is nothing to serve.
 *
 * Terminals (F_PTY): the command gets a fresh pseudo-terminal of the sandbox's own devpts as its
 * stdin, stdout and stderr and as its controlling terminal (it leads a new session); the master is
 * opened by the agent and its slave taken with TIOCGPTPEER (no path is looked up in /dev/pts, which
 * the sandbox's root controls). Output is the master's (one stream, capped like stdout), STDIN goes
 * to the master (so ^C is the line discipline's SIGINT to the foreground job), RESIZE sets its window
 * size (the kernel signals SIGWINCH); HOLD stops reading the master while the daemon's client is
 * behind, so a flood blocks its writer instead of filling the daemon.
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
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wire format is little-endian and encoded with memcpy"
#endif
#ifndef TIOCGPTPEER /* musl's headers may predate it */
#define TIOCGPTPEER _IO('T', 0x41)
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

enum {
	M_EXEC = 1, M_STDIN = 2, M_SIGNAL = 3, M_PING = 4, M_REOPEN = 5, M_FORGET = 6, M_SRUN = 7, M_CMDIN = 8,
	M_WATCH = 9, M_UNWATCH = 20, M_RESIZE = 22, M_HOLD = 23,
	M_STARTED = 10, M_STDOUT = 11, M_STDERR = 12, M_EXIT = 13, M_ERROR = 14, M_PONG = 15, M_HELLO = 16,
	M_SEXIT = 17, M_WEVENT = 18, M_WEND = 19, M_ALERT = 21,
};
enum { F_STDIN_PIPE = 1, F_SETSID = 2, F_MERGE = 4, F_SESSION = 8, F_NONDUMP = 16, F_PTY = 32, F_LOWFD = 64,
       F_LAZY = 128 };
enum { X_TIMED_OUT = 1, X_OUT_TRUNC = 2, X_ERR_TRUNC = 4, X_LOST = 8 };
enum { S_STDIN = 1 }; /* SRUN flags */
enum { K_CHAN, K_SIG, K_OUT, K_ERR, K_IN, K_EP, K_STATUS, K_CIN, K_WATCH, K_NOTIF }; /* epoll event kinds */

/* 3: exec starts without blocking the agent, F_MERGE, sessions framed by the agent (SRUN, CMDIN,
 * SEXIT), FORGET with a list of ids to keep, WATCH; 4: the seccomp listener, ALERT; 5: F_PTY, RESIZE;
 * 6: F_LOWFD, terminal sessions (F_SESSION | F_PTY). F_LAZY needs no new version: an agent before it
 * ignores the flag and sends STARTED at once, which the daemon takes as before. */
#define VERSION "sandfleet-agent/6"
#define STATUS_FD 100 /* a session shell's status socket */
#define CMDIN_FD 101  /* a session shell's per-command stdin (a pipe the agent reopens per command) */
#define LOW_STATUS_FD 9 /* the same, with F_LOWFD */
#define LOW_CMDIN_FD 8
#define NONCE_LEN 32
#define LOST_GRACE_US 5000000 /* after a session command's timeout: how long the shell may take to report */
#define MAX_WATCHES 8192	  /* inotify watches per WATCH request (a recursive tree) */
#define WATCH_RATE 2000	  /* events forwarded per watch and second; past it: one overflow event */
#define MAXPAY 65536
#define CHAN 3
#define HANDOFF 4
#define LISTENER 5     /* the seccomp filter's listener, when the launcher gave one */
#define ALERT_RATE 20  /* ALERT messages per second; past it they are counted, then reported as one */

/* <linux/seccomp.h>, which musl's headers lack */
struct sf_seccomp_data {
	int32_t nr;
	uint32_t arch;
	uint64_t instruction_pointer;
	uint64_t args[6];
};
struct sf_notif {
	uint64_t id;
	uint32_t pid;
	uint32_t flags;
	struct sf_seccomp_data data;
};
struct sf_notif_resp {
	uint64_t id;
	int64_t val;
	int32_t error;
	uint32_t flags;
};
#define SF_NOTIF_RECV _IOWR('!', 0, struct sf_notif)
#define SF_NOTIF_SEND _IOWR('!', 1, struct sf_notif_resp)
#define SF_NOTIF_ID_VALID _IOW('!', 2, uint64_t)
#define SF_NOTIF_CONTINUE 1u
#define SF_ARCH_X86_64 0xC000003Eu
#define SF_ARCH_I386 0x40000003u
#define SF_X32_BIT 0x40000000
#define GRACE_US 50000 /* wait for pipe EOF this long after reaping */
/* F_LAZY (the daemon waits for the whole result anyway): STARTED goes with the first output or the
 * EXIT if either comes this soon, so a short command wakes the daemon once, not twice */
#define LAZY_START_US 5000
#define STOP_WAIT_US 50000 /* a tree kill: how long the root may take to stop before the walk goes on */
#define STOP_POLL_US 5000  /* ... looking again this often (its stop's SIGCHLD usually wakes us first) */
#define DEFAULT_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* Bytes queued for a non-blocking writer (a child's stdin, a session command's stdin). */
struct wbuf {
	int fd, reg, closing; /* fd -1: closed; reg: waiting for EPOLLOUT; closing: close once flushed */
	char *buf;	      /* pending bytes [off, len) */
	size_t off, len, cap;
};

struct exec {
	uint32_t id, xflags;
	pid_t pid;
	int fd[3]; /* [1] stdout read end, [2] stderr read end; -1 = closed */
	struct wbuf in; /* the child's stdin (a session's: its script socket) */
	int reaped, status, orphan;
	int epr;     /* while starting: the read end of the exec-status pipe; -1 once exec'd or failed */
	int failed;  /* the exec failed (ERROR sent): no EXIT for it */
	int lazy;    /* F_LAZY */
	uint64_t start_due; /* F_LAZY: exec'd, STARTED not sent yet; sent by then at the latest */
	uint64_t cap, total[2], start, deadline, reaped_at;
	uint64_t cpu_us; /* CPU of the process and the descendants it waited for (its rusage when reaped) */
	/* a SIGKILL of the tree waiting for the root to stop (kill_by: then the walk goes on anyway) */
	uint32_t kill_scope;
	uint64_t kill_by;
	/* sessions (F_SESSION) */
	int session, sfd, cin_r, active;
	int pty;  /* F_PTY: fd[1] is the terminal's master */
	int held; /* HOLD: the master is not read (its writers block, as on a terminal nobody reads) */
	struct wbuf cin; /* the running command's stdin, when it has one */
	struct termios tio; /* a terminal session: its terminal's modes between commands */
	char nonce[NONCE_LEN];
	uint32_t cxflags, cseq;
	uint64_t ccap, ctotal[2], cstart, cdeadline, cgrace, dropped;
};

/* A WATCH: inotify over a directory (and its subdirectories when recursive). */
struct watch {
	uint32_t id;
	int ifd, recursive, nwd;
	int *wds;    /* watch descriptor -> index into paths */
	char **paths; /* absolute path of each watched directory, by watch descriptor */
	int cap;
	uint64_t dropped, win_start; /* rate cap: events forwarded in the current one-second window */
	uint32_t win_count;
};

static struct exec **ex;
static size_t nex;
static struct watch **wt;
static size_t nwt;
static int epfd, sigfd, chan_dead, handoff_open, handoff_drop;
static int lfd = -1; /* the seccomp listener (LISTENER), -1 without one */
static uint64_t alert_win, alert_suppressed; /* rate cap: the current one-second window */
static uint32_t alert_count;
static char rbuf[MAXPAY + 64], obuf[MAXPAY];

static void watch_free(size_t slot);

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

/* Never pid 1 (ourselves: our own filter would make us wait for our own answer) nor -1 (everyone). */
static void sig_pid(pid_t pid, int sig)
{
	if (pid > 1 || pid < -1)
		kill(pid, sig);
}

/* A process's state letter from /proc (0 if it is gone). */
static char proc_state(pid_t pid)
{
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	char *rp = strrchr(buf, ')');
	return rp && rp[1] == ' ' ? rp[2] : 0;
}

/* Whether a process stopped by SIGSTOP has stopped (or is gone) by now. */
static int stop_settled(pid_t pid)
{
	char st = proc_state(pid);
	return st == 0 || st == 'T' || st == 't' || st == 'Z' || st == 'X';
}

/* The walk of a SIGKILL of the tree, once the root has stopped (or STOP_WAIT_US passed): stop
 * everything found first (a killed parent's children would be reparented to us mid-scan and
 * escape the ppid-chain walk), then kill it. The root too when it is to live on (a session's
 * shell, scope 2), and first: a shell with job control would see its job stopped (as by ^Z) and
 * report that; stopped itself, it sees only the job killed. */
static void kill_tree(struct exec *e)
{
	uint32_t scope = e->kill_scope;
	e->kill_scope = 0;
	if (e->reaped) { /* the pid may be recycled, and its children were reparented to us anyway */
		if (scope != 2)
			sig_pid(-e->pid, SIGKILL);
		return;
	}
	struct pidset s = { 0 };
	ps_add(&s, e->pid);
	for (int round = 0; round < 64; round++) {
		size_t before = s.n;
		scan_children(&s);
		for (size_t i = before; i < s.n; i++)
			sig_pid(s.v[i], SIGSTOP);
		if (s.n == before)
			break;
	}
	/* the group and the root go last, so the walk above saw an intact tree */
	for (size_t i = 1; i < s.n; i++)
		sig_pid(s.v[i], SIGKILL);
	if (scope == 1) {
		sig_pid(-e->pid, SIGKILL);
		sig_pid(e->pid, SIGKILL);
	} else {
		sig_pid(e->pid, SIGCONT);
	}
	free(s.v);
}

/* scope 0: process group; 1: group + all descendants; 2: descendants only. */
static void signal_exec(struct exec *e, int sig, uint32_t scope)
{
	/* once reaped the pid may be recycled, and its children were reparented to us anyway */
	if (scope == 0 || e->reaped) {
		if (scope != 2)
			sig_pid(-e->pid, sig);
		return;
	}
	if (sig == SIGKILL) {
		/* The root is stopped first: a process blocked in wait() could still collect a child's
		 * state change between our kill() and its stop. Its stop is awaited from the event loop
		 * (service(); our SIGCHLD says when), never here: a root that cannot stop now (in 'D')
		 * must not hold up every other exec of the sandbox. */
		if (e->kill_scope) {
			if (scope == 1)
				e->kill_scope = 1; /* the group and the root too, now */
			return;
		}
		e->kill_scope = scope;
		e->kill_by = now_us() + STOP_WAIT_US;
		sig_pid(e->pid, SIGSTOP);
		if (stop_settled(e->pid))
			kill_tree(e);
		return;
	}
	struct pidset s = { 0 };
	ps_add(&s, e->pid);
	for (int round = 0; round < 64; round++) {
		size_t before = s.n;
		scan_children(&s);
		if (s.n == before)
			break;
	}
	for (size_t i = 1; i < s.n; i++)
		sig_pid(s.v[i], sig);
	if (scope == 1) {
		sig_pid(-e->pid, sig);
		sig_pid(e->pid, sig);
	}
	free(s.v);
}

/* ---- exec lifecycle -------------------------------------------------------------------- */

static void wbuf_close(struct wbuf *w)
{
	ep_close(&w->fd);
	w->reg = w->closing = 0;
	free(w->buf);
	w->buf = NULL;
	w->off = w->len = w->cap = 0;
}

/* Write as much as the fd takes; park the rest behind EPOLLOUT (kind K_IN or K_CIN). */
static void wbuf_flush(struct wbuf *w, int kind, size_t slot)
{
	while (w->fd >= 0 && w->off < w->len) {
		ssize_t n = write(w->fd, w->buf + w->off, w->len - w->off);
		if (n > 0) {
			w->off += (size_t)n;
		} else if (n < 0 && errno == EINTR) {
			continue;
		} else if (n < 0 && errno == EAGAIN) {
			if (!w->reg) {
				ep_add(w->fd, kind, slot, EPOLLOUT);
				w->reg = 1;
			}
			return;
		} else { /* EPIPE: the reader closed its end, drop everything */
			wbuf_close(w);
			return;
		}
	}
	w->off = w->len = 0;
	if (w->reg && w->fd >= 0) {
		epoll_ctl(epfd, EPOLL_CTL_DEL, w->fd, NULL);
		w->reg = 0;
	}
	if (w->closing)
		wbuf_close(w);
}

/* Queue bytes for the writer; n == 0 means: close once everything queued is written. */
static void wbuf_data(struct wbuf *w, int kind, size_t slot, const char *p, size_t n)
{
	if (w->fd < 0 || w->closing)
		return;
	if (n == 0) {
		w->closing = 1;
	} else {
		size_t pending = w->len - w->off;
		if (pending + n > w->cap) {
			size_t nc = w->cap ? w->cap : 65536;
			while (nc < pending + n)
				nc *= 2;
			char *nb = malloc(nc);
			if (!nb) {
				wbuf_close(w);
				return;
			}
			if (pending)
				memcpy(nb, w->buf + w->off, pending);
			free(w->buf);
			w->buf = nb;
			w->cap = nc;
		} else if (w->off) {
			memmove(w->buf, w->buf + w->off, pending);
		}
		memcpy(w->buf + pending, p, n);
		w->off = 0;
		w->len = pending + n;
	}
	wbuf_flush(w, kind, slot);
}

/* STARTED of an exec, once it exec'd (F_LAZY: held until its first output, its EXIT or start_due,
 * whichever comes first). */
static void started(struct exec *e)
{
	if (!e->start_due)
		return;
	e->start_due = 0;
	int32_t pid32 = e->pid;
	if (!e->orphan)
		chan_send(M_STARTED, e->id, &pid32, 4, NULL, 0);
}

/* Read up to `reads` chunks from stdout (s=1) or stderr (s=2); forward within the cap. A session
 * forwards only while a command runs (within that command's cap); between commands its output is
 * read and dropped, and counted, so a background `yes` costs the sandbox's CPU, never the daemon's. */
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
		/* a terminal's master gives at most a few KiB a read: gather what is already there into
		 * one message (16x fewer for a flood; nothing waits for more to come) */
		while (e->pty && (size_t)n < sizeof obuf) {
			ssize_t m = read(e->fd[s], obuf + n, sizeof obuf - (size_t)n);
			if (m <= 0)
				break; /* EAGAIN, or EIO at the end: the next read sees it again */
			n += m;
		}
		uint64_t cap = e->session ? e->ccap : e->cap, *total = e->session ? e->ctotal : e->total;
		uint32_t *xf = e->session ? &e->cxflags : &e->xflags;
		if (e->session && !e->active) {
			e->dropped += (uint64_t)n;
			continue;
		}
		uint64_t before = total[s - 1], fwd = (uint64_t)n;
		total[s - 1] += (uint64_t)n;
		if (cap != UINT64_MAX && before + fwd > cap) { /* UINT64_MAX: no cap; 0: keep nothing */
			fwd = before >= cap ? 0 : cap - before;
			*xf |= s == 1 ? X_OUT_TRUNC : X_ERR_TRUNC;
		}
		if (fwd && !e->orphan) {
			started(e);
			chan_send(s == 1 ? M_STDOUT : M_STDERR, e->id, obuf, (size_t)fwd, NULL, 0);
		}
	}
}

/* The end of a session command: whatever it wrote is already in the sockets (the shell reports
 * after the command), so forward that, then SEXIT: i32 status, u32 flags, u64 out, u64 err,
 * u64 duration us, u64 bytes dropped between commands before this one. */
static void session_done(struct exec *e, int32_t status, uint32_t extra)
{
	for (int s = 1; s <= 2; s++)
		drain(e, s, 256);
	wbuf_close(&e->cin);
	if (e->pty && e->fd[1] >= 0) {
		/* a command that ended on a signal (a pager ^C'd or killed) leaves the terminal in its raw
		 * mode: back to the modes before it; one that exited keeps what it set (`stty -echo`) */
		if (extra || (e->cxflags & X_TIMED_OUT) || status >= 128)
			tcsetattr(e->fd[1], TCSANOW, &e->tio);
		else
			tcgetattr(e->fd[1], &e->tio);
		/* and what was typed but not read is not the next command's input */
		int s = ioctl(e->fd[1], TIOCGPTPEER, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
		if (s >= 0) {
			tcflush(s, TCIFLUSH);
			close(s);
		}
	}
	/* what the command left unread of its stdin must not reach the next one (bounded: a writer that
	 * keeps it fed through /proc/self/fd/101 must not hold the agent here) */
	for (int i = 0; e->cin_r >= 0 && i < 64 && read(e->cin_r, obuf, sizeof obuf) > 0; i++)
		;
	char p[44];
	uint32_t flags = e->cxflags | extra;
	uint64_t dur = now_us() - e->cstart;
	memcpy(p, &status, 4);
	memcpy(p + 4, &flags, 4);
	memcpy(p + 8, &e->ctotal[0], 8);
	memcpy(p + 16, &e->ctotal[1], 8);
	memcpy(p + 24, &dur, 8);
	memcpy(p + 32, &e->dropped, 8);
	memcpy(p + 40, &e->cseq, 4);
	e->active = 0;
	e->dropped = 0;
	if (!e->orphan)
		chan_send(M_SEXIT, e->id, p, sizeof p, NULL, 0);
}

static void finish(size_t slot)
{
	struct exec *e = ex[slot];
	if (e->session && e->active) /* the shell exited mid-command (`exit`, killed) */
		session_done(e, WIFEXITED(e->status) ? WEXITSTATUS(e->status) : 128 + WTERMSIG(e->status), X_LOST);
	for (int s = 1; s <= 2; s++) {
		drain(e, s, 16); /* whatever is already buffered; a live grandchild may keep writing */
		ep_close(&e->fd[s]);
	}
	wbuf_close(&e->in);
	wbuf_close(&e->cin);
	ep_close(&e->sfd);
	ep_close(&e->cin_r);
	ep_close(&e->epr);
	if (!e->orphan && !e->failed) {
		started(e);
		char p[40];
		int32_t st = e->status;
		uint64_t dur = e->reaped_at - e->start;
		memcpy(p, &st, 4);
		memcpy(p + 4, &e->xflags, 4);
		memcpy(p + 8, &e->total[0], 8);
		memcpy(p + 16, &e->total[1], 8);
		memcpy(p + 24, &dur, 8);
		memcpy(p + 32, &e->cpu_us, 8);
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

/* A high copy of fd (close-on-exec), clear of the numbers the child's fds are moved to. */
static int move_high(int fd)
{
	return fd < 0 ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, CMDIN_FD + 1);
}

static int socketpair_cloexec(int type, int sv[2])
{
	return socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv);
}

/* A new pseudo-terminal of the sandbox's devpts: the master non-blocking (ours), the slave taken
 * from it (TIOCGPTPEER, Linux 4.13) rather than by a path the sandbox could replace. */
static int open_pty(int *ptm, int *pts, const struct winsize *wsz)
{
	struct stat sb;
	int unlock = 0;
	*ptm = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
	if (*ptm < 0)
		return -1;
	if (fstat(*ptm, &sb) < 0 || !S_ISCHR(sb.st_mode) || ioctl(*ptm, TIOCSPTLCK, &unlock) < 0 ||
	    ioctl(*ptm, TIOCSWINSZ, wsz) < 0 || (*pts = ioctl(*ptm, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
		int err = errno ? errno : ENOTTY;
		close(*ptm);
		*ptm = -1;
		errno = err;
		return -1;
	}
	return 0;
}

/* Starting a command never blocks the agent: the child reports a failed setup or exec on a
 * close-on-exec pipe, which the event loop reads (K_EP); EOF means it exec'd. A child stopped
 * between fork and exec (SIGSTOP from the sandbox) therefore wedges nothing but itself, and its
 * deadline still applies. */
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
	int session = (flags & F_SESSION) != 0, pty = (flags & F_PTY) != 0;
	struct winsize wsz = { .ws_row = 24, .ws_col = 80 };
	size_t off = 32;
	if (pty) { /* u16 rows, u16 cols follow the header */
		uint16_t rc[2];
		if (n < 36) {
			send_error(id, EINVAL, "bad terminal exec");
			return;
		}
		memcpy(rc, p + 32, 4);
		wsz.ws_row = rc[0];
		wsz.ws_col = rc[1];
		off = 36;
		flags |= F_SETSID | F_MERGE; /* a controlling terminal needs a session; one stream */
	}
	/* strings point into rbuf, which stays untouched until the child has forked */
	char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 1, sizeof *envp);
	const char *cwd = NULL, *path = DEFAULT_PATH;
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
	/* [0] the child's end, [1] ours. Sessions get sockets (not reopenable through /proc). */
	int in[2] = { -1, -1 }, out[2] = { -1, -1 }, err[2] = { -1, -1 }, ep[2] = { -1, -1 };
	int st[2] = { -1, -1 }, cin[2] = { -1, -1 }, ptm = -1, pts = -1;
	struct termios tio;
	size_t slot = (size_t)-1;
	struct exec *e = NULL;
	if (!ok) {
		send_error(id, EINVAL, "malformed exec strings");
		goto out;
	}
	errno = 0;
	int fail = 0;
	if (session) {
		int sv[2];
		/* the script travels on a stream socket: [0] child reads, [1] we write */
		fail = fail || socketpair_cloexec(SOCK_STREAM, sv) < 0;
		if (!fail) { in[0] = sv[0]; in[1] = sv[1]; }
		fail = fail || socketpair_cloexec(SOCK_DGRAM, sv) < 0;
		if (!fail) { st[1] = sv[0]; st[0] = sv[1]; }
		if (pty) { /* the terminal is its stdout, stderr and every command's stdin */
			fail = fail || open_pty(&ptm, &pts, &wsz) < 0 || tcgetattr(ptm, &tio) < 0;
		} else {
			fail = fail || socketpair_cloexec(SOCK_STREAM, sv) < 0;
			if (!fail) { out[1] = sv[0]; out[0] = sv[1]; }
			fail = fail || socketpair_cloexec(SOCK_STREAM, sv) < 0;
			if (!fail) { err[1] = sv[0]; err[0] = sv[1]; }
			fail = fail || pipe2(cin, O_CLOEXEC) < 0;
		}
		if (!fail) {
			int on = 1;
			shutdown(in[0], SHUT_WR);
			if (!pty) {
				shutdown(out[0], SHUT_WR);
				shutdown(err[0], SHUT_WR);
				close(cin[1]); /* write ends are opened per command (see do_srun) */
				cin[1] = -1;
			}
			fail = setsockopt(st[0], SOL_SOCKET, SO_PASSCRED, &on, sizeof on) < 0;
		}
	} else if (pty) {
		if (open_pty(&ptm, &pts, &wsz) < 0) {
			send_error(id, errno, "no pseudo-terminal could be opened");
			goto out;
		}
	} else {
		int pin[2] = { -1, -1 }, pout[2], perr[2];
		fail = ((flags & F_STDIN_PIPE) && pipe2(pin, O_CLOEXEC) < 0) || pipe2(pout, O_CLOEXEC) < 0 ||
		       pipe2(perr, O_CLOEXEC) < 0;
		if (!fail) {
			in[0] = pin[0]; in[1] = pin[1];
			out[1] = pout[1]; out[0] = pout[0];
			err[1] = perr[1]; err[0] = perr[0];
		}
	}
	if (fail || pipe2(ep, O_CLOEXEC) < 0 || !(e = calloc(1, sizeof *e)) || (slot = alloc_slot()) == (size_t)-1) {
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
		/* first out of the way of the numbers they are placed at */
		int epw = move_high(ep[1]);
		if (pty) {
			if (session)
				cin[0] = pts; /* stdin stays the script's socket */
			else
				in[0] = pts;
			out[1] = pts;
			/* our terminal: the user it runs as owns it (as login(1) does); then it becomes the
			 * session's controlling terminal */
			if (fchown(pts, uid, (gid_t)-1) < 0) { /* best effort: a terminal it cannot chmod */
			}
			if (ioctl(pts, TIOCSCTTY, 0) < 0)
				child_fail(epw >= 0 ? epw : ep[1], 0);
		}
		int infd = (flags & (F_STDIN_PIPE | F_SESSION) || pty) ? move_high(in[0]) : open("/dev/null", O_RDONLY);
		int o = move_high(out[1]), r = move_high((flags & F_MERGE) ? out[1] : err[1]);
		int sfd = move_high(st[1]), cfd = move_high(cin[0]);
		if (epw < 0 || infd < 0 || o < 0 || r < 0 || (session && (sfd < 0 || cfd < 0)))
			child_fail(epw >= 0 ? epw : ep[1], 0);
		if (dup2(infd, 0) < 0 || dup2(o, 1) < 0 || dup2(r, 2) < 0)
			child_fail(epw, 0);
		int sat = (flags & F_LOWFD) ? LOW_STATUS_FD : STATUS_FD, cat = (flags & F_LOWFD) ? LOW_CMDIN_FD : CMDIN_FD;
		if (session && (dup2(sfd, sat) < 0 || dup2(cfd, cat) < 0))
			child_fail(epw, 0);
		close_from(3, CLOSE_RANGE_CLOEXEC); /* keeps epw open until exec succeeds */
		if (session) {
			fcntl(sat, F_SETFD, 0);
			fcntl(cat, F_SETFD, 0);
		}
		if (chdir(cwd) < 0)
			child_fail(epw, 1);
		if (flags & F_NONDUMP) {
			/* A session shell starts with its effective gid differing from its real one: the
			 * kernel then makes it non-dumpable from its exec on, and the shell (bash and dash
			 * drop such a gid at start) stays so. No other process of the sandbox, even of the
			 * same uid, may then ptrace it, read its memory, take its fds (pidfd_getfd) or open
			 * /proc/<shell>/fd: its script, nonce and status socket are out of reach. */
			gid_t decoy = gid != 65534 ? 65534 : 65533;
			if (setgroups(0, NULL) < 0)
				child_fail(epw, 2);
			if (setresgid(gid, decoy, decoy) < 0)
				child_fail(epw, 3);
			if (setresuid(uid, uid, uid) < 0)
				child_fail(epw, 4);
		} else if (uid != getuid() || gid != getgid()) {
			if (setgroups(0, NULL) < 0)
				child_fail(epw, 2);
			if (setgid(gid) < 0)
				child_fail(epw, 3);
			if (setuid(uid) < 0)
				child_fail(epw, 4);
		}
		/* execvpe searches the *caller's* PATH, so make ours the one from the request */
		extern char **environ;
		char *penv[2] = { (char *)path, NULL };
		environ = penv;
		execvpe(argv[0], argv, envp);
		if (errno == ENOEXEC)
			exec_as_script(argv, envp, path + 5);
		child_fail(epw, 5);
	}
	if (!(flags & F_SETSID))
		setpgid(pid, pid); /* also in the parent, so a SIGNAL right after STARTED can't race */
	if (pty) { /* the master is our stdout (read) and, through a second fd, the child's stdin */
		close(pts);
		pts = -1;
		if (session) /* it types into it per command (do_srun) */
			e->tio = tio;
		else
			in[1] = fcntl(ptm, F_DUPFD_CLOEXEC, 0);
		out[0] = ptm;
		ptm = -1;
		e->pty = 1;
	}
	e->id = id;
	e->pid = pid;
	e->cap = cap;
	e->start = start;
	e->deadline = tmo ? start + (uint64_t)tmo * 1000u : 0;
	e->in.fd = in[1];
	e->fd[1] = out[0];
	e->fd[2] = err[0];
	e->epr = ep[0];
	e->session = session;
	/* (not with a stdin pipe: the daemon writes the input once STARTED is in, and the command may
	 * wait for it before it writes or exits) */
	e->lazy = (flags & F_LAZY) && !(flags & F_STDIN_PIPE) && !session && !pty;
	e->sfd = st[0];
	if (cin[0] >= 0) { /* our own open file description of the pipe: non-blocking for us only */
		char path[64];
		snprintf(path, sizeof path, "/proc/self/fd/%d", cin[0]);
		e->cin_r = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	} else {
		e->cin_r = -1;
	}
	e->cin.fd = -1;
	in[1] = out[0] = err[0] = ep[0] = st[0] = -1;
	if (e->in.fd >= 0)
		set_nonblock(e->in.fd, 1);
	for (int s = 1; s <= 2; s++)
		set_nonblock(e->fd[s], 1);
	set_nonblock(e->epr, 1);
	if (flags & F_MERGE) { /* stderr is the same pipe: nothing ever arrives on ours */
		close(e->fd[2]);
		e->fd[2] = -1;
	}
	ep_add(e->fd[1], K_OUT, slot, EPOLLIN);
	if (e->fd[2] >= 0)
		ep_add(e->fd[2], K_ERR, slot, EPOLLIN);
	ep_add(e->epr, K_EP, slot, EPOLLIN);
	if (e->sfd >= 0)
		ep_add(e->sfd, K_STATUS, slot, EPOLLIN);
	/* until the exec is confirmed, strings of the request must outlive rbuf: the child has its
	 * own copy of them (fork), so nothing here refers to rbuf any more */
	ex[slot] = e;
	e = NULL;
out:
	for (int i = 0; i < 2; i++) {
		if (in[i] >= 0) close(in[i]);
		if (out[i] >= 0) close(out[i]);
		if (err[i] >= 0) close(err[i]);
		if (ep[i] >= 0) close(ep[i]);
		if (st[i] >= 0) close(st[i]);
		if (cin[i] >= 0) close(cin[i]);
	}
	if (ptm >= 0) close(ptm);
	if (pts >= 0) close(pts);
	free(e);
	free(argv);
	free(envp);
}

/* The exec-status pipe of a starting command: a setup error, or EOF once it exec'd. */
static void handle_ep(size_t slot)
{
	struct exec *e = ex[slot];
	struct child_err ce;
	ssize_t r = read(e->epr, &ce, sizeof ce);
	if (r < 0 && (errno == EINTR || errno == EAGAIN))
		return;
	ep_close(&e->epr);
	if (r == (ssize_t)sizeof ce) {
		char msg[128];
		static const char *what[] = { "setup", "chdir to the working directory", "setgroups", "setgid", "setuid",
					      "exec" };
		snprintf(msg, sizeof msg, "%s: %s", what[ce.stage % 6], strerror(ce.err));
		e->failed = 1; /* the child exits by itself; reaped and freed without an EXIT */
		if (!e->orphan)
			send_error(e->id, ce.err, msg);
		return;
	}
	e->start_due = now_us() + (e->lazy ? LAZY_START_US : 0);
	if (!e->lazy)
		started(e);
}

/* SRUN: a session command begins. Payload: u32 timeout ms, u32 flags, u64 cap, nonce (32 bytes),
 * u32 sequence number (echoed in its SEXIT), then the script, or its first part (the rest follows
 * as STDIN on the session's id); the command's own stdin (S_STDIN) comes as CMDIN. */
static void do_srun(uint32_t id, const char *p, size_t n)
{
	size_t slot;
	struct exec *e = find_id(id, &slot);
	if (!e || !e->session || e->reaped || n < 20 + NONCE_LEN) {
		send_error(id, ESRCH, "no such session");
		return;
	}
	/* A command still active was given up by the daemon (its caller went away, or it was in a
	 * snapshot this sandbox was restored from): it ends unreported, and its late report, with the
	 * old nonce, will not be taken for this one's. */
	if (e->active) {
		wbuf_close(&e->cin);
		e->active = 0;
	}
	uint32_t tmo, flags;
	memcpy(&tmo, p, 4);
	memcpy(&flags, p + 4, 4);
	memcpy(&e->ccap, p + 8, 8);
	memcpy(e->nonce, p + 16, NONCE_LEN);
	memcpy(&e->cseq, p + 16 + NONCE_LEN, 4);
	/* whatever background jobs wrote since the last command is not this command's output */
	for (int s = 1; s <= 2; s++)
		drain(e, s, 64);
	e->active = 1;
	e->cxflags = 0;
	e->ctotal[0] = e->ctotal[1] = 0;
	e->cstart = now_us();
	e->cdeadline = tmo ? e->cstart + (uint64_t)tmo * 1000u : 0;
	e->cgrace = 0;
	if (e->pty) {
		/* typed into the terminal; closed (whatever is still queued dropped) when the command ends */
		if (e->fd[1] >= 0)
			e->cin.fd = fcntl(e->fd[1], F_DUPFD_CLOEXEC, 0);
	} else if (flags & S_STDIN) {
		char path[64];
		snprintf(path, sizeof path, "/proc/self/fd/%d", e->cin_r);
		/* a new write end of the same pipe: closing it is this command's EOF */
		e->cin.fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
	}
	if (n > 20 + NONCE_LEN)
		wbuf_data(&e->in, K_IN, slot, p + 20 + NONCE_LEN, n - 20 - NONCE_LEN);
}

/* The session shell's report: one datagram "<nonce> <status>\n", from the shell itself. */
static void handle_status(size_t slot)
{
	struct exec *e = ex[slot];
	for (int i = 0; i < 16; i++) {
		char buf[128];
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(struct ucred))];
		} c;
		struct iovec iov = { buf, sizeof buf - 1 };
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.b, .msg_controllen = sizeof c.b };
		ssize_t n = recvmsg(e->sfd, &m, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return;
		struct cmsghdr *h = CMSG_FIRSTHDR(&m);
		struct ucred cred;
		if (!h || h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_CREDENTIALS)
			continue;
		memcpy(&cred, CMSG_DATA(h), sizeof cred);
		/* only the shell process itself (not a child or anything else holding the socket) */
		if (cred.pid != e->pid || !e->active || n < NONCE_LEN + 2 || memcmp(buf, e->nonce, NONCE_LEN) ||
		    buf[NONCE_LEN] != ' ')
			continue;
		buf[n] = 0;
		char *end;
		long status = strtol(buf + NONCE_LEN + 1, &end, 10);
		if (end == buf + NONCE_LEN + 1)
			continue;
		session_done(e, (int32_t)status, 0);
	}
}

static void reap(void)
{
	struct signalfd_siginfo si;
	while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si)
		;
	int st;
	pid_t p;
	struct rusage ru;
	while ((p = wait4(-1, &st, WNOHANG, &ru)) > 0) {
		for (size_t i = 0; i < nex; i++) {
			struct exec *e = ex[i];
			if (e && e->pid == p && !e->reaped) {
				e->reaped = 1;
				e->status = st;
				e->reaped_at = now_us();
				e->cpu_us = (uint64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000u +
					    (uint64_t)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
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
	for (size_t i = 0; orphan && i < nwt; i++)
		if (wt[i])
			watch_free(i);
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

/* ---- watches -------------------------------------------------------------------------- */

static struct watch *find_watch(uint32_t id, size_t *slot)
{
	for (size_t i = 0; i < nwt; i++)
		if (wt[i] && wt[i]->id == id) {
			if (slot)
				*slot = i;
			return wt[i];
		}
	return NULL;
}

static void watch_free(size_t slot)
{
	struct watch *w = wt[slot];
	ep_close(&w->ifd);
	for (int i = 0; i < w->cap; i++)
		free(w->paths[i]);
	free(w->paths);
	free(w);
	wt[slot] = NULL;
}

static void watch_end(size_t slot, int err, const char *why)
{
	struct watch *w = wt[slot];
	int32_t e = err;
	chan_send(M_WEND, w->id, &e, 4, why, strlen(why));
	watch_free(slot);
}

/* Watch one directory; remembers its path by watch descriptor. */
static int watch_dir(struct watch *w, const char *path)
{
	if (w->nwd >= MAX_WATCHES)
		return -1;
	int wd = inotify_add_watch(w->ifd, path,
				   IN_CREATE | IN_DELETE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO |
				       IN_ATTRIB | IN_DELETE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK);
	if (wd < 0)
		return -1;
	if (wd >= w->cap) {
		int nc = w->cap ? w->cap : 64;
		while (nc <= wd)
			nc *= 2;
		char **np = realloc(w->paths, (size_t)nc * sizeof *np);
		if (!np)
			return -1;
		memset(np + w->cap, 0, (size_t)(nc - w->cap) * sizeof *np);
		w->paths = np;
		w->cap = nc;
	}
	free(w->paths[wd]);
	w->paths[wd] = strdup(path);
	w->nwd++;
	return 0;
}

/* A directory and, breadth first, every directory below it (not following symlinks). */
/* `announce`: a directory that appeared under the watch: what it already holds was made before its
 * own inotify watch existed (a `mkdir d; echo x > d/f` is faster than us), so each entry found is
 * reported as created. */
static void watch_tree(struct watch *w, const char *top, int announce)
{
	size_t qn = 0, qcap = 64, qi = 0;
	char **q = malloc(qcap * sizeof *q);
	if (!q)
		return;
	q[qn++] = strdup(top);
	while (qi < qn) {
		char *dir = q[qi++];
		if (dir && watch_dir(w, dir) == 0 && w->recursive) {
			DIR *d = opendir(dir);
			struct dirent *de;
			while (d && (de = readdir(d))) {
				if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
					continue;
				if (announce) {
					char path[4096];
					uint32_t m = IN_CREATE | (de->d_type == DT_DIR ? IN_ISDIR : 0);
					snprintf(path, sizeof path, "%s%s%s", dir, strcmp(dir, "/") ? "/" : "", de->d_name);
					chan_send(M_WEVENT, w->id, &m, 4, path, strlen(path) + 1);
				}
				if (de->d_type != DT_DIR)
					continue;
				if (qn == qcap) {
					char **nq = realloc(q, qcap * 2 * sizeof *nq);
					if (!nq)
						break;
					q = nq;
					qcap *= 2;
				}
				size_t len = strlen(dir) + strlen(de->d_name) + 2;
				char *sub = malloc(len);
				if (sub)
					snprintf(sub, len, "%s%s%s", dir, strcmp(dir, "/") ? "/" : "", de->d_name);
				q[qn++] = sub;
			}
			if (d)
				closedir(d);
		}
		free(dir);
		if (w->nwd >= MAX_WATCHES)
			break;
	}
	for (; qi < qn; qi++)
		free(q[qi]);
	free(q);
}

/* WATCH: u32 flags (1: recursive), then the absolute directory path. Events go out as WEVENT:
 * u32 inotify mask, then the path; WEND (i32 errno, reason) when the watch ends. */
static void do_watch(uint32_t id, const char *p, size_t n)
{
	if (n < 5 || p[n - 1] != '\0' || p[4] != '/' || find_watch(id, NULL)) {
		int32_t e = EINVAL;
		chan_send(M_WEND, id, &e, 4, "bad watch request", 17);
		return;
	}
	size_t slot = (size_t)-1;
	for (size_t i = 0; i < nwt; i++)
		if (!wt[i]) {
			slot = i;
			break;
		}
	if (slot == (size_t)-1) {
		size_t nn = nwt ? nwt * 2 : 8;
		struct watch **nw = realloc(wt, nn * sizeof *nw);
		if (!nw)
			return;
		memset(nw + nwt, 0, (nn - nwt) * sizeof *nw);
		wt = nw;
		slot = nwt;
		nwt = nn;
	}
	struct watch *w = calloc(1, sizeof *w);
	if (!w)
		return;
	uint32_t flags;
	memcpy(&flags, p, 4);
	w->id = id;
	w->recursive = flags & 1;
	w->ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	wt[slot] = w;
	if (w->ifd < 0) {
		watch_end(slot, errno, "inotify_init1");
		return;
	}
	watch_tree(w, p + 4, 0);
	if (w->nwd == 0) {
		watch_end(slot, errno ? errno : ENOENT, "not a directory that can be watched");
		return;
	}
	ep_add(w->ifd, K_WATCH, slot, EPOLLIN);
}

static void handle_watch(size_t slot)
{
	struct watch *w = wt[slot];
	char buf[16384] __attribute__((aligned(__alignof__(struct inotify_event))));
	for (int round = 0; round < 16; round++) {
		ssize_t n = read(w->ifd, buf, sizeof buf);
		if (n <= 0)
			return;
		for (char *q = buf; q < buf + n;) {
			struct inotify_event *ev = (struct inotify_event *)q;
			q += sizeof *ev + ev->len;
			if (ev->mask & IN_Q_OVERFLOW) {
				uint32_t m = IN_Q_OVERFLOW;
				chan_send(M_WEVENT, w->id, &m, 4, "", 1);
				continue;
			}
			if (ev->wd < 0 || ev->wd >= w->cap || !w->paths[ev->wd])
				continue;
			const char *dir = w->paths[ev->wd];
			char path[4096];
			if (ev->len && ev->name[0])
				snprintf(path, sizeof path, "%s%s%s", dir, strcmp(dir, "/") ? "/" : "", ev->name);
			else
				snprintf(path, sizeof path, "%s", dir);
			if (ev->mask & IN_IGNORED) {
				free(w->paths[ev->wd]);
				w->paths[ev->wd] = NULL;
				w->nwd--;
				continue;
			}
			if (w->recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)))
				watch_tree(w, path, 1);
			/* a sandbox churning files must not turn into a flood to the daemon */
			uint64_t now = now_us();
			if (now - w->win_start >= 1000000) {
				w->win_start = now;
				w->win_count = 0;
			}
			if (w->win_count >= WATCH_RATE) {
				w->dropped++;
				continue;
			}
			uint32_t m = ++w->win_count == WATCH_RATE ? IN_Q_OVERFLOW : ev->mask;
			chan_send(M_WEVENT, w->id, &m, 4, m == IN_Q_OVERFLOW ? "" : path,
				  m == IN_Q_OVERFLOW ? 1 : strlen(path) + 1);
		}
	}
}

/* ---- attempts on the agent (the seccomp listener) ------------------------------------------ */

struct attempt_call {
	int32_t nr_x86_64, nr_x32, nr_i386;
	const char *name;
	int detail;	    /* index of the argument worth reporting, -1: none */
	const char *what;   /* its name in the alert */
};

/* The calls of runtime/seccomp.py ATTEMPT_SYSCALLS, by architecture (x32: nr | SF_X32_BIT). */
static const struct attempt_call attempt_calls[] = {
	{ 62, 62, 37, "kill", 1, "signal" },
	{ 200, 200, 238, "tkill", 1, "signal" },
	{ 234, 234, 270, "tgkill", 2, "signal" },
	{ 129, 524, 178, "rt_sigqueueinfo", 1, "signal" },
	{ 297, 536, 335, "rt_tgsigqueueinfo", 2, "signal" },
	{ 101, 521, 26, "ptrace", 0, "request" },
	{ 434, 434, 434, "pidfd_open", 1, "flags" },
	{ 310, 539, 347, "process_vm_readv", -1, NULL },
};

static void json_str(char *out, size_t cap, const char *in)
{
	size_t o = 0;
	for (const unsigned char *c = (const unsigned char *)in; *c && o + 7 < cap; c++) {
		if (*c == '"' || *c == '\\') {
			out[o++] = '\\';
			out[o++] = (char)*c;
		} else if (*c < 0x20 || *c >= 0x7f) {
			o += (size_t)snprintf(out + o, cap - o, "\\u%04x", *c);
		} else {
			out[o++] = (char)*c;
		}
	}
	out[o] = 0;
}

/* From /proc/PID/status: the command name, real and effective uid, and how many pid namespaces
 * deep the process sits below ours (NSpid lists its pid in each, ours first). 0 if unreadable. */
static int caller_status(pid_t pid, char *comm, size_t ccap, long *uid, long *euid, int *nsdepth)
{
	char path[64], buf[4096];
	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	for (char *line = buf; line && *line;) {
		char *next = strchr(line, '\n');
		if (next)
			*next++ = 0;
		if (!strncmp(line, "Name:\t", 6)) {
			snprintf(comm, ccap, "%s", line + 6);
		} else if (!strncmp(line, "Uid:", 4)) {
			sscanf(line + 4, "%ld %ld", uid, euid);
		} else if (!strncmp(line, "NSpid:", 6)) {
			int depth = 0;
			for (char *t = strtok(line + 6, " \t"); t; t = strtok(NULL, " \t"))
				depth++;
			*nsdepth = depth;
		}
		line = next;
	}
	return 1;
}

static void alert_send(const char *json) { chan_send(M_ALERT, 0, json, strlen(json), NULL, 0); }

/* Past ALERT_RATE in a window: one message with the count, once the window is over. */
static void alert_flush(uint64_t now)
{
	if (now - alert_win < 1000000)
		return;
	if (alert_suppressed) {
		char json[96];
		snprintf(json, sizeof json, "{\"kind\":\"suppressed\",\"count\":%llu}",
			 (unsigned long long)alert_suppressed);
		alert_send(json);
		alert_suppressed = 0;
	}
	alert_win = now;
	alert_count = 0;
}

static void attempt(const struct sf_notif *n)
{
	char comm[64] = "", qcomm[400], name[32], detail[48] = "", json[640];
	long uid = -1, euid = -1;
	int nsdepth = 1;
	int known = caller_status((pid_t)n->pid, comm, sizeof comm, &uid, &euid, &nsdepth);
	/* only now: the notification still pending means n->pid was still the caller when we read it */
	uint64_t id = n->id;
	int valid = ioctl(lfd, SF_NOTIF_ID_VALID, &id) == 0;
	struct sf_notif_resp r = { .id = n->id };
	if (known && nsdepth > 1) { /* a nested pid namespace's init, not us */
		r.flags = SF_NOTIF_CONTINUE;
		if (valid)
			ioctl(lfd, SF_NOTIF_SEND, &r);
		return;
	}
	r.error = -EPERM; /* also for kill(1, 0): a probe is an attempt too */
	if (valid)
		ioctl(lfd, SF_NOTIF_SEND, &r); /* ENOENT if the caller died meanwhile */

	uint64_t now = now_us();
	alert_flush(now);
	if (alert_count >= ALERT_RATE) {
		alert_suppressed++;
		return;
	}
	alert_count++;
	int nr = n->data.nr;
	const char *arch = n->data.arch == SF_ARCH_I386 ? "i386" : (nr & SF_X32_BIT) ? "x32" : "x86_64";
	const struct attempt_call *call = NULL;
	for (size_t i = 0; i < sizeof attempt_calls / sizeof *attempt_calls; i++) {
		const struct attempt_call *c = &attempt_calls[i];
		if (n->data.arch == SF_ARCH_I386 ? nr == c->nr_i386
		    : (nr & SF_X32_BIT) ? (nr & ~SF_X32_BIT) == c->nr_x32
					: nr == c->nr_x86_64) {
			call = c;
			break;
		}
	}
	if (call)
		snprintf(name, sizeof name, "%s", call->name);
	else
		snprintf(name, sizeof name, "nr_%d", nr);
	if (call && call->detail >= 0)
		snprintf(detail, sizeof detail, ",\"%s\":%lld", call->what,
			 (long long)(int32_t)n->data.args[call->detail]);
	json_str(qcomm, sizeof qcomm, comm);
	snprintf(json, sizeof json,
		 "{\"kind\":\"attempt\",\"syscall\":\"%s\",\"nr\":%d,\"arch\":\"%s\",\"pid\":%u,\"uid\":%ld,"
		 "\"euid\":%ld,\"comm\":\"%s\"%s%s}",
		 name, nr, arch, n->pid, uid, euid, qcomm, detail, valid ? "" : ",\"gone\":true");
	alert_send(json);
}

/* Every pending notification; never blocks (RECV only after poll says one is there). */
static void handle_notif(void)
{
	for (int round = 0; round < 64 && lfd >= 0; round++) {
		struct pollfd pf = { lfd, POLLIN, 0 };
		if (poll(&pf, 1, 0) <= 0)
			return;
		if (pf.revents & (POLLHUP | POLLERR | POLLNVAL)) { /* no task left on the filter */
			ep_close(&lfd);
			return;
		}
		if (!(pf.revents & POLLIN))
			return;
		struct sf_notif n;
		memset(&n, 0, sizeof n); /* the kernel insists */
		if (ioctl(lfd, SF_NOTIF_RECV, &n) < 0) {
			if (errno == EINTR || errno == ENOENT) /* ENOENT: the caller was gone first */
				continue;
			return;
		}
		attempt(&n);
	}
}

/* At start: keep fd 5 if it is a seccomp listener (an ID_VALID check of id 0 answers ENOENT). */
static void take_listener(void)
{
	uint64_t id = 0;
	if (fcntl(LISTENER, F_GETFD) < 0)
		return;
	if (ioctl(LISTENER, SF_NOTIF_ID_VALID, &id) == 0 || errno != ENOENT) {
		close(LISTENER);
		return;
	}
	fcntl(LISTENER, F_SETFD, FD_CLOEXEC); /* never inherited: a child holding it could answer for us */
	set_nonblock(LISTENER, 1);
	lfd = LISTENER;
}

/* ---- channel messages ------------------------------------------------------------------ */

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
				wbuf_data(&e->in, K_IN, slot, p, len);
			break;
		case M_CMDIN:
			if ((e = find_id(id, &slot)) && e->session && e->active) {
				if (len == 0 && e->pty) { /* a terminal's end of input is a character */
					struct termios t;
					char eof = tcgetattr(e->fd[1], &t) == 0 && t.c_cc[VEOF] ? (char)t.c_cc[VEOF] : 4;
					wbuf_data(&e->cin, K_CIN, slot, &eof, 1);
				} else {
					wbuf_data(&e->cin, K_CIN, slot, p, len);
				}
			}
			break;
		case M_SRUN:
			do_srun(id, p, len);
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
		case M_HOLD: /* u32 1: stop reading a terminal's output (the daemon's client is behind), 0: go on */
			if (len >= 4 && (e = find_id(id, &slot)) && e->pty && e->fd[1] >= 0) {
				uint32_t stop;
				memcpy(&stop, p, 4);
				if (stop && !e->held)
					epoll_ctl(epfd, EPOLL_CTL_DEL, e->fd[1], NULL);
				else if (!stop && e->held)
					ep_add(e->fd[1], K_OUT, slot, EPOLLIN);
				e->held = stop != 0;
			}
			break;
		case M_RESIZE: /* u16 rows, u16 cols of a terminal exec */
			if (len >= 4 && (e = find_id(id, NULL)) && e->pty && !e->reaped) {
				uint16_t rc[2];
				memcpy(rc, p, 4);
				struct winsize w = { .ws_row = rc[0], .ws_col = rc[1] };
				int fd = e->fd[1] >= 0 ? e->fd[1] : e->in.fd;
				if (fd >= 0)
					ioctl(fd, TIOCSWINSZ, &w);
			}
			break;
		case M_FORGET: /* a daemon that never knew our running execs (adopted, restored) */
			/* the payload lists u32 ids the new daemon does know (a fork keeps its parent's
			 * sessions and background processes); every other exec and watch is orphaned */
			for (size_t i = 0; i < nex; i++) {
				if (!ex[i])
					continue;
				int keep = 0;
				for (size_t k = 0; k + 4 <= len && !keep; k += 4) {
					uint32_t kid;
					memcpy(&kid, p + k, 4);
					keep = kid == ex[i]->id;
				}
				if (!keep)
					ex[i]->orphan = 1;
			}
			for (size_t i = 0; i < nwt; i++)
				if (wt[i])
					watch_free(i);
			break;
		case M_WATCH:
			do_watch(id, p, len);
			break;
		case M_UNWATCH:
			for (size_t i = 0; i < nwt; i++)
				if (wt[i] && wt[i]->id == id)
					watch_end(i, 0, "unwatched");
			break;
		case M_REOPEN:
			/* u32 flags, 1: a criu checkpoint follows (the daemon's REOPEN; vminit's, before a
			 * VM's memory is saved whole, has none). criu cannot dump a seccomp listener: from
			 * here on the filter's notify rules fail with ENOSYS (no listener), unreported. */
			if (len >= 4) {
				uint32_t rflags;
				memcpy(&rflags, p, 4);
				if (rflags & 1)
					ep_close(&lfd);
			}
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
#define SOONER(t) do { if ((t) < next) next = (t); } while (0)
	for (size_t i = 0; i < nex; i++) {
		struct exec *e = ex[i];
		if (!e)
			continue;
		if (!e->reaped && e->deadline && !(e->xflags & X_TIMED_OUT)) {
			if (now >= e->deadline) {
				e->xflags |= X_TIMED_OUT;
				signal_exec(e, SIGKILL, 1);
			} else {
				SOONER(e->deadline);
			}
		}
		if (e->session && e->active && !e->reaped) {
			if (e->cdeadline && !(e->cxflags & X_TIMED_OUT)) {
				if (now >= e->cdeadline) {
					/* kill what the shell runs; the shell itself (its cwd, variables) lives on */
					e->cxflags |= X_TIMED_OUT;
					signal_exec(e, SIGKILL, 2);
					e->cgrace = now + LOST_GRACE_US;
				} else {
					SOONER(e->cdeadline);
				}
			}
			if (e->cgrace) {
				if (now >= e->cgrace) { /* the shell did not come back: the session is over */
					session_done(e, -1, X_LOST);
					signal_exec(e, SIGKILL, 1);
				} else {
					SOONER(e->cgrace);
				}
			}
		}
		if (e->kill_scope) { /* a tree kill (perhaps from above) waiting for its root to stop */
			if (e->reaped || now >= e->kill_by || stop_settled(e->pid))
				kill_tree(e);
			else
				SOONER(e->kill_by < now + STOP_POLL_US ? e->kill_by : now + STOP_POLL_US);
		}
		if (e->start_due) {
			if (now >= e->start_due)
				started(e);
			else
				SOONER(e->start_due);
		}
		if (e->reaped) {
			if (e->epr >= 0) /* died before its exec was confirmed: settle that first */
				handle_ep(i);
			if ((e->fd[1] < 0 && e->fd[2] < 0) || now >= e->reaped_at + GRACE_US)
				finish(i);
			else
				SOONER(e->reaped_at + GRACE_US);
		}
	}
	if (alert_suppressed) {
		alert_flush(now);
		if (alert_suppressed)
			SOONER(alert_win + 1000000);
	}
#undef SOONER
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
	take_listener();
	close(HANDOFF);
	close_from(LISTENER + 1, 0);
	if (lfd < 0)
		close(LISTENER);
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
	if (lfd >= 0)
		ep_add(lfd, K_NOTIF, 0, EPOLLIN);
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
				if (e && e->in.fd == fd)
					wbuf_flush(&e->in, K_IN, slot);
				break;
			case K_CIN:
				if (e && e->cin.fd == fd)
					wbuf_flush(&e->cin, K_CIN, slot);
				break;
			case K_EP:
				if (e && e->epr == fd)
					handle_ep(slot);
				break;
			case K_STATUS:
				if (e && e->sfd == fd)
					handle_status(slot);
				break;
			case K_WATCH:
				if (slot < nwt && wt[slot] && wt[slot]->ifd == fd)
					handle_watch(slot);
				break;
			case K_NOTIF:
				if (lfd >= 0 && lfd == fd)
					handle_notif();
				break;
			}
		}
	}
}
