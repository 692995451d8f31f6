/* route.c - a KCCL communicator beside each real one, and the all-reduces KCCL
 * takes from NCCL.
 *
 * Making the KCCL side.  After the real library made a communicator (init, init
 * with config, scalable init, split), every rank takes part, through the real
 * communicator, in three small steps:
 *   1. agree: a min-all-reduce of what each rank can do (a KCCL with the GPU
 *      transport for its device), of the settings that decide routing, and of
 *      the machine each rank is on (a communicator over several machines, which
 *      KCCL cannot join, is left forward-only at once instead of after every
 *      rank's KCCL init timed out);
 *   2. rank 0's kcclGetUniqueId reaches the others by the real broadcast, and
 *      every rank calls kcclCommInitRankConfig on the communicator's device;
 *   3. agree again that every rank's init succeeded.
 * When any step says no, every rank keeps the communicator forward-only, so the
 * ranks never disagree about where a call goes (that would hang the real NCCL).
 *
 * Routing.  ncclAllReduce goes to KCCL when the communicator has a KCCL side, the
 * call is outside ncclGroupStart/End (the real library batches those), the type is
 * float32, float16 or bfloat16, the op is one of NCCL's five built-in ones, and
 * the message is 1 .. KCCL_NCCL_ROUTE_MAX_BYTES bytes.  These depend only on what
 * NCCL already requires to be equal on all ranks, and on settings that step 1
 * checked, so every rank decides the same.  Everything else is forwarded.
 *
 * Communicators made inside ncclGroupStart/End (PyTorch makes every one so) get
 * their KCCL side at the outermost ncclGroupEnd, when they are ready.  Left
 * forward-only: ncclCommInitAll, and several ranks made by one thread in one
 * group (one thread would have to sit in several ranks' KCCL init at once).
 *
 * A communicator whose real library reports no CUDA device (the stand-in NCCL of
 * tests/test_nccl_shim.py, whose "device" buffers are host memory) gets KCCL's
 * host transport, so the routing itself is tested on machines without a GPU. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kccl.h"
#include "shim.h"

#ifdef KCCL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* ------------------------------------------------------------- settings -- */

static struct {
  int route;               /* KCCL_NCCL_ROUTE */
  size_t route_max_bytes;  /* KCCL_NCCL_ROUTE_MAX_BYTES */
} g_set;
static kcclResult_t g_set_rc;
static char g_set_error[512];
static pthread_once_t g_set_once = PTHREAD_ONCE_INIT;

/* Through KCCL's own parser of the table (kcclSettingParse), so these read as every
 * other KCCL setting does. */
static void read_settings(void) {
  long long v;
#define KCCL_NCCL_SETTING(field, var, kind, def, lo, hi, doc)                                     \
  if (g_set_rc == kcclSuccess) {                                                                  \
    v = (long long)(def);                                                                         \
    g_set_rc = kcclSettingParse(var, getenv(var), &v);                                            \
    if (g_set_rc != kcclSuccess) snprintf(g_set_error, sizeof g_set_error, "%s", kcclGetLastError(NULL)); \
    else KCCL_NCCL_STORE_##field(v);                                                              \
  }
#define KCCL_NCCL_STORE_route(v) g_set.route = (int)(v)
#define KCCL_NCCL_STORE_route_max_bytes(v) g_set.route_max_bytes = (size_t)(v)
#define KCCL_NCCL_STORE_lib(v) (void)(v)
#include "kccl_settings.def"
#undef KCCL_NCCL_SETTING
}

/* kcclSuccess, or the shim's error set and ncclInvalidArgument. */
static ncclResult_t settings_ok(void) {
  pthread_once(&g_set_once, read_settings);
  if (g_set_rc == kcclSuccess) return ncclSuccess;
  shim_error("kccl_nccl: %s", g_set_error);
  return ncclInvalidArgument;
}

/* --------------------------------------------- communicators with a side -- */

