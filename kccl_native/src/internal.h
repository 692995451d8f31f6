/* internal.h - shared definitions of the C core (not installed).
 *
 * The files in layers, lowest first: each calls only files listed before it, so
 * the core has no dependency circle.
 *   1. util.c      clock, sleep, futex, process liveness
 *      error.c     error codes' text, the thread's last error, logging
 *      dtype.c     sizes and names of types, ops, collectives; a call's signature
 *      reduce.c    the reduction kernels of the host transport
 *      config.c    the settings (kccl_settings.def); the all-reduce algorithm
 *      uniqueid.c  the unique id's bytes
 *      src/gpu/ or gpu_none.c  the CUDA side behind gpu_api.h (calls only error.c)
 *   2. replicas.c  per-domain replicas: layout, NUMA binding, replicated publish
 *      slot_store.c  how a rank writes its own slots: plain or streaming stores
 *   3. shm.c       the segments: create, map, agree on settings, sweep stale names,
 *                  mark this rank failed
 *   4. wait.c      publish and wait for flags, peer checks, kccl_comm_fail
 *   5. host.c      the host transport: collectives as steps over the segments
 *      gpu_host.c  the GPU transport's host side: bootstrap, watcher, kernel dispatch
 *      p2p.c       point-to-point: per-pair rings of slots, matching, progress
 *   6. comm.c      communicator life cycle: unique id, init (with a placement or
 *                  not), destroy, abort, queries
 *   7. collectives.c  the public collectives: the shared checks, then the
 *                  communicator's transport (struct kccl_transport)
 *   8. nonblocking.c  the split-phase all-reduce, on collectives.c's checks
 * One call goes upward, through a pointer: a wait of wait.c runs c->idle_work, which the
 * point-to-point layer sets while its operations are outstanding, so that they keep
 * moving while this rank waits in a collective. */
#ifndef KCCL_INTERNAL_H_
#define KCCL_INTERNAL_H_

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "kccl.h"
#include "gpu_api.h"

#define KCCL_LINE 64
#define KCCL_PAGE 4096
/* Buffer sets: c->nsets = 2 * max_outstanding, rounded up to a power of two
 * (so that step % nsets survives the 32-bit wrap of step).  With blocking
 * collectives only (max_outstanding 1) two suffice: every step waits for every
 * peer's flag of that step, so when a rank starts step s+1 (reusing the set of
 * step s-1) every peer has finished step s-1.  With D split-phase all-reduces
 * in flight, a rank that starts step s has completed step s-D, so every peer
 * has started s-D and therefore completed s-2D: sets of steps <= s-2D are
 * free, and 2D sets suffice (nonblocking.c). */
#define KCCL_MAX_OUTSTANDING 8
#define KCCL_MAX_RANKS 1024

/* The C settings of kccl_settings.def (config.c), in table order. */
enum { KCCL_KIND_INT, KCCL_KIND_SIZE, KCCL_KIND_CHOICE, KCCL_KIND_PATH };
enum { KCCL_EQUAL_NO, KCCL_EQUAL_ALL, KCCL_EQUAL_GPU };
enum {
#define KCCL_SETTING(field, ...) KCCL_SETTING_##field,
#include "kccl_settings.def"
  KCCL_NSETTINGS
};
typedef struct {
  const char *field, *var;
  int kind;
  long long def, lo, hi;
  int multiple, equal;
  const char *choices; /* KCCL_KIND_CHOICE: the names, space-separated */
  size_t offset;       /* of the field in kcclConfig_t */
} kccl_setting;
extern const kccl_setting kccl_settings[KCCL_NSETTINGS];
/* Setting i of cfg, whatever its field's type. */
long long kccl_setting_get(const kcclConfig_t *cfg, int i);
/* Every setting of a caller's config within its range (kcclInvalidArgument naming it if not). */
kcclResult_t kccl_config_check(const kcclConfig_t *cfg);
/* The all-reduce algorithm (kcclAlgoOneShot or kcclAlgoTwoShot) for `bytes`: KCCL_ALGO, and in
 * auto one-shot up to `oneshot_max` bytes (each transport passes its own crossover). */
