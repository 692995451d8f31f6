/* uniqueid.c - the 128-byte unique id: magic, version, creator pid, a random
 * 128-bit token (names the shared-memory segments), creation time, and a
 * checksum, so that bytes that did not come from kcclGetUniqueId are refused
 * instead of being used to rendezvous. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static const char UID_MAGIC[8] = {'K', 'C', 'C', 'L', 'U', 'I', 'D', '1'};
enum { OFF_VERSION = 8, OFF_PID = 12, OFF_TOKEN = 16, OFF_TIME = 32, OFF_SUM = 40, UID_USED = 48 };

static uint64_t fnv1a(const uint8_t *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
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
  uint64_t sum = fnv1a(b, OFF_SUM);
  memcpy(b + OFF_SUM, &sum, 8);
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
  if (sum != fnv1a(b, OFF_SUM) || !tail_zero)
    return kccl_err(kcclInvalidArgument, "malformed unique id: checksum mismatch (corrupted or forged)");
  uint32_t v;
  memcpy(&v, b + OFF_VERSION, 4);
  if (v != KCCL_VERSION_CODE)
    return kccl_err(kcclInvalidUsage, "unique id made by KCCL version %u, this is %d", v, KCCL_VERSION_CODE);
  memcpy(token, b + OFF_TOKEN, 16);
  return kcclSuccess;
}
