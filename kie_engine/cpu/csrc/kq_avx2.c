/* placeholder until the AVX2 kernels land */
#include "kq_internal.h"
const kq_impl *const kq_impl_avx2 = NULL;
