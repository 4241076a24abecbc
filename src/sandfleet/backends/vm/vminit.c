/*
 * sandfleet-vminit: PID 1 of a sandfleet guest (microvm and vm tiers), run from the initramfs that
 * backends/vm/guest.py builds.
 *
 *   1 mounts devtmpfs, proc, sysfs; loads the kernel modules listed in /modules/order (finit_module,
 *     in that order: guest.py sorts them by their `depends=`)
 *   2 reads its settings from the kernel command line (sandfleet.layers=N sandfleet.disk=BYTES
 *     sandfleet.inodes=N sandfleet.uid=UID sandfleet.nofile=N sandfleet.hostname=H)
 *   3 moves everything onto a tmpfs root: pivot_root (which the launcher does) refuses a root on the
 *     initramfs (it has no parent mount)
 *   4 mounts disk i (/dev/vda, vdb, ...: the image's layers, bottom first, EROFS, read-only) on
 *     /layers/i
 *   5 runs the launcher in standalone mode, exactly as the container tier's launcher starts an agent
 *     (user, pid, mount, ipc, uts, net namespaces, seccomp, no capabilities), with fd 3 one end of a
 *     SOCK_SEQPACKET socketpair, fd 4 the agent binary, fd 5 the seccomp filter
 *   6 relays forever between the virtio-serial port named "sandfleet.agent" (a byte stream: each
 *     datagram framed as u32 little-endian length + bytes) and its end of the socketpair; reaps
 *     orphans; powers the guest off when the agent exits.
 *
 * Full mode (the vm tier: sandfleet.mode=full): the guest is the user's machine, not a container host.
 * Its one disk (/dev/vda, ext4, a copy-on-write overlay over the image's base) becomes the root
 * (devtmpfs, proc, sysfs moved onto it, then mount --move + chroot, as switch_root does), its
 * filesystem first grown to the disk (the overlay is the sandbox's `disk` larger than the base:
 * that is the guest's room to write, and the bound of the overlay's growth on the host); a child
 * (the relay) starts the agent directly in the guest's root namespaces as real root (fd 3 its
 * channel, exec'd from an fd opened in the initramfs before the chroot) and relays the port; then,
 * with sandfleet.init=1 and an executable /sbin/init, PID 1 execs the image's init (systemd, ...),
 * else it mounts what an init would (devpts, /dev/shm, /run, cgroup2) and stays, reaping. The agent
 * and the relay are ordinary root processes of that machine: the guest's root can kill or ptrace
 * them, and then the sandbox is broken, not escaped (the VM is the boundary; QEMU's jail guards the host).
 *
 * Host reconnects (a daemon restart): the port reports the host gone (POLLHUP / read 0). We then do
 * what the daemon's death does to a container's agent: close our end of the channel, so the agent
 * offers a fresh socketpair on its fd 4 (HELLO queued in it), and take that with pidfd_getfd. Each
 * time the host (re)appears we first send SYNC_MAGIC, an 8-byte marker that is never a valid frame
 * length, so the host can skip whatever stale bytes of an earlier connection precede it.
 *
 * Snapshots (the daemon migrates the VM's memory to a file): a restored copy wakes with its host gone
 * and its daemon keeps some of the parent's execs (sessions, background processes), so those must
 * not be orphaned. Before migrating, the daemon sends a control frame (CTRL_MAGIC "keepnext"): the
 * next time the host goes we have the agent move to a fresh channel as before a criu checkpoint
 * (M_REOPEN: same execs, nothing dropped) instead of closing its channel, and the restored copy's
 * daemon orphans what it does not keep (M_FORGET). After the snapshot the parent's daemon sends
 * "keepdone". Control frames never reach the agent.
 *
 * A restored copy (a snapshot's child, a VM started from its image's booted template) wakes with its
 * parent's kernel random state, its clock stopped at the parent's last instant and, from a template,
 * the template's hostname. Its daemon sends, before anything else: "entropy\0" + fresh bytes (mixed in
 * and credited, then the kernel's generator reseeds from them), "realtime" + u64 LE nanoseconds since
 * the epoch (the host's clock), and, from a template, "hostname" + the sandbox's hostname.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PAYLOAD (65536 + 8) /* one agent datagram: header + 64 KiB */
