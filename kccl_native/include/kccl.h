/*
 * kccl.h - the one public C header of KCCL, a low-latency collective library.
 *
 * The shape follows NCCL: opaque communicator handles, a 128-byte POD unique
 * id that the caller distributes, every call returns a kcclResult_t, result
 * codes and data-type / op enums carry NCCL's numeric values, and a
 * collective is in place when sendbuff == recvbuff.
 *
 * Host transport (the default, no GPU): every rank maps every peer's POSIX
 * shared-memory segment; collectives block the calling thread until the
 * result is in recvbuff.  Pass stream = NULL.
 *
 * GPU transport (config.device >= 0): every rank maps every peer's device
 * buffer (CUDA IPC); collectives take device buffers and a cudaStream_t
 * (NULL = the legacy default stream), return as soon as the work is enqueued,
 * never synchronize with the host, and can be captured in a CUDA graph.  An
 * error found on the GPU (a peer that died, aborted or called something else;
 * a timeout) is returned by the next call and by kcclCommGetAsyncError.
 * Several ranks may share one GPU (run them under MPS so that their kernels
 * are resident together).
 *
 * Thread safety: a communicator may be used by one thread at a time.
 * kcclGetLastError() returns the calling thread's last error text.
 */
#ifndef KCCL_H_
#define KCCL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KCCL_MAJOR 0
#define KCCL_MINOR 1
#define KCCL_PATCH 0
#define KCCL_VERSION_CODE (KCCL_MAJOR * 10000 + KCCL_MINOR * 100 + KCCL_PATCH)

#define KCCL_UNIQUE_ID_BYTES 128

typedef struct kcclComm *kcclComm_t;

/* Plain old data: copy it, send it, write it to a file. */
typedef struct {
  char internal[KCCL_UNIQUE_ID_BYTES];
} kcclUniqueId;

/* Numeric values 0..7 are NCCL's; kcclTimeout is KCCL's addition. */
typedef enum {
  kcclSuccess = 0,
  kcclUnhandledCudaError = 1,
  kcclSystemError = 2,
  kcclInternalError = 3,
  kcclInvalidArgument = 4,
  kcclInvalidUsage = 5,
  kcclRemoteError = 6, /* a peer died, aborted, or called a different collective */
  kcclInProgress = 7,
  kcclTimeout = 8,     /* a wait ran past KCCL_TIMEOUT_MS */
  kcclNumResults = 9
} kcclResult_t;

/* NCCL's numbering. */
typedef enum {
  kcclInt8 = 0,
  kcclUint8 = 1,
  kcclInt32 = 2,
  kcclUint32 = 3,
  kcclInt64 = 4,
  kcclUint64 = 5,
  kcclFloat16 = 6,
  kcclFloat32 = 7,
  kcclFloat64 = 8,
  kcclBfloat16 = 9,
  kcclNumTypes = 10
} kcclDataType_t;

typedef enum {
  kcclSum = 0,
  kcclProd = 1,
  kcclMax = 2,
  kcclMin = 3,
  kcclAvg = 4,
  kcclNumOps = 5
} kcclRedOp_t;

/* Algorithm choice for all-reduce. */
typedef enum { kcclAlgoAuto = 0, kcclAlgoOneShot = 1, kcclAlgoTwoShot = 2 } kcclAlgo_t;

/*
 * Per-communicator settings.  kcclConfigInit() fills the built-in defaults and
 * then applies the KCCL_* environment variables.  Every setting's variable,
 * default, range and meaning is listed in kccl_settings.def, next to this
 * header (`python -m kccl.config` prints them); kcclCommInitRankConfig refuses
 * a config with a value outside its range.
 */