struct side {
  ncclComm_t real;
  kcclComm_t k;
  int device;      /* -1: KCCL's host transport (a real library without a device) */
  int rank, nranks, debug;
  unsigned long routed, forwarded; /* all-reduces, for KCCL_DEBUG=INFO's line at close */
  struct side *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct side *g_sides;
static __thread int t_group_depth; /* NCCL's groups are per thread */

static struct side *find(ncclComm_t real) {
  /* no KCCL side anywhere: no lock on the forwarding path */
  if (!__atomic_load_n(&g_sides, __ATOMIC_ACQUIRE)) return NULL;
  pthread_mutex_lock(&g_lock);
  struct side *s = g_sides;
  while (s && s->real != real) s = s->next;
  pthread_mutex_unlock(&g_lock);
  return s;
}

static void add(struct side *s) {
  pthread_mutex_lock(&g_lock);
  s->next = g_sides;
  __atomic_store_n(&g_sides, s, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&g_lock);
}

static struct side *take(ncclComm_t real) {
  pthread_mutex_lock(&g_lock);
  struct side **p = &g_sides, *s;
  while ((s = *p) && s->real != real) p = &s->next;
  if (s) __atomic_store_n(p, s->next, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&g_lock);
  return s;
}

/* KCCL's codes 0..7 are NCCL's; a timeout is a peer that did not come. */
static ncclResult_t nccl_code(kcclResult_t r) { return r == kcclTimeout ? ncclRemoteError : (ncclResult_t)r; }

/* KCCL calls switch to the side's device and back: the caller's current device
 * is its own business, and NCCL does not change it either. */
struct on_device {
  int saved;
};

static void device_enter(struct on_device *d, int device) {
  d->saved = -1;
#ifdef KCCL_HAVE_CUDA
  if (device >= 0 && cudaGetDevice(&d->saved) == cudaSuccess && d->saved != device) cudaSetDevice(device);
#else
  (void)device;
#endif
}

static void device_leave(struct on_device *d, int device) {
#ifdef KCCL_HAVE_CUDA
  if (d->saved >= 0 && d->saved != device) cudaSetDevice(d->saved);
#else
  (void)d, (void)device;
#endif
}

/* ---------------------------------------- bootstrap through the real comm -- */

/* Device memory for the bootstrap's few bytes (host memory for a real library
 * without a device), and a stream of its own. */
struct scratch {
  int device;
  void *buf;
  void *stream;
};
enum { SCRATCH_BYTES = 256 };

static ncclResult_t scratch_open(struct scratch *s, int device) {
  memset(s, 0, sizeof *s);
  s->device = device;
  if (device < 0) {
    s->buf = calloc(1, SCRATCH_BYTES);
    if (s->buf) return ncclSuccess;
    shim_error("kccl_nccl: out of host memory");
    return ncclSystemError;
  }
#ifdef KCCL_HAVE_CUDA
  cudaError_t e = cudaMalloc(&s->buf, SCRATCH_BYTES);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags((cudaStream_t *)&s->stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) return ncclSuccess;
  shim_error("kccl_nccl: bootstrap memory on GPU %d: %s", device, cudaGetErrorString(e));
  if (s->buf) cudaFree(s->buf);
  s->buf = NULL;
  return ncclUnhandledCudaError;
#else
  shim_error("kccl_nccl: built without CUDA, cannot use GPU %d", device);
  return ncclSystemError;
#endif
}

static void scratch_close(struct scratch *s) {
  if (s->device < 0) free(s->buf);
#ifdef KCCL_HAVE_CUDA
  else {
    if (s->stream) cudaStreamDestroy((cudaStream_t)s->stream);
    if (s->buf) cudaFree(s->buf);
  }
#endif
  s->buf = NULL;
}

static ncclResult_t scratch_copy(struct scratch *s, void *dst, const void *src, size_t n, int to_device) {
  if (s->device < 0) {
    memcpy(dst, src, n);
    return ncclSuccess;
  }
#ifdef KCCL_HAVE_CUDA
  cudaError_t e = cudaMemcpyAsync(dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                  (cudaStream_t)s->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)s->stream);
  if (e == cudaSuccess) return ncclSuccess;
  shim_error("kccl_nccl: bootstrap copy on GPU %d: %s", s->device, cudaGetErrorString(e));
  return ncclUnhandledCudaError;
#else
  (void)to_device;
  return ncclSystemError;
#endif
}

