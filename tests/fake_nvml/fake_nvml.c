/*
 * A stand-in for libnvidia-ml.so.1, so the GPU gate is tested through the
 * real pynvml and its real ctypes calls on a machine without a GPU.
 *
 * It exports exactly the entry points pynvml resolves for the calls the gate
 * makes (pynvml 12/13 names: nvmlInitWithFlags, nvmlDeviceGetCount_v2,
 * nvmlDeviceGetHandleByIndex_v2, the unversioned nvmlDeviceGetMemoryInfo, ...).
 * A call the gate starts making without the fake growing the symbol shows up
 * as NVML_ERROR_FUNCTION_NOT_FOUND in the tests instead of passing silently.
 *
 * Behaviour comes from a text file named by $FAKE_NVML_CONFIG, read at every
 * nvmlInitWithFlags that takes the reference count from 0 to 1, so one
 * compiled library serves every test (and a process that has it loaded can be
 * pointed at another box by changing the variable between init/shutdown
 * pairs). One directive a line, '#' starts a comment:
 *
 *   init_error CODE           nvmlInitWithFlags returns CODE
 *   count_error CODE          nvmlDeviceGetCount_v2 returns CODE
 *   count N                   devices reported (default: highest "dev" index + 1)
 *   driver VERSION            nvmlSystemGetDriverVersion  (default 570.86.15)
 *   driver_error CODE
 *   cuda N                    nvmlSystemGetCudaDriverVersion, e.g. 12080 for 12.8
 *   cuda_error CODE
 *   log PATH                  append "init <rc>" / "shutdown <rc>" lines here
 *   dev I name TEXT...        the rest of the line is the name
 *   dev I uuid GPU-...
 *   dev I cc MAJOR MINOR
 *   dev I mem BYTES
 *   dev I fail CODE [QUERY]   QUERY: all (default) handle name uuid cc mem mig
 *                             remap pages ecc fabric fabricv compute
 *   dev I mig MIG-...         MIG mode on, one more MIG device with this UUID
 *
 * Health (what the gate reads beyond presence; each query answers as a
 * healthy card does unless told otherwise, and `fail 3 QUERY` makes it
 * NVML_ERROR_NOT_SUPPORTED, as many parts answer):
 *
 *   dev I remap CORR UNC PENDING FAILURE   nvmlDeviceGetRemappedRows (default 0 0 0 0)
 *   dev I pages_pending 0|1                nvmlDeviceGetRetiredPagesPendingStatus
 *   dev I ecc_volatile_unc N               nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)
 *   dev I compute MODE                     nvmlDeviceGetComputeMode (0 Default, 2 Prohibited, 3 ExclusiveProcess)
 *   dev I fabric STATE STATUS              nvmlDeviceGetGpuFabricInfo / ...InfoV: state (0 not supported,
 *                                          1 not started, 2 in progress, 3 completed) and status (an NVML
 *                                          return code). Without it both answer NOT_SUPPORTED, as every
 *                                          part before Hopper does.
 *
 * $FAKE_NVML_HANG=FUNCTION: that exported function blocks forever (see
 * hang_if_asked), logging "hang FUNCTION PID" first.
 *
 * Without $FAKE_NVML_CONFIG, nvmlInitWithFlags answers
 * NVML_ERROR_LIBRARY_NOT_FOUND: a test process that once preloaded the fake
 * behaves, for every test that did not ask for a box, like a machine with no
 * driver, which is what this machine is.
 *
 * Like the real library, every device call before a successful init (or
 * after the matching shutdown) is NVML_ERROR_UNINITIALIZED, so a gate that
 * forgets the init/shutdown protocol fails here.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

enum { Q_HANDLE, Q_NAME, Q_UUID, Q_CC, Q_MEM, Q_MIG, Q_REMAP, Q_PAGES, Q_ECC, Q_FABRIC, Q_FABRICV, Q_COMPUTE, Q_COUNT };

/* The health calls' types, as nvml.h declares them. */
typedef enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 } nvmlEnableState_t;
typedef enum { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 } nvmlMemoryErrorType_t;
typedef enum { NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1 } nvmlEccCounterType_t;
typedef enum {
    NVML_COMPUTEMODE_DEFAULT = 0,
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1,
    NVML_COMPUTEMODE_PROHIBITED = 2,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3,
} nvmlComputeMode_t;

#define NVML_GPU_FABRIC_UUID_LEN 16
/* One byte in nvml.h; pynvml declares it c_uint, which reads the three
 * padding bytes after it too (see fill_fabric). */
typedef unsigned char nvmlGpuFabricState_t;