typedef struct {
  size_t size;             /* sizeof(kcclConfig_t), checked for ABI safety */
  int timeout_ms;          /* KCCL_TIMEOUT_MS: bound on any wait of a collective; 0 = wait forever */
  int algo;                /* KCCL_ALGO: kcclAlgo_t */
  size_t oneshot_max_bytes;/* KCCL_ONESHOT_MAX_BYTES: all-reduce crossover */
  size_t buffer_bytes;     /* KCCL_BUFFER_BYTES: bytes per slot */
  int spin_us;             /* KCCL_SPIN_US: busy-poll time before yielding; -1 = auto */
  int yield_us;            /* KCCL_YIELD_US: sched_yield phase before futex sleep; -1 = auto */
  int debug;               /* KCCL_DEBUG: 0 none, 1 warn, 2 info, 3 trace */
  /* GPU transport (built when nvcc was found; see kcclGetGpuSupport). */
  int device;              /* -1 (default): host transport; >= 0: CUDA device of this rank */
  size_t gpu_oneshot_max_bytes; /* KCCL_GPU_ONESHOT_MAX_BYTES: GPU all-reduce crossover */
  size_t gpu_buffer_bytes; /* KCCL_GPU_BUFFER_BYTES: two-shot / gather chunk on the GPU */
  int gpu_pdl;             /* KCCL_GPU_PDL: 1 = programmatic dependent launch (Hopper) */
  int gpu_flag_replicas;   /* KCCL_GPU_FLAG_REPLICAS: 1 = a copy of each chunked-path flag per L2
                              partition (calibrated at init; see kcclCommGpuFlagReplicas) */
  int max_outstanding;     /* KCCL_MAX_OUTSTANDING: kcclAllReduceStart ops in flight, 1..8 */
  int gpu_blocks;          /* KCCL_GPU_BLOCKS: blocks per rank of the chunked GPU kernels; 0 = auto */
  int gpu_pull;            /* KCCL_GPU_PULL: one-shot lines pulled from the sender (1) or pushed to
                              every peer (0); -1 = auto: pull when every rank shares one GPU */
  int gpu_carveout;        /* KCCL_GPU_CARVEOUT: shared-memory carveout (percent) the collective kernels
                              ask for; -1 = the driver's choice; default 100 (see gpu_launch.cu) */
  int gpu_ll_threads;      /* KCCL_GPU_LL_THREADS: threads per block of the one-shot all-reduce (one
                              8-byte line each per round), 32..256, a multiple of 32; default 256 */
  int gpu_ll_hops;         /* KCCL_GPU_LL_HOPS: a one-shot call of one line per thread in one hop (1: every
                              rank reads every line) or two (2: reduce-scatter, then all-gather, both in
                              LL lines); 0 = auto: 1 (gpu_runtime.cu) */
  int gpu_chunk_threads;   /* KCCL_GPU_CHUNK_THREADS: threads per block of the chunked GPU kernels, a
                              multiple of 32 up to 768; 0 = auto (gpu_runtime.cu) */
  size_t chunk_bytes;      /* KCCL_CHUNK_BYTES: bytes per rank per step of the blocking host collectives'
                              large messages (at most buffer_bytes) */
  int slot_stores;         /* KCCL_SLOT_STORES: 0 auto, 1 plain, 2 streaming stores into this rank's
                              shared slots */
  int init_timeout_ms;     /* KCCL_INIT_TIMEOUT_MS: bound on joining the communicator; 0 = wait forever */
  size_t p2p_bytes;        /* KCCL_P2P_BYTES: shared-memory bytes per peer for point-to-point */
} kcclConfig_t;

kcclResult_t kcclConfigInit(kcclConfig_t *config);

/* The settings of kccl_settings.def for code that takes them from elsewhere than the
 * environment (kccl/config.py, libkccl_nccl.so), by the rules kcclConfigInit applies:
 * kcclSettingParse reads `value` as setting `name` ("KCCL_TIMEOUT_MS") into *out (an
 * integer; a choice's index; a path leaves *out alone, as does a NULL or blank value);
 * kcclInvalidArgument naming both for an unknown name or a bad value.
 * kcclSettingClosest: the known name nearest to `name` (itself when known; NULL when
 * none is close).  kcclSettingsWarnUnknown: the first call of a process prints one
 * line on stderr naming every KCCL_* variable that is no setting (nothing on ranks
 * other than 0 where the launcher sets PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK,
 * SLURM_PROCID or RANK) and returns how many there are; kcclConfigInit calls it. */
