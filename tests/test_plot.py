"""k3jax.plot on the metrics of a run of k3_tiny (cut to two layers): the AttnRes depth-weight
heatmap is drawn from the per-sub-layer ``depth_weights [N + 1]`` entries the model logs (and from
scanned ``[R, N + 1]``)."""

import jax
import numpy as np

from configs.k3_tiny import model_config
from k3jax.model import K3Model, init_variables
from k3jax.plot import depth_weight_rows, plot_runs
from k3jax.train.metrics import MetricsWriter, flatten


def _tiny_diag() -> dict:
    """k3_tiny cut to two layers (KDA with a dense FFN, then MLA with MoE, the AttnRes blocks as
    configured): every kind of sub-layer logs its read, at half the compile time."""
    cfg = model_config().replace(num_layers=2, mla_every=2)
    variables = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    apply = jax.jit(lambda v, t: K3Model(cfg).apply(v, t, mutable=["diagnostics"]))
    _, mut = apply(variables, tokens)
    return cfg, flatten(mut["diagnostics"], "diag/")


def test_depth_heatmap_is_drawn_for_a_k3_tiny_run(tmp_path):
    cfg, diag = _tiny_diag()
    (tmp_path / "tiny").mkdir()
    writer = MetricsWriter(tmp_path / "tiny", tensorboard=False)
    writer.write(0, "train", {"loss": 5.0})
    writer.write(10, "eval", {"loss": 4.0, "bpb": 6.0, **diag})
    writer.close()

    labels, rows = depth_weight_rows(diag)
    # One read per sub-layer, then the final aggregation, in depth order.
    assert len(labels) == cfg.num_sublayers + 1
    assert labels[:3] == ["layer_0/residual_mixer", "layer_0/residual_ffn",
                          "layer_1/residual_mixer"]
    assert labels[-1] == "final_residual"
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, rtol=1e-5)  # a softmax over the sources
    assert rows[0, 0] == 1.0  # the first read sees only the embedding

    paths = plot_runs([str(tmp_path / "tiny")], tmp_path / "plots")
    heatmap = tmp_path / "plots" / "attnres_depth_tiny.png"
    assert heatmap in paths and heatmap.stat().st_size > 1000


def test_scanned_depth_weights_become_one_row_per_repeat():
    record = {"diag/block_0_scan/layer_0/residual_mixer/depth_weights": [[1.0, 0.0], [0.5, 0.5]],
              "diag/layer_10/residual_ffn/depth_weights": [0.2, 0.8],
              "diag/layer_9/residual_ffn/depth_weights": [0.3, 0.7],
              "diag/final_residual/depth_weights": [0.1, 0.9],
              "diag/final_residual/block_rms": [1.0, 2.0]}
    labels, rows = depth_weight_rows(record)
    assert labels == ["block_0_scan/layer_0/residual_mixer[0]",
                      "block_0_scan/layer_0/residual_mixer[1]",
                      "layer_9/residual_ffn", "layer_10/residual_ffn", "final_residual"]
    np.testing.assert_array_equal(rows[2], [0.3, 0.7])
