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
 * Faults injected in SIM/faults.json for the tool apply here too (and to
 * cuCheckpointOperationComplete as "checkpoint-complete"/"restore-complete").
 *
 * With "cuda_version" 13040+ in sim.json it is a CUDA 13.4+ driver with
 * custom storage: the caller's retained primary contexts are its own
 * connections to the GPU service, which maps the target's memory onto the
 * caller's GPU as one range and paces the caller's copies over the link.
 * Declarations: fake_cuda.h (re-typed from cuda.h, checked against it).
 *
 * SIM is $CUDA_SIM_DIR, else the parent of the directory this library was
 * loaded from (a node keeps it at SIM/lib/libcuda.so.1).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fake_cuda.h"

#define EXPORT __attribute__((visibility("default")))

/* ---- the simulated node ------------------------------------------------ */

static struct {
    int initialised;
    int major;
    char version[64];
    double attach_latency_s;
    double call_cost_s;
    int transient;
    int cuda_version; /* sim.json "cuda_version": a CUDA 13.4+ driver; 0: by branch */
    int gpu_count;
    char gpu_uuid[16][48]; /* the node's GPUs, in ordinal order */
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
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
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
    node.cuda_version = (int)json_get_number(config, "cuda_version", 0);
    const char *gpus = json_find(config, "gpus");
    int have_gpus = gpus && *gpus == '[' && *skip_ws(gpus + 1) != ']';
    node.gpu_count = 0;
    /* The GPUs' UUIDs in order: every "uuid" key after "gpus" is one GPU's. */
    for (const char *u = gpus ? strstr(gpus, "\"uuid\"") : NULL; u && node.gpu_count < 16;
         u = strstr(u + 6, "\"uuid\""))
        if (json_get_string(u, "uuid", node.gpu_uuid[node.gpu_count], sizeof node.gpu_uuid[0]))
            node.gpu_count++;
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

/* The CUDA version the simulated driver supports: the node's own setting
 * (a CUDA 13.4+ driver, with custom storage), else its branch's. */
static int cuda_version(void) {
    if (node.cuda_version)
        return node.cuda_version;
    int m = node.major;
    return m >= 590 ? 13010 : m >= 580 ? 13000 : m >= 575 ? 12090
         : m >= 570 ? 12080 : m >= 560 ? 12060 : m >= 555 ? 12050 : 12040;
}

/* The node's driver version, read before cuInit when asked for it. */
static void load_version(void) {
    if (!node.initialised && !node.major && find_dir() == 0) {
        char path[PATH_MAX];
        node_path(path, sizeof path, "sim.json");
        char *config = slurp(path, 1 << 20);
        if (config && json_get_string(config, "driver_version", node.version, sizeof node.version))
            node.major = atoi(node.version);
        if (config)
            node.cuda_version = (int)json_get_number(config, "cuda_version", 0);
        free(config);
    }
}

EXPORT CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    load_version();
    *driverVersion = cuda_version();
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

/* ---- contexts, streams, pinned memory, copies (custom storage's caller) -- */

/* A retained primary context is a connection to the GPU service for its
 * device, as a real one is an open GPU context: the service lists the
 * caller as a process on that GPU, and its copies take turns on that GPU's
 * link with everyone else's. */
struct CUctx_st {
    int dev, refs, sock, ready;
    pthread_mutex_t io;
};

struct CUstream_st {
    struct CUctx_st *ctx;
    double until; /* CLOCK_MONOTONIC time the stream's queued copies end */
};

static struct CUctx_st contexts[16];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t stream_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread struct CUctx_st *current_ctx;

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void wait_until(double until) {
    sleep_s(until - now_mono());
}

/* One request on a context's service connection; its reply line, and the
 * descriptor that came with it when fd_out is given. */
static CUresult service_call(struct CUctx_st *ctx, const char *request, char *reply, size_t size,
                             int *fd_out) {
    int got_fd = -1;
    size_t n = 0, len = strlen(request), sent = 0;
    pthread_mutex_lock(&ctx->io);
    while (sent < len) {
        ssize_t w = send(ctx->sock, request + sent, len - sent, MSG_NOSIGNAL);
        if (w <= 0)
            break;
        sent += (size_t)w;
    }
    while (sent == len && n + 1 < size) {
        struct iovec iov = {reply + n, size - 1 - n};
        union {
            char buf[CMSG_SPACE(4 * sizeof(int))];
            struct cmsghdr align;
        } control;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t r = recvmsg(ctx->sock, &msg, MSG_CMSG_CLOEXEC);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (got_fd < 0)
                    got_fd = fd;
                else
                    close(fd);
            }
        }
        n += (size_t)r;
        if (reply[n - 1] == '\n')
            break;
    }
    pthread_mutex_unlock(&ctx->io);
    reply[n] = 0;
    CUresult rc = CUDA_SUCCESS;
    if (n == 0)
        rc = CUDA_ERROR_UNKNOWN;
    else if (!json_get_bool(reply, "ok")) {
        int code = (int)json_get_number(reply, "code", CUDA_ERROR_UNKNOWN);
        rc = code ? (CUresult)code : CUDA_ERROR_UNKNOWN;
    }
    if (rc == CUDA_SUCCESS && fd_out)
        *fd_out = got_fd;
    else if (got_fd >= 0)
        close(got_fd);
    return rc;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = node.gpu_count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= node.gpu_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= node.gpu_count)
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUctx_st *ctx = &contexts[dev];
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&ctx_lock);
    if (!ctx->ready) {
        pthread_mutex_init(&ctx->io, NULL);
        ctx->dev = dev;
        ctx->ready = 1;
    }
    if (ctx->refs == 0) {
        char path[PATH_MAX], request[256], reply[4096];
        node_path(path, sizeof path, "gpu.sock");
        ctx->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (ctx->sock < 0 || connect_path(ctx->sock, path) != 0) {
            rc = CUDA_ERROR_NO_DEVICE;
        } else {
            snprintf(request, sizeof request, "{\"op\": \"hello\", \"uuid\": \"%s\"}\n",
                     node.gpu_uuid[dev]);
            rc = service_call(ctx, request, reply, sizeof reply, NULL);
        }
        if (rc != CUDA_SUCCESS && ctx->sock >= 0)
            close(ctx->sock);
    }
    if (rc == CUDA_SUCCESS) {
        ctx->refs++;
        *pctx = ctx;
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= node.gpu_count)
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUctx_st *ctx = &contexts[dev];
    pthread_mutex_lock(&ctx_lock);
    CUresult rc = ctx->refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (ctx->refs > 0 && --ctx->refs == 0)
        close(ctx->sock); /* the service frees whatever the context held */
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    return cuDevicePrimaryCtxRelease_v2(dev);
}

