"""The numpy float32 reference model (model.py), whole or as one lane of several
(sharded.py): what the native CPU and CUDA engines are tested against."""