typedef struct {
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;

/* NVML_STRUCT_VERSION(GpuFabricInfo, v): the size in the low bits, the version in the top byte. */
#define nvmlGpuFabricInfo_v2 (unsigned int)(sizeof(nvmlGpuFabricInfo_v2_t) | (2U << 24U))
#define nvmlGpuFabricInfo_v3 (unsigned int)(sizeof(nvmlGpuFabricInfo_v3_t) | (3U << 24U))

#define MAX_DEVICES 16
#define MAX_MIG 7
#define TEXT 96

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

struct nvmlDevice_st {
    int is_mig;
    int index;            /* physical index; for a MIG device, its parent's */
    char name[TEXT];
    char uuid[TEXT];
    int cc_major, cc_minor;
    unsigned long long memory;
    nvmlReturn_t fail[Q_COUNT];
    unsigned int remap_corr, remap_unc, remap_pending, remap_failure;
    int pages_pending;
    unsigned long long ecc_volatile_unc;
    int compute_mode;
    int has_fabric;
    unsigned int fabric_state;
    nvmlReturn_t fabric_status;
    int mig_count;
    struct nvmlDevice_st *mig[MAX_MIG];
};

typedef struct nvmlDevice_st *nvmlDevice_t;

static struct nvmlDevice_st devices[MAX_DEVICES];
static struct nvmlDevice_st mig_devices[MAX_DEVICES * MAX_MIG];
static int mig_used;
static unsigned device_count;
static nvmlReturn_t init_error, count_error, driver_error, cuda_error;
static char driver_version[TEXT];
static int cuda_version;
static char log_path[512];
static int refcount;

static void log_line(const char *what, nvmlReturn_t rc)
{
    if (!log_path[0])
        return;
    FILE *f = fopen(log_path, "a");
    if (!f)
        return;
    fprintf(f, "%s %d\n", what, rc);
    fclose(f);
}

static int query_of(const char *word)
{
    static const char *names[Q_COUNT] = {"handle", "name", "uuid", "cc", "mem", "mig",
                                         "remap", "pages", "ecc", "fabric", "fabricv", "compute"};
    for (int q = 0; q < Q_COUNT; q++)
        if (strcmp(word, names[q]) == 0)
            return q;
    return -1; /* "all" or anything else */
}

static void reset(void)
{
    memset(devices, 0, sizeof devices);
    memset(mig_devices, 0, sizeof mig_devices);
    mig_used = 0;
    device_count = 0;
    init_error = count_error = driver_error = cuda_error = NVML_SUCCESS;
    snprintf(driver_version, sizeof driver_version, "570.86.15");
    cuda_version = 12080;
    log_path[0] = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        struct nvmlDevice_st *d = &devices[i];
        d->index = i;
        snprintf(d->name, sizeof d->name, "Fake GPU %d", i);
        snprintf(d->uuid, sizeof d->uuid, "GPU-fa4e0000-0000-0000-0000-%012d", i);
        d->cc_major = 8;
        d->cc_minor = 6;
        d->memory = 24ULL << 30;
    }
}

static void trim(char *s)
{
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = 0;
}