static int live_context(const struct CUctx_st *ctx) {
    for (int i = 0; i < node.gpu_count; i++)
        if (ctx == &contexts[i])
            return ctx->refs > 0;
    return 0;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx && !live_context(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    if (!phStream || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!current_ctx || !live_context(current_ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->ctx = current_ctx;
    *phStream = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
    if (!hStream)
        return CUDA_ERROR_INVALID_HANDLE;
    wait_until(hStream->until); /* as the driver: queued work still completes */
    free(hStream);
    return CUDA_SUCCESS;
}

/* The legacy default stream of each context (hStream 0). */
static struct CUstream_st default_streams[16];

static struct CUstream_st *stream_of(CUstream hStream) {
    if (hStream)
        return hStream;
    if (!current_ctx || !live_context(current_ctx))
        return NULL;
    struct CUstream_st *s = &default_streams[current_ctx->dev];
    s->ctx = current_ctx;
    return s;
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUstream_st *s = stream_of(hStream);
    if (!s)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&stream_lock);
    double until = s->until;
    pthread_mutex_unlock(&stream_lock);
    wait_until(until);
    return CUDA_SUCCESS;
}

/* Page-locked host memory: page-aligned, known by its start for cuMemFreeHost. */
struct host_alloc {
    struct host_alloc *next;
    void *p;
    size_t size;
};
static struct host_alloc *host_allocs;
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;

EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    if (!pp || !bytesize || flags > 0xf)
        return CUDA_ERROR_INVALID_VALUE;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!current_ctx || !live_context(current_ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct host_alloc *a = malloc(sizeof *a);
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!a || p == MAP_FAILED) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->p = p;
    a->size = bytesize;
    pthread_mutex_lock(&host_lock);
    a->next = host_allocs;
    host_allocs = a;
    pthread_mutex_unlock(&host_lock);
    *pp = p;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&host_lock);
    struct host_alloc **at = &host_allocs;
    while (*at && (*at)->p != p)
        at = &(*at)->next;
    struct host_alloc *a = *at;
    if (a)
        *at = a->next;
    pthread_mutex_unlock(&host_lock);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    munmap(a->p, a->size);
    free(a);
    return CUDA_SUCCESS;
}

