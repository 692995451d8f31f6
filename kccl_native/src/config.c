/* config.c - the KCCL_* settings of kccl_settings.def in C: their defaults,
 * their parsing from the environment, the check of a caller's kcclConfig_t,
 * and the warning about unknown KCCL_* variables.  kccl/config.py reads the
 * same table (`python -m kccl.config` prints it). */
#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "internal.h"

/* The variable's value without surrounding blanks (as kccl/config.py reads it);
 * NULL when unset or empty.  A value too long for `buf` (no setting has one) is an
 * error: cut short, its first digits could parse as another number. */
static kcclResult_t env_value(const char *name, char *buf, size_t n, const char **out) {
  *out = NULL;
  const char *s = getenv(name);
  if (!s) return kcclSuccess;
  while (isspace((unsigned char)*s)) s++;
  size_t len = strlen(s);
  while (len && isspace((unsigned char)s[len - 1])) len--;
  if (!len) return kcclSuccess;
  if (len >= n)
    return kccl_err(kcclInvalidArgument, "%s=%.20s...: %zu characters, longer than any value it takes", name, s, len);
  memcpy(buf, s, len);
  buf[len] = 0;
  *out = buf;
  return kcclSuccess;
}

/* An integer in [lo, hi] and a multiple of `multiple`; byte sizes may end in k/K or
 * m/M (binary multiples). */
kcclResult_t kccl_env_long(const char *name, long lo, long hi, int sizes, int multiple, long *out) {
  char buf[64];
  const char *s;
  kcclResult_t r = env_value(name, buf, sizeof buf, &s);
  if (r || !s) return r;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10), mult = 1;
  if (sizes && end != s && (*end == 'k' || *end == 'K') && !end[1]) { mult = 1024; end++; }
  else if (sizes && end != s && (*end == 'm' || *end == 'M') && !end[1]) { mult = 1024 * 1024; end++; }
  /* v * mult is formed only when it cannot overflow (a wrapped product could land in range) */
  int in_range = !errno && v >= lo / mult && v <= hi / mult && v * mult >= lo && v * mult <= hi;
  if (end == s || *end || !in_range)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected an integer in [%ld, %ld]%s", name, s, lo, hi,
                    sizes ? " (k/M suffix allowed)" : "");
  v *= mult;
  if (v % multiple)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected a multiple of %d in [%ld, %ld]", name, s, multiple, lo, hi);
  *out = v;
  return kcclSuccess;
}

/* One of names[0..n) (any case) or its index as a digit. */
static kcclResult_t env_choice(const char *name, char names[][16], int n, int *out) {
  char buf[64];
  const char *s;
  kcclResult_t r = env_value(name, buf, sizeof buf, &s);
  if (r || !s) return r;
  for (int i = 0; i < n; i++)
    if (!strcasecmp(s, names[i]) || (s[0] == '0' + i && !s[1])) { *out = i; return kcclSuccess; }
  char list[128] = "";
  for (int i = 0; i < n; i++) {
    strncat(list, names[i], sizeof list - strlen(list) - 1);
    if (i + 1 < n) strncat(list, ", ", sizeof list - strlen(list) - 1);
  }
  return kccl_err(kcclInvalidArgument, "%s=%s: expected one of %s", name, s, list);
}

/* Every KCCL_* variable KCCL reads: the table's C, Python-only, build-time and NCCL-shim entries. */
static const char *const known_env[] = {
#define KCCL_SETTING(field, var, ...) var,
#define KCCL_PY_SETTING(field, var, ...) var,
#define KCCL_BUILD_SETTING(var, ...) var,
#define KCCL_NCCL_SETTING(field, var, ...) var,
#include "kccl_settings.def"
};
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