int kccl_allreduce_algo(const kcclConfig_t *cfg, size_t bytes, size_t oneshot_max);

/* Segment states, in the header of each rank's segment. */
enum { SEG_CREATING = 0, SEG_READY = 1, SEG_CLOSED = 2, SEG_ABORTED = 3, SEG_FAILED = 4 };

/* Collective kinds, part of the call signature. */
/* COLL_ALLREDUCE is the one-shot all-reduce; the two-shot one signs (and names) itself
 * COLL_ALLREDUCE_2SHOT, so ranks that chose different algorithms (KCCL_ALGO or the
 * crossover set differently) see a mismatch at the first step instead of waiting. */
enum { COLL_ALLREDUCE = 1, COLL_ALLGATHER, COLL_REDUCESCATTER, COLL_BROADCAST, COLL_BARRIER, COLL_ALLREDUCE_NB,
       COLL_ALLREDUCE_2SHOT };

/* What a rank is currently calling; read by peers only to explain a mismatch. */
typedef struct {
  uint32_t coll, dtype, op, root;
  uint64_t count;
  uint32_t seq; /* the step this call is at: peers trust the rest only when it matches */
} kccl_call_desc;

/* First page of every rank's segment. */
typedef struct {
  uint64_t magic;
  uint32_t version, nranks, rank, pid;
  uint64_t starttime;       /* /proc/<pid>/stat field 22: tells pid reuse apart */
  uint8_t token[16];
  uint64_t seg_bytes, slot_bytes;
  _Atomic uint32_t state;   /* SEG_* */
  _Atomic uint32_t mapped;  /* 1 once this rank has mapped every peer */
  _Atomic uint32_t attached; /* peers that have mapped this segment (init): a rank that fails
                                init keeps its name until every peer has read its header */
  /* The rank's transport (1: GPU) and settings, for the ones every rank must share
   * (shm.c): each rank compares every rank's against rank 0's, so all reach the same
   * verdict with the same words. */
  int64_t gpu_transport;
  int64_t settings[KCCL_NSETTINGS];
  char pad0[KCCL_LINE];
  /* Written only by peers that go to sleep on one of this rank's flags;
   * read by this rank after each publish to decide whether to futex-wake. */
  _Atomic uint32_t sleepers __attribute__((aligned(KCCL_LINE)));
  char pad1[KCCL_LINE];
  kccl_call_desc call __attribute__((aligned(KCCL_LINE)));
  char error_text[256]; /* why this rank failed (state SEG_FAILED): for its peers and itself */
  /* GPU communicators: the rank's export, then 1 once published, 2 once it has
   * mapped every peer's buffer. */
  _Atomic uint32_t gpu_state __attribute__((aligned(KCCL_LINE)));
  kgpu_export gpu;
  /* Placement (replicas.c): peers check that every rank sees the same domains. */
  int32_t ndomains, domain;
  uint64_t topo_hash;
} kccl_seg_header;

_Static_assert(sizeof(kccl_seg_header) <= KCCL_PAGE, "header must fit a page");

/* A slot: the flag word at offset 0, data right after it, so a message of up to
 * 56 bytes travels in the same cache line as its flag (one hop, not two).
 * Flag = seq << 32 | signature. */
#define SLOT_DATA_OFF 8

/* A started, not yet completed kcclAllReduceStart (nonblocking.c). */
typedef struct {
  uint64_t ticket; /* the request id handed to the caller */
  uint32_t step, sig;
  void *recv;
  size_t count;
  int dtype, op;
} kccl_nb_op;
/* One collective call, as the transports take it. */
typedef struct {
  int coll;          /* COLL_* */
  const void *send;
  void *recv;
  size_t count;      /* elements per rank: all-gather's send count, reduce-scatter's receive count */
  int dtype, op, root;
  void *stream;
  uint32_t sig;      /* kccl_signature of the call */
} kccl_call;