kcclResult_t kcclSettingParse(const char *name, const char *value, long long *out);
const char *kcclSettingClosest(const char *name);
int kcclSettingsWarnUnknown(void);

kcclResult_t kcclGetVersion(int *version);
kcclResult_t kcclGetUniqueId(kcclUniqueId *uniqueId);
/* *key: equal on the processes that can share a KCCL communicator (same kernel boot,
 * /dev/shm and pid namespace: a unique id made on another key is refused); 0 when
 * this process cannot tell (then nothing is checked). */
kcclResult_t kcclGetMachineKey(uint64_t *key);

/* Collective over nranks processes of one host; blocks until all have joined
 * or KCCL_TIMEOUT_MS passes. */
kcclResult_t kcclCommInitRank(kcclComm_t *comm, int nranks, kcclUniqueId commId, int rank);
kcclResult_t kcclCommInitRankConfig(kcclComm_t *comm, int nranks, kcclUniqueId commId, int rank,
                                    const kcclConfig_t *config);
/* Releases the communicator; peers still waiting on this rank get kcclRemoteError. */
kcclResult_t kcclCommDestroy(kcclComm_t comm);
/* Local and immediate: marks this rank aborted (peers blocked in a collective
 * return kcclRemoteError) and releases the communicator. */
kcclResult_t kcclCommAbort(kcclComm_t comm);
kcclResult_t kcclCommCount(const kcclComm_t comm, int *count);
kcclResult_t kcclCommUserRank(const kcclComm_t comm, int *rank);
/* kcclSuccess while usable; otherwise the error that broke it. */
kcclResult_t kcclCommGetAsyncError(kcclComm_t comm, kcclResult_t *asyncError);
/* The calling rank's next blocking collective on comm will wait long (for a peer busy
 * elsewhere, e.g. in a network leg): its waits skip the spin and sched_yield phases and
 * sleep on the futex at once, leaving the core to the ranks doing the work.  Applies to
 * that one collective, then the waits are as KCCL_SPIN_US / KCCL_YIELD_US say again. */
kcclResult_t kcclCommExpectLongWait(kcclComm_t comm);

kcclResult_t kcclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           kcclDataType_t datatype, kcclRedOp_t op, kcclComm_t comm, void *stream);
/* recvbuff holds nranks * sendcount elements; in place when sendbuff == recvbuff + rank*sendcount. */
kcclResult_t kcclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           kcclDataType_t datatype, kcclComm_t comm, void *stream);
/* sendbuff holds nranks * recvcount elements; in place when recvbuff == sendbuff + rank*recvcount. */
kcclResult_t kcclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               kcclDataType_t datatype, kcclRedOp_t op, kcclComm_t comm,
                               void *stream);
/* sendbuff is read on root only. */
kcclResult_t kcclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           kcclDataType_t datatype, int root, kcclComm_t comm, void *stream);
kcclResult_t kcclBarrier(kcclComm_t comm, void *stream);

const char *kcclGetErrorString(kcclResult_t result);
/* The calling thread's last error detail (comm may be NULL). */
const char *kcclGetLastError(kcclComm_t comm);

/* GPU transport. *built = 1 when this library was compiled with CUDA;
 * *devices = CUDA devices this process sees (0 without a driver or GPU). */
kcclResult_t kcclGetGpuSupport(int *built, int *devices);
/* The CUDA device of a GPU communicator, -1 for a host one (as ncclCommCuDevice). */
kcclResult_t kcclCommCuDevice(const kcclComm_t comm, int *device);
/* Fills a kcclDevComm (kccl_device.cuh) for kernels that call the device API;
 * bytes = sizeof(kcclDevComm) = KCCL_DEV_COMM_BYTES, checked. */
#define KCCL_DEV_COMM_BYTES 200
kcclResult_t kcclCommGetDevComm(kcclComm_t comm, void *devComm, size_t bytes);
/* Per-L2-partition flag replicas of a GPU communicator (KCCL_GPU_FLAG_REPLICAS):
 * *state = 1 in use (every rank's calibration found two L2 groups), 0 not asked
 * for, -1 asked for but disabled; note (noteBytes, may be NULL/0) says why, or
 * what this rank's calibration found.  kcclInvalidUsage for a host communicator. */
