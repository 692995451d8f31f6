"""What KIE reads and writes: checkpoints (Hugging Face safetensors directories and GGUF
files, with their config, tokenizer and chat template), GGUF's block types in numpy, the
writers (`init`'s random checkpoints, `convert`), and where a short model name's file is.
Nothing here runs a model."""
