"""core/config/platform.py: `auto` keys become the platform's choice; an explicit value wins; the model refuses
an unresolved `auto`."""

import jax.numpy as jnp
import pytest

from core.config.platform import PLATFORM_CHOICES, resolve
from core.config.schema import load_config
from core.model import moe


@pytest.mark.parametrize("platform, expected", [("cpu", "cpu"), ("tpu", "tpu"), ("cuda", "gpu"), ("gpu", "gpu")])
def test_auto_keys_take_the_platforms_choice(platform, expected):
    cfg = load_config("deepseek4-tiny")
    assert all(getattr(cfg, key) == "auto" for key in PLATFORM_CHOICES)
    resolved = resolve(cfg, platform)
    for key, choices in PLATFORM_CHOICES.items():
        assert getattr(resolved, key) == choices[expected], key
    assert resolve(resolved, platform) is resolved  # nothing left to resolve


def test_an_explicit_value_wins_on_every_platform():
    cfg = load_config("deepseek4-tiny", ["moe_impl=dense"])
    assert {resolve(cfg, p).moe_impl for p in ("cpu", "gpu", "tpu")} == {"dense"}


def test_unknown_platform_and_unresolved_auto_are_refused():
    with pytest.raises(ValueError, match="platform"):
        resolve(load_config("deepseek4-tiny"), "quantum")
    spec = moe.MoESpec(emb=8, mlp=4, num_experts=4, k=2, shared=0, hash_routed=False, vocab_size=10, impl="auto")
    x = jnp.zeros((1, 2, 8))
    idx = jnp.zeros((1, 2, 2), jnp.int32)
    w = (jnp.zeros((4, 8, 4)), jnp.zeros((4, 4, 8)), jnp.zeros((4, 8, 4)))
    with pytest.raises(ValueError, match="moe_impl=auto reached the model unresolved"):
        moe.routed_experts(spec, x, idx, jnp.ones((1, 2, 2)), w, None)