const kccl_setting kccl_settings[KCCL_NSETTINGS] = {
#define KCCL_SETTING(field, var, kind, def, lo, hi, multiple, equal, choices, doc) \
  {#field, var, kind, def, lo, hi, multiple, equal, choices, offsetof(kcclConfig_t, field)},
#include "kccl_settings.def"
};

/* Every entry names a kcclConfig_t field of its kind's type. */
#define KCCL_SETTING(field, var, kind, ...)                                                         \
  _Static_assert(sizeof(((kcclConfig_t *)0)->field) == ((kind) == KCCL_KIND_SIZE ? sizeof(size_t) : sizeof(int)), \
                 var ": the kcclConfig_t field's type does not match the table's kind");
#include "kccl_settings.def"

/* The limits the code names are the ones the table spells as numbers. */
#define KCCL_SETTING(field, var, kind, def, lo, hi, ...) enum { max_of_##field = (int)((hi) > 1000000000 ? -1 : (hi)) };
#include "kccl_settings.def"
_Static_assert(max_of_max_outstanding == KCCL_MAX_OUTSTANDING, "KCCL_MAX_OUTSTANDING's maximum");
_Static_assert(max_of_gpu_blocks == KCCL_GPU_MAX_BLOCKS, "KCCL_GPU_BLOCKS's maximum");
_Static_assert(max_of_gpu_chunk_threads == KCCL_GPU_MAX_CHUNK_THREADS, "KCCL_GPU_CHUNK_THREADS's maximum");

long long kccl_setting_get(const kcclConfig_t *cfg, int i) {
  const kccl_setting *s = &kccl_settings[i];
  const char *p = (const char *)cfg + s->offset;
  if (s->kind == KCCL_KIND_SIZE) return (long long)*(const size_t *)p;
  return *(const int *)p;
}

static void setting_set(kcclConfig_t *cfg, int i, long long v) {
  const kccl_setting *s = &kccl_settings[i];
  char *p = (char *)cfg + s->offset;
  if (s->kind == KCCL_KIND_SIZE) *(size_t *)p = (size_t)v;
  else *(int *)p = (int)v;
}

/* The names of a space-separated list of choices (at most 8), and their count. */
static int split_choices(const char *choices, char names[][16]) {
  int n = 0;
  for (const char *s = choices; *s && n < 8;) {
    while (*s == ' ') s++;
    size_t len = strcspn(s, " ");
    if (!len) break;
    snprintf(names[n++], 16, "%.*s", (int)len, s);
    s += len;
  }
  return n;
}

kcclResult_t kccl_config_check(const kcclConfig_t *cfg) {
  for (int i = 0; i < KCCL_NSETTINGS; i++) {
    const kccl_setting *s = &kccl_settings[i];
    long long v = kccl_setting_get(cfg, i);
    if (s->kind == KCCL_KIND_SIZE && (size_t)v > (size_t)s->hi)
      return kccl_err(kcclInvalidArgument, "invalid config: config.%s=%zu, expected %lld..%lld (%s)", s->field,
                      *(const size_t *)((const char *)cfg + s->offset), s->lo, s->hi, s->var);
    if (v < s->lo || v > s->hi)
      return kccl_err(kcclInvalidArgument, "invalid config: config.%s=%lld, expected %lld..%lld (%s)", s->field, v,
                      s->lo, s->hi, s->var);
    if (v % s->multiple)
      return kccl_err(kcclInvalidArgument, "invalid config: config.%s=%lld, expected a multiple of %d (%s)", s->field,
                      v, s->multiple, s->var);
  }
  return kcclSuccess;
}

kcclResult_t kcclConfigInit(kcclConfig_t *cfg) {
  if (!cfg) return kccl_err(kcclInvalidArgument, "config is NULL");
  warn_unknown_env();
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->device = -1;
  for (int i = 0; i < KCCL_NSETTINGS; i++) {
    const kccl_setting *s = &kccl_settings[i];
    long v = (long)s->def;
    kcclResult_t r;
    if (s->kind == KCCL_KIND_CHOICE) {
      char names[8][16];
      int idx = (int)v;
      if ((r = env_choice(s->var, names, split_choices(s->choices, names), &idx))) return r;
      v = idx;
    } else if ((r = kccl_env_long(s->var, (long)s->lo, (long)s->hi, s->kind == KCCL_KIND_SIZE, s->multiple, &v))) {
      return r;
    }
    setting_set(cfg, i, v);
  }
  return kcclSuccess;
}

int kccl_allreduce_algo(const kcclConfig_t *cfg, size_t bytes, size_t oneshot_max) {
  if (cfg->algo != kcclAlgoAuto) return cfg->algo;
  return bytes <= oneshot_max ? kcclAlgoOneShot : kcclAlgoTwoShot;
}
