/*
 * A drop-in libcuda.so.1 for the simulated GPU: the driver API's checkpoint
 * entry points (CUDA 12.8+ / R570+) with the signatures and argument structs
 * of cuda.h, driving the same state machine as the fake cuda-checkpoint.
 *
 * Like the real driver it talks to the target's own restore thread (its
 * control socket, reached through /proc/PID/root), so a process locked
 * through this library can be unlocked by the fake tool and the other way
 * round, and a frozen or stopped target makes a call hang. The simulated
 * node's settings come from SIM/sim.json, read once by cuInit: the driver
 * branch, the attach latency (paid once per cuInit, not per call), the
 * per-call cost and CUDA 13.4 transient states. Copy bandwidth is the
 * workload runtime's and the GPU service's business, as for the tool.
 * Faults injected in SIM/faults.json for the tool apply here too.
 *
 * SIM is $CUDA_SIM_DIR, else the parent of the directory this library was
 * loaded from (a node keeps it at SIM/lib/libcuda.so.1).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- cuda.h (CUDA 13.0), the parts this library implements ------------ */

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef uint64_t cuuint64_t;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef enum CUprocessState_enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3
} CUprocessState;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[64 - sizeof(CUcheckpointGpuPair *) - sizeof(unsigned int) - sizeof(cuuint64_t)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "cuda.h layout");

#define EXPORT __attribute__((visibility("default")))

/* ---- the simulated node ------------------------------------------------ */

static struct {
    int initialised;
    int major;
    char version[64];
    double attach_latency_s;
    double call_cost_s;
    int transient;
    char dir[PATH_MAX];
} node;

static const struct cu_error {
    CUresult code;
    const char *name;
    const char *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static void sleep_s(double seconds) {
    if (seconds <= 0)
        return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/* The whole of a small file, NUL-terminated; NULL when unreadable. */
static char *slurp(const char *path, size_t limit) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    char *buf = malloc(limit + 1);
    size_t n = 0;
    ssize_t got;
    while (buf && n < limit && (got = read(fd, buf + n, limit - n)) > 0)
        n += (size_t)got;
    close(fd);
    if (buf)
        buf[n] = 0;
    return buf;
}

/* ---- just enough JSON for sim.json, faults.json and the replies -------- */

static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    return p;
}

/* A JSON string at p (after its opening quote) into out; the end, or NULL. */
static const char *json_string(const char *p, char *out, size_t size) {
    size_t n = 0;
    while (*p && *p != '"') {
        char c = *p++;
        if (c == '\\') {
            c = *p++;
            switch (c) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': c = '?'; p += (strlen(p) >= 4) ? 4 : strlen(p); break;
            case 0: return NULL;
            default: break; /* \" \\ \/ */
            }
        }
        if (n + 1 < size)
            out[n++] = c;
    }
    if (size)
        out[n] = 0;
    return *p == '"' ? p + 1 : NULL;
}

/* Where the value of "key" starts in a flat object's text, or NULL. */
static const char *json_find(const char *text, const char *key) {
    char quoted[128];
    snprintf(quoted, sizeof quoted, "\"%s\"", key);
    for (const char *p = strstr(text, quoted); p; p = strstr(p + 1, quoted)) {
        const char *q = skip_ws(p + strlen(quoted));
        if (*q == ':')
            return skip_ws(q + 1);
    }
    return NULL;
}

static int json_get_string(const char *text, const char *key, char *out, size_t size) {
    const char *v = json_find(text, key);
    return v && *v == '"' && json_string(v + 1, out, size) != NULL;
}

static double json_get_number(const char *text, const char *key, double fallback) {
    const char *v = json_find(text, key);
    if (!v)
        return fallback;
    char *end;
    double d = strtod(v, &end);
    return end == v ? fallback : d;
}

static int json_get_bool(const char *text, const char *key) {
    const char *v = json_find(text, key);
    return v && strncmp(v, "true", 4) == 0;
}

/* ---- where the simulated node lives ------------------------------------ */

static int find_dir(void) {
    const char *env = getenv("CUDA_SIM_DIR");
    if (env && *env) {
        snprintf(node.dir, sizeof node.dir, "%s", env);
        return 0;
    }
    Dl_info info;
    if (!dladdr((void *)find_dir, &info) || !info.dli_fname)
        return -1;
    char self[PATH_MAX];
    if (!realpath(info.dli_fname, self))
        snprintf(self, sizeof self, "%s", info.dli_fname);
    for (int up = 0; up < 2; up++) { /* SIM/lib/libcuda.so.1 -> SIM */
        char *slash = strrchr(self, '/');
        if (!slash)
            return -1;
        *slash = 0;
    }
    snprintf(node.dir, sizeof node.dir, "%s", self);
    return 0;
}