/* A nonblocking communicator (config blocking = 0) answers ncclInProgress until
 * its operation is done: wait for that, as a blocking one would have. */
static ncclResult_t finish_in_progress(ncclComm_t comm, ncclResult_t rc) {
  while (rc == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    rc = real_ncclCommGetAsyncError(comm, &state);
    if (rc == ncclSuccess) rc = state;
    if (rc == ncclInProgress) sched_yield();
  }
  return rc;
}

static ncclResult_t scratch_sync(struct scratch *s) {
#ifdef KCCL_HAVE_CUDA
  if (s->device >= 0) {
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)s->stream);
    if (e != cudaSuccess) {
      shim_error("kccl_nccl: bootstrap on GPU %d: %s", s->device, cudaGetErrorString(e));
      return ncclUnhandledCudaError;
    }
  }
#else
  (void)s;
#endif
  return ncclSuccess;
}

/* `bytes` of host memory through the real communicator: an element-wise int64
 * minimum over every rank (bcast 0), or rank 0's bytes to every rank (bcast 1).
 * The copy back is ordered after the collective on the scratch stream, and its
 * wait covers both. */
static ncclResult_t round_trip(ncclComm_t real, struct scratch *s, void *host, size_t bytes, int bcast) {
  ncclResult_t rc = scratch_copy(s, s->buf, host, bytes, 1);
  if (rc == ncclSuccess)
    rc = finish_in_progress(real, bcast ? ncclBroadcast(s->buf, s->buf, bytes, ncclUint8, 0, real, s->stream)
                                        : real_ncclAllReduce(s->buf, s->buf, bytes / sizeof(int64_t), ncclInt64,
                                                             ncclMin, real, s->stream));
  if (rc == ncclSuccess) rc = scratch_copy(s, host, s->buf, bytes, 0);
  return rc;
}

/* Equal on ranks that can share a KCCL communicator: KCCL_HOST_ID when set (as the
 * Python package reads it), else the machine key of the unique id's check; >= 0. */
static int64_t host_key(void) {
  const char *id = getenv("KCCL_HOST_ID");
  uint64_t h = 0;
  if (id && *id) {
    h = 0xcbf29ce484222325ull;
    for (const char *p = id; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
  } else if (kcclGetMachineKey(&h) != kcclSuccess) {
    h = 0;
  }
  return (int64_t)(h & INT64_MAX);
}

static void say_forward_only(int nranks, const char *why) {
  static int said; /* once per process: every later communicator would say the same */
  if (__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED)) return;
  fprintf(stderr, "kccl_nccl: a communicator of %d ranks stays with the real NCCL only: %s\n", nranks, why);
}

/* The three steps of the file's header.  A failing real call is returned (the
 * real communicator is then as broken as that call says); a rank that cannot
 * make a KCCL side only makes the communicator forward-only. */
