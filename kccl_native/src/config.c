/* config.c - the KCCL_* settings of kccl_settings.def in C: their defaults, the
 * one parser of their values (kcclSettingParse: kcclConfigInit's, kccl/config.py's
 * and libkccl_nccl.so's), the check of a caller's kcclConfig_t, and the warning
 * about unknown KCCL_* variables.  kccl/config.py reads the same table for the
 * names, defaults and meanings (`python -m kccl.config` prints it). */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "internal.h"

/* `s` without surrounding blanks, into buf; NULL when s is NULL or blank: an unset or
 * empty variable means the default.  *too_long when it does not fit buf: such a value is
 * refused, since cut short its first digits could read as another number. */
static const char *trimmed(const char *s, char *buf, size_t n, int *too_long) {
  *too_long = 0;
  if (!s) return NULL;
  while (isspace((unsigned char)*s)) s++;
  size_t len = strlen(s);
  while (len && isspace((unsigned char)s[len - 1])) len--;
  if (!len) return NULL;
  if (len >= n) {
    *too_long = 1;
    return NULL;
  }
  memcpy(buf, s, len);
  buf[len] = 0;
  return buf;
}

/* Every setting a value can be parsed for: the C, Python-only and NCCL-shim entries of
 * the table (the build-time ones are read by the build, as text). */
typedef struct {
  const char *var;
  int kind;
  long long lo, hi;
  int multiple;
  const char *choices;
} kccl_parse_rule;
static const kccl_parse_rule parse_rules[] = {
#define KCCL_SETTING(field, var, kind, def, lo, hi, multiple, equal, choices, doc) {var, kind, lo, hi, multiple, choices},
/* a Python-only byte count lies in [0, 1 TiB] (the table's rule for them) */
#define KCCL_PY_SETTING(field, var, kind, def, choices, doc) {var, kind, 0, (kind) == KCCL_KIND_SIZE ? 1LL << 40 : 0, 1, choices},
#define KCCL_NCCL_SETTING(field, var, kind, def, lo, hi, doc) {var, kind, lo, hi, 1, ""},
#include "kccl_settings.def"
};
#define NRULES (sizeof parse_rules / sizeof parse_rules[0])

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

/* The one parser of a setting's text (s: trimmed, not empty).  An integer in [lo, hi] and a
 * multiple of `multiple`, byte sizes with an optional k/K or m/M (binary multiples); a choice
 * by name in any case or by its index as a digit; a path as it is. */
static kcclResult_t parse_rule(const kccl_parse_rule *r, const char *s, long long *out) {
  if (r->kind == KCCL_KIND_PATH) return kcclSuccess;
  if (r->kind == KCCL_KIND_CHOICE) {
    char names[8][16], list[128] = "";
    int n = split_choices(r->choices, names);
    for (int i = 0; i < n; i++)
      if (!strcasecmp(s, names[i]) || (s[0] == '0' + i && !s[1])) { *out = i; return kcclSuccess; }
    for (int i = 0; i < n; i++) {
      strncat(list, names[i], sizeof list - strlen(list) - 1);
      if (i + 1 < n) strncat(list, ", ", sizeof list - strlen(list) - 1);
    }
    return kccl_err(kcclInvalidArgument, "%s=%s: expected one of %s", r->var, s, list);
  }
  const int sizes = r->kind == KCCL_KIND_SIZE;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10), mult = 1;
  if (sizes && end != s && (*end == 'k' || *end == 'K') && !end[1]) { mult = 1024; end++; }
  else if (sizes && end != s && (*end == 'm' || *end == 'M') && !end[1]) { mult = 1024 * 1024; end++; }
  if (errno || end == s || *end || v > LLONG_MAX / mult || v < LLONG_MIN / mult || v * mult < r->lo ||
      v * mult > r->hi)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected an integer in [%lld, %lld]%s", r->var, s, r->lo, r->hi,
                    sizes ? " (k/M suffix allowed)" : "");
  v *= mult;
  if (v % r->multiple)
    return kccl_err(kcclInvalidArgument, "%s=%s: expected a multiple of %d in [%lld, %lld]", r->var, s, r->multiple,
                    r->lo, r->hi);
  *out = v;
  return kcclSuccess;
}

