"""Checkpoint formats other than the library's own orbax folders: HF folders (safetensors, or
PyTorch with the torch extra) and llama.cpp GGUF files, read into models, converted to orbax,
and models written back as HF folders. The library loads such checkpoints on the fly with
these modules; `convert` and `dflash-jax convert` build the conversion on them."""
