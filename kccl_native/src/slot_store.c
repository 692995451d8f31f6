/* slot_store.c - how a rank writes its own shared slots: plain stores, or streaming
 * (non-temporal) stores when plain ones have become slow.
 *
 * A slot's lines were last read by the peers, so they sit in the peers' caches.  Where
 * the ranks' cores share a last-level cache that costs nothing.  Where they do not (a VM
 * whose vCPUs the host puts on different core complexes, for minutes at a time), every
 * plain store must first take its line back from the other cache and waits for it:
 * refilling such a slot runs about ten times slower than with streaming stores, which do
 * not fetch the line (bench/RESULTS.md, "Command 1, ten runs").  With a shared cache, streaming
 * stores cost instead: the readers then fetch the data from memory, not from the other
 * core's cache.  So with KCCL_SLOT_STORES=auto each plain fill of a large piece is timed;
 * SLOW_STREAK fills in a row slower than SLOW_BYTES_PER_NS switch this rank to streaming
 * stores for a period of pieces.  One slow fill is not enough there: a vCPU the host takes
 * away for a moment makes a few fills slow on a machine whose stores are fast.  After
 * the period one plain fill probes: slow, the rank streams again for twice the period (up
 * to MIN_PERIOD << MAX_DOUBLINGS); fast, it stays with plain stores, and FAST_STREAK fast
 * fills in a row bring the period back to MIN_PERIOD.  So a switch made by a moment's slowness costs a
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
#define SLOW_BYTES_PER_NS 4         /* 4 GB/s: far below a fill with a shared cache, above one without */
#define SLOW_STREAK 3
#define FAST_STREAK 8
#define MIN_PERIOD 16
#define MAX_DOUBLINGS 4             /* periods of 16 .. 256 pieces */
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

enum store { STORE_PLAIN, STORE_TIMED, STORE_STREAM };

/* How this rank writes a piece of `bytes` into its slot now: plain, plain and timed (auto
 * deciding), or streaming (one piece of a streaming period taken). */
static enum store store_for(struct kcclComm *c, size_t bytes) {
  if (!HAVE_STREAM || bytes < TIMED_MIN_BYTES) return STORE_PLAIN;
  if (c->cfg.slot_stores != SLOT_STORES_AUTO) return c->cfg.slot_stores == SLOT_STORES_STREAM ? STORE_STREAM : STORE_PLAIN;
  if (c->stream_left == 0) return STORE_TIMED;
  c->stream_left--;
  return STORE_STREAM;
}

/* Under auto: a plain fill that took `ns` for `bytes`; may start a streaming period. */
static void after_timed_fill(struct kcclComm *c, int64_t ns, size_t bytes) {
  if (ns <= (int64_t)(bytes / SLOW_BYTES_PER_NS)) {
    c->slow_fills = 0;
    c->probing = 0;
    if (++c->fast_fills >= FAST_STREAK) c->stream_doublings = 0;
    return;
  }
  c->fast_fills = 0;
  if (!c->probing && ++c->slow_fills < SLOW_STREAK) return;
  c->slow_fills = 0;
  c->probing = 1; /* the first plain fill after this period */
  c->stream_left = MIN_PERIOD << c->stream_doublings;
  uint64_t k = ++c->stream_switches;
  while (k % 10 == 0) k /= 10;
  if (k == 1) /* the 1st, 10th, 100th, ... switch */
    kccl_log(2, "rank %d: plain fills of its slots ran below %d GB/s; streaming stores for %u pieces (switch %llu)",
             c->rank, SLOW_BYTES_PER_NS, c->stream_left, (unsigned long long)c->stream_switches);
  if (c->stream_doublings < MAX_DOUBLINGS) c->stream_doublings++;
}

void kccl_slot_fill(struct kcclComm *c, uint8_t *dst, const void *src, size_t bytes) {
  switch (store_for(c, bytes)) {
  case STORE_STREAM:
    stream_copy(dst, src, bytes);
    fence();
    return;
  case STORE_TIMED: {
    int64_t t0 = kccl_now_ns();
    memcpy(dst, src, bytes);
    after_timed_fill(c, kccl_now_ns() - t0, bytes);
    return;
  }
  case STORE_PLAIN:
    memcpy(dst, src, bytes);
  }
}

void kccl_slot_reduce(struct kcclComm *c, uint8_t *dst, void *also, const void *const *in, int nin,
                      size_t count, kcclDataType_t dt, kcclRedOp_t op) {
  const size_t es = kccl_dtype_size(dt), bytes = count * es;
  if (store_for(c, bytes) != STORE_STREAM) { /* only fills are timed */
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
