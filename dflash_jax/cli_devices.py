"""The command line's devices: `--tensor-parallel N` and, for one model over several processes
or hosts, `--coordinator HOST:PORT --num-processes P --process-id I` (`jax.distributed`).

Every process runs the same command with its own `--process-id`; process 0 hosts the
coordinator. `start_devices` joins the processes (before anything touches a device) and
returns the mesh the models are loaded on: the first N devices of all processes together.
"""

from __future__ import annotations

import argparse

import jax


def add_device_arguments(parser: argparse.ArgumentParser, *, multi_process: bool = True) -> None:
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split each model over N devices (of all processes together)")
    if not multi_process:
        return
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the jax.distributed coordinator (process 0's address) when one model spans "
                        "several processes or hosts")
    parser.add_argument("--num-processes", type=int, metavar="P", help="processes taking part (with --coordinator)")
    parser.add_argument("--process-id", type=int, metavar="I", help="this process's rank, 0 .. P - 1")


def start_devices(args: argparse.Namespace):
    """Join the other processes if asked (`jax.distributed.initialize`, CPU collectives over
    gloo), then the ("data", "model") mesh of `--tensor-parallel` devices; None for one device."""
    from dflash_jax.sharding import make_mesh

    distributed = getattr(args, "coordinator", None) is not None or (getattr(args, "num_processes", None) or 1) > 1
    if distributed:
        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id too (the same command on "
                             "every process, each with its own id).")
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"--process-id must lie in [0, {args.num_processes}), got {args.process_id}.")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    tensor_parallel = args.tensor_parallel
    if tensor_parallel < 1 or tensor_parallel > jax.device_count():
        raise ValueError(f"--tensor-parallel must lie in [1, {jax.device_count()}] (the devices there are), "
                         f"got {tensor_parallel}.")
    if tensor_parallel == 1 and not distributed:
        return None
    return make_mesh(tensor_parallel, 1, devices=jax.devices()[:tensor_parallel])