static ncclResult_t attach(ncclComm_t real) {
  int nranks = 0, rank = 0, device = -1;
  ncclResult_t rc = ncclCommCount(real, &nranks);
  if (rc == ncclSuccess) rc = ncclCommUserRank(real, &rank);
  if (rc != ncclSuccess) return rc;
  if (nranks < 2) return ncclSuccess; /* nothing to reduce across */
  if (ncclCommCuDevice(real, &device) != ncclSuccess) device = -1;
#ifndef KCCL_HAVE_CUDA
  /* Built without CUDA, no rank of this build can hold the bootstrap's device
   * memory, so none of them starts it: every rank stays forward-only alike. */
  if (device >= 0) {
    say_forward_only(nranks, "libkccl_nccl.so was built without CUDA (no nvcc at install)");
    return ncclSuccess;
  }
#endif

  struct on_device dev;
  device_enter(&dev, device);
  struct scratch s;
  if ((rc = scratch_open(&s, device)) != ncclSuccess) {
    device_leave(&dev, device);
    return rc;
  }
  char why[300] = "";
  kcclConfig_t cfg;
  int can = 1;
  if (kcclConfigInit(&cfg) != kcclSuccess) {
    snprintf(why, sizeof why, "KCCL's settings: %s", kcclGetLastError(NULL));
    can = 0;
  }
  if (device >= 0) {
    int built = 0, devices = 0;
    kcclGetGpuSupport(&built, &devices);
    if (!built || devices <= 0) {
      snprintf(why, sizeof why, "this KCCL %s", built ? "sees no GPU" : "was built without the GPU transport");
      can = 0;
    }
  }
  const int64_t max = (int64_t)g_set.route_max_bytes;
  const int64_t host = host_key();
  int64_t v[7] = {can, max, -max, KCCL_VERSION_CODE, -(int64_t)KCCL_VERSION_CODE, host, -host};
  kcclComm_t k = NULL;
  if ((rc = round_trip(real, &s, v, sizeof v, 0)) != ncclSuccess) goto out;
  if (!v[0]) {
    if (!why[0]) snprintf(why, sizeof why, "another rank cannot make a KCCL communicator");
    goto out;
  }
  if (v[1] != -v[2] || v[3] != -v[4]) {
    snprintf(why, sizeof why, "the ranks differ in KCCL_NCCL_ROUTE_MAX_BYTES or in KCCL's version");
    goto out;
  }
  if (v[5] != -v[6]) {
    snprintf(why, sizeof why, "its ranks are on more than one host (KCCL_HOST_ID, or machine, /dev/shm or pid "
             "namespace): KCCL joins ranks of one host only");
    goto out;
  }

  kcclUniqueId uid;
  memset(&uid, 0, sizeof uid);
  if (rank == 0 && kcclGetUniqueId(&uid) != kcclSuccess)
    snprintf(why, sizeof why, "kcclGetUniqueId: %s", kcclGetLastError(NULL));
  if ((rc = round_trip(real, &s, &uid, sizeof uid, 1)) != ncclSuccess) goto out;
  cfg.device = device;
  /* rank 0's failed id is all zeros: the others' init refuses it at once */
  if (kcclCommInitRankConfig(&k, nranks, uid, rank, &cfg) != kcclSuccess) {
    if (!why[0]) snprintf(why, sizeof why, "rank %d: kcclCommInitRankConfig: %s", rank, kcclGetLastError(NULL));
    k = NULL;
  }
  int64_t ok = k != NULL;
  if ((rc = round_trip(real, &s, &ok, sizeof ok, 0)) != ncclSuccess) goto out;
  if (!ok) {
    if (!why[0]) snprintf(why, sizeof why, "another rank's KCCL init failed");
    goto out;
  }
  struct side *side = calloc(1, sizeof *side);
  if (!side) {
    rc = ncclSystemError;
    shim_error("kccl_nccl: out of host memory");
    goto out;
  }
  side->real = real;
  side->k = k;
  side->device = device;
  side->rank = rank;
  side->nranks = nranks;
  side->debug = cfg.debug;
  add(side);
  k = NULL;
out:
  if (k) kcclCommAbort(k);
  scratch_close(&s);
  device_leave(&dev, device);
  if (why[0] && rc == ncclSuccess) say_forward_only(nranks, why);
  return rc;
}

/* One thread that makes several ranks in one group (one process driving several
 * GPUs) cannot make their KCCL sides: KCCL's init is one blocking call per rank.
 * Its communicators still take part in step 1, all in one real group as that
 * thread must, and say no, so their peers in other processes hear it too. */