/* What moves a communicator's data: the host transport (host.c) through the segments,
 * the GPU transport (gpu_host.c) through kernels.  Every collective goes through
 * collectives.c, which runs the checks common to both around these two. */
struct kccl_transport {
  /* First of a call's checks after the communicator's own: may this transport take a
   * call now (the host one: no stream; the GPU one: no failure recorded since)? */
  kcclResult_t (*enter)(struct kcclComm *c, void *stream);
  /* A call that passed every shared check (kccl_enter, kccl_check_buffers). */
  kcclResult_t (*run)(struct kcclComm *c, const kccl_call *call);
};
extern const struct kccl_transport kccl_host_transport, kccl_gpu_transport;

/* The host side of a GPU communicator (gpu_host.c). */
struct kccl_gpu_host {
  struct kgpu *kg;
  kcclGpuStatus *status; /* host-mapped: written by kernels and by the watcher */
  int efd;               /* written by the owner to stop the watcher */
  int watching;
  pthread_t watcher;
};

struct kcclComm {
  uint64_t magic;
  int nranks, rank;
  kcclConfig_t cfg;
  int ncpus;                 /* CPUs this process may run on */
  int64_t spin_ns, yield_ns; /* resolved waiting phases */
  int long_wait;             /* kcclCommExpectLongWait: this blocking collective's waits sleep at once */
  uint32_t step;             /* last step sequence number used */
  kcclResult_t error;        /* sticky: first error that broke the communicator (text: own header) */
  size_t seg_bytes, slot_bytes, slot_stride;
  size_t chunk_bytes;        /* a blocking collective's piece per step: KCCL_CHUNK_BYTES, at most slot_bytes */
  uint32_t stream_left;      /* slot_store.c: pieces still written with streaming stores */
  uint32_t slow_fills, fast_fills; /* slot_store.c: slow / fast plain fills in a row */
  uint32_t stream_doublings; /* slot_store.c: the next streaming period is 16 << this pieces */
  int probing;               /* slot_store.c: the next plain fill decides alone */
  uint64_t stream_switches;  /* times a slow plain fill switched to streaming stores */
  uint8_t token[16];
  char **names;              /* shm name of each rank (kept to clean up after dead peers) */
  uint8_t **base;            /* each rank's mapped segment */
  kccl_seg_header **hdr;
  size_t *map_bytes;         /* length of each rank's mapping (a peer's segment is mapped at its own size) */
  pid_t *pid;
  int *pidfd;                /* -1 where pidfd_open is unavailable */
  uint32_t nsets;            /* buffer sets (see KCCL_MAX_OUTSTANDING) */
  /* Outstanding split-phase all-reduces: a FIFO ring (nonblocking.c). */
  uint32_t nb_head, nb_count;
  uint64_t nb_issued;        /* last ticket handed out */
  int64_t nb_next_check;     /* kcclAllReduceTest: next peer-liveness check (ns) */
  kccl_nb_op nb[KCCL_MAX_OUTSTANDING];
  const struct kccl_transport *tp; /* host or GPU, by config.device */
  struct kccl_gpu_host *gpu; /* GPU communicators only (gpu_host.c) */
  struct kccl_replicas *rep; /* per-domain replicas (replicas.h); NULL: one copy of everything */
  size_t p2p_off;            /* where the point-to-point area starts in every segment (p2p.c); from
                                there on the pages are touched only when used */
  struct kccl_p2p *p2p;      /* point-to-point state (p2p.c); NULL for a GPU communicator */
  /* Run by the waits of wait.c between looks at their flag, never blocking (see the layers above). */
  void (*idle_work)(struct kcclComm *c);
};