/* ---- custom storage (CUDA 13.4+) ----------------------------------------
 * The driver maps the target's device memory onto the caller's GPU: here
 * the GPU service gathers the target's allocations into one range (a memfd
 * it owns for the target) and hands it to the caller's context, which maps
 * it. Copies to and from the range are made at once and charged to the
 * GPU's link by the service; the stream is done when the link says so. The
 * simulated processes each use one GPU, so an operation has one range. */
struct CUIcheckpointOperation_st {
    struct CUIcheckpointOperation_st *next;
    int pid, restore;
    char token[64];
    struct CUctx_st *ctx;
    void *addr;
    size_t size;
    CUcheckpointCustomStorageInfo info;
    CUcheckpointCustomStoragePerDeviceData data[1];
};

static struct CUIcheckpointOperation_st *operations;
static pthread_rwlock_t ops_lock = PTHREAD_RWLOCK_INITIALIZER;

static long tgid_of(int pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    char *status = slurp(path, 16384);
    long tgid = status ? status_field(status, "\nTgid:", 0) : -1;
    free(status);
    return tgid;
}

static int device_of(const char *uuid) {
    for (int i = 0; i < node.gpu_count; i++)
        if (strcmp(node.gpu_uuid[i], uuid) == 0)
            return i;
    return -1;
}

/* Start a custom-storage checkpoint or restore: the target (on GPU `uuid`
 * once done) is asked with `request`, and its range mapped here. */
static CUresult storage_begin(int pid, int restore, const char *uuid, const char *request,
                              CUcheckpointCustomStorageInfo **out) {
    int dev = device_of(uuid);
    if (dev < 0 || !live_context(&contexts[dev]))
        return CUDA_ERROR_INVALID_CONTEXT; /* the caller must retain that GPU's context */
    struct CUctx_st *ctx = &contexts[dev];
    char reply[4096], token[64] = "", msg[256];
    CUresult rc = ask(pid, request, reply, sizeof reply);
    if (rc != CUDA_SUCCESS)
        return rc;
    json_get_string(reply, "token", token, sizeof token);
    size_t size = (size_t)json_get_number(reply, "size", 0);
    struct CUIcheckpointOperation_st *op = calloc(1, sizeof *op);
    struct CUstream_st *stream = calloc(1, sizeof *stream);
    int fd = -1;
    if (!op || !stream)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS && size) {
        snprintf(msg, sizeof msg, "{\"op\": \"map\", \"token\": \"%s\"}\n", token);
        rc = service_call(ctx, msg, reply, sizeof reply, &fd);
        if (rc == CUDA_SUCCESS && fd < 0)
            rc = CUDA_ERROR_UNKNOWN;
    }
    if (rc == CUDA_SUCCESS && size) {
        /* MAP_POPULATE: the range's pages are mapped here in one go, not
         * faulted in 4 KiB at a time by the copies - a GPU's mapping of
         * device memory costs the host no page faults, so the simulated
         * copies should not either (the link's time is the service's). */
        op->addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (op->addr == MAP_FAILED)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (fd >= 0)
        close(fd);
    if (rc != CUDA_SUCCESS) {
        /* Inside this one call: put the target back as it was. */
        snprintf(msg, sizeof msg, "{\"op\": \"storage-cancel\", \"token\": \"%s\"}\n", token);
        ask(pid, msg, reply, sizeof reply);
        free(op);
        free(stream);
        return rc;
    }
    op->pid = pid;
    op->restore = restore;
    snprintf(op->token, sizeof op->token, "%s", token);
    op->ctx = ctx;
    op->size = size;
    stream->ctx = ctx;
    op->data[0].devPtr = (CUdeviceptr)(uintptr_t)op->addr;
    op->data[0].size = size;
    op->data[0].stream = stream;
    op->info.handle = op;
    op->info.perDeviceData = size ? op->data : NULL;
    op->info.deviceCount = size ? 1 : 0;
    pthread_rwlock_wrlock(&ops_lock);
    op->next = operations;
    operations = op;
    pthread_rwlock_unlock(&ops_lock);
    *out = &op->info;
    return CUDA_SUCCESS;
}