static ncclResult_t decline_together(ncclComm_t *comms, int n) {
#ifndef KCCL_HAVE_CUDA
  int d0 = -1;
  if (ncclCommCuDevice(comms[0], &d0) == ncclSuccess && d0 >= 0) return ncclSuccess; /* see attach */
#endif
  struct scratch *s = calloc((size_t)n, sizeof *s);
  int *dev = calloc((size_t)n, sizeof *dev);
  int64_t no[5] = {0, 0, 0, 0, 0};
  ncclResult_t rc = s && dev ? ncclSuccess : ncclSystemError;
  int opened = 0, nranks = 0;
  for (; rc == ncclSuccess && opened < n; opened++) {
    if (ncclCommCuDevice(comms[opened], &dev[opened]) != ncclSuccess) dev[opened] = -1;
    struct on_device d;
    device_enter(&d, dev[opened]);
    rc = scratch_open(&s[opened], dev[opened]);
    if (rc == ncclSuccess) rc = scratch_copy(&s[opened], s[opened].buf, no, sizeof no, 1);
    device_leave(&d, dev[opened]);
    if (rc != ncclSuccess) break;
  }
  if (rc == ncclSuccess) {
    rc = real_ncclGroupStart();
    for (int i = 0; rc == ncclSuccess && i < n; i++) {
      struct on_device d;
      device_enter(&d, dev[i]);
      rc = real_ncclAllReduce(s[i].buf, s[i].buf, 5, ncclInt64, ncclMin, comms[i], s[i].stream);
      device_leave(&d, dev[i]);
    }
    ncclResult_t end = real_ncclGroupEnd();
    if (rc == ncclSuccess) rc = end;
    for (int i = 0; i < n && (rc == ncclSuccess || rc == ncclInProgress); i++) {
      rc = finish_in_progress(comms[i], rc == ncclInProgress ? ncclInProgress : ncclSuccess);
      if (rc == ncclSuccess) rc = scratch_sync(&s[i]);
    }
  }
  for (int i = 0; i < opened && s; i++) {
    struct on_device d;
    device_enter(&d, dev[i]);
    scratch_close(&s[i]);
    device_leave(&d, dev[i]);
  }
  free(s);
  free(dev);
  if (rc == ncclSuccess && ncclCommCount(comms[0], &nranks) == ncclSuccess)
    say_forward_only(nranks, "one thread made several of its ranks in one group");
  return rc;
}

/* Communicators made inside a group are ready only after the group's end, and
 * that is where PyTorch makes every communicator: they wait here, per thread,
 * for the outermost ncclGroupEnd. */
static __thread ncclComm_t *t_pending;
static __thread int t_npending, t_cap;

static ncclResult_t defer(ncclComm_t comm) {
  if (t_npending == t_cap) {
    int cap = t_cap ? 2 * t_cap : 4;
    ncclComm_t *p = realloc(t_pending, (size_t)cap * sizeof *p);
    if (!p) {
      shim_error("kccl_nccl: out of host memory");
      return ncclSystemError;
    }
    t_pending = p;
    t_cap = cap;
  }
  t_pending[t_npending++] = comm;
  return ncclSuccess;
}

/* After a real init: a KCCL side unless routing is off; inside a group, at the
 * group's end.  A failed attach takes the new communicator down with it. */
static ncclResult_t after_init(ncclResult_t rc, ncclComm_t *comm) {
  if ((rc != ncclSuccess && rc != ncclInProgress) || !comm || !*comm || !g_set.route) return rc;
  if (t_group_depth) {
    ncclResult_t d = defer(*comm);
    return d == ncclSuccess ? rc : d;
  }
  if ((rc = finish_in_progress(*comm, rc)) != ncclSuccess) return rc;
  ncclResult_t a = attach(*comm);
  if (a != ncclSuccess) {
    real_ncclCommAbort(*comm);
    *comm = NULL;
  }
  return a;
}

/* The outermost group's end: its communicators are made (or failed with it). */
static ncclResult_t attach_pending(ncclResult_t rc) {
  int n = t_npending;
  t_npending = 0;
  if (rc != ncclSuccess && rc != ncclInProgress) return rc;
  for (int i = 0; i < n; i++) {
    ncclResult_t r = finish_in_progress(t_pending[i], ncclInProgress);
    if (r != ncclSuccess) return r;
  }
  if (n > 1) return decline_together(t_pending, n);
  /* A failed attach leaves the caller's handle as it is: NCCL wrote it
   * before the group ended, and the caller learns of the failure here. */
  return attach(t_pending[0]);
}

