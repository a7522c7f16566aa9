"""openxla/tokamax, an optional benchmark-only dependency: its GPU `ragged_dot` kernels
(Mosaic GPU, Triton; on Hopper a Mosaic GPU kernel that dequantizes qwix-quantized
right-hand sides in registers) timed beside this project's kernels.

tokamax and the packages it imports travel to the device as wheels (bench/README.md), all but
xprof (22 MB, over what a device call carries beside the tree), which tokamax imports only for
its own benchmarking helpers: a stand-in module takes its place. Where tokamax is missing, or
the backend is not a GPU, its variants are left out with the reason printed."""

from __future__ import annotations

import importlib.util
import sys
import types


def load_tokamax():
    """The tokamax module, or None (the reason printed) off a GPU or where it does not import."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:  # tokamax's package imports it for its benchmarking helpers
        stand_in_for_xprof()
    try:
        import tokamax
    except Exception as error:  # ImportError, or a version that does not import under this jax
        print(f"tokamax not measured: {type(error).__name__}: {error}", flush=True)
        return None
    from absl import flags

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, which would parse the script's arguments
        flags.FLAGS(sys.argv[:1])
    return tokamax


def stand_in_for_xprof() -> None:
    """An `xprof.cli.tools` whose one name tokamax imports fails only if called."""

    def get_kernel_stats_tool(*args, **kwargs):
        raise RuntimeError("xprof is not installed; tokamax's benchmarking helpers need it.")

    tools = types.ModuleType("xprof.cli.tools")
    tools.get_kernel_stats_tool = get_kernel_stats_tool
    for name, module in (("xprof", types.ModuleType("xprof")), ("xprof.cli", types.ModuleType("xprof.cli")),
                         ("xprof.cli.tools", tools)):
        sys.modules.setdefault(name, module)
    sys.modules["xprof"].cli = sys.modules["xprof.cli"]
    sys.modules["xprof.cli"].tools = tools