static const kccl_parse_rule *rule_of(const char *name) {
  for (size_t i = 0; name && i < NRULES; i++)
    if (!strcmp(parse_rules[i].var, name)) return &parse_rules[i];
  return NULL;
}

kcclResult_t kcclSettingParse(const char *name, const char *value, long long *out) {
  const kccl_parse_rule *r = rule_of(name);
  if (!r) return kccl_err(kcclInvalidArgument, "%s is not a KCCL setting that takes a value", name ? name : "(null)");
  if (!out) return kccl_err(kcclInvalidArgument, "%s: out is NULL", name);
  char buf[256];
  int too_long;
  const char *s = trimmed(value, buf, sizeof buf, &too_long);
  if (too_long)
    return kccl_err(kcclInvalidArgument, "%s=%.20s...: longer than the %zu characters any value may have", name,
                    value, sizeof buf - 1);
  return s ? parse_rule(r, s, out) : kcclSuccess;
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

/* The known name closest to name[0..len) (within 3 edits, and fewer than half the letters
 * after KCCL_; the first in table order on a tie): the name itself when known, else NULL. */
static const char *closest(const char *name, size_t len) {
  const char *best = NULL;
  int best_d = 4;
  for (size_t k = 0; k < NKNOWN; k++) {
    if (strlen(known_env[k]) == len && !strncmp(name, known_env[k], len)) return known_env[k];
    int d = edit_distance(name, len, known_env[k]);
    if (d < best_d && 2 * d < (int)len - 5) { best_d = d; best = known_env[k]; }
  }
  return best;
}

const char *kcclSettingClosest(const char *name) { return name ? closest(name, strlen(name)) : NULL; }

/* The launcher's word that this process is not rank 0 of its job (MPICH / Intel MPI,
 * Open MPI, PMIx, Slurm, torchrun): then rank 0 speaks for the job. */
static int launcher_rank_nonzero(void) {
  static const char *const vars[] = {"PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v) return strcmp(v, "0") != 0;
  }
  return 0;
}

/* A misspelled setting would otherwise be ignored without a word: one line on stderr
 * per process (per job where the launcher tells the ranks apart) names every KCCL_*
 * variable that is not a setting, and the known one closest to each. */
int kcclSettingsWarnUnknown(void) {
  static atomic_int done;
  if (atomic_exchange(&done, 1)) return 0;
  extern char **environ;
  char line[1024];
  size_t used = 0;
  int n = 0;
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "KCCL_", 5) != 0) continue;
    const char *eq = strchr(*e, '=');
    size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
    const char *near = closest(*e, len);
    if (near && strlen(near) == len) continue; /* a setting */
    if (used < sizeof line)
      used += (size_t)snprintf(line + used, sizeof line - used, near ? "%s%.*s (did you mean %s?)" : "%s%.*s%s",
                               n ? ", " : "", (int)len, *e, near ? near : "");
    n++;
  }
  if (n && !launcher_rank_nonzero())
    fprintf(stderr, "[kccl pid %d] WARN %s: %s, ignored (python -m kccl.config lists the settings)\n", (int)getpid(),
            line, n == 1 ? "not a KCCL setting" : "not KCCL settings");
  return n;
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
  kcclSettingsWarnUnknown();
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->device = -1;
  for (int i = 0; i < KCCL_NSETTINGS; i++) {
    long long v = kccl_settings[i].def;
    kcclResult_t r = kcclSettingParse(kccl_settings[i].var, getenv(kccl_settings[i].var), &v);
    if (r != kcclSuccess) return r;
    setting_set(cfg, i, v);
  }
  return kcclSuccess;
}

int kccl_allreduce_algo(const kcclConfig_t *cfg, size_t bytes, size_t oneshot_max) {
  if (cfg->algo != kcclAlgoAuto) return cfg->algo;
  return bytes <= oneshot_max ? kcclAlgoOneShot : kcclAlgoTwoShot;
}
