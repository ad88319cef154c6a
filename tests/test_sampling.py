"""Each sampling rule on hand-made logits (k3jax.generate.sampling); no model involved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config.base import ConfigError
from k3jax.generate.sampling import (
    SamplingConfig,
    repetition_penalty,
    sample,
    top_k_filter,
    top_p_filter,
)

LOGITS = jnp.array([[2.0, -1.0, 0.5, 3.0, -2.0]])  # order by value: 3, 0, 2, 1, 4


def test_greedy_is_the_arg_max_whatever_the_key():
    cfg = SamplingConfig(temperature=0.0)
    for seed in range(3):
        assert int(sample(LOGITS, jax.random.key(seed), cfg)[0]) == 3


def test_top_k_keeps_the_k_largest():
    out = np.asarray(top_k_filter(LOGITS, 2))[0]
    assert np.isfinite(out).tolist() == [True, False, False, True, False]
    np.testing.assert_array_equal(out[[0, 3]], [2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(top_k_filter(LOGITS, 0)), np.asarray(LOGITS))


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = np.asarray(jax.nn.softmax(LOGITS))[0]  # ~ [0.231, 0.0115, 0.0516, 0.628, 0.0042]
    # p just above P(3): token 0 is needed too; p just below P(3): token 3 alone.
    out = np.asarray(top_p_filter(LOGITS, float(probs[3]) + 1e-3))[0]
    assert np.isfinite(out).tolist() == [True, False, False, True, False]
    out = np.asarray(top_p_filter(LOGITS, float(probs[3]) - 1e-3))[0]
    assert np.isfinite(out).tolist() == [False, False, False, True, False]
    # p just above P(3) + P(0): token 2 joins
    out = np.asarray(top_p_filter(LOGITS, float(probs[3] + probs[0]) + 1e-3))[0]
    assert np.isfinite(out).tolist() == [True, False, True, True, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    seen = jnp.array([[True, True, False, False, False]])
    out = np.asarray(repetition_penalty(LOGITS, seen, 2.0))[0]
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 3.0, -2.0])


def test_temperature_draws_follow_softmax_of_scaled_logits():
    """10k seeded draws at T = 2: frequencies within 4 sigma of softmax(logits / 2)."""
    cfg = SamplingConfig(temperature=2.0)
    n = 10_000
    draws = jax.vmap(lambda k: sample(LOGITS, k, cfg)[0])(jax.random.split(jax.random.key(0), n))
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    p = np.asarray(jax.nn.softmax(LOGITS / 2.0))[0]
    assert np.all(np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_filters_combine_and_a_seed_reproduces_the_draws():
    cfg = SamplingConfig(temperature=1.0, top_k=2, seed=3)
    keys = jax.random.split(jax.random.key(cfg.seed), 200)
    a = np.asarray(jax.vmap(lambda k: sample(LOGITS, k, cfg)[0])(keys))
    b = np.asarray(jax.vmap(lambda k: sample(LOGITS, k, cfg)[0])(keys))
    np.testing.assert_array_equal(a, b)
    assert set(a.tolist()) == {0, 3}  # top-2 only, and both occur


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -1), ("top_p", 0.0),
                                         ("top_p", 1.5), ("repetition_penalty", 0.0)])
def test_bad_sampling_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"SamplingConfig.{field}="):
        SamplingConfig(**{field: value})
