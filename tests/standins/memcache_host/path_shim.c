/* LD_PRELOAD shim for MemCache on a CPU host: redirects three paths, nothing else.
 *   /etc/ascend_install.info         -> $ALP_ASCEND_INSTALL_INFO (memfabric reads the driver version via it)
 *   /tmp/mmc_meta_service.lock       -> $ALP_MMC_META_LOCK (one MetaService per test process)
 *   /dev/shm/memfabric_hybrid_<rank> -> /dev/shm/memfabric_hybrid_$ALP_MMC_SHM_NS_<rank>: each client's
 *                                       share of the pool, named by its rank in its MetaService; two
 *                                       MetaServices on one host would otherwise name the same files */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SHM_PREFIX "/dev/shm/memfabric_hybrid_"
static __thread char shm_path[512];

static const char *redirect(const char *path) {
    if (!path) return path;
    if (strncmp(path, SHM_PREFIX, sizeof(SHM_PREFIX) - 1) == 0) {
        const char *ns = getenv("ALP_MMC_SHM_NS");
        if (ns && *ns) {
            snprintf(shm_path, sizeof shm_path, "%s%s_%s", SHM_PREFIX, ns, path + sizeof(SHM_PREFIX) - 1);
            return shm_path;
        }
        return path;
    }
    if (strcmp(path, "/etc/ascend_install.info") == 0) {
        const char *to = getenv("ALP_ASCEND_INSTALL_INFO");
        if (to) return to;
    } else if (strcmp(path, "/tmp/mmc_meta_service.lock") == 0) {
        const char *to = getenv("ALP_MMC_META_LOCK");
        if (to) return to;
    }
    return path;
}

#define REAL(type, name) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

typedef char *(*realpath_fn)(const char *, char *);
typedef char *(*realpath_chk_fn)(const char *, char *, size_t);
typedef FILE *(*fopen_fn)(const char *, const char *);
typedef int (*open_fn)(const char *, int, ...);
typedef int (*path_fn)(const char *);
typedef int (*access_fn)(const char *, int);

char *realpath(const char *p, char *r) { REAL(realpath_fn, realpath); return real_realpath(redirect(p), r); }
char *__realpath_chk(const char *p, char *r, size_t n) { REAL(realpath_chk_fn, __realpath_chk); return real___realpath_chk(redirect(p), r, n); }
FILE *fopen(const char *p, const char *m) { REAL(fopen_fn, fopen); return real_fopen(redirect(p), m); }
FILE *fopen64(const char *p, const char *m) { REAL(fopen_fn, fopen64); return real_fopen64(redirect(p), m); }

static int mode_of(int flags, va_list ap) { return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, int) : 0; }
int open(const char *p, int flags, ...) {
    REAL(open_fn, open);
    va_list ap; va_start(ap, flags); int mode = mode_of(flags, ap); va_end(ap);
    return real_open(redirect(p), flags, mode);
}
int open64(const char *p, int flags, ...) {
    REAL(open_fn, open64);
    va_list ap; va_start(ap, flags); int mode = mode_of(flags, ap); va_end(ap);
    return real_open64(redirect(p), flags, mode);
}
int unlink(const char *p) { REAL(path_fn, unlink); return real_unlink(redirect(p)); }
int access(const char *p, int mode) { REAL(access_fn, access); return real_access(redirect(p), mode); }
