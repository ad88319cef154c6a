"""k3jax: the Kimi K3 architecture in pure-functional JAX/Flax."""