static void node_path(char *out, size_t size, const char *name) {
    snprintf(out, size, "%s/%s", node.dir, name);
}

/* ---- the target's restore thread --------------------------------------- */

static int connect_path(int sock, const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) < sizeof addr.sun_path - 8) {
        snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
        return connect(sock, (struct sockaddr *)&addr, sizeof addr);
    }
    /* sun_path holds 108 bytes: go through a descriptor of the directory. */
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", path);
    char *slash = strrchr(parent, '/');
    if (!slash)
        return -1;
    *slash = 0;
    int dfd = open(parent, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return -1;
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/%s", dfd, slash + 1);
    int rc = connect(sock, (struct sockaddr *)&addr, sizeof addr);
    int saved = errno;
    close(dfd);
    errno = saved;
    return rc;
}

static long status_field(const char *text, const char *field, int last) {
    const char *p = strstr(text, field);
    if (!p)
        return -1;
    p += strlen(field);
    long value = -1;
    char *end;
    for (;;) {
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p < '0' || *p > '9')
            break;
        value = strtol(p, &end, 10);
        p = end;
        if (!last)
            break;
    }
    return value;
}

/* The control socket of pid's restore thread, through the target's own root. */
static CUresult target_path(int pid, char *out, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    char *status = slurp(path, 16384);
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    long tgid = status_field(status, "\nTgid:", 0);
    free(status);
    if (tgid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(path, sizeof path, "/proc/%ld/status", tgid);
    status = slurp(path, 16384);
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    long nspid = status_field(status, "\nNSpid:", 1);
    free(status);
    if (nspid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(path, sizeof path, "/proc/%ld/environ", tgid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t cap = 65536, n = 0;
    char *env = malloc(cap + 1);
    ssize_t got;
    while (env && n < cap && (got = read(fd, env + n, cap - n)) > 0)
        n += (size_t)got;
    close(fd);
    if (!env)
        return CUDA_ERROR_OUT_OF_MEMORY;
    env[n] = 0;
    const char *ctl = "/dev/shm";
    for (size_t i = 0; i < n; i += strlen(env + i) + 1)
        if (strncmp(env + i, "CUDA_SIM_CTL_DIR=", 17) == 0)
            ctl = env + i + 17;
    snprintf(out, size, "/proc/%ld/root%s/cuda-sim-%ld.sock", tgid, ctl, nspid);
    free(env);
    return CUDA_SUCCESS;
}

/* One request to pid's restore thread; its reply line in reply. */
/* A `segv` fault with `after`: the call is carried out, then the library
 * crashes (see ask). */
static __thread int crash_after;

static CUresult ask(int pid, const char *request, char *reply, size_t size) {
    char path[PATH_MAX];
    CUresult rc = target_path(pid, path, sizeof path);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct stat st;
    if (stat(path, &st) != 0)
        return CUDA_ERROR_NOT_INITIALIZED; /* no CUDA in that process */
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return CUDA_ERROR_UNKNOWN;
    if (connect_path(sock, path) != 0) {
        int refused = errno == ECONNREFUSED;
        close(sock);
        return refused ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_UNKNOWN;
    }
    size_t len = strlen(request), sent = 0;
    while (sent < len) {
        ssize_t w = send(sock, request + sent, len - sent, MSG_NOSIGNAL);
        if (w <= 0) {
            close(sock);
            return CUDA_ERROR_UNKNOWN;
        }
        sent += (size_t)w;
    }
    size_t n = 0;
    while (n + 1 < size) {
        ssize_t r = recv(sock, reply + n, size - 1 - n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
        if (reply[n - 1] == '\n')
            break;
    }
    close(sock);
    reply[n] = 0;
    if (crash_after && n > 0)
        raise(SIGSEGV); /* the driver carried the call out, then crashed */
    if (n == 0)
        return CUDA_ERROR_UNKNOWN;
    if (!json_get_bool(reply, "ok")) {
        int code = (int)json_get_number(reply, "code", CUDA_ERROR_UNKNOWN);
        return code ? (CUresult)code : CUDA_ERROR_UNKNOWN;
    }
    return CUDA_SUCCESS;
}

/* ---- injected faults (SIM/faults.json, shared with the fake tool) ------ */

#define MAX_RULES 64

typedef struct {
    char action[32], mode[16], tag[128], message[256];
    long pid;
    int has_pid, has_tag, has_times, has_message, has_skip, after;
    long times, skip;
    long code;
    double seconds; /* delay: how long the call waits before it is carried out */
} Rule;


static int parse_rules(const char *text, Rule *rules) {
    int count = 0;
    const char *p = skip_ws(text);
    if (*p != '[')
        return 0;
    p++;
    while (count < MAX_RULES) {
        p = skip_ws(p);
        if (*p != '{')
            break;
        const char *end = strchr(p, '}'); /* rules are flat objects */
        if (!end)
            break;
        char obj[2048];
        size_t len = (size_t)(end - p + 1) < sizeof obj ? (size_t)(end - p + 1) : sizeof obj - 1;
        memcpy(obj, p, len);
        obj[len] = 0;
        Rule *r = &rules[count++];
        memset(r, 0, sizeof *r);
        if (!json_get_string(obj, "action", r->action, sizeof r->action))
            strcpy(r->action, "*");
        if (!json_get_string(obj, "mode", r->mode, sizeof r->mode))
            strcpy(r->mode, "error");
        r->has_tag = json_get_string(obj, "tag", r->tag, sizeof r->tag);
        r->has_message = json_get_string(obj, "message", r->message, sizeof r->message);
        r->has_pid = json_find(obj, "pid") != NULL;
        r->pid = (long)json_get_number(obj, "pid", -1);
        r->has_times = json_find(obj, "times") != NULL;
        r->times = (long)json_get_number(obj, "times", 1);
        r->has_skip = json_find(obj, "skip") != NULL;
        r->skip = (long)json_get_number(obj, "skip", 0);
        r->after = json_get_bool(obj, "after");
        r->code = (long)json_get_number(obj, "code", CUDA_ERROR_UNKNOWN);
        r->seconds = json_get_number(obj, "seconds", 0);
        p = skip_ws(end + 1);
        if (*p == ',')
            p++;
    }
    return count;
}

static void put_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fputc('\\', f);
        if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", *s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

static void write_rules(int fd, const Rule *rules, int count) {
    char *buf = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&buf, &size);
    if (!f)
        return;
    fputc('[', f);
    for (int i = 0; i < count; i++) {
        const Rule *r = &rules[i];
        fprintf(f, "%s{\"action\": ", i ? ", " : "");
        put_string(f, r->action);
        fputs(", \"mode\": ", f);
        put_string(f, r->mode);
        if (r->has_pid)
            fprintf(f, ", \"pid\": %ld", r->pid);
        if (r->has_tag) {
            fputs(", \"tag\": ", f);
            put_string(f, r->tag);
        }
        if (r->has_times)
            fprintf(f, ", \"times\": %ld", r->times);
        if (r->has_skip)
            fprintf(f, ", \"skip\": %ld", r->skip);
        if (r->after)
            fputs(", \"after\": true", f);
        fprintf(f, ", \"code\": %ld", r->code);
        if (r->seconds > 0)
            fprintf(f, ", \"seconds\": %g", r->seconds);
        if (r->has_message) {
            fputs(", \"message\": ", f);
            put_string(f, r->message);
        }
        fputc('}', f);
    }
    fputc(']', f);
    fclose(f);
    if (ftruncate(fd, 0) == 0 && lseek(fd, 0, SEEK_SET) == 0) {
        size_t done = 0;
        while (done < size) {
            ssize_t w = write(fd, buf + done, size - done);
            if (w <= 0)
                break;
            done += (size_t)w;
        }
    }
    free(buf);
}

static int tag_of(int pid, char *tag, size_t size) {
    char reply[4096];
    if (ask(pid, "{\"op\": \"status\"}\n", reply, sizeof reply) != CUDA_SUCCESS)
        return 0;
    return json_get_string(reply, "tag", tag, size);
}

/* The fault injected for op on pid, if any: its result (hang never returns). */
static CUresult inject_fault(int pid, const char *op) {
    char path[PATH_MAX];
    node_path(path, sizeof path, "faults.json");
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return CUDA_SUCCESS;
    flock(fd, LOCK_EX);
    char *text = slurp(path, 1 << 20);
    static __thread Rule rules[MAX_RULES];
    int count = text ? parse_rules(text, rules) : 0;
    free(text);
    Rule hit;
    int found = 0;
    char tag[128];
    int tag_known = -1;
    for (int i = 0; i < count && !found; i++) {
        Rule *r = &rules[i];
        if (strcmp(r->action, "*") != 0 && strcmp(r->action, op) != 0)
            continue;
        if (r->has_pid && r->pid != pid)
            continue;
        if (r->has_tag) {
            if (tag_known < 0)
                tag_known = tag_of(pid, tag, sizeof tag);
            if (!tag_known || strcmp(tag, r->tag) != 0)
                continue;
        }
        if (r->has_times && r->times <= 0)
            continue;
        if (r->has_skip && r->skip > 0) { /* let this many matching calls through */
            r->skip--;
            write_rules(fd, rules, count);
            continue;
        }
        hit = *r;
        found = 1;
        if (r->has_times) {
            r->times--;
            write_rules(fd, rules, count);
        }
    }
    close(fd); /* releases the lock */
    if (!found)
        return CUDA_SUCCESS;
    if (strcmp(hit.mode, "hang") == 0)
        for (;;)
            sleep(3600);
    if (strcmp(hit.mode, "delay") == 0) { /* slow, then carried out as asked */
        sleep_s(hit.seconds);
        return CUDA_SUCCESS;
    }
    if (strcmp(hit.mode, "crash") == 0) { /* the target dies */
        kill(pid, SIGKILL);
        return CUDA_ERROR_UNKNOWN;
    }
    if (strcmp(hit.mode, "segv") == 0) { /* the library itself crashes */
        if (!hit.after)
            raise(SIGSEGV);
        crash_after = 1; /* once the call is carried out: see ask */
        return CUDA_SUCCESS;
    }
    return (CUresult)hit.code;
}

/* ---- the driver API ----------------------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (node.initialised)
        return CUDA_SUCCESS;
    if (find_dir() != 0)
        return CUDA_ERROR_NO_DEVICE;
    char path[PATH_MAX];
    node_path(path, sizeof path, "sim.json");
    char *config = slurp(path, 1 << 20);
    if (!config)
        return CUDA_ERROR_NO_DEVICE;
    node.attach_latency_s = json_get_number(config, "attach_latency_s", 0);
    node.call_cost_s = json_get_number(config, "call_cost_s", 0);
    node.transient = json_get_bool(config, "transient_states");
    if (!json_get_string(config, "driver_version", node.version, sizeof node.version))
        snprintf(node.version, sizeof node.version, "0");
    node.major = atoi(node.version);
    const char *gpus = json_find(config, "gpus");
    int have_gpus = gpus && *gpus == '[' && *skip_ws(gpus + 1) != ']';
    free(config);
    /* The driver attach: what every cuda-checkpoint run pays, once here. */
    sleep_s(node.attach_latency_s);
    if (!have_gpus)
        return CUDA_ERROR_NO_DEVICE;
    node_path(path, sizeof path, "gpu.pid");
    char *pidtext = slurp(path, 64);
    long service = pidtext ? strtol(pidtext, NULL, 10) : 0;
    free(pidtext);
    if (service <= 0 || (kill((pid_t)service, 0) != 0 && errno != EPERM))
        return CUDA_ERROR_NO_DEVICE; /* the GPU service (the "driver") is not up */
    node.initialised = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised && find_dir() == 0 && !node.major) {
        char path[PATH_MAX];
        node_path(path, sizeof path, "sim.json");
        char *config = slurp(path, 1 << 20);
        if (config && json_get_string(config, "driver_version", node.version, sizeof node.version))
            node.major = atoi(node.version);
        free(config);
    }
    /* The CUDA version each driver branch supports. */
    int m = node.major;
    *driverVersion = m >= 590 ? 13010 : m >= 580 ? 13000 : m >= 575 ? 12090
                   : m >= 570 ? 12080 : m >= 560 ? 12060 : m >= 555 ? 12050 : 12040;
    return CUDA_SUCCESS;
}

/* errors[] entry of `error`, or NULL for a code the driver does not know. */
static const struct cu_error *find_error(CUresult error) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error)
            return &errors[i];
    return NULL;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct cu_error *e = find_error(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct cu_error *e = find_error(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* What every checkpoint entry point does first. */
static CUresult begin(int pid, const char *op) {
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (node.major < 570)
        return CUDA_ERROR_NOT_SUPPORTED; /* the checkpoint driver API is R570+ */
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    sleep_s(node.call_cost_s);
    return inject_fault(pid, op);
}

static int reserved_zero(const void *p, size_t size) {
    const unsigned char *b = p;
    for (size_t i = 0; i < size; i++)
        if (b[i])
            return 0;
    return 1;
}

EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "get-state");
    if (rc != CUDA_SUCCESS)
        return rc;
    char reply[4096], word[32] = "";
    rc = ask(pid, "{\"op\": \"get-state\"}\n", reply, sizeof reply);
    if (rc != CUDA_SUCCESS)
        return rc;
    json_get_string(reply, "state", word, sizeof word);
    if (strcmp(word, "running") == 0)
        *state = CU_PROCESS_STATE_RUNNING;
    else if (strcmp(word, "locked") == 0)
        *state = CU_PROCESS_STATE_LOCKED;
    else if (strcmp(word, "checkpointed") == 0)
        *state = CU_PROCESS_STATE_CHECKPOINTED;
    else if (strcmp(word, "failed") == 0)
        *state = CU_PROCESS_STATE_FAILED;
    else if (strcmp(word, "checkpointing") == 0)
        *state = (CUprocessState)4; /* CUDA 13.4 */
    else if (strcmp(word, "restoring") == 0)
        *state = (CUprocessState)5;
    else
        *state = (CUprocessState)0x7fffffff; /* a state the driver cannot place */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "get-restore-tid");
    if (rc != CUDA_SUCCESS)
        return rc;
    char reply[4096];
    rc = ask(pid, "{\"op\": \"get-restore-tid\"}\n", reply, sizeof reply);
    if (rc == CUDA_SUCCESS)
        *tid = (int)json_get_number(reply, "tid", 0);
    return rc;
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    if (args && (args->reserved0 || !reserved_zero(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "lock");
    if (rc != CUDA_SUCCESS)
        return rc;
    char request[128], reply[4096];
    snprintf(request, sizeof request, "{\"op\": \"lock\", \"timeout_ms\": %u}\n",
             args ? args->timeoutMs : 0);
    return ask(pid, request, reply, sizeof reply);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    if (args && !reserved_zero(args->reserved, sizeof args->reserved))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "checkpoint");
    if (rc != CUDA_SUCCESS)
        return rc;
    char reply[4096];
    return ask(pid, node.transient ? "{\"op\": \"checkpoint\", \"transient\": true}\n"
                                   : "{\"op\": \"checkpoint\"}\n", reply, sizeof reply);
}

