/* uniqueid.c - the 128-byte unique id: magic, version, creator pid, a random
 * 128-bit token (names the shared-memory segments), creation time, the
 * creator's machine key, and a checksum, so that bytes that did not come from
 * kcclGetUniqueId are refused instead of being used to rendezvous, and a rank
 * that cannot map the creator's segments (another machine, container or /dev/shm)
 * is refused at once instead of waiting KCCL_INIT_TIMEOUT_MS for them. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static const char UID_MAGIC[8] = {'K', 'C', 'C', 'L', 'U', 'I', 'D', '1'};
enum { OFF_VERSION = 8, OFF_PID = 12, OFF_TOKEN = 16, OFF_TIME = 32, OFF_SUM = 40, OFF_HOST = 48, UID_USED = 56 };

static uint64_t fnv1a_from(uint64_t h, const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
static uint64_t fnv1a(const uint8_t *p, size_t n) { return fnv1a_from(0xcbf29ce484222325ull, p, n); }

/* The checksum covers every used byte but its own. */
static uint64_t uid_sum(const uint8_t *b) { return fnv1a_from(fnv1a(b, OFF_SUM), b + OFF_HOST, UID_USED - OFF_HOST); }

/* What two processes must share to map each other's segments and watch each other's
 * pids: the kernel (boot id), the /dev/shm file system (its device and inode) and the
 * pid namespace.  0 when /proc or /dev/shm cannot be read (then nothing is checked).
 * Hostnames and IPC namespaces are left out: containers that differ only in those
 * (docker --ipc=host) still share /dev/shm, and a KCCL communicator among them works.
 * kcclGetMachineKey (kccl.h) gives it to the NCCL shim for its agreement. */
static uint64_t kccl_machine_key(void) {
  char buf[256] = "", ns[128] = "";
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return 0;
  int ok = fgets(buf, sizeof buf, f) != NULL;
  fclose(f);
  struct stat st;
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (!ok || n <= 0 || stat("/dev/shm", &st) != 0) return 0;
  ns[n] = 0;
  uint64_t h = fnv1a((const uint8_t *)buf, strlen(buf));
  h = fnv1a_from(h, (const uint8_t *)ns, (size_t)n);
  uint64_t ids[2] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino};
  h = fnv1a_from(h, (const uint8_t *)ids, sizeof ids);
  return h ? h : 1;
}

kcclResult_t kcclGetVersion(int *version) {
  if (!version) return kccl_err(kcclInvalidArgument, "version is NULL");
  *version = KCCL_VERSION_CODE;
  return kcclSuccess;
}

kcclResult_t kccl_uid_make(kcclUniqueId *id) {
  if (!id) return kccl_err(kcclInvalidArgument, "uniqueId is NULL");
  uint8_t *b = (uint8_t *)id->internal;
  memset(b, 0, KCCL_UNIQUE_ID_BYTES);
  memcpy(b, UID_MAGIC, 8);
  uint32_t v = KCCL_VERSION_CODE, pid = (uint32_t)getpid();
  memcpy(b + OFF_VERSION, &v, 4);
  memcpy(b + OFF_PID, &pid, 4);
  size_t got = 0;
  while (got < 16) {
    ssize_t n = getrandom(b + OFF_TOKEN + got, 16 - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return kccl_err(kcclSystemError, "getrandom: %s", strerror(errno));
    }
    got += (size_t)n;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  memcpy(b + OFF_TIME, &t, 8);
  uint64_t host = kccl_machine_key();
  memcpy(b + OFF_HOST, &host, 8);
  uint64_t sum = uid_sum(b);
  memcpy(b + OFF_SUM, &sum, 8);
  return kcclSuccess;
}

kcclResult_t kcclGetMachineKey(uint64_t *key) {
  if (!key) return kccl_err(kcclInvalidArgument, "key is NULL");
  *key = kccl_machine_key();
  return kcclSuccess;
}

kcclResult_t kccl_uid_parse(const kcclUniqueId *id, uint8_t token[16]) {
  const uint8_t *b = (const uint8_t *)id->internal;
  if (memcmp(b, UID_MAGIC, 8) != 0)
    return kccl_err(kcclInvalidArgument, "malformed unique id: it was not made by kcclGetUniqueId");
  uint64_t sum;
  memcpy(&sum, b + OFF_SUM, 8);
  int tail_zero = 1;
  for (int i = UID_USED; i < KCCL_UNIQUE_ID_BYTES; i++) tail_zero &= b[i] == 0;
  if (sum != uid_sum(b) || !tail_zero)
    return kccl_err(kcclInvalidArgument, "malformed unique id: checksum mismatch (corrupted or forged)");
  uint32_t v;
  memcpy(&v, b + OFF_VERSION, 4);
  if (v != KCCL_VERSION_CODE)
    return kccl_err(kcclInvalidUsage, "unique id made by KCCL version %u, this is %d", v, KCCL_VERSION_CODE);
  uint64_t theirs, mine = kccl_machine_key();
  memcpy(&theirs, b + OFF_HOST, 8);
  if (theirs && mine && theirs != mine)
    return kccl_err(kcclInvalidUsage, "this unique id was made on another machine (or in a container with its own "
                    "/dev/shm or pid namespace): a KCCL communicator needs every rank where it can map the others' "
                    "shared memory; ranks on several hosts: kccl.Communicator.from_mpi");
  memcpy(token, b + OFF_TOKEN, 16);
  return kcclSuccess;
}
