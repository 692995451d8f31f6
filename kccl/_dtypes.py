"""kccl.h's kcclDataType_t codes, for the modules that turn buffers into them
(_buffers.py, _dlpack.py, _cuda_buffers.py) without importing one another."""
from ._native import lib

INT8, UINT8, INT32, UINT32, INT64, UINT64 = (lib.kcclInt8, lib.kcclUint8, lib.kcclInt32, lib.kcclUint32,
                                             lib.kcclInt64, lib.kcclUint64)
FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = lib.kcclFloat16, lib.kcclFloat32, lib.kcclFloat64, lib.kcclBfloat16
