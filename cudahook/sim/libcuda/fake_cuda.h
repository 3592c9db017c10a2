/*
 * The parts of cuda.h (CUDA 13.5) that the fake libcuda.so.1 implements,
 * re-typed from the header's declarations: the checkpoint group, with the
 * custom-storage path of CUDA 13.4+, and the few context, stream, memory and
 * copy calls a custom-storage caller needs. tests/test_cuda_abi.py compares
 * every struct's size and field offsets here with the real header's.
 */
#ifndef CUDAHOOK_FAKE_CUDA_H
#define CUDAHOOK_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef enum CUdriverProcAddressQueryResult_enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

typedef enum CUprocessState_enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
    CU_PROCESS_STATE_CHECKPOINTING = 4, /* CUDA 13.4+ */
    CU_PROCESS_STATE_RESTORING = 5      /* CUDA 13.4+ */
} CUprocessState;

/* Custom storage (CUDA 13.4+): one mapped device range per GPU. */
typedef struct CUcheckpointCustomStoragePerDeviceData_st {
    CUdeviceptr devPtr;
    size_t size;
    CUstream stream;
} CUcheckpointCustomStoragePerDeviceData;

typedef struct CUIcheckpointOperation_st *CUcheckpointOperationHandle;

typedef struct CUcheckpointCustomStorageInfo_st {
    CUcheckpointOperationHandle handle;
    CUcheckpointCustomStoragePerDeviceData *perDeviceData;
    unsigned int deviceCount;
} CUcheckpointCustomStorageInfo;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
    CUcheckpointCustomStorageInfo **customStorageInfo_out; /* NULL: to host memory */
    char reserved[56];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    unsigned int padding0;
    CUcheckpointCustomStorageInfo **customStorageInfo_out; /* NULL: from host memory */
    char reserved[40];
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "cuda.h layout");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "cuda.h layout");

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointOperationComplete(CUcheckpointOperationHandle handle);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);

#endif