kcclResult_t kcclCommGpuFlagReplicas(const kcclComm_t comm, int *state, char *note, size_t noteBytes);

/*
 * Topology-aware placement (the host transport).  The caller (Python's
 * topology/ package: kccl.Communicator does it) says how many cache domains
 * (L3 x NUMA node) the machine has and which one this rank runs in.  When the
 * ranks span several domains every flag and small-message slot gets one
 * replica per domain: a writer writes every replica (the remote ones with
 * non-temporal stores, so the line lands in the replica's home node instead of
 * staying in the writer's cache), a reader polls its own domain's.  Replica
 * pages are bound to their domain's NUMA node (mbind) and the binding is
 * checked with move_pages.  kcclCommInitRankConfig means one copy of each.
 */
#define KCCL_MAX_DOMAINS 64

typedef struct {
  size_t size;                   /* sizeof(kcclPlacement_t) */
  int ndomains;                  /* domains of the machine; 0 or 1: one copy of everything */
  int domain;                    /* this rank's domain, -1 when its CPUs span several */
  int numaNode[KCCL_MAX_DOMAINS];/* node to bind each domain's replica pages to; -1: do not bind */
  uint64_t topoHash;             /* names the domain list: must be equal on every rank */
} kcclPlacement_t;

kcclResult_t kcclCommInitRankPlacement(kcclComm_t *comm, int nranks, kcclUniqueId commId, int rank,
                                       const kcclConfig_t *config, const kcclPlacement_t *placement);

typedef struct {
  int ndomains;           /* as placed (1 when replicas are off) */
  int domain;             /* this rank's */
  int replicas;           /* remote replicas this rank writes at every publish */
  int bound;              /* 1: every replica page verified on its node; 0: nothing to bind or
                             no way to verify; -1: binding failed (see note) */
  uint64_t pushes;        /* remote replica writes so far */
  uint64_t replicaReads;  /* peer flags this rank polled in a replica so far */
  char note[192];         /* how the binding went, for people */
} kcclTopoInfo_t;

kcclResult_t kcclCommTopoInfo(kcclComm_t comm, kcclTopoInfo_t *info);

/*
 * Split-phase (non-blocking) all-reduce, host transport, one-shot.
 * Start copies sendbuff into this rank's slot and publishes it, then returns:
 * sendbuff may be reused at once, recvbuff must stay valid until the wait.
 * Wait completes the operations in the order they were started: waiting for
 * one completes every older one first (their results land in their recvbuffs).
 * At most config.max_outstanding (KCCL_MAX_OUTSTANDING) operations may be
 * started and not yet waited (kcclInvalidUsage beyond that); a message may
 * hold up to KCCL_BUFFER_BYTES bytes; blocking collectives are refused
 * (kcclInvalidUsage) while any operation is outstanding.  Waiting for a
 * request that already completed succeeds at once.
 */
kcclResult_t kcclAllReduceStart(const void *sendbuff, void *recvbuff, size_t count,
                                kcclDataType_t datatype, kcclRedOp_t op, kcclComm_t comm,
                                uint64_t *request);
kcclResult_t kcclAllReduceWait(kcclComm_t comm, uint64_t request);
/* *done = 1 when the request (and every older one) has completed, which this
 * call does itself when every peer's data is there; never blocks.  A dead or
 * aborted peer is reported as by Wait (checked about once a millisecond). */
kcclResult_t kcclAllReduceTest(kcclComm_t comm, uint64_t request, int *done);

/*
 * Split phase for both transports, stream-ordered on the GPU.  On a GPU
 * communicator Start enqueues the all-reduce on the communicator's own side
 * stream, after the work already enqueued on `stream`, and returns at once;
 * WaitStream makes work enqueued on `stream` afterwards wait for it (and for
 * every older one).  Neither blocks the host, so both can be captured in a CUDA
 * graph (the collective becomes a branch that joins at the wait); each Start
 * needs its WaitStream before the capture ends.  Up to KCCL_MAX_OUTSTANDING in
 * flight, any size, and blocking collectives are refused while any is
 * outstanding, as on the host.  A host communicator takes stream = NULL and
 * behaves as kcclAllReduceStart / kcclAllReduceWait.
 */
