"""The files and core types one decoder layer's forward meets, in the order it meets them.

    python tools/layer_map.py [--layer 1] [KEY=VALUE ...]

Builds layer `--layer` of deepseek4-tiny cut to two layers (SWA, then CSA: `compress_ratios=[0,4]`),
resolved for this machine's platform as a run resolves it, and calls it once in the sparse stage
(top-k selection and the indexer loss) under `sys.setprofile`. It prints every core/ file a call
enters, first entry first (the order a reader following the forward opens them), and every core
type met: the class of each method's `self` (dataclasses' and named tuples' generated constructors
included), the dataclasses those objects hold (and those hold), and the layer's nnx graph nodes (a module whose
weights are read without a call, such as the router bias), plus the layer's spec, which its
constructor takes. docs/development.md#one-sparse-layers-forward lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.config.schema import load_config
    from core.model import block as layer
    from core.parallel.mesh import make_mesh, mesh_platform
    from core.spec.resolve import resolve

    root = str(Path(layer.__file__).resolve().parents[2]) + "/"  # the checkout whose core/ is imported
    keys = ["compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "max_target_length=64",
            "dataset_type=synthetic", *args.overrides]
    asked = load_config("deepseek4-tiny", keys, stage="sparse")
    mesh = make_mesh(asked)
    specs = resolve(asked, mesh_platform(mesh), mesh.shape)
    cfg, spec = specs.cfg, specs.model.blocks[args.layer]
    block = layer.Block(spec, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, cfg.max_target_length, cfg.mhc_expansion_rate, cfg.emb))
    tokens = jnp.zeros(x.shape[:2], jnp.int32)
    positions, segments = jnp.arange(x.shape[1])[None], jnp.ones(x.shape[:2], jnp.int32)
    files: list[str] = []
    types: list[type] = [type(spec)]

    def note(t: type) -> None:
        if t.__module__.startswith("core.") and t not in types:
            types.append(t)

    held: set[int] = set()

    def note_held(obj) -> None:  # a dataclass an object holds, and those it holds in turn (a spec's parts)
        for value in getattr(obj, "__dict__", {}).values():
            if dataclasses.is_dataclass(value) and not isinstance(value, type) and id(value) not in held:
                held.add(id(value))
                note(type(value))
                note_held(value)

    def on_call(frame, event, _):
        path = frame.f_code.co_filename
        if event != "call" or not (path.startswith(root + "core/") or path == "<string>"):
            return
        if path != "<string>" and path[len(root):] not in files:
            files.append(path[len(root):])
        for name in ("self", "cls", "_cls"):
            obj = frame.f_locals.get(name)
            if obj is not None:
                note(obj if isinstance(obj, type) else type(obj))
                note_held(obj)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        sys.setprofile(on_call)
        block(x, tokens, positions, segments, dense=False, indexer_loss=True)
        sys.setprofile(None)
    for _, node in nnx.iter_graph(block):
        note(type(node))
    print(f"{len(files)} files:", *files, sep="\n  ")
    print(f"{len(types)} types:", *(f"{t.__module__}.{t.__qualname__}" for t in types), sep="\n  ")


if __name__ == "__main__":
    main()
