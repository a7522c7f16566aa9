"""Read the tensors of a HF checkpoint folder, lazily and by name, without torch when possible.

Formats: `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), and, with
the `torch` extra, `pytorch_model.bin` (sharded or not) or a single `.pt` state dict. Shapes
are known before any tensor is read, so the converter can refuse a mismatch without loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or file at fault."""


# safetensors' dtype codes -> numpy names.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}


class TensorSource:
    """name -> shape, name -> stored dtype name (where the format says it without reading the
    tensor) and name -> array (jax or numpy), over every file of one checkpoint."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], getter, dtypes: dict[str, str] | None = None):
        self.shapes = shapes
        self.dtypes = dtypes or {}
        self._get = getter

    def get(self, name: str):
        return self._get(name)


def safetensors_files(model_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """A folder's safetensors files and, where it has an index, which file holds each tensor:
    the index's files, else every `*.safetensors` (and None)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = {name: model_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        return sorted(set(weight_map.values())), weight_map
    return sorted(model_dir.glob("*.safetensors")), None


def open_checkpoint(model_dir: str | Path) -> TensorSource:
    model_dir = Path(model_dir)
    files, weight_map = safetensors_files(model_dir)
    if files:
        return mxfp4_dequantized(_safetensors_source(files, weight_map))
    torch_files = sorted(model_dir.glob("pytorch_model*.bin")) or sorted(model_dir.glob("*.pt"))
    if torch_files:
        return _torch_source(torch_files)
    if (model_dir / "params").is_dir():
        raise ConversionError(
            f"{model_dir} looks like a converted checkpoint without its dflash_jax.json (an incomplete copy?); "
            "convert the HF checkpoint again."
        )
    raise ConversionError(
        f"no weights found in {model_dir}: expected *.safetensors, "
        "model.safetensors.index.json, pytorch_model*.bin or *.pt."
    )


# The 16 values of an FP4 (e2m1) nibble, by its bits.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def mxfp4_dequantized(source: TensorSource) -> TensorSource:
    """`source` with each MXFP4 pair `NAME_blocks` [E, out, G, 16] (two FP4 values a byte, low
    nibble first) + `NAME_scales` [E, out, G] (a power of two per 32 values, biased by 127)
    read as one float32 tensor `NAME` [E, in = 32 G, out]: gpt-oss's published experts,
    dequantized at conversion."""
    pairs = {name.removesuffix("_blocks") for name in source.shapes
             if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in source.shapes}
    if not pairs:
        return source

    def dequantized(name):
        blocks, scales = np.asarray(source.get(f"{name}_blocks")), np.asarray(source.get(f"{name}_scales"))
        if blocks.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
            raise ConversionError(f"{name}_blocks / {name}_scales are not MXFP4 blocks and scales ({blocks.dtype} "
                                  f"{list(blocks.shape)}, {list(scales.shape)}); the checkpoint is damaged.")
        values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1).reshape(*scales.shape, -1)
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
        return np.ascontiguousarray(values.reshape(*scales.shape[:-1], -1).swapaxes(1, 2))

    shapes, dtypes = dict(source.shapes), dict(source.dtypes)
    for name in pairs:
        experts, out, groups, width = shapes.pop(f"{name}_blocks")
        shapes[name], dtypes[name] = (experts, groups * width * 2, out), "float32"
        del shapes[f"{name}_scales"]
    return TensorSource(shapes, lambda name: dequantized(name) if name in pairs else source.get(name), dtypes)


def _safetensors_source(files: list[Path], weight_map: dict[str, Path] | None = None) -> TensorSource:
    """The tensors of `files`; with an index's `weight_map`, each named tensor from the file
    the index maps it to (another file holding the same name is not read for it)."""
    from safetensors import SafetensorError, safe_open

    handles, shapes, dtypes, owner, paths = [], {}, {}, {}, {}
    for path in files:
        if not path.is_file():
            raise ConversionError(f"{path} is listed in the index but does not exist.")
        try:
            handle = safe_open(str(path), framework="flax")
        except SafetensorError as err:
            raise ConversionError(
                f"{path.name} is truncated or corrupt ({err}); download or export it again."
            ) from err
        handles.append(handle)
        for name in handle.keys():
            if weight_map is not None and weight_map.get(name, path) != path:
                continue
            tensor = handle.get_slice(name)
            shapes[name] = tuple(tensor.get_shape())
            dtypes[name] = SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype().lower())
            owner[name], paths[name] = handle, path

    def get(name):
        try:
            if dtypes[name].startswith("float8"):  # safetensors' numpy and flax readers have no 8-bit floats
                return _raw_tensor(paths[name], name, dtypes[name], shapes[name])
            return owner[name].get_tensor(name)
        except Exception as err:  # safetensors raises its own error types here
            raise ConversionError(f"cannot read tensor {name!r}: {err}") from err

    return TensorSource(shapes, get, dtypes)


def _raw_tensor(path: Path, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor read straight from a .safetensors file (an 8-byte header size, a JSON header
    of byte offsets, then the data), as the ml_dtypes type `dtype`."""
    import ml_dtypes

    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        start, stop = json.loads(f.read(header_size))[name]["data_offsets"]
        f.seek(8 + header_size + start)
        data = f.read(stop - start)
    return np.frombuffer(data, getattr(ml_dtypes, dtype)).reshape(shape)


def _torch_source(files: list[Path]) -> TensorSource:
    try:
        import torch
    except ImportError as err:
        raise ConversionError(
            f"{files[0].name} is a PyTorch checkpoint; install the torch extra "
            "(pip install 'dflash-jax[torch]') or convert it to safetensors."
        ) from err
    state = {}
    for path in files:
        try:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as err:  # torch raises many types for a bad file
            raise ConversionError(f"{path.name} is not a readable PyTorch state dict ({err}).") from err

    def get(name):
        tensor = state[name]
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: go through float32 (exact)
            import ml_dtypes

            return tensor.float().numpy().astype(ml_dtypes.bfloat16)
        return tensor.numpy()

    return TensorSource({name: tuple(t.shape) for name, t in state.items()}, get,
                        {name: str(t.dtype).removeprefix("torch.") for name, t in state.items()})