/* ------------------------------------------------------- NCCL functions -- */

SHIM_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  ncclResult_t rc = settings_ok();
  if (rc != ncclSuccess) return rc;
  return after_init(real_ncclCommInitRank(comm, nranks, commId, rank), comm);
}

SHIM_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                                ncclConfig_t *config) {
  ncclResult_t rc = settings_ok();
  if (rc != ncclSuccess) return rc;
  return after_init(real_ncclCommInitRankConfig(comm, nranks, commId, rank, config), comm);
}

SHIM_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                                  ncclUniqueId *commIds, ncclConfig_t *config) {
  ncclResult_t rc = settings_ok();
  if (rc != ncclSuccess) return rc;
  return after_init(real_ncclCommInitRankScalable(newcomm, nranks, myrank, nId, commIds, config), newcomm);
}

SHIM_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                       ncclConfig_t *config) {
  ncclResult_t rc = settings_ok();
  if (rc != ncclSuccess) return rc;
  /* a rank that passes NCCL_SPLIT_NOCOLOR gets NULL and takes no part */
  return after_init(real_ncclCommSplit(comm, color, key, newcomm, config), newcomm);
}

static void side_close(struct side *s, int abort) {
  if (s->debug >= 2)
    fprintf(stderr, "kccl_nccl: rank %d of %d: %lu all-reduces went to KCCL, %lu to the real NCCL (%s)\n", s->rank,
            s->nranks, s->routed, s->forwarded, abort ? "abort" : "destroy");
  struct on_device dev;
  device_enter(&dev, s->device);
  if (abort) kcclCommAbort(s->k);
  else kcclCommDestroy(s->k);
  device_leave(&dev, s->device);
  free(s);
}

SHIM_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  struct side *s = take(comm);
  if (s) side_close(s, 0);
  return real_ncclCommDestroy(comm);
}

SHIM_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  struct side *s = take(comm);
  if (s) side_close(s, 1); /* first: peers blocked in KCCL hear of it at once */
  return real_ncclCommAbort(comm);
}

SHIM_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  struct side *s = asyncError ? find(comm) : NULL;
  kcclResult_t e = kcclSuccess;
  if (s && kcclCommGetAsyncError(s->k, &e) == kcclSuccess && e != kcclSuccess) {
    shim_error("kccl_nccl: %s", kcclGetLastError(s->k));
    *asyncError = nccl_code(e);
    return ncclSuccess;
  }
  return real_ncclCommGetAsyncError(comm, asyncError);
}

SHIM_EXPORT ncclResult_t ncclGroupStart(void) {
  ncclResult_t rc = real_ncclGroupStart();
  if (rc == ncclSuccess) t_group_depth++;
  return rc;
}

SHIM_EXPORT ncclResult_t ncclGroupEnd(void) {
  ncclResult_t rc = real_ncclGroupEnd();
  if (t_group_depth > 0) t_group_depth--; /* the group is closed whatever the result */
  if (t_group_depth == 0 && t_npending) rc = attach_pending(rc);
  return rc;
}

SHIM_EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                       ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  struct side *s = find(comm);
  const size_t es = datatype == ncclFloat32 ? 4 : datatype == ncclFloat16 || datatype == ncclBfloat16 ? 2 : 0;
  if (!s || t_group_depth || !es || (unsigned)op > (unsigned)ncclAvg || count == 0 || count > g_set.route_max_bytes / es) {
    if (s) s->forwarded++;
    return real_ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
  }
  s->routed++;
  shim_clear_error();
  struct on_device dev;
  device_enter(&dev, s->device);
  kcclResult_t r = kcclAllReduce(sendbuff, recvbuff, count, (kcclDataType_t)datatype, (kcclRedOp_t)op, s->k,
                                 s->device >= 0 ? (void *)stream : NULL);
  device_leave(&dev, s->device);
  if (r == kcclSuccess) return ncclSuccess;
  shim_error("kccl_nccl: KCCL's all-reduce: %s", kcclGetLastError(s->k));
  return nccl_code(r);
}