#define KCCL_COMM_MAGIC 0x4b43434c434f4d4dull /* "KCCLCOMM" */
#define KCCL_SEG_MAGIC 0x4b43434c5345474dull  /* "KCCLSEGM" */

/* A handle the API may use: not NULL and not destroyed (finish() in comm.c
 * clears the magic before it frees the communicator). */
static inline int kccl_comm_valid(const struct kcclComm *c) { return c && c->magic == KCCL_COMM_MAGIC; }

/* kcclSuccess for a valid communicator that no error has broken; else the
 * error every call on it reports. */
static inline kcclResult_t kccl_comm_check(const struct kcclComm *c) {
  if (!kccl_comm_valid(c)) return kccl_err(kcclInvalidArgument, "invalid communicator");
  if (c->error != kcclSuccess)
    return kccl_err(kcclInvalidUsage, "communicator is unusable after an earlier error (%s); create a new one",
                    c->hdr[c->rank]->error_text);
  return kcclSuccess;
}

/* Slot `which` (0 = A, 1 = B) of buffer set `set` in rank r's segment. */
static inline uint8_t *kccl_slot(struct kcclComm *c, int r, uint32_t set, int which) {
  return c->base[r] + KCCL_PAGE + ((size_t)set * 2 + (size_t)which) * c->slot_stride;
}
static inline _Atomic uint64_t *kccl_flag(uint8_t *slot) { return (_Atomic uint64_t *)slot; }
static inline uint8_t *kccl_data(uint8_t *slot) { return slot + SLOT_DATA_OFF; }


/* util.c, and the helpers small enough to inline */
static inline int64_t kccl_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
static inline size_t kccl_round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
/* What a busy-wait does between two looks at a flag. */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif
/* The sequence number is the high half of the 64-bit flag: on little-endian
 * machines that is the second 32-bit word, and sleepers wait on it. */
static inline uint32_t *kccl_seq_word(_Atomic uint64_t *flag) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  return (uint32_t *)flag + 1;
#else
  return (uint32_t *)flag;
#endif
}
void kccl_sleep_us(long us);
long kccl_futex_wait(uint32_t *addr, uint32_t val, const struct timespec *ts);
long kccl_futex_wake(uint32_t *addr); /* wakes every waiter */
uint64_t kccl_proc_starttime(pid_t pid);
int kccl_pid_alive(pid_t pid, uint64_t starttime);