/* Returns NVML_SUCCESS, or the error the test asked init to fail with. */
static nvmlReturn_t load_config(void)
{
    reset();
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (!path || !*path)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fake_nvml: cannot open FAKE_NVML_CONFIG=%s\n", path);
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    }
    char line[1024];
    int explicit_count = -1;
    unsigned highest = 0;
    while (fgets(line, sizeof line, f)) {
        trim(line);
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char key[32] = {0};
        int used = 0;
        if (sscanf(line, "%31s %n", key, &used) < 1)
            continue;
        char *rest = line + used;
        if (strcmp(key, "init_error") == 0)
            init_error = atoi(rest);
        else if (strcmp(key, "count_error") == 0)
            count_error = atoi(rest);
        else if (strcmp(key, "count") == 0)
            explicit_count = atoi(rest);
        else if (strcmp(key, "driver") == 0)
            snprintf(driver_version, sizeof driver_version, "%s", rest);
        else if (strcmp(key, "driver_error") == 0)
            driver_error = atoi(rest);
        else if (strcmp(key, "cuda") == 0)
            cuda_version = atoi(rest);
        else if (strcmp(key, "cuda_error") == 0)
            cuda_error = atoi(rest);
        else if (strcmp(key, "log") == 0)
            snprintf(log_path, sizeof log_path, "%s", rest);
        else if (strcmp(key, "dev") == 0) {
            int index = -1, n = 0;
            char field[32] = {0};
            if (sscanf(rest, "%d %31s %n", &index, field, &n) < 2 || index < 0 || index >= MAX_DEVICES) {
                fprintf(stderr, "fake_nvml: bad line: %s\n", line);
                continue;
            }
            struct nvmlDevice_st *d = &devices[index];
            char *value = rest + n;
            if ((unsigned)index + 1 > highest)
                highest = (unsigned)index + 1;
            if (strcmp(field, "name") == 0)
                snprintf(d->name, sizeof d->name, "%s", value);
            else if (strcmp(field, "uuid") == 0)
                snprintf(d->uuid, sizeof d->uuid, "%s", value);
            else if (strcmp(field, "cc") == 0)
                sscanf(value, "%d %d", &d->cc_major, &d->cc_minor);
            else if (strcmp(field, "mem") == 0)
                d->memory = strtoull(value, NULL, 10);
            else if (strcmp(field, "remap") == 0)
                sscanf(value, "%u %u %u %u", &d->remap_corr, &d->remap_unc, &d->remap_pending, &d->remap_failure);
            else if (strcmp(field, "pages_pending") == 0)
                d->pages_pending = atoi(value);
            else if (strcmp(field, "ecc_volatile_unc") == 0)
                d->ecc_volatile_unc = strtoull(value, NULL, 10);
            else if (strcmp(field, "compute") == 0)
                d->compute_mode = atoi(value);
            else if (strcmp(field, "fabric") == 0) {
                d->has_fabric = 1;
                sscanf(value, "%u %d", &d->fabric_state, &d->fabric_status);
            }
            else if (strcmp(field, "fail") == 0) {
                int code = 0;
                char which[16] = "all";
                sscanf(value, "%d %15s", &code, which);
                int q = query_of(which);
                for (int k = 0; k < Q_COUNT; k++)
                    if (q < 0 || q == k)
                        d->fail[k] = code;
            } else if (strcmp(field, "mig") == 0 && d->mig_count < MAX_MIG) {
                struct nvmlDevice_st *m = &mig_devices[mig_used++];
                m->is_mig = 1;
                m->index = index;
                snprintf(m->uuid, sizeof m->uuid, "%s", value);
                snprintf(m->name, sizeof m->name, "%s MIG", d->name);
                d->mig[d->mig_count++] = m;
            } else
                fprintf(stderr, "fake_nvml: bad line: %s\n", line);
        } else
            fprintf(stderr, "fake_nvml: bad line: %s\n", line);
    }
    fclose(f);
    device_count = explicit_count >= 0 ? (unsigned)explicit_count : highest;
    if (device_count > MAX_DEVICES)
        device_count = MAX_DEVICES;
    return init_error;
}

/* $FAKE_NVML_HANG names an exported function (nvmlInitWithFlags,
 * nvmlDeviceGetHandleByIndex_v2, ...) that then never returns, as a call into
 * a driver whose card fell off the bus can block for good. It logs
 * "hang <function> <pid>" first, so a test can tell the call was reached and
 * prove the blocked process is gone afterwards. The variable is read at each
 * call, not from the config: the hang must hold whichever call comes first. */
static void hang_if_asked(const char *function)
{
    const char *wanted = getenv("FAKE_NVML_HANG");
    if (!wanted || strcmp(wanted, function) != 0)
        return;
    char what[160];
    snprintf(what, sizeof what, "hang %s", function);
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path && *path && !log_path[0]) {
        /* init has not read the config yet: find the log line in it. */
        FILE *f = fopen(path, "r");
        char line[sizeof log_path];
        while (f && fgets(line, sizeof line, f))
            if (strncmp(line, "log ", 4) == 0) {
                trim(line);
                snprintf(log_path, sizeof log_path, "%s", line + 4);
            }
        if (f)
            fclose(f);
    }
    log_line(what, (int)getpid());
    for (;;)
        pause();
}

static int is_device(nvmlDevice_t d)
{
    if (d >= devices && d < devices + device_count)
        return 1;
    return d >= mig_devices && d < mig_devices + mig_used;
}

/* The checks every device query shares: initialised, a handle we gave out,
 * and the failure the test scripted for this query. */
static nvmlReturn_t device_call(nvmlDevice_t d, int query)
{
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_device(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig)
        return devices[d->index].fail[query];
    return d->fail[query];
}