#define MAX_LAYERS 26
#define SYNC_MAGIC "SFVMSYNC"
#define SYNC_LEN 8
#define CTRL_MAGIC "SFVMCTRL" /* a host frame of CTRL_MAGIC + an 8-byte command is for us */
#define CTRL_LEN 16
#define M_REOPEN 5 /* the agent's message: move to a fresh channel offered on fd 4, execs kept */
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef MODULE_INIT_COMPRESSED_FILE
#define MODULE_INIT_COMPRESSED_FILE 4
#endif
#ifndef SYS_finit_module
#define SYS_finit_module 313
#endif
#ifndef BLKGETSIZE64
#define BLKGETSIZE64 _IOR(0x12, 114, size_t)
#endif
#define EXT4_IOC_RESIZE_FS _IOW('f', 16, uint64_t)
/* linux/random.h (musl has no kernel headers) */
#define RNDADDENTROPY _IOW('R', 0x03, int[2])
#define RNDRESEEDCRNG _IO('R', 0x07)

static char hostname[65] = "sandbox";
static unsigned long long disk = 256ULL << 20, inodes = 65536;
static unsigned long uid = 100000, nofile = 1024, n_layers;
static pid_t agent = -1;
static int full_mode, want_init;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("vminit: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

static void power_off(void)
{
	sync();
	reboot(RB_POWER_OFF);
	for (;;)
		pause();
}

/* A failed boot step: nothing useful can run, and the host sees the VM exit (panic=-1 is for the
 * kernel's own failures). */
static void die(const char *what)
{
	say("%s: %s", what, strerror(errno));
	power_off();
}

static void msleep(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* Reap every exited child; if the agent was among them, the sandbox is over. */
static void reap(void)
{
	for (;;) {
		int status;
		pid_t pid = waitpid(-1, &status, WNOHANG);
		if (pid <= 0)
			return;
		if (pid == agent) {
			say("agent exited (status %d): powering off", status);
			power_off();
		}
	}
}

static void on_sigchld(int sig) { (void)sig; }

/* ---- boot ------------------------------------------------------------------------------------ */

static void mount_basics(void)
{
	mkdir("/dev", 0755);
	mkdir("/proc", 0555);
	mkdir("/sys", 0555);
	if (mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") < 0 && errno != EBUSY)
		die("mount devtmpfs");
	if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		die("mount proc");
	if (mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		die("mount sysfs");
}

static void load_modules(void)
{
	FILE *f = fopen("/modules/order", "re");
	char line[256], path[300];
	if (!f)
		return; /* a kernel with everything built in */
	while (fgets(line, sizeof line, f)) {
		line[strcspn(line, "\r\n")] = '\0';
		if (!line[0])
			continue;
		snprintf(path, sizeof path, "/modules/%s", line);
		/* An image's kernel may ship compressed modules (.ko.xz, .ko.zst): the kernel unpacks them. */
		size_t len = strlen(line);
		int compressed = len > 3 && (!strcmp(line + len - 3, ".xz") || !strcmp(line + len - 3, ".gz") ||
					     !strcmp(line + len - 4, ".zst"));
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0 || (syscall(SYS_finit_module, fd, "", compressed ? MODULE_INIT_COMPRESSED_FILE : 0) < 0 &&
			       errno != EEXIST))
			say("module %s: %s", line, strerror(errno));
		if (fd >= 0)
			close(fd);
		unlink(path); /* the initramfs is RAM: give it back */
	}
	fclose(f);
}

static void read_cmdline(void)
{
	static char buf[4096];
	int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
	if (n < 0)
		die("read /proc/cmdline");
	close(fd);
	buf[n] = '\0';
	for (char *tok = strtok(buf, " \n"); tok; tok = strtok(NULL, " \n")) {
		if (!strncmp(tok, "sandfleet.layers=", 17))
			n_layers = strtoul(tok + 17, NULL, 10);
		else if (!strncmp(tok, "sandfleet.disk=", 15))
			disk = strtoull(tok + 15, NULL, 10);
		else if (!strncmp(tok, "sandfleet.inodes=", 17))
			inodes = strtoull(tok + 17, NULL, 10);
		else if (!strncmp(tok, "sandfleet.uid=", 14))
			uid = strtoul(tok + 14, NULL, 10);
		else if (!strncmp(tok, "sandfleet.nofile=", 17))
			nofile = strtoul(tok + 17, NULL, 10);
		else if (!strncmp(tok, "sandfleet.hostname=", 19))
			snprintf(hostname, sizeof hostname, "%s", tok + 19);
		else if (!strcmp(tok, "sandfleet.mode=full"))
			full_mode = 1;
		else if (!strcmp(tok, "sandfleet.init=1"))
			want_init = 1;
	}
	if (!full_mode && (n_layers < 1 || n_layers > MAX_LAYERS)) {
		errno = EINVAL;
		die("sandfleet.layers");
	}
}

/* Step 3: a tmpfs root with /dev, /proc, /sys moved over and /sandfleet bound read-only. */
static void switch_root(void)
{
	static const char *dirs[] = {"/newroot/dev", "/newroot/proc", "/newroot/sys", "/newroot/run",
				     "/newroot/layers", "/newroot/sandfleet"};
	mkdir("/newroot", 0755);
	if (mount("root", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m") < 0)
		die("mount the tmpfs root");
	for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++)
		if (mkdir(dirs[i], 0755) < 0)
			die("mkdir in the new root");
	if (mount("/dev", "/newroot/dev", NULL, MS_MOVE, NULL) < 0 || mount("/proc", "/newroot/proc", NULL, MS_MOVE, NULL) < 0 ||
	    mount("/sys", "/newroot/sys", NULL, MS_MOVE, NULL) < 0)
		die("move /dev, /proc, /sys");
	if (mount("/sandfleet", "/newroot/sandfleet", NULL, MS_BIND, NULL) < 0 ||
	    mount(NULL, "/newroot/sandfleet", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
		die("bind /sandfleet");
	if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
		die("switch to the tmpfs root");
}

/* Step 4 (/run/sb is 0711: the sandbox root binds its rootfs from inside its user namespace).
 * Layer i is disk i (vda, vdb, ...); devtmpfs shows a disk once its driver probed it. */
static void mount_layers(void)
{
	char dev[32], target[32];
	for (unsigned long i = 0; i < n_layers; i++) {
		snprintf(dev, sizeof dev, "/dev/vd%c", (char)('a' + i));
		snprintf(target, sizeof target, "/layers/%lu", i);
		for (int tries = 0; access(dev, F_OK) < 0 && tries < 500; tries++)
			msleep(10);
		if (mkdir(target, 0755) < 0 || mount(dev, target, "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID, NULL) < 0)
			die("mount a layer");
	}
	if (mkdir("/run/sb", 0711) < 0 || mkdir("/run/sb/scratch", 0700) < 0 || mkdir("/run/sb/rootfs", 0755) < 0)
		die("mkdir /run/sb");
}

/* Step 5: the launcher, standalone; returns our end of the agent channel. */
static int start_agent(void)
{
	int sv[2], out[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0 || pipe2(out, O_CLOEXEC) < 0)
		die("socketpair");
	int agent_fd = open("/sandfleet/agent", O_RDONLY | O_CLOEXEC);
	int bpf_fd = open("/sandfleet/seccomp.bpf", O_RDONLY | O_CLOEXEC);
	if (agent_fd < 0 || bpf_fd < 0)
		die("open the agent and the seccomp filter");
	char a_disk[32], a_inodes[32], a_uid[32], a_nofile[32], a_lower[MAX_LAYERS][32];
	snprintf(a_disk, sizeof a_disk, "%llu", disk);
	snprintf(a_inodes, sizeof a_inodes, "%llu", inodes);
	snprintf(a_uid, sizeof a_uid, "%lu", uid);
	snprintf(a_nofile, sizeof a_nofile, "%lu", nofile);
	char *argv[32 + 2 * MAX_LAYERS];
	int n = 0;
	argv[n++] = "sandfleet-run";
	argv[n++] = "--dir", argv[n++] = "/run/sb";
	for (unsigned long i = n_layers; i-- > 0;) { /* overlay wants the top layer first */
		snprintf(a_lower[i], sizeof a_lower[i], "/layers/%lu", i);
		argv[n++] = "--lower", argv[n++] = a_lower[i];
	}
	argv[n++] = "--disk", argv[n++] = a_disk;
	argv[n++] = "--inodes", argv[n++] = a_inodes;
	argv[n++] = "--nofile", argv[n++] = a_nofile;
	argv[n++] = "--uid", argv[n++] = a_uid;
	argv[n++] = "--hostname", argv[n++] = hostname;
	argv[n] = NULL;
	pid_t pid = fork();
	if (pid < 0)
		die("fork");
	if (pid == 0) {
		/* dup2 clears close-on-exec on the copies; sv[1], agent_fd, bpf_fd may sit on 3..5
		 * themselves, so go through fds above them first. */
		int c = fcntl(sv[1], F_DUPFD_CLOEXEC, 10), a = fcntl(agent_fd, F_DUPFD_CLOEXEC, 10),
		    b = fcntl(bpf_fd, F_DUPFD_CLOEXEC, 10);
		if (c < 0 || a < 0 || b < 0 || dup2(out[1], 1) < 0 || dup2(c, 3) < 0 || dup2(a, 4) < 0 || dup2(b, 5) < 0)
			_exit(127);
		execv("/sandfleet/launcher", argv);
		_exit(127);
	}
	close(out[1]);
	close(sv[1]);
	close(agent_fd);
	close(bpf_fd);
	char buf[32] = {0};
	size_t len = 0;
	for (;;) {
		ssize_t r = read(out[0], buf + len, sizeof buf - 1 - len);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		len += (size_t)r;
	}
	close(out[0]);
	int status;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	agent = (pid_t)atoi(buf);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || agent <= 0) {
		errno = ECHILD;
		die("the launcher failed");
	}
	return sv[0];
}

/* ---- the channel relay ------------------------------------------------------------------------ */

static int open_port(void)
{
	char path[300], name[64];
	for (int tries = 0; tries < 1000; tries++) {
		DIR *d = opendir("/sys/class/virtio-ports");
		struct dirent *e;
		while (d && (e = readdir(d))) {
			if (e->d_name[0] == '.')
				continue;
			snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
			int fd = open(path, O_RDONLY | O_CLOEXEC);
			ssize_t n = fd < 0 ? -1 : read(fd, name, sizeof name - 1);
			if (fd >= 0)
				close(fd);
			if (n <= 0)
				continue;
			name[n] = '\0';
			name[strcspn(name, "\n")] = '\0';
			if (strcmp(name, "sandfleet.agent"))
				continue;
			snprintf(path, sizeof path, "/dev/%s", e->d_name);
			int port = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
			if (port >= 0) {
				closedir(d);
				return port;
			}
		}
		if (d)
			closedir(d);
		msleep(10);
	}
	errno = ENOENT;
	die("find the virtio-serial port sandfleet.agent");
	return -1;
}

/* After closing our end of the channel, the agent offers a new socketpair on its fd 4. */
static int take_new_channel(void)
{
	int pidfd = (int)syscall(SYS_pidfd_open, agent, 0);
	if (pidfd < 0)
		die("pidfd_open the agent");
	for (int tries = 0; tries < 1000; tries++) {
		reap();
		int fd = (int)syscall(SYS_pidfd_getfd, pidfd, 4, 0);
		struct stat st;
		if (fd >= 0 && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) {
			close(pidfd);
			fcntl(fd, F_SETFD, FD_CLOEXEC);
			return fd;
		}
		if (fd >= 0)
			close(fd); /* still the /dev/null placeholder */
		msleep(5);
	}
	die("the agent offered no new channel");
	return -1;
}

static int write_all(int fd, const char *p, size_t len)
{
	while (len) {
		ssize_t n = write(fd, p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN) {
			struct pollfd pf = {fd, POLLOUT, 0};
			if (poll(&pf, 1, 1000) < 0 && errno != EINTR)
				return -1;
			if (pf.revents & (POLLHUP | POLLERR))
				return -1;
			continue;
		}
		if (n <= 0)
			return -1;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

struct relay {
	int port, chan;
	int host_up;			   /* the host is connected (and has had SYNC_MAGIC) */
	int had_host;			   /* the channel has been relayed to a host: reset it when that host goes */
	int keep_next;			   /* the next host to go was snapshotted: keep the agent's execs */
	char in[4 + MAX_PAYLOAD];	   /* port -> channel: a partial frame */
	size_t in_len;
	char out[4 + MAX_PAYLOAD];	   /* channel -> port: one framed datagram being written */
	size_t out_off, out_len;
};

static void host_gone(struct relay *r)
{
	r->host_up = 0;
	r->in_len = r->out_off = r->out_len = 0;
	if (!r->had_host)
		return;
	if (r->keep_next) {
		/* a snapshot's copy (or its parent, should its daemon die right then): the agent moves to a
		 * fresh channel with every exec kept; the next daemon says which to forget */
		uint32_t reopen[2] = {M_REOPEN, 0};
		if (send(r->chan, reopen, sizeof reopen, MSG_NOSIGNAL) < 0)
			say("reopen: %s", strerror(errno));
		int chan = take_new_channel();
		close(r->chan);
		r->chan = chan;
		r->keep_next = 0;
	} else {
		close(r->chan); /* the agent orphans that daemon's execs and offers a new channel */
		r->chan = take_new_channel();
	}
	r->had_host = 0;
}

/* The host's entropy: mixed in and credited, then the generator reseeds at once (a restored copy's
 * state is its parent's until then). */
static void add_entropy(const char *bytes, size_t len)
{
	struct {
		int entropy_count, buf_size; /* struct rand_pool_info */
		char buf[256];
	} req;
	if (len > sizeof req.buf)
		len = sizeof req.buf;
	req.entropy_count = (int)(8 * len);
	req.buf_size = (int)len;
	memcpy(req.buf, bytes, len);
	int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
	if (fd < 0 || ioctl(fd, RNDADDENTROPY, &req) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0)
		say("entropy: %s", strerror(errno));
	if (fd >= 0)
		close(fd);
}

/* The sandbox's hostname, set in the agent's UTS namespace (ours in full mode). */
static void set_hostname(const char *name, size_t len)
{
	char path[64];
	if (len >= sizeof hostname)
		len = sizeof hostname - 1;
	snprintf(path, sizeof path, "/proc/%d/ns/uts", (int)agent);
	int own = open("/proc/self/ns/uts", O_RDONLY | O_CLOEXEC), theirs = open(path, O_RDONLY | O_CLOEXEC);
	if (own < 0 || theirs < 0 || setns(theirs, CLONE_NEWUTS) < 0 || sethostname(name, len) < 0)
		say("hostname: %s", strerror(errno));
	if (own >= 0 && setns(own, CLONE_NEWUTS) < 0)
		say("back to our own UTS namespace: %s", strerror(errno));
	if (own >= 0)
		close(own);
	if (theirs >= 0)
		close(theirs);
}

/* A control frame from the host (see "Snapshots" above); 1 if it was one. */
static int control(struct relay *r, const char *p, uint32_t len)
{
	if (len < CTRL_LEN || memcmp(p, CTRL_MAGIC, 8))
		return 0;
	const char *arg = p + CTRL_LEN;
	size_t n = len - CTRL_LEN;
	if (!memcmp(p + 8, "keepnext", 8))
		r->keep_next = 1;
	else if (!memcmp(p + 8, "keepdone", 8))
		r->keep_next = 0;
	else if (!memcmp(p + 8, "entropy", 8))
		add_entropy(arg, n);
	else if (!memcmp(p + 8, "hostname", 8))
		set_hostname(arg, n);
	else if (!memcmp(p + 8, "realtime", 8) && n == 8) {
		uint64_t ns;
		memcpy(&ns, arg, 8);
		struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
		if (clock_settime(CLOCK_REALTIME, &ts) < 0)
			say("realtime: %s", strerror(errno));
	}
	return 1;
}

static void host_came(struct relay *r)
{
	if (write_all(r->port, SYNC_MAGIC, SYNC_LEN) < 0) {
		host_gone(r);
		return;
	}
	r->host_up = 1;
	r->had_host = 1;
}

/* Bytes from the host: complete frames go to the agent as datagrams. Returns -1 when the host left. */
static int from_host(struct relay *r)
{
	for (;;) {
		ssize_t n = read(r->port, r->in + r->in_len, sizeof r->in - r->in_len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return 0;
		if (n <= 0)
			return -1;
		r->in_len += (size_t)n;
		size_t off = 0;
		while (r->in_len - off >= 4) {
			uint32_t len;
			memcpy(&len, r->in + off, 4);
			if (len > MAX_PAYLOAD) {
				say("bad frame length %u from the host", len);
				return -1;
			}
			if (r->in_len - off < 4 + len)
				break;
			if (control(r, r->in + off + 4, len)) {
				off += 4 + len;
				continue;
			}
			/* The agent reads as fast as it can; a full socket buffer means waiting a little. */
			while (send(r->chan, r->in + off + 4, len, 0) < 0) {
				if (errno == EINTR)
					continue;
				if (errno == EAGAIN || errno == ENOBUFS) {
					msleep(1);
					continue;
				}
				break; /* the agent is gone: reap() powers off */
			}
			off += 4 + len;
		}
		memmove(r->in, r->in + off, r->in_len - off);
		r->in_len -= off;
	}
}

/* One datagram from the agent, framed for the port. Returns -1 when the agent closed. */
static int from_agent(struct relay *r)
{
	ssize_t n = recv(r->chan, r->out + 4, MAX_PAYLOAD, MSG_DONTWAIT);
	if (n < 0)
		return errno == EINTR || errno == EAGAIN ? 0 : -1;
	if (n == 0)
		return -1;
	uint32_t len = (uint32_t)n;
	memcpy(r->out, &len, 4);
	r->out_off = 0;
	r->out_len = 4 + (size_t)n;
	return 0;
}

/* Write what is pending to the port; -1 when the host left. */
static int flush_out(struct relay *r)
{
	while (r->out_off < r->out_len) {
		ssize_t n = write(r->port, r->out + r->out_off, r->out_len - r->out_off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return 0;
		if (n <= 0)
			return -1;
		r->out_off += (size_t)n;
	}
	r->out_off = r->out_len = 0;
	return 0;
}

static void relay_forever(int port, int chan)
{
	static struct relay r;
	r.port = port;
	r.chan = chan;
	for (;;) {
		reap();
		struct pollfd pf[2] = {{r.port, POLLIN, 0}, {r.chan, 0, 0}};
		if (r.host_up) {
			if (r.out_len)
				pf[0].events |= POLLOUT;
			else
				pf[1].events = POLLIN;
		}
		int n = poll(pf, 2, 500);
		if (n < 0) {
			if (errno != EINTR)
				msleep(10);
			continue;
		}
		if (!r.host_up) {
			/* The port reports POLLHUP for as long as no host is connected; it does not wake us
			 * when one connects, so look again shortly. */
			if (pf[0].revents & POLLHUP) {
				msleep(20);
				continue;
			}
			host_came(&r);
			continue;
		}
		if ((pf[0].revents & POLLIN) && from_host(&r) < 0) {
			host_gone(&r);
			continue;
		}
		if ((pf[0].revents & POLLHUP) && !(pf[0].revents & POLLIN)) {
			host_gone(&r);
			continue;
		}
		if ((pf[1].revents & (POLLIN | POLLHUP)) && !r.out_len && from_agent(&r) < 0) {
			msleep(10); /* the agent exits: reap() powers off; or it reconnects on its own */
			continue;
		}
		if (r.out_len && flush_out(&r) < 0)
			host_gone(&r);
	}
}

/* ---- full mode (the vm tier) ------------------------------------------------------------------ */

static void wait_for(const char *dev)
{
	for (int tries = 0; access(dev, F_OK) < 0 && tries < 1000; tries++)
		msleep(10);
}

/* Grow the mounted root filesystem to its whole disk (online; nothing to do when it already is). */
static void grow_root(void)
{
	uint64_t bytes = 0, blocks;
	struct statfs sf;
	int dev = open("/dev/vda", O_RDONLY | O_CLOEXEC), root = open("/newroot", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dev >= 0 && root >= 0 && ioctl(dev, BLKGETSIZE64, &bytes) == 0 && fstatfs(root, &sf) == 0 && sf.f_bsize > 0) {
		blocks = bytes / (uint64_t)sf.f_bsize;
		if (blocks > (uint64_t)sf.f_blocks && ioctl(root, EXT4_IOC_RESIZE_FS, &blocks) < 0)
			say("growing the root filesystem to %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
	}
	if (dev >= 0)
		close(dev);
	if (root >= 0)
		close(root);
}

/* The root disk becomes / (the initramfs stays underneath, unreachable: a few MiB of guest RAM). */
static void enter_root_disk(void)
{
	wait_for("/dev/vda");
	mkdir("/newroot", 0755);
	if (mount("/dev/vda", "/newroot", "ext4", 0, NULL) < 0)
		die("mount the root disk");
	grow_root();
	mkdir("/newroot/dev", 0755);
	mkdir("/newroot/proc", 0555);
	mkdir("/newroot/sys", 0555);
	if (mount("/dev", "/newroot/dev", NULL, MS_MOVE, NULL) < 0 || mount("/proc", "/newroot/proc", NULL, MS_MOVE, NULL) < 0 ||
	    mount("/sys", "/newroot/sys", NULL, MS_MOVE, NULL) < 0)
		die("move /dev, /proc, /sys");
	if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
		die("switch to the root disk");
}

static void mount_one(const char *src, const char *target, const char *type, unsigned long flags, const char *data)
{
	mkdir(target, 0755);
	if (mount(src, target, type, flags, data) < 0 && errno != EBUSY)
		say("mount %s: %s", target, strerror(errno));
}

/* What an init would mount (only when the image's init does not run: systemd mounts its own). */
static void mount_like_init(void)
{
	mount_one("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=620,ptmxmode=666");
	mount_one("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
	mount_one("run", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755");
	mount_one("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

/* The agent as real root of the guest, exec'd from agent_fd; returns our end of its channel. */
static int start_agent_full(int agent_fd)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		die("socketpair");
	pid_t pid = fork();
	if (pid < 0)
		die("fork");
	if (pid == 0) {
		static char *argv[] = {"sandfleet-agent", NULL};
		static char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", NULL};
		int c = fcntl(sv[1], F_DUPFD_CLOEXEC, 10), a = fcntl(agent_fd, F_DUPFD_CLOEXEC, 10);
		int null = open("/dev/null", O_RDWR | O_CLOEXEC);
		if (c < 0 || a < 0 || null < 0 || dup2(null, 0) < 0 || dup2(c, 3) < 0)
			_exit(127);
		setsid();
		signal(SIGCHLD, SIG_DFL);
		signal(SIGPIPE, SIG_DFL);
		syscall(SYS_execveat, a, "", argv, envp, AT_EMPTY_PATH);
		_exit(127);
	}
	close(sv[1]);
	agent = pid;
	return sv[0];
}

static void run_full(void)
{
	int agent_fd = open("/sandfleet/agent", O_RDONLY | O_CLOEXEC);
	if (agent_fd < 0)
		die("open the agent");
	enter_root_disk();
	sethostname(hostname, strlen(hostname));
	int init = want_init && access("/sbin/init", X_OK) == 0;
	if (!init)
		mount_like_init();
	pid_t relay = fork();
	if (relay < 0)
		die("fork");
	if (relay == 0) {
		int chan = start_agent_full(agent_fd);
		close(agent_fd);
		relay_forever(open_port(), chan);
	}
	close(agent_fd);
	if (init) {
		signal(SIGCHLD, SIG_DFL);
		execl("/sbin/init", "/sbin/init", (char *)NULL);
		say("exec /sbin/init: %s: staying init", strerror(errno));
		signal(SIGCHLD, on_sigchld);
		mount_like_init();
	}
	for (;;) {
		int status;
		pid_t pid = wait(&status);
		if (pid == relay) {
			say("the relay exited (status %d): powering off", status);
			power_off();
		}
		if (pid < 0 && errno == ECHILD)
			pause();
	}
}

int main(void)
{
	/* The kernel opened /dev/console (from the initramfs) as 0, 1, 2 for us. */
	signal(SIGCHLD, on_sigchld);
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stderr, NULL, _IOLBF, 0);
	mount_basics();
	load_modules();
	read_cmdline();
	if (full_mode)
		run_full();
	switch_root();
	mount_layers();
	sethostname(hostname, strlen(hostname));
	int chan = start_agent();
	int port = open_port();
	relay_forever(port, chan);
	return 0;
}
