"""Per-device memory of a training state over a mesh, computed before anything is allocated.

The training state (parameters, optimiser moments, counters) is sharded as the training loop
shards it: parameters by their logical names through the rules table, optimiser leaves like the
parameters they copy (:func:`~k3jax.parallel.sharding.like_params_shardings`), the rest
replicated. The gradients the step holds have the parameters' layout and dtype. Shard shapes
come from an abstract mesh of the asked axis sizes, so any mesh can be sized on any machine.
Activations are not counted here: XLA's memory analysis of the compiled step gives them
(``temp_GiB`` in ``benchmarks/step_profile.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import jax
from jax.sharding import AbstractMesh

from k3jax.config.base import ConfigError
from k3jax.config.mesh import MESH_AXES
from k3jax.model import abstract_variables_and_axes
from k3jax.parallel.sharding import like_params_shardings, logical_to_sharding
from k3jax.train.optim import build_optimizer
from k3jax.train.step import init_state


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds (the largest over devices: shards are equal or padded)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _shard_bytes(tree, shardings) -> int | None:
    """Bytes of one device's shards of ``tree``; None when a sharded dimension does not divide."""
    try:
        return sum(math.prod(sh.shard_shape(tuple(x.shape))) * x.dtype.itemsize
                   for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
    except ValueError:
        return None


def abstract_state(cfg) -> tuple[dict, dict, dict]:
    """``(params, logical axes, optimiser state)`` of ``cfg`` (an ExperimentConfig) as shapes."""
    variables, variable_axes = abstract_variables_and_axes(cfg.model)
    params, axes = variables["params"], variable_axes["params"]
    optimizer = build_optimizer(cfg.optim, cfg.train.steps, params, axes)
    state = jax.eval_shape(lambda p, b: init_state(p, b, optimizer, cfg.train.seed), params,
                           variables.get("balance", {}))
    return params, axes, state["opt_state"]


def state_bytes_per_device(cfg, sizes: Mapping[str, int], abstract=None) -> StateBytes | None:
    """Per-device bytes of ``cfg``'s training state on a mesh of axis ``sizes`` (``{"fsdp": 8,
    ...}``; missing axes are 1), or None when the mesh does not divide a sharded dimension.
    ``abstract``: :func:`abstract_state`'s result, to size several meshes for one trace."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ConfigError(f"state_bytes_per_device: unknown mesh axes {sorted(unknown)}; "
                          f"expected some of {MESH_AXES}")
    params, axes, opt_state = abstract or abstract_state(cfg)
    mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)
    param_sh = logical_to_sharding(axes, mesh, cfg.mesh.rules)
    p = _shard_bytes(params, param_sh)
    o = _shard_bytes(opt_state, like_params_shardings(opt_state, params, param_sh, mesh))
    return None if p is None or o is None else StateBytes(params=p, grads=p, optimizer=o)


def smallest_mesh(cfg, sizes: Mapping[str, int], budget_bytes: float,
                  max_devices: int = 4096, abstract=None) -> dict[str, int] | None:
    """The mesh with the fewest devices whose per-device state fits ``budget_bytes``: ``fsdp``
    and (with a MoE) ``expert`` sizes over the powers of two, ``data`` and ``tensor`` as in
    ``sizes``; None if none up to ``max_devices`` devices fits. ``abstract`` as in
    :func:`state_bytes_per_device`."""
    abstract = abstract or abstract_state(cfg)
    fixed = math.prod(v for k, v in sizes.items() if k not in ("fsdp", "expert"))
    experts = cfg.model.moe.num_experts if cfg.model.moe is not None else 1
    powers = [2**i for i in range(13) if 2**i * fixed <= max_devices]
    candidates = sorted(((f, e) for f in powers for e in powers
                         if f * e * fixed <= max_devices and experts % e == 0),
                        key=lambda fe: (fe[0] * fe[1], fe[1]))
    for fsdp, expert in candidates:
        trial = {**sizes, "fsdp": fsdp, "expert": expert}
        need = state_bytes_per_device(cfg, trial, abstract)
        if need is not None and need.total <= budget_bytes:
            return trial
    return None


def check_state_fits(cfg, sizes: Mapping[str, int], device_bytes: float | None,
                     share: float = 0.6, abstract=None) -> StateBytes | None:
    """Refuse a mesh whose per-device state (parameters, gradients, optimiser state) takes more
    than ``share`` of a device's memory (the rest is for activations), naming the smallest mesh
    that fits (:func:`smallest_mesh`). ``device_bytes`` None (unknown, e.g. the CPU) checks
    nothing. ``abstract`` as in :func:`state_bytes_per_device`. Returns the per-device state
    (None when the mesh does not divide a sharded dimension, which fails with its own error)."""
    need = state_bytes_per_device(cfg, sizes, abstract)
    budget = None if device_bytes is None else share * device_bytes
    if need is None or budget is None or need.total <= budget:
        return need
    fits = smallest_mesh(cfg, sizes, budget, abstract=abstract)
    asked = ", ".join(f"{k}={v}" for k, v in sizes.items())
    hint = ("the smallest mesh that fits: " + ", ".join(f"mesh.{k}={v}" for k, v in fits.items())
            + f" ({math.prod(fits.values())} devices)" if fits
            else "no fsdp x expert mesh up to 4096 devices fits")
    raise ConfigError(
        f"mesh ({asked}): the training state needs {describe(need)} per device, over "
        f"{share:.0%} of the device's {device_bytes / 2**30:.1f} GiB; {hint}")


def size(n: float) -> str:
    """``"12.4 GiB"``, or ``"37.5 MiB"`` under a GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe(need: StateBytes) -> str:
    """``"12.4 GiB (parameters 4.0 GiB, gradients 4.0 GiB, optimiser 4.3 GiB)"``."""
    return (f"{size(need.total)} (parameters {size(need.params)}, gradients "
            f"{size(need.grads)}, optimiser {size(need.optimizer)})")


def memory_line(state: StateBytes | None, temp: int | None) -> str:
    """The training loop's per-device memory line: the state (sized before the compile) and
    XLA's temporaries of the compiled step (activations and workspaces)."""
    held = "unknown" if state is None else describe(state)
    extra = "" if temp is None else f"; XLA's temporaries {size(temp)}"
    return f"[memory] per device: training state {held}{extra}"


def memory_record(state: StateBytes | None, temp: int | None) -> dict:
    """The same in bytes, for ``metrics.jsonl``'s compile record."""
    record = {} if state is None else {"state_bytes": state.total}
    return record if temp is None else {**record, "temp_bytes": temp}


def main(argv=None) -> int:
    """The per-device training state of a preset on a mesh, and whether it fits a device of a
    given memory (what ``train.py`` checks before it compiles), from shapes alone."""
    import argparse
    import json
    import sys

    from k3jax.config.experiment import load_config
    from k3jax.config.mesh import parse_sizes

    ap = argparse.ArgumentParser(prog="python -m k3jax.train.memory",
                                 description=main.__doc__.replace("\n    ", " "))
    ap.add_argument("--config", required=True, help="preset file or preset name (k3_1b)")
    ap.add_argument("--mesh", default="data=1", help="axis sizes, e.g. fsdp=4,expert=2")
    ap.add_argument("--device-gib", type=float,
                    help="refuse, as train.py does, a state over 60%% of a device of this many "
                         "GiB (an H200: 141), naming the smallest mesh that fits")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    try:
        sizes = parse_sizes(args.mesh, "--mesh")
        cfg = load_config(args.config)
        device = None if args.device_gib is None else args.device_gib * 2**30
        need = check_state_fits(cfg, sizes, device, abstract=abstract_state(cfg))
        if need is None:
            raise ConfigError(f"--mesh {args.mesh}: a sharded dimension of the state does not "
                              f"divide by its axis size")
    except ValueError as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    mesh = ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "one device"
    if args.json:
        print(json.dumps({"config": args.config, "mesh": sizes, "params": need.params,
                          "grads": need.grads, "optimizer": need.optimizer,
                          "total": need.total}))
    else:
        print(f"{args.config} ({mesh}): training state {describe(need)} per device")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
