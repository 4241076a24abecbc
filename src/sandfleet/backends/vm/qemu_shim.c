/*
 * sandfleet-qemu-shim.so: preloaded into the QEMU of a VM started from a booted template, so that
 * the template's guest memory file is opened read-only.
 *
 * Such a VM maps the template's memory file privately (memory-backend-file, share=off): every page
 * it does not write is the template's page cache page, shared with every other VM of the template;
 * a page it writes becomes its own copy. A private mapping needs only read access, but QEMU 7.2
 * opens the file read-write all the same (QEMU 8.1 falls back to read-only on its own), and its
 * free page reporting then punches holes into the file. Read-only, the file is bound into the jail
 * from a read-only mount: neither QEMU nor anything that takes it over can change what the other
 * VMs of the template start from.
 *
 * With SANDFLEET_RO_FILE=<path> in the environment, an open of exactly <path> for reading and
 * writing is made read-only; every other open is untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static int readonly_flags(const char *path, int flags)
{
	const char *ro = getenv("SANDFLEET_RO_FILE");
	if (ro && path && !strcmp(path, ro) && (flags & O_ACCMODE) == O_RDWR)
		return (flags & ~O_ACCMODE & ~(O_CREAT | O_TRUNC)) | O_RDONLY;
	return flags;
}

static mode_t mode_arg(int flags, va_list ap)
{
	return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

#define WRAP_OPEN(name)                                                                        \
	int name(const char *path, int flags, ...)                                             \
	{                                                                                      \
		static int (*real)(const char *, int, ...);                                    \
		va_list ap;                                                                    \
		va_start(ap, flags);                                                           \
		mode_t mode = mode_arg(flags, ap);                                             \
		va_end(ap);                                                                    \
		if (!real)                                                                     \
			real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name);        \
		return real(path, readonly_flags(path, flags), mode);                          \
	}

#define WRAP_OPENAT(name)                                                                      \
	int name(int dirfd, const char *path, int flags, ...)                                  \
	{                                                                                      \
		static int (*real)(int, const char *, int, ...);                               \
		va_list ap;                                                                    \
		va_start(ap, flags);                                                           \
		mode_t mode = mode_arg(flags, ap);                                             \
		va_end(ap);                                                                    \
		if (!real)                                                                     \
			real = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, #name);   \
		return real(dirfd, path, readonly_flags(path, flags), mode);                   \
	}

/* _FORTIFY_SOURCE turns an open() whose flags are not a constant into __open_2 and friends. */
#define WRAP_OPEN_2(name)                                                                      \
	int name(const char *path, int flags)                                                  \
	{                                                                                      \
		static int (*real)(const char *, int);                                         \
		if (!real)                                                                     \
			real = (int (*)(const char *, int))dlsym(RTLD_NEXT, #name);             \
		return real(path, readonly_flags(path, flags));                                \
	}

WRAP_OPEN(open)
WRAP_OPEN(open64)
WRAP_OPENAT(openat)
WRAP_OPENAT(openat64)
WRAP_OPEN_2(__open_2)
WRAP_OPEN_2(__open64_2)
