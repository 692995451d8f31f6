/* placeholder until the AVX-512 kernels land */
#include "kq_internal.h"
const kq_impl *const kq_impl_avx512 = NULL;
