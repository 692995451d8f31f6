/* kq.h: matrix-vector products on weights kept in their GGUF block formats.
 *
 * This is the seam between the CPU engine's decode step (kie_cpu.h, which walks the
 * model and splits each product over its threads by rows) and the kernels (one dot
 * product per block type, picked at run time from the CPU's features).  Every
 * function is thread-safe; none allocates.
 *
 * A product is two calls: kq_prepare_act converts the input vector once into the
 * form the weight type's dot product consumes (float for float weights, 8-bit blocks
 * with their scales for the quantized ones), then any number of threads each call
 * kq_matvec on their own row range with that same prepared input. */
#ifndef KQ_H
#define KQ_H

#include <stddef.h>
#include <stdint.h>

/* GGUF / ggml tensor type codes, as the file stores them */
#define KQ_F32 0
#define KQ_F16 1
#define KQ_Q4_0 2
#define KQ_Q4_1 3
#define KQ_Q8_0 8
#define KQ_Q4_K 12
#define KQ_Q6_K 14
#define KQ_BF16 30

/* 1 when the kernels take weights of this type, else 0 */
int kq_supported(int type);
/* "Q4_1", "BF16", ...; "?" for a code this file does not know */
const char *kq_type_name(int type);
/* elements per block (1 for the float types, 32, 256) */
int64_t kq_block_elems(int type);
/* bytes of one row of `cols` weights; 0 when the type is unsupported or cols is not a
 * multiple of its block */
size_t kq_row_bytes(int type, int64_t cols);
/* bytes of the prepared input for `cols` inputs against weights of `type` */
size_t kq_act_bytes(int type, int64_t cols);
/* x (cols floats) -> act (kq_act_bytes(type, cols) bytes, 64-byte aligned) */
void kq_prepare_act(int type, const float *x, int64_t cols, void *act);
/* y[r] = dot(row r of w, x) for r in [r0, r1); w points at row 0, rows are
 * kq_row_bytes(type, cols) apart; act from kq_prepare_act with the same type and cols */
void kq_matvec(int type, const void *w, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1);
/* The sixteen-row packed layout of Q8_0, Q4_0 and Q4_1 (type | KQ_PACKED).  A matrix of
 * R rows is padded with zero rows to R16 = R rounded up to 16; groups of sixteen rows are
 * interleaved block by block, quants and scales in two regions:
 *   quants  [R16 / 16][cols / 32][qb / 4 pieces][16 rows][4 bytes]
 *                                               qb = 32 (Q8_0) or 16 (the nibbles)
 *   scales  [R16 / 16][cols / 32][sb / 2][16 rows] halves: d (and m for Q4_1: sb = 4)
 * the same bytes as the GGUF rows (R16 * kq_row_bytes), reordered so that a thread's
 * share of rows is one sequential stream of full 64-byte lines (the GGUF rows, 34 or
 * 20-byte blocks, a kernel reading four rows at once, streamed at a third of the
 * machine's read bandwidth, the packed layout at nearly all of it: bench/RESULTS.md),
 * and the sixteen rows' 4-byte pieces j side by side: one 64-byte register holds piece j
 * of every row of the group, one VNNI product takes it against an input's piece j
 * broadcast, and each lane is one row all along (no sums across lanes, no input laid out
 * again per kernel: kq_avx512.c, kq_avx512_mm.c). */
#define KQ_PACKED 0x100
/* bytes of the packed form of a rows x cols matrix of `type`; 0 when the type has no
 * packed form (or the rows are too long for the portable path: > 16 kB) */
size_t kq_packed_bytes(int type, int64_t rows, int64_t cols);
/* rows per group of the packed layout */
#define KQ_GROUP 16
/* src (rows GGUF rows) -> dst (kq_packed_bytes bytes, 64-byte aligned); returns the
 * packed type code, or -1 when the type has no packed form */
int kq_pack(int type, const void *src, int64_t rows, int64_t cols, void *dst);
/* kq_matvec for any type, packed ones included (they need the matrix's row count) */
void kq_matvec_mat(int type, const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0,
                   int64_t r1);
/* Where rows [r0, r1) of a matrix at w (rows x cols of `type`, packed or not) lie: at
 * most 2 spans (the packed layout's quants and scales), written to p[] / n[]; returns
 * how many (0 for an empty range or a type the kernels do not take). */
int kq_share_spans(int type, const void *w, int64_t rows, int64_t cols, int64_t r0, int64_t r1, const void **p,
                   size_t *n);
/* Several inputs per pass over the weights (a prompt's tokens, a batch of sequences):
 * each weight block is read once and applied to every input.  The nt prepared inputs
 * lie kq_act_bytes(type, cols) apart; kq_acts_bytes: the whole buffer. */
size_t kq_acts_bytes(int type, int64_t cols, int nt);
/* Inputs [t0, t1) of the nt, row t of x at x + t * ldx floats, into acts (64-byte
 * aligned, kq_acts_bytes): threads may prepare disjoint ranges of one buffer at once. */
void kq_prepare_acts(int type, const float *x, size_t ldx, int64_t cols, int nt, int t0, int t1, void *acts);
/* y[t * ldy + r] = dot(row r of w, input t) for t in [0, nt), r in [r0, r1): for each
 * input, bit for bit what kq_matvec_mat gives on that input alone (the tests hold every
 * level to that), so a batch computes what its members compute one at a time. */
void kq_matmul_mat(int type, const void *w, int64_t rows, int64_t cols, const void *acts, int nt, float *y,
                   size_t ldy, int64_t r0, int64_t r1);
/* one row to floats (embedding lookups, tests) */
void kq_dequant_row(int type, const void *row, int64_t cols, float *out);

/* The instruction set in use: "avx512" (F/BW/VL/DQ with VNNI; without VNNI a CPU runs
 * "avx2"), "avx2" (with FMA and F16C) or "scalar" (the portable C, also what arm64 runs:
 * there is no "neon" level yet); chosen once from CPUID at first use (KIE_CPU_HIDE=avx512,avx2
 * hides features from the choice). */
const char *kq_level(void);
/* Use `name` instead (tests run every path the CPU can): 0, or -1 when this CPU or
 * build cannot run it. */
int kq_set_level(const char *name);

#endif
