/* slot_store.c - how a rank writes its own shared slots: plain stores, or streaming
 * (non-temporal) stores when plain ones have become slow.
 *
 * A slot's lines were last read by the peers, so they sit in the peers' caches.  Where
 * the ranks' cores share a last-level cache that costs nothing.  Where they do not (a VM
 * whose vCPUs the host puts on different core complexes, for minutes at a time), every
 * plain store must first take its line back from the other cache and waits for it:
 * refilling such a slot ran at 2-3 GB/s, against 20-28 GB/s with streaming stores, which
 * do not fetch the line (bench/RESULTS.md, "Command 1").  With a shared cache, streaming
 * stores cost instead: the readers then fetch the data from memory, not from the other
 * core's cache.  So with KCCL_SLOT_STORES=auto each plain fill of a large piece is timed;
 * SLOW_STREAK fills in a row slower than SLOW_BYTES_PER_NS switch this rank to streaming
 * stores for a period of pieces.  One slow fill is not enough there: a vCPU the host takes
 * away for a moment makes ~0.4 % of fills slow on a machine whose stores are fast.  After
 * the period one plain fill probes: slow, the rank streams again for twice the period (up
 * to MAX_PERIOD); fast, it stays with plain stores, and FAST_STREAK fast fills in a row
 * bring the period back to MIN_PERIOD.  So a switch made by a moment's slowness costs a
 * short period, and a lasting placement pays one slow fill per long one.
 *
 * The choice is each rank's own: readers see a slot's data only after its flag, and the
 * streaming stores are fenced before any flag is published. */
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

enum { SLOT_STORES_AUTO = 0, SLOT_STORES_PLAIN = 1, SLOT_STORES_STREAM = 2 };

#define TIMED_MIN_BYTES (64 * 1024) /* smaller fills are too short to time reliably */
#define SLOW_BYTES_PER_NS 4         /* 4 GB/s: between the 2-3 GB/s and 20+ GB/s above */
#define SLOW_STREAK 3
#define FAST_STREAK 8
#define MIN_PERIOD 16
#define MAX_PERIOD 256
#define TILE_BYTES (16 * 1024)      /* stream-mode reduction tile: stays in L1 */

/* dst[0, n) = src with streaming stores from dst's first 64-byte boundary on (a slot's
 * first line also holds its flag, which the readers poll: that line stays cached).  The
 * caller fences (fence()) before publishing. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
#if HAVE_STREAM
  size_t head = (size_t)(-(uintptr_t)dst & (KCCL_LINE - 1));
  if (head > n) head = n;
  memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
    _mm_stream_si128((__m128i *)(dst + i), a);
    _mm_stream_si128((__m128i *)(dst + i + 16), b);
    _mm_stream_si128((__m128i *)(dst + i + 32), c);
    _mm_stream_si128((__m128i *)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, n - i);
#else
  memcpy(dst, src, n);
#endif
}

static void fence(void) {
#if HAVE_STREAM
  _mm_sfence(); /* streaming stores are weakly ordered: before the flag that publishes them */
#endif
}

static int streaming(struct kcclComm *c, size_t bytes) {
  if (!HAVE_STREAM || bytes < TIMED_MIN_BYTES) return 0;
  if (c->cfg.slot_stores != SLOT_STORES_AUTO) return c->cfg.slot_stores == SLOT_STORES_STREAM;
  if (c->stream_left == 0) return 0;
  c->stream_left--;
  return 1;
}

/* Plain-store fill of a large piece under auto: timed. */
static void plain_fill_timed(struct kcclComm *c, uint8_t *dst, const void *src, size_t bytes) {
  int timed = HAVE_STREAM && bytes >= TIMED_MIN_BYTES && c->cfg.slot_stores == SLOT_STORES_AUTO;
  int64_t t0 = timed ? kccl_now_ns() : 0;
  memcpy(dst, src, bytes);
  if (!timed) return;
  if (c->stream_period < MIN_PERIOD) c->stream_period = MIN_PERIOD;
  if (kccl_now_ns() - t0 <= (int64_t)(bytes / SLOW_BYTES_PER_NS)) {
    c->slow_fills = 0;
    c->probing = 0;
    if (++c->fast_fills >= FAST_STREAK) c->stream_period = MIN_PERIOD;
    return;
  }
  c->fast_fills = 0;
  if (!c->probing && ++c->slow_fills < SLOW_STREAK) return;
  c->slow_fills = 0;
  c->probing = 1; /* the first plain fill after this period */
  c->stream_left = c->stream_period;
  uint64_t k = ++c->stream_switches;
  while (k % 10 == 0) k /= 10;
  if (k == 1) /* the 1st, 10th, 100th, ... switch */
    kccl_log(2, "rank %d: plain fills of its slots ran below %d GB/s; streaming stores for %u pieces (switch %llu)",
             c->rank, SLOW_BYTES_PER_NS, c->stream_period, (unsigned long long)c->stream_switches);
  if (c->stream_period < MAX_PERIOD) c->stream_period *= 2;
}

void kccl_slot_fill(struct kcclComm *c, uint8_t *dst, const void *src, size_t bytes) {
  if (streaming(c, bytes)) {
    stream_copy(dst, src, bytes);
    fence();
  } else
    plain_fill_timed(c, dst, src, bytes);
}

void kccl_slot_reduce(struct kcclComm *c, uint8_t *dst, void *also, const void *const *in, int nin,
                      size_t count, kcclDataType_t dt, kcclRedOp_t op) {
  const size_t es = kccl_dtype_size(dt), bytes = count * es;
  if (!streaming(c, bytes)) {
    kccl_reduce(dst, in, nin, count, dt, op, c->nranks);
    memcpy(also, dst, bytes);
    return;
  }
  /* Reduce a tile into L1, then stream it to the slot and copy it to `also`. */
  _Alignas(64) uint8_t tile[TILE_BYTES];
  const void *at[KCCL_MAX_RANKS];
  const size_t per = TILE_BYTES / es;
  for (size_t off = 0; off < count; off += per) {
    size_t m = count - off < per ? count - off : per;
    for (int p = 0; p < nin; p++) at[p] = (const uint8_t *)in[p] + off * es;
    kccl_reduce(tile, at, nin, m, dt, op, c->nranks);
    stream_copy(dst + off * es, tile, m * es);
    memcpy((uint8_t *)also + off * es, tile, m * es);
  }
  fence();
}
