/* config.c - built-in defaults and the KCCL_* environment variables.
 * Names, meanings and defaults are registered in kccl/config.py (printable
 * with `python -m kccl.config`); a test checks that both agree. */
#include <ctype.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "internal.h"

/* The variable's value without surrounding blanks (as kccl/config.py reads it);
 * NULL when unset or empty. */
static const char *env_value(const char *name, char *buf, size_t n) {
  const char *s = getenv(name);
  if (!s) return NULL;
  while (isspace((unsigned char)*s)) s++;
  size_t len = strlen(s);
  while (len && isspace((unsigned char)s[len - 1])) len--;
  if (!len) return NULL;
  if (len >= n) len = n - 1;
  memcpy(buf, s, len);
  buf[len] = 0;
  return buf;
}

/* An integer in [lo, hi]; byte sizes may end in k/K or m/M (binary multiples). */
static kcclResult_t env_long(const char *name, long lo, long hi, int sizes, long *out) {
  char buf[64];
  const char *s = env_value(name, buf, sizeof buf);
  if (!s) return kcclSuccess;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (sizes && end != s && (*end == 'k' || *end == 'K') && !end[1]) { v *= 1024; end++; }
  else if (sizes && end != s && (*end == 'm' || *end == 'M') && !end[1]) { v *= 1024 * 1024; end++; }
  if (errno || end == s || *end || v < lo || v > hi)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected an integer in [%ld, %ld]%s", name, s, lo, hi,
                    sizes ? " (k/M suffix allowed)" : "");
  *out = v;
  return kcclSuccess;
}

/* One of names[0..n) (any case) or its index as a digit. */
static kcclResult_t env_choice(const char *name, const char *const *names, int n, int *out) {
  char buf[64];
  const char *s = env_value(name, buf, sizeof buf);
  if (!s) return kcclSuccess;
  for (int i = 0; i < n; i++)
    if (!strcasecmp(s, names[i]) || (s[0] == '0' + i && !s[1])) { *out = i; return kcclSuccess; }
  char list[128] = "";
  for (int i = 0; i < n; i++) {
    strncat(list, names[i], sizeof list - strlen(list) - 1);
    if (i + 1 < n) strncat(list, ", ", sizeof list - strlen(list) - 1);
  }
  return kccl_err(kcclInvalidArgument, "%s=%s: expected one of %s", name, s, list);
}

/* Every KCCL_* variable KCCL reads: the ones above, the Python-only placement ones and
 * the build-time one (kccl/config.py registers the same names; a test compares). */
static const char *const known_env[] = {
    "KCCL_TIMEOUT_MS", "KCCL_ALGO", "KCCL_ONESHOT_MAX_BYTES", "KCCL_BUFFER_BYTES", "KCCL_SPIN_US",
    "KCCL_YIELD_US", "KCCL_GPU_ONESHOT_MAX_BYTES", "KCCL_GPU_BUFFER_BYTES", "KCCL_GPU_PDL",
    "KCCL_GPU_FLAG_REPLICAS", "KCCL_GPU_BLOCKS", "KCCL_GPU_PULL", "KCCL_GPU_CARVEOUT", "KCCL_GPU_LL_THREADS",
    "KCCL_GPU_LL_HOPS", "KCCL_GPU_CHUNK_THREADS", "KCCL_DEBUG", "KCCL_TOPO", "KCCL_TOPO_FILE",
    "KCCL_MAX_OUTSTANDING", "KCCL_CUDA"};
#define NKNOWN (sizeof known_env / sizeof known_env[0])

/* Levenshtein distance of two short names (longer ones count as far apart). */
static int edit_distance(const char *a, size_t la, const char *b) {
  size_t lb = strlen(b);
  int row[64];
  if (la >= 64 || lb >= 64) return 1 << 20;
  for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
  for (size_t i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = (int)i;
    for (size_t j = 1; j <= lb; j++) {
      int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      diag = up;
      row[j] = best;
    }
  }
  return row[lb];
}

/* A misspelled setting would otherwise be ignored without a word: the first
 * kcclConfigInit of a process names every unknown KCCL_* variable, and the known one
 * closest to it (within 3 edits, and fewer than half the letters after KCCL_). */
static void warn_unknown_env(void) {
  static atomic_int done;
  if (atomic_exchange(&done, 1)) return;
  extern char **environ;
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "KCCL_", 5) != 0) continue;
    const char *eq = strchr(*e, '=');
    size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
    const char *best = NULL;
    int best_d = 4, known = 0;
    for (size_t k = 0; k < NKNOWN && !known; k++) {
      if (strlen(known_env[k]) == len && !strncmp(*e, known_env[k], len)) known = 1;
      int d = edit_distance(*e, len, known_env[k]);
      if (d < best_d && 2 * d < (int)len - 5) { best_d = d; best = known_env[k]; }
    }
    if (known) continue;
    if (best)
      fprintf(stderr, "[kccl pid %d] WARN %.*s is not a KCCL setting and is ignored; did you mean %s? "
              "(python -m kccl.config lists them)\n", (int)getpid(), (int)len, *e, best);
    else
      fprintf(stderr, "[kccl pid %d] WARN %.*s is not a KCCL setting and is ignored "
              "(python -m kccl.config lists them)\n", (int)getpid(), (int)len, *e);
  }
}