/* The mapped range holding [ptr, ptr+n), or NULL; with ops_lock held. */
static struct CUIcheckpointOperation_st *range_of(CUdeviceptr ptr, size_t n) {
    for (struct CUIcheckpointOperation_st *op = operations; op; op = op->next) {
        CUdeviceptr start = (CUdeviceptr)(uintptr_t)op->addr;
        if (op->size && ptr >= start && n <= op->size && ptr - start <= op->size - n)
            return op;
    }
    return NULL;
}

static CUresult copy(void *host, CUdeviceptr dev, size_t n, CUstream hStream, int to_device) {
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!host && n)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = stream_of(hStream);
    if (!s)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_rwlock_rdlock(&ops_lock);
    struct CUIcheckpointOperation_st *op = range_of(dev, n);
    CUresult rc = op ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    /* One copy is one chunk of a custom-storage checkpoint (copy-out) or
     * restore (copy-in): `skip` picks the chunk a fault hits. */
    if (op)
        rc = inject_fault(op->pid, to_device ? "copy-in" : "copy-out");
    if (op && rc == CUDA_SUCCESS) {
        if (to_device)
            memcpy((void *)(uintptr_t)dev, host, n);
        else
            memcpy(host, (const void *)(uintptr_t)dev, n);
        /* The bytes cross that GPU's link: the service queues them there. */
        char request[128], reply[4096];
        snprintf(request, sizeof request, "{\"op\": \"link\", \"size\": %zu}\n", n);
        rc = service_call(op->ctx, request, reply, sizeof reply, NULL);
        if (rc == CUDA_SUCCESS) {
            double until = json_get_number(reply, "link_until", 0);
            pthread_mutex_lock(&stream_lock);
            if (until > s->until)
                s->until = until;
            pthread_mutex_unlock(&stream_lock);
        }
    }
    pthread_rwlock_unlock(&ops_lock);
    return rc;
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t n,
                                     CUstream hStream) {
    return copy(dstHost, srcDevice, n, hStream, 0);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t n,
                                     CUstream hStream) {
    return copy((void *)srcHost, dstDevice, n, hStream, 1);
}

EXPORT CUresult cuCheckpointOperationComplete(CUcheckpointOperationHandle handle) {
    if (cuda_version() < 13040)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (!node.initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_rwlock_wrlock(&ops_lock);
    struct CUIcheckpointOperation_st **at = &operations;
    while (*at && *at != handle)
        at = &(*at)->next;
    struct CUIcheckpointOperation_st *op = *at;
    if (op)
        *at = op->next;
    pthread_rwlock_unlock(&ops_lock);
    if (!op)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = inject_fault(op->pid, op->restore ? "restore-complete" : "checkpoint-complete");
    if (rc != CUDA_SUCCESS) { /* the operation stays open, as before the call */
        pthread_rwlock_wrlock(&ops_lock);
        op->next = operations;
        operations = op;
        pthread_rwlock_unlock(&ops_lock);
        return rc;
    }
    struct CUstream_st *stream = op->data[0].stream;
    pthread_mutex_lock(&stream_lock);
    double until = stream->until;
    pthread_mutex_unlock(&stream_lock);
    wait_until(until); /* the driver synchronises the operation's streams */
    if (op->addr)
        munmap(op->addr, op->size);
    char request[256], reply[4096];
    snprintf(request, sizeof request, "{\"op\": \"storage-complete\", \"token\": \"%s\"}\n",
             op->token);
    rc = ask(op->pid, request, reply, sizeof reply);
    free(stream);
    free(op);
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status);

/* The entry points cuGetProcAddress knows, with the CUDA version of each. */
static const struct entry {
    const char *name;
    void *fn;
    int since;
} entries[] = {
    {"cuInit", (void *)cuInit, 2000},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion, 2020},
    {"cuGetErrorName", (void *)cuGetErrorName, 6000},
    {"cuGetErrorString", (void *)cuGetErrorString, 6000},
    {"cuDeviceGet", (void *)cuDeviceGet, 2000},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount, 2000},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain, 7000},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2, 11000},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent, 4000},
    {"cuStreamCreate", (void *)cuStreamCreate, 2000},
    {"cuStreamDestroy", (void *)cuStreamDestroy_v2, 4000},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize, 2000},
    {"cuMemHostAlloc", (void *)cuMemHostAlloc, 2020},
    {"cuMemFreeHost", (void *)cuMemFreeHost, 2000},
    {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync_v2, 3020},
    {"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync_v2, 3020},
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2, 12000},
    {"cuCheckpointProcessGetState", (void *)cuCheckpointProcessGetState, 12080},
    {"cuCheckpointProcessGetRestoreThreadId", (void *)cuCheckpointProcessGetRestoreThreadId,
     12080},
    {"cuCheckpointProcessLock", (void *)cuCheckpointProcessLock, 12080},
    {"cuCheckpointProcessCheckpoint", (void *)cuCheckpointProcessCheckpoint, 12080},
    {"cuCheckpointProcessRestore", (void *)cuCheckpointProcessRestore, 12080},
    {"cuCheckpointProcessUnlock", (void *)cuCheckpointProcessUnlock, 12080},
    {"cuCheckpointOperationComplete", (void *)cuCheckpointOperationComplete, 13040},
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn || flags > 4)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    load_version(); /* callable before cuInit, as the runtime does */
    if (cudaVersion > cuda_version())
        return CUDA_ERROR_INVALID_VALUE; /* newer than this driver */
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        if (strcmp(entries[i].name, symbol) != 0 || entries[i].since > cuda_version())
            continue;
        if (cudaVersion < entries[i].since) {
            found = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        } else {
            *pfn = entries[i].fn;
            found = CU_GET_PROC_ADDRESS_SUCCESS;
        }
        break;
    }
    if (status)
        *status = found;
    return CUDA_SUCCESS;
}

