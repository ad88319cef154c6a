"""k3jax.plot on the metrics of a run of k3_tiny (cut to two layers): the AttnRes depth-weight
heatmap is drawn from the per-sub-layer ``depth_weights [N + 1]`` entries the model logs (and from
scanned ``[R, N + 1]``)."""

import functools

import jax
import numpy as np
from helpers import host_variables

from configs.k3_tiny import model_config
from k3jax.model import K3Model
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from k3jax.plot import depth_weight_rows, plot_runs, run_labels
from k3jax.train.metrics import MetricsWriter, flatten


def _diag(cfg, variables) -> dict:
    """The ``diag/...`` metrics a forward of ``cfg`` logs."""
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    apply = jax.jit(lambda v, t: K3Model(cfg).apply(v, t, mutable=["diagnostics"]))
    _, mut = apply(variables, tokens)
    return flatten(mut["diagnostics"], "diag/")


@functools.cache
def _tiny_diag() -> dict:
    """k3_tiny cut to two layers (KDA with a dense FFN, then MLA with MoE, the AttnRes blocks as
    configured): every kind of sub-layer logs its read, at half the compile time."""
    cfg = model_config().replace(num_layers=2, mla_every=2)
    return cfg, _diag(cfg, host_variables(cfg, 0))


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


def test_scanned_depth_weights_become_one_row_per_repeat_in_depth_order():
    # layers 0-1 and 4-5 scanned (one layer a group, two repeats), 2-3 and 6-7 unrolled, and a
    # group of period two covering layers 8-11
    record = {"diag/final_residual/depth_weights": [0.1, 0.9],
              "diag/final_residual/block_rms": [1.0, 2.0]}
    for i in (2, 3, 6, 7):
        record[f"diag/layer_{i}/residual_ffn/depth_weights"] = [i, 1.0]
        record[f"diag/layer_{i}/residual_mixer/depth_weights"] = [i, 0.0]
    for group, first, period in (("block_2_scan", 4, 1), ("block_0_scan", 0, 1),
                                 ("block_10_scan", 8, 2)):
        for k in range(period):
            for sub, last in (("residual_mixer", 0.0), ("residual_ffn", 1.0)):
                record[f"diag/{group}/layer_{k}/{sub}/depth_weights"] = [
                    [first + r * period + k, last] for r in range(2)]
    labels, rows = depth_weight_rows(record)
    assert labels == [f"layer_{i}/{sub}" for i in range(12)
                      for sub in ("residual_mixer", "residual_ffn")] + ["final_residual"]
    np.testing.assert_array_equal(rows[:-1], [[i, last] for i in range(12) for last in (0, 1)])


def test_depth_order_of_a_stack_mixing_scanned_and_unrolled_layers():
    """Its rows equal those of the same weights run unrolled, read for read."""
    from k3jax.config import ResidualConfig
    from k3jax.stack import plan_segments, unroll_params

    # two-layer AttnRes blocks: a KDA and an MLA layer are not a scan, the block of two KDA layers
    # after them is, so the scanned reads start two layers deep
    cfg = model_config().replace(num_layers=4, mla_layers=(1,), moe=None, dtype="float32",
                                 residual=ResidualConfig(kind="attnres", block_size_layers=2))
    assert [p.repeats for p in plan_segments(cfg)] == [0, 2]
    # Random queries (the initialiser's are zero: every read uniform over its sources): each read
    # has weights of its own, so a read placed at the wrong depth shows
    variables = host_variables(cfg, 0)
    unrolled = cfg.replace(scan_layers=False)
    scanned_labels, scanned = depth_weight_rows(_diag(cfg, variables))
    labels, rows = depth_weight_rows(
        _diag(unrolled, {"params": unroll_params(cfg, variables["params"])}))
    assert scanned_labels == labels and len(labels) == 2 * cfg.num_layers + 1
    assert rel_rms(rows, scanned) < FP32_TOL  # the same fp32 math, scanned or not
    assert np.count_nonzero(rows[-2]) > np.count_nonzero(rows[0])  # rows differ with depth


def test_runs_with_the_same_folder_name_keep_apart(tmp_path):
    _, diag = _tiny_diag()
    workdirs = [tmp_path / "a" / "tiny", tmp_path / "b" / "tiny"]
    for w, loss in zip(workdirs, (5.0, 4.0)):
        w.mkdir(parents=True)
        writer = MetricsWriter(w, tensorboard=False)
        writer.write(0, "eval", {"loss": loss, **diag})
        writer.close()
    assert run_labels([str(w) for w in workdirs]) == ["a/tiny", "b/tiny"]
    assert run_labels([str(workdirs[0])] * 2) == [str(workdirs[0]), f"{workdirs[0]}#2"]
    paths = plot_runs([str(w) for w in workdirs], tmp_path / "plots")
    assert {tmp_path / "plots" / f"attnres_depth_{n}_tiny.png" for n in "ab"} <= set(paths)
