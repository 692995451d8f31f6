/* nccl_api.h - the types of NCCL's C interface (NCCL 2.2x) as the shim needs
 * them: the same sizes and values, so that a program compiled against nccl.h
 * calls the shim unchanged.  Structures the shim only passes on (the config,
 * the simulation info) stay opaque. */
#ifndef KCCL_NCCL_API_H_
#define KCCL_NCCL_API_H_
#include <stddef.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;
typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef struct ncclComm *ncclComm_t;
typedef struct ncclWindow *ncclWindow_t;
typedef struct ncclConfig_opaque ncclConfig_t;   /* passed by pointer only */
typedef struct ncclSimInfo_opaque ncclSimInfo_t; /* passed by pointer only */
typedef struct CUstream_st *cudaStream_t;

#endif