kcclResult_t kcclConfigInit(kcclConfig_t *cfg) {
  if (!cfg) return kccl_err(kcclInvalidArgument, "config is NULL");
  warn_unknown_env();
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->timeout_ms = 30000;
  cfg->algo = kcclAlgoAuto;
  cfg->oneshot_max_bytes = 16 * 1024; /* bench/crossover.py: 2 and 4 ranks */
  cfg->buffer_bytes = 1024 * 1024;
  cfg->spin_us = -1;
  cfg->yield_us = -1;
  cfg->debug = 0;
  cfg->max_outstanding = 1;
  cfg->device = -1;
  cfg->gpu_oneshot_max_bytes = 256 * 1024; /* the LL path's capacity; bench/allreduce.py --device cuda */
  cfg->gpu_buffer_bytes = 16 * 1024 * 1024;
  cfg->gpu_pdl = 1; /* lets the next call's one-shot kernel start while this one ends */
  cfg->gpu_flag_replicas = 0; /* opt-in: not yet measured (bench/gpu/replica_ab.py) */
  cfg->gpu_blocks = 0;        /* auto: from the ranks per GPU and the occupancy (gpu_runtime.cu) */
  cfg->gpu_pull = -1;         /* auto: pull on one GPU (bench/gpu/ll_ladder.cu), push across GPUs */
  cfg->gpu_carveout = 100;    /* a late rank's kernels can start beside waiting blocks (gpu_kernels.cu) */
  cfg->gpu_ll_threads = 256;  /* 128 was not faster at 8 KB and slower from 64 KB (gpu_kernels.cu) */
  cfg->gpu_ll_hops = 0;       /* auto: the rule in gpu_runtime.cu (ll_hops_auto) */
  cfg->gpu_chunk_threads = 0; /* auto: the rule in gpu_runtime.cu (kgpu_connect) */

  long v;
  kcclResult_t r;
  v = cfg->timeout_ms;
  if ((r = env_long("KCCL_TIMEOUT_MS", 0, 86400000L, 0, &v))) return r;
  cfg->timeout_ms = (int)v;
  v = (long)cfg->oneshot_max_bytes;
  if ((r = env_long("KCCL_ONESHOT_MAX_BYTES", 0, 1L << 40, 1, &v))) return r;
  cfg->oneshot_max_bytes = (size_t)v;
  v = (long)cfg->buffer_bytes;
  if ((r = env_long("KCCL_BUFFER_BYTES", 4096, 1L << 30, 1, &v))) return r;
  cfg->buffer_bytes = (size_t)v;
  v = cfg->spin_us;
  if ((r = env_long("KCCL_SPIN_US", -1, 10000000L, 0, &v))) return r;
  cfg->spin_us = (int)v;
  v = cfg->yield_us;
  if ((r = env_long("KCCL_YIELD_US", -1, 10000000L, 0, &v))) return r;
  cfg->yield_us = (int)v;
  v = cfg->max_outstanding;
  if ((r = env_long("KCCL_MAX_OUTSTANDING", 1, KCCL_MAX_OUTSTANDING, 0, &v))) return r;
  cfg->max_outstanding = (int)v;
  v = (long)cfg->gpu_oneshot_max_bytes;
  if ((r = env_long("KCCL_GPU_ONESHOT_MAX_BYTES", 0, 1L << 40, 1, &v))) return r;
  cfg->gpu_oneshot_max_bytes = (size_t)v;
  v = (long)cfg->gpu_buffer_bytes;
  if ((r = env_long("KCCL_GPU_BUFFER_BYTES", 65536, 1L << 32, 1, &v))) return r;
  cfg->gpu_buffer_bytes = (size_t)v;
  v = cfg->gpu_pdl;
  if ((r = env_long("KCCL_GPU_PDL", 0, 1, 0, &v))) return r;
  cfg->gpu_pdl = (int)v;
  v = cfg->gpu_flag_replicas;
  if ((r = env_long("KCCL_GPU_FLAG_REPLICAS", 0, 1, 0, &v))) return r;
  cfg->gpu_flag_replicas = (int)v;
  v = cfg->gpu_blocks;
  if ((r = env_long("KCCL_GPU_BLOCKS", 0, KCCL_GPU_MAX_BLOCKS, 0, &v))) return r;
  cfg->gpu_blocks = (int)v;
  v = cfg->gpu_pull;
  if ((r = env_long("KCCL_GPU_PULL", -1, 1, 0, &v))) return r;
  cfg->gpu_pull = (int)v;
  v = cfg->gpu_carveout;
  if ((r = env_long("KCCL_GPU_CARVEOUT", -1, 100, 0, &v))) return r;
  cfg->gpu_carveout = (int)v;
  v = cfg->gpu_ll_threads;
  if ((r = env_long("KCCL_GPU_LL_THREADS", 32, 256, 0, &v))) return r;
  if (v % 32)
    return kccl_err(kcclInvalidArgument, "KCCL_GPU_LL_THREADS=%ld: a multiple of 32 (whole warps), 32..256", v);
  cfg->gpu_ll_threads = (int)v;
  v = cfg->gpu_ll_hops;
  if ((r = env_long("KCCL_GPU_LL_HOPS", 0, 2, 0, &v))) return r;
  cfg->gpu_ll_hops = (int)v;
  v = cfg->gpu_chunk_threads;
  if ((r = env_long("KCCL_GPU_CHUNK_THREADS", 0, KCCL_GPU_MAX_CHUNK_THREADS, 0, &v))) return r;
  if (v % 32)
    return kccl_err(kcclInvalidArgument, "KCCL_GPU_CHUNK_THREADS=%ld: 0 (auto) or a multiple of 32 (whole warps) "
                    "up to %d", v, KCCL_GPU_MAX_CHUNK_THREADS);
  cfg->gpu_chunk_threads = (int)v;
  static const char *const algos[] = {"auto", "oneshot", "twoshot"};
  static const char *const levels[] = {"NONE", "WARN", "INFO", "TRACE"};
  if ((r = env_choice("KCCL_ALGO", algos, 3, &cfg->algo))) return r;
  if ((r = env_choice("KCCL_DEBUG", levels, 4, &cfg->debug))) return r;
  return kcclSuccess;
}
