"""Running the model over a device mesh: mesh, shardings, multi-process setup.

The expert-parallel MoE dispatches run inside the model (:mod:`k3jax.ops.ep_dispatch`); they read
the mesh and rules that :func:`use_mesh` makes current.
"""

from k3jax.parallel.distributed import initialize_distributed, local_batch_rows, make_global_batch
from k3jax.parallel.mesh import (
    check_experts_fit,
    expert_axis_size,
    make_mesh,
    start_devices,
    use_mesh,
)
from k3jax.parallel.sharding import (
                                        batch_sharding,
                                        batch_shards,
                                        constrain,
                                        init_on_one_device,
                                        init_sharded,
                                        logical_to_sharding,
                                        shardings_of,
                                        variable_shardings,
)
from k3jax.parallel.step import (
                                        abstract_batch,
                                        batch_placement,
                                        compile_in_background,
                                        init_sharded_state,
                                        sharded_state_shapes,
                                        sharded_step,
                                        under_mesh,
)

__all__ = ["abstract_batch", "batch_placement", "batch_sharding", "batch_shards",
           "check_experts_fit", "compile_in_background", "constrain", "expert_axis_size",
           "init_on_one_device", "init_sharded", "init_sharded_state", "initialize_distributed",
           "local_batch_rows",
           "logical_to_sharding", "make_global_batch", "make_mesh", "sharded_state_shapes",
           "sharded_step", "shardings_of", "start_devices", "under_mesh", "use_mesh",
           "variable_shardings"]