/* error.c */
kcclResult_t kccl_err(kcclResult_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kcclResult_t kccl_verr(kcclResult_t code, const char *fmt, va_list ap);
void kccl_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
extern int kccl_debug_level;

/* dtype.c */
size_t kccl_dtype_size(kcclDataType_t t); /* 0 when unknown */
const char *kccl_dtype_name(int t);
const char *kccl_op_name(int op);
const char *kccl_coll_name(int coll);
/* A hash of the call's arguments, carried in every flag: a peer's call that differs is seen
 * at the first step. */
uint32_t kccl_signature(int coll, size_t count, int dtype, int op, int root);

/* reduce.c: out[i] = in[0][i] op in[1][i] op ... in rank order (f16/bf16 in f32). */
void kccl_reduce(void *out, const void *const *in, int nin, size_t count, kcclDataType_t t,
                 kcclRedOp_t op, int nranks_for_avg);

/* slot_store.c: fill this rank's slot `dst` with `bytes` of src; reduce in[] (count
 * elements, rank order) into this rank's slot `dst` and copy the result to `also`.  Plain
 * or streaming stores, by KCCL_SLOT_STORES; fenced, ready to publish. */
void kccl_slot_fill(struct kcclComm *c, uint8_t *dst, const void *src, size_t bytes);
void kccl_slot_reduce(struct kcclComm *c, uint8_t *dst, void *also, const void *const *in, int nin,
                      size_t count, kcclDataType_t dt, kcclRedOp_t op);

/* wait.c */
void kccl_publish(struct kcclComm *c, _Atomic uint64_t *flag, uint32_t seq, uint32_t sig);
/* Publishes this rank's slot (set, which), whose first `bytes` of data are written, and its
 * replicas (replicas.c) when the placement has them. */
void kccl_publish_slot(struct kcclComm *c, uint32_t set, int which, size_t bytes, uint32_t seq, uint32_t sig);
kcclResult_t kccl_wait_flag(struct kcclComm *c, int peer, _Atomic uint64_t *flag, uint32_t seq,
                            uint32_t sig);
void kccl_wake_all(struct kcclComm *c);
/* Records a sticky error on the communicator, marks this rank's segment failed and wakes
 * its sleepers, so that peers waiting on this rank stop waiting. */
kcclResult_t kccl_comm_fail(struct kcclComm *c, kcclResult_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Why step seq cannot complete (dead, aborted, closed or mismatching peer), without waiting;
 * kcclSuccess when nothing is wrong (yet).  The text goes to why. */
kcclResult_t kccl_peer_problem(struct kcclComm *c, uint32_t seq, uint32_t sig, char *why, size_t n);
kcclResult_t kccl_peers_gone(struct kcclComm *c, char *why, size_t whylen, int *failed);
/* Whether peer p is gone (aborted, closed, failed or dead): kcclRemoteError with the reason in why. */
kcclResult_t kccl_peer_gone(struct kcclComm *c, int p, char *why, size_t whylen);

/* shm.c */
kcclResult_t kccl_shm_connect(struct kcclComm *c);
void kccl_shm_release(struct kcclComm *c);
void kccl_shm_sweep_stale(void);
/* This rank's segment: state SEG_FAILED, the thread's last error text as the reason. */
void kccl_seg_mark_failed(struct kcclComm *c);


/* collectives.c: the checks every collective starts with (*sig: its signature), then those
 * of its buffers (NULL, overlap outside the in-place layout). */
kcclResult_t kccl_enter(struct kcclComm *c, int coll, size_t count, int dtype, int op, int root,
                        void *stream, uint32_t *sig);
kcclResult_t kccl_check_buffers(const struct kcclComm *c, const kccl_call *call);

/* gpu_host.c: the GPU transport's host side */
kcclResult_t kccl_gpu_init(struct kcclComm *c);
void kccl_gpu_quiesce(struct kcclComm *c, int aborting);
void kccl_gpu_release(struct kcclComm *c, int aborting);
kcclResult_t kccl_gpu_enter(struct kcclComm *c);
kcclResult_t kccl_gpu_collective(struct kcclComm *c, int coll, const void *send, void *recv, size_t count,
                                 int dtype, int op, int root, void *stream, uint32_t sig);
/* replicas.c (see replicas.h for the hot-path helpers) */
kcclResult_t kccl_replicas_alloc(struct kcclComm *c, const kcclPlacement_t *pl); /* before sizing */
size_t kccl_replicas_layout(struct kcclComm *c, size_t area_off); /* bytes the replicas add to a segment */
void kccl_replicas_own(struct kcclComm *c);      /* own segment mapped: header fields, mbind, verify */
kcclResult_t kccl_replicas_check_rank(struct kcclComm *c, int r);
void kccl_replicas_setup(struct kcclComm *c);    /* every peer mapped: who writes where */
void kccl_replicas_wake_all(struct kcclComm *c);
void kccl_replicas_free(struct kcclComm *c);

/* p2p.c */
size_t kccl_p2p_layout(struct kcclComm *c); /* bytes the area adds to a segment (0 for a GPU one) */
kcclResult_t kccl_p2p_init(struct kcclComm *c); /* once every segment is mapped */
void kccl_p2p_free(struct kcclComm *c);

/* uniqueid.c */
kcclResult_t kccl_uid_make(kcclUniqueId *id);
kcclResult_t kccl_uid_parse(const kcclUniqueId *id, uint8_t token[16]);

#endif
