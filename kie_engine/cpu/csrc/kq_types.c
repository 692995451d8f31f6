/* kq_types.c: what each GGUF type is (name, block, bytes) and the sizes of the
 * prepared input; no arithmetic.  The table is kie_engine/formats/gguf_types.py's: the build
 * (../_build.py) refuses to compile when the two differ. */
#include "kq_internal.h"

typedef struct { int type; const char *name; int64_t elems; size_t bytes; } kq_type_info;

static const kq_type_info kq_types[] = {
    {KQ_F32, "F32", 1, 4},          {KQ_F16, "F16", 1, 2},          {KQ_BF16, "BF16", 1, 2},
    {KQ_Q8_0, "Q8_0", 32, 34},      {KQ_Q4_0, "Q4_0", 32, 18},      {KQ_Q4_1, "Q4_1", 32, 20},
    {KQ_Q4_K, "Q4_K", 256, 144},    {KQ_Q6_K, "Q6_K", 256, 210},
};

static const kq_type_info *kq_info(int type)
{
    size_t qb, sb;
    if (type & KQ_PACKED) { /* sizes per row as the base type's: the packed form only reorders */
        if (!kq_packed_parts(type & ~KQ_PACKED, &qb, &sb))
            return NULL;
        type &= ~KQ_PACKED;
    }
    for (size_t i = 0; i < sizeof kq_types / sizeof kq_types[0]; i++)
        if (kq_types[i].type == type)
            return &kq_types[i];
    return NULL;
}

int kq_supported(int type) { return kq_info(type) != NULL; }

const char *kq_type_name(int type)
{
    const kq_type_info *t = kq_info(type);
    if (t && (type & KQ_PACKED))
        return type == (KQ_Q8_0 | KQ_PACKED) ? "Q8_0x16" : type == (KQ_Q4_0 | KQ_PACKED) ? "Q4_0x16" : "Q4_1x16";
    return t ? t->name : "?";
}

int64_t kq_block_elems(int type)
{
    const kq_type_info *t = kq_info(type);
    return t ? t->elems : 0;
}

size_t kq_row_bytes(int type, int64_t cols)
{
    const kq_type_info *t = kq_info(type);
    if (!t || cols <= 0 || cols % t->elems)
        return 0;
    return (size_t)(cols / t->elems) * t->bytes;
}

static int kq_is_float(int type) { return type == KQ_F32 || type == KQ_F16 || type == KQ_BF16; }

size_t kq_act_bytes(int type, int64_t cols)
{
    if (!kq_row_bytes(type, cols))
        return 0;
    if (kq_is_float(type))
        return kq_up64((size_t)cols * sizeof(float));
    return kq_act8_bytes(cols);
}
