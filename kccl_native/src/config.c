/* config.c - built-in defaults and the KCCL_* environment variables.
 * Names, meanings and defaults are registered in kccl/config.py (printable
 * with `python -m kccl.config`); a test checks that both agree. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

static kcclResult_t env_long(const char *name, long lo, long hi, long *out) {
  const char *s = getenv(name);
  if (!s || !*s) return kcclSuccess;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  /* allow k/M suffixes for sizes */
  if (*end == 'k' || *end == 'K') { v *= 1024; end++; }
  else if (*end == 'm' || *end == 'M') { v *= 1024 * 1024; end++; }
  if (errno || *end || v < lo || v > hi)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected an integer in [%ld, %ld]", name, s, lo, hi);
  *out = v;
  return kcclSuccess;
}

kcclResult_t kcclConfigInit(kcclConfig_t *cfg) {
  if (!cfg) return kccl_err(kcclInvalidArgument, "config is NULL");
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->timeout_ms = 30000;
  cfg->algo = kcclAlgoAuto;
  cfg->oneshot_max_bytes = 64 * 1024;
  cfg->buffer_bytes = 1024 * 1024;
  cfg->spin_us = -1;
  cfg->yield_us = -1;
  cfg->debug = 0;

  long v;
  kcclResult_t r;
  v = cfg->timeout_ms;
  if ((r = env_long("KCCL_TIMEOUT_MS", 0, 86400000L, &v))) return r;
  cfg->timeout_ms = (int)v;
  v = (long)cfg->oneshot_max_bytes;
  if ((r = env_long("KCCL_ONESHOT_MAX_BYTES", 0, 1L << 40, &v))) return r;
  cfg->oneshot_max_bytes = (size_t)v;
  v = (long)cfg->buffer_bytes;
  if ((r = env_long("KCCL_BUFFER_BYTES", 4096, 1L << 30, &v))) return r;
  cfg->buffer_bytes = (size_t)v;
  v = cfg->spin_us;
  if ((r = env_long("KCCL_SPIN_US", -1, 10000000L, &v))) return r;
  cfg->spin_us = (int)v;
  v = cfg->yield_us;
  if ((r = env_long("KCCL_YIELD_US", -1, 10000000L, &v))) return r;
  cfg->yield_us = (int)v;

  const char *a = getenv("KCCL_ALGO");
  if (a && *a) {
    if (!strcasecmp(a, "auto")) cfg->algo = kcclAlgoAuto;
    else if (!strcasecmp(a, "oneshot")) cfg->algo = kcclAlgoOneShot;
    else if (!strcasecmp(a, "twoshot")) cfg->algo = kcclAlgoTwoShot;
    else return kccl_err(kcclInvalidArgument, "KCCL_ALGO=%s: expected auto, oneshot or twoshot", a);
  }
  const char *d = getenv("KCCL_DEBUG");
  if (d && *d) {
    static const char *names[] = {"NONE", "WARN", "INFO", "TRACE"};
    int found = -1;
    for (int i = 0; i < 4; i++)
      if (!strcasecmp(d, names[i]) || (d[0] == '0' + i && d[1] == 0)) found = i;
    if (found < 0) return kccl_err(kcclInvalidArgument, "KCCL_DEBUG=%s: expected NONE, WARN, INFO or TRACE", d);
    cfg->debug = found;
  }
  return kcclSuccess;
}
