/* util.c - helpers below every other file: sleeping, futex calls, and whether
 * a process is still the one a segment header names. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

void kccl_sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

long kccl_futex_wait(uint32_t *addr, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, FUTEX_WAIT, val, ts, NULL, 0);
}

long kccl_futex_wake(uint32_t *addr) { return syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* /proc/<pid>/stat read into buf; returns the text after the command name's
 * closing parenthesis (the name may contain spaces), or NULL. */
static const char *proc_stat_fields(pid_t pid, char *buf, size_t n) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NULL;
  ssize_t got = read(fd, buf, n - 1);
  close(fd);
  if (got <= 0) return NULL;
  buf[got] = 0;
  const char *p = strrchr(buf, ')');
  return (p && p[1] == ' ') ? p + 2 : NULL; /* at field 3, the state */
}

/* Start time of a process in clock ticks since boot (0 if unknown): with the
 * pid it names one process, even after the pid is reused. */
uint64_t kccl_proc_starttime(pid_t pid) {
  char buf[1024];
  const char *p = proc_stat_fields(pid, buf, sizeof buf);
  if (!p) return 0;
  for (int field = 3; *p && field < 22; p++) /* starttime is field 22 */
    if (*p == ' ') field++;
  return strtoull(p, NULL, 10);
}

static char proc_state(pid_t pid) {
  char buf[1024];
  const char *p = proc_stat_fields(pid, buf, sizeof buf);
  return p ? p[0] : 0;
}

/* Alive = exists, is not a zombie, and is the same process (start time). */
int kccl_pid_alive(pid_t pid, uint64_t starttime) {
  if (pid <= 0) return 0;
  if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
  char st = proc_state(pid);
  if (st == 0) return kill(pid, 0) == 0 || errno == EPERM; /* no /proc: trust kill() */
  if (st == 'Z' || st == 'X') return 0;
  if (starttime && kccl_proc_starttime(pid) != starttime) return 0;
  return 1;
}