static void format_uuid(const CUuuid *u, char *out) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
            b[13], b[14], b[15]);
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    if (args && (!reserved_zero(args->reserved, sizeof args->reserved) || args->reserved1))
        return CUDA_ERROR_INVALID_VALUE;
    if (args && args->gpuPairsCount && !args->gpuPairs)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "restore");
    if (rc != CUDA_SUCCESS)
        return rc;
    unsigned int pairs = args ? args->gpuPairsCount : 0;
    if (pairs && node.major < 580)
        return CUDA_ERROR_NOT_SUPPORTED; /* GPU remapping is R580+ */
    if (pairs > 64)
        return CUDA_ERROR_INVALID_VALUE;
    char request[8192], reply[4096];
    int n = snprintf(request, sizeof request, "{\"op\": \"restore\"%s",
                     node.transient ? ", \"transient\": true" : "");
    if (pairs) {
        n += snprintf(request + n, sizeof request - n, ", \"device_map\": {");
        for (unsigned int i = 0; i < pairs; i++) {
            char old[48], new[48];
            format_uuid(&args->gpuPairs[i].oldUuid, old);
            format_uuid(&args->gpuPairs[i].newUuid, new);
            n += snprintf(request + n, sizeof request - n, "%s\"%s\": \"%s\"", i ? ", " : "",
                          old, new);
        }
        n += snprintf(request + n, sizeof request - n, "}");
    }
    snprintf(request + n, sizeof request - n, "}\n");
    return ask(pid, request, reply, sizeof reply);
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    if (args && !reserved_zero(args->reserved, sizeof args->reserved))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "unlock");
    if (rc != CUDA_SUCCESS)
        return rc;
    char reply[4096];
    return ask(pid, "{\"op\": \"unlock\"}\n", reply, sizeof reply);
}