kcclResult_t kcclAllReduceStartStream(const void *sendbuff, void *recvbuff, size_t count,
                                      kcclDataType_t datatype, kcclRedOp_t op, kcclComm_t comm, void *stream,
                                      uint64_t *request);
kcclResult_t kcclAllReduceWaitStream(kcclComm_t comm, uint64_t request, void *stream);

/*
 * Point-to-point, host transport.  Each ordered pair of ranks has a ring of
 * slots in the sender's segment (KCCL_P2P_BYTES per peer, 4 slots) with the
 * collectives' flag protocol: the sender copies a piece of the message into
 * the next free slot and publishes its flag; the receiver copies it out and
 * publishes how far it has read, which frees the slot.  A message of any size
 * goes through in pieces; a send completes once its last piece is in the ring
 * (the buffer may then be reused), a receive once the message is in recvbuff.
 *
 * Matching is MPI's: messages from one sender arrive in the order they were
 * sent, and each goes to the oldest posted receive from that sender (or from
 * KCCL_ANY_SOURCE) with the same tag.  A message that no posted receive wants
 * waits in the ring, unless a receive from that sender (or any source) is
 * waiting for a later one: then it is read into a private buffer until a
 * receive for its tag is posted.  Sizes must match: a receive of another byte
 * count than the message's breaks the communicator (kcclRemoteError on both
 * sides).  Waits are bounded by KCCL_TIMEOUT_MS (reset by every piece that
 * moves) and end with kcclRemoteError when the peer dies, aborts or fails.
 * While split-phase operations are outstanding, every wait of the
 * communicator (the collectives' too) keeps them moving, so a large isend
 * never waits on its sender's next call.  Blocking collectives and
 * point-to-point may be interleaved freely.  stream must be NULL; a GPU
 * communicator refuses both (kcclInvalidUsage).
 */
#define KCCL_ANY_SOURCE (-1)
/* NCCL's shape: tag 0, blocking. */
kcclResult_t kcclSend(const void *sendbuff, size_t count, kcclDataType_t datatype, int peer, kcclComm_t comm,
                      void *stream);
kcclResult_t kcclRecv(void *recvbuff, size_t count, kcclDataType_t datatype, int peer, kcclComm_t comm,
                      void *stream);
/* Split phase with a tag: Start returns at once with a request (*request != 0), and the
 * buffer must stay valid until the request completes.  peer = KCCL_ANY_SOURCE receives
 * from whichever rank's matching message comes first. */
kcclResult_t kcclSendStart(const void *sendbuff, size_t count, kcclDataType_t datatype, int peer, int tag,
                           kcclComm_t comm, uint64_t *request);
kcclResult_t kcclRecvStart(void *recvbuff, size_t count, kcclDataType_t datatype, int peer, int tag,
                           kcclComm_t comm, uint64_t *request);
/* Wait: until the request completes; Test: never blocks, *done = 1 once it has.  Both
 * move every outstanding operation along and, once they report a request complete,
 * forget it (another Wait or Test on it is kcclInvalidArgument).  *source (may be
 * NULL): the rank a completed receive came from. */
kcclResult_t kcclP2PWait(kcclComm_t comm, uint64_t request, int *source);
kcclResult_t kcclP2PTest(kcclComm_t comm, uint64_t request, int *done, int *source);
/* Moves every outstanding send and receive along without blocking, as Wait and Test do
 * first (*moved = 1 when a piece moved); for a thread that keeps them moving while the
 * caller computes.  Reports nothing complete and checks no peer: Wait and Test do. */
kcclResult_t kcclP2PProgress(kcclComm_t comm, int *moved);

#ifdef __cplusplus
}
#endif
#endif /* KCCL_H_ */