/* ---- checkpoint and restore ---------------------------------------------- */

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    /* Before CUDA 13.4 the custom-storage pointer is reserved space: non-zero
     * there is an invalid argument, as the older driver sees it. */
    int storage = args && args->customStorageInfo_out && cuda_version() >= 13040;
    if (args && ((args->customStorageInfo_out && !storage) ||
                 !reserved_zero(args->reserved, sizeof args->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = begin(pid, "checkpoint");
    if (rc != CUDA_SUCCESS)
        return rc;
    char reply[4096];
    if (storage && tgid_of(pid) == (long)getpid())
        return CUDA_ERROR_NOT_SUPPORTED; /* not on the calling process itself */
    if (storage) {
        char gpu[64] = "";
        rc = ask(pid, "{\"op\": \"status\"}\n", reply, sizeof reply);
        if (rc != CUDA_SUCCESS)
            return rc;
        json_get_string(reply, "gpu", gpu, sizeof gpu);
        return storage_begin(pid, 0, gpu, "{\"op\": \"checkpoint\", \"storage\": true}\n",
                             args->customStorageInfo_out);
    }
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
    int storage = args && args->customStorageInfo_out && cuda_version() >= 13040;
    if (args && ((args->customStorageInfo_out && !storage) || args->padding0 ||
                 !reserved_zero(args->reserved, sizeof args->reserved)))
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
    char request[8192], reply[4096], gpu[64] = "";
    if (storage && tgid_of(pid) == (long)getpid())
        return CUDA_ERROR_NOT_SUPPORTED;
    if (storage) { /* the GPU it will be on: its own, or where the map sends it */
        rc = ask(pid, "{\"op\": \"status\"}\n", reply, sizeof reply);
        if (rc != CUDA_SUCCESS)
            return rc;
        json_get_string(reply, "gpu", gpu, sizeof gpu);
    }
    int n = snprintf(request, sizeof request, "{\"op\": \"restore\"%s%s",
                     node.transient && !storage ? ", \"transient\": true" : "",
                     storage ? ", \"storage\": true" : "");
    if (pairs) {
        n += snprintf(request + n, sizeof request - n, ", \"device_map\": {");
        for (unsigned int i = 0; i < pairs; i++) {
            char old[48], new[48];
            format_uuid(&args->gpuPairs[i].oldUuid, old);
            format_uuid(&args->gpuPairs[i].newUuid, new);
            n += snprintf(request + n, sizeof request - n, "%s\"%s\": \"%s\"", i ? ", " : "",
                          old, new);
            if (storage && strcmp(old, gpu) == 0)
                snprintf(gpu, sizeof gpu, "%s", new);
        }
        n += snprintf(request + n, sizeof request - n, "}");
    }
    snprintf(request + n, sizeof request - n, "}\n");
    if (storage)
        return storage_begin(pid, 1, gpu, request, args->customStorageInfo_out);
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