static nvmlReturn_t copy_text(char *out, unsigned length, const char *text)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    hang_if_asked(__func__);
    (void)flags;
    nvmlReturn_t rc = NVML_SUCCESS;
    if (refcount == 0)
        rc = load_config();
    if (rc == NVML_SUCCESS)
        refcount++;
    log_line("init", rc);
    return rc;
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (refcount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        refcount--;
    log_line("shutdown", rc);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    hang_if_asked(__func__);
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    case 27: return "System is not ready";
    case 999: return "Unknown Error";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    hang_if_asked(__func__);
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (driver_error)
        return driver_error;
    return copy_text(version, length, driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    hang_if_asked(__func__);
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (cuda_error)
        return cuda_error;
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    hang_if_asked(__func__);
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (count_error)
        return count_error;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    hang_if_asked(__func__);
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= device_count || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (devices[index].fail[Q_HANDLE])
        return devices[index].fail[Q_HANDLE];
    *device = &devices[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_NAME);
    return rc ? rc : copy_text(name, length, device->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_UUID);
    return rc ? rc : copy_text(uuid, length, device->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_CC);
    if (rc)
        return rc;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct nvmlDevice_st *d = device->is_mig ? &devices[device->index] : device;
    *major = d->cc_major;
    *minor = d->cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_MEM);
    if (rc)
        return rc;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = device->memory;
    memory->used = device->memory / 100;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* MIG-capable parts answer these; a card the test gave no MIG devices is an
 * older part, which the real library answers with NOT_SUPPORTED. */
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_MIG);
    if (rc)
        return rc;
    if (device->is_mig || device->mig_count == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_MIG);
    if (rc)
        return rc;
    if (device->is_mig || device->mig_count == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = MAX_MIG;
    return NVML_SUCCESS;
}

/* Slots past the configured instances are empty, as on a card where only
 * some of the seven possible instances were created: NOT_FOUND. */
EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_MIG);
    if (rc)
        return rc;
    if (device->is_mig || device->mig_count == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!mig || index >= MAX_MIG)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= (unsigned)device->mig_count)
        return NVML_ERROR_NOT_FOUND;
    *mig = device->mig[index];
    return NVML_SUCCESS;
}

/* Health. Every call answers for the physical card only: the gate asks
 * about cards, never about MIG instances. */

static nvmlReturn_t card_call(nvmlDevice_t device, int query)
{
    nvmlReturn_t rc = device_call(device, query);
    if (rc)
        return rc;
    return device->is_mig ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = card_call(device, Q_REMAP);
    if (rc)
        return rc;
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    *corrRows = device->remap_corr;
    *uncRows = device->remap_unc;
    *isPending = device->remap_pending;
    *failureOccurred = device->remap_failure;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = card_call(device, Q_PAGES);
    if (rc)
        return rc;
    if (!isPending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isPending = device->pages_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

/* The aggregate counter includes the volatile one (it survives reboots);
 * corrected errors are none here: the gate does not read them. */
EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = card_call(device, Q_ECC);
    if (rc)
        return rc;
    if (!eccCounts || (unsigned)errorType > NVML_MEMORY_ERROR_TYPE_UNCORRECTED ||
        (unsigned)counterType > NVML_AGGREGATE_ECC)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? device->ecc_volatile_unc : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = card_call(device, Q_COMPUTE);
    if (rc)
        return rc;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (nvmlComputeMode_t)device->compute_mode;
    return NVML_SUCCESS;
}

/* The fields every version shares, written at their own offsets. The three
 * bytes after `state` are padding in nvml.h, and nothing obliges a driver to
 * zero them; pynvml reads `state` as a c_uint that spans them, so the fake
 * leaves them dirty and the gate must read only the low byte. */
static void fill_fabric(const struct nvmlDevice_st *d, unsigned char *uuid, nvmlReturn_t *status,
                        unsigned int *clique, nvmlGpuFabricState_t *state)
{
    for (int i = 0; i < NVML_GPU_FABRIC_UUID_LEN; i++)
        uuid[i] = (unsigned char)(0xc0 + i);
    *status = d->fabric_status;
    *clique = d->fabric_state == 3 ? 1 : 0;
    *state = (nvmlGpuFabricState_t)d->fabric_state;
    memset((unsigned char *)state + 1, 0xa5, 3);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = card_call(device, Q_FABRIC);
    if (rc)
        return rc;
    if (!device->has_fabric)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_fabric(device, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    return NVML_SUCCESS;
}

/* The versioned call reads the caller's `version` first, as NVML does: a
 * struct version this library does not know is ARGUMENT_VERSION_MISMATCH. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v3_t *info)
{
    hang_if_asked(__func__);
    nvmlReturn_t rc = device_call(device, Q_FABRICV);
    if (rc)
        return rc;
    rc = card_call(device, Q_FABRIC);
    if (rc)
        return rc;
    if (!device->has_fabric)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuFabricInfo_v2 && info->version != nvmlGpuFabricInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fill_fabric(device, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    info->healthMask = 0;
    if (info->version == nvmlGpuFabricInfo_v3)
        info->healthSummary = 0;
    return NVML_SUCCESS;
}
