"""dflash-jax: DFlash block speculative decoding in JAX, Flax NNX and Pallas."""

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.dense import draft_logits, draft_path, target_forward
from dflash_jax.engine import Engine
from dflash_jax.generate import GenerateResult, generate, generate_autoregressive
from dflash_jax.kernels import Kernels
from dflash_jax.loading import load_drafter, load_target
from dflash_jax.models import Drafter, Target
from dflash_jax.requests import RequestOutput, RequestStats, SamplingParams
from dflash_jax.sharding import make_mesh

__all__ = [
    "ConfigError",
    "Drafter",
    "DrafterConfig",
    "Engine",
    "GenerateResult",
    "Kernels",
    "RequestOutput",
    "RequestStats",
    "SamplingParams",
    "Target",
    "TargetConfig",
    "draft_logits",
    "draft_path",
    "generate",
    "generate_autoregressive",
    "load_drafter",
    "load_target",
    "make_mesh",
    "target_forward",
]
