"""The one name/layout map between DeepSeek-V4 checkpoints and dsv4 (DESIGN.md, "Real checkpoints").

Two checkpoint layouts (notes/checkpoint-format.md sections 1 and 3):
  official      the released DeepSeek-V4 files / `inference/model.py` names: `embed.weight`,
                `layers.{i}.attn.wq_a.weight`, `layers.{i}.hc_attn_fn`, one tensor per routed expert
                `layers.{i}.ffn.experts.{e}.w1.weight` (w1 gate, w3 up, w2 down);
  transformers  `DeepseekV4ForCausalLM`'s state dict: `model.layers.{i}.self_attn.q_a_proj.weight`,
                `model.layers.{i}.attn_hc.fn`, fused `mlp.experts.gate_up_proj` [E, 2F, M] (gate rows
                first) and `mlp.experts.down_proj` [E, M, F].
Both store matrices torch-style [out, in]; dsv4 stores [in, out] (module docstrings of core.model.transformer,
core.model.attention, core.model.moe). `RULES` is the table: one row per dsv4 parameter with its name in each
layout and the converter between the layouts. `mtp.*` tensors (the multi-token-prediction block)
have no dsv4 counterpart and are skipped by the callers; any other name that matches no row is an
error naming it.

dsv4 logical paths name decoder layer i `layers.{i}.<block path>` whatever the scan grouping;
`set_params` (and core.hf.importer) place them into the stacked segments of `core.model.transformer.layer_plan`.
A weight held in the released format (core/model/quant.py) is `<path>.codes` + `<path>.scales` there:
the official tensor and its `<module>.scale`, unchanged (`held_to_official`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import numpy as np

from core.errors import CheckpointError

LAYOUTS = ("official", "transformers")
PREFIX = {"official": "layers.", "transformers": "model.layers."}
MTP = re.compile(r"^(model\.)?mtp\.")


# ----------------------------------------------------------------------------- converters


@dataclasses.dataclass(frozen=True)
class Conv:
    """HF layout <-> dsv4 layout of one tensor; `hf_shape` maps a dsv4 shape to the HF one."""

    to_ours: Callable[[np.ndarray, dict], np.ndarray]
    to_hf: Callable[[np.ndarray, dict], np.ndarray]
    hf_shape: Callable[[tuple, dict], tuple]


SAME = Conv(lambda a, d: a, lambda a, d: a, lambda s, d: tuple(s))
LINEAR = Conv(lambda a, d: a.T, lambda a, d: a.T, lambda s, d: tuple(reversed(s)))
# routed experts stacked [E, a, b] <-> [E, b, a] (transformers' fused tensors)
EXPERTS = Conv(lambda a, d: a.transpose(0, 2, 1), lambda a, d: a.transpose(0, 2, 1), lambda s, d: (s[0], s[2], s[1]))
# mHC fn: HF [J, n * M] <-> ours [n, M, J] with ours[i, m, j] = hf[j, i * M + m]
HC_FN = Conv(lambda a, d: a.reshape(a.shape[0], d["n"], d["emb"]).transpose(1, 2, 0),
             lambda a, d: a.transpose(2, 0, 1).reshape(a.shape[2], -1),
             lambda s, d: (s[2], s[0] * s[1]))
# grouped output projection: HF [G * R, H/G * D] (viewed [G, R, H/G * D]) <-> ours [G, H/G * D, R]
GROUPED = Conv(lambda a, d: a.reshape(d["o_groups"], a.shape[0] // d["o_groups"], a.shape[1]).transpose(0, 2, 1),
               lambda a, d: a.transpose(0, 2, 1).reshape(-1, a.shape[1]),
               lambda s, d: (s[0] * s[2], s[1]))


def heads(heads_key: str, dim_key: str) -> Conv:
    """[heads * dim, in] (torch Linear) <-> [in, heads, dim]."""
    return Conv(lambda a, d: a.T.reshape(a.shape[1], d[heads_key], d[dim_key]),
                lambda a, d: a.reshape(a.shape[0], -1).T,
                lambda s, d: (s[1] * s[2], s[0]))


# ----------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Rule:
    """One dsv4 parameter and its name in each layout.

    `ours` is relative to a decoder layer's Block (or the Transformer for root rules). An official
    name containing `{e}` is one tensor per routed expert, filling ours[e] (converter applied to
    that slice). `part` = (index, count): the transformers tensor is split into `count` equal parts
    along axis 1 and this rule takes part `index` (the fused gate_up_proj).
    """

    ours: str
    official: str
    transformers: str
    conv_official: Conv
    conv_transformers: Conv
    part: tuple[int, int] | None = None
    aliases: tuple[str, ...] = ()  # other transformers names read on import


    def name(self, layout: str) -> str:
        return self.official if layout == "official" else self.transformers

    def conv(self, layout: str) -> Conv:
        return self.conv_official if layout == "official" else self.conv_transformers

    def per_expert(self, layout: str) -> bool:
        return layout == "official" and "{e}" in self.official


def _rule(ours, official, transformers, conv=SAME, conv_t=None, part=None) -> Rule:
    # transformers 5.24's save_pretrained writes every `kv_norm` as `norm` (its reversed rename)
    aliases = (transformers.replace("kv_norm.", "norm."),) if "kv_norm." in transformers else ()
    return Rule(ours, official, transformers, conv, conv if conv_t is None else conv_t, part, aliases)


_HC = [_rule(f"hc_{s}.{p}", f"hc_{s}_{p}", f"{s}_hc.{p}", HC_FN if p == "fn" else SAME)
       for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
_COMPRESSOR = [("wkv", "wkv.weight", "kv_proj.weight", LINEAR), ("wgate", "wgate.weight", "gate_proj.weight", LINEAR),
               ("ape", "ape", "position_bias", SAME), ("norm.weight", "norm.weight", "kv_norm.weight", SAME)]
LAYER_RULES = [
    _rule("attn_norm.weight", "attn_norm.weight", "input_layernorm.weight"),
    _rule("ffn_norm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
    *_HC,
    _rule("attn.wq_a", "attn.wq_a.weight", "self_attn.q_a_proj.weight", LINEAR),
    _rule("attn.q_norm.weight", "attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    _rule("attn.wq_b", "attn.wq_b.weight", "self_attn.q_b_proj.weight", heads("heads", "head_dim")),
    _rule("attn.wkv", "attn.wkv.weight", "self_attn.kv_proj.weight", LINEAR),
    _rule("attn.kv_norm.weight", "attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    _rule("attn.wo_a", "attn.wo_a.weight", "self_attn.o_a_proj.weight", GROUPED),
    _rule("attn.wo_b", "attn.wo_b.weight", "self_attn.o_b_proj.weight", LINEAR),
    _rule("attn.attn_sink", "attn.attn_sink", "self_attn.sinks"),
    *[_rule(f"attn.compressor.{o}", f"attn.compressor.{a}", f"self_attn.compressor.{t}", c) for o, a, t, c in _COMPRESSOR],
    # the indexer: HF nests it in the CSA compressor, the official code and dsv4 beside it
    _rule("attn.indexer.wq_b", "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight",
          heads("indexer_heads", "indexer_head_dim")),
    _rule("attn.indexer.weights_proj", "attn.indexer.weights_proj.weight",
          "self_attn.compressor.indexer.scorer.weights_proj.weight", LINEAR),
    *[_rule(f"attn.indexer.compressor.{o}", f"attn.indexer.compressor.{a}", f"self_attn.compressor.indexer.{t}", c)
      for o, a, t, c in _COMPRESSOR],
    _rule("ffn.gate.weight", "ffn.gate.weight", "mlp.gate.weight", LINEAR),
    _rule("ffn.gate.bias", "ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    _rule("ffn.gate.tid2eid", "ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    _rule("ffn.experts.w1", "ffn.experts.{e}.w1.weight", "mlp.experts.gate_up_proj", LINEAR, EXPERTS, part=(0, 2)),
    _rule("ffn.experts.w3", "ffn.experts.{e}.w3.weight", "mlp.experts.gate_up_proj", LINEAR, EXPERTS, part=(1, 2)),
    _rule("ffn.experts.w2", "ffn.experts.{e}.w2.weight", "mlp.experts.down_proj", LINEAR, EXPERTS),
    _rule("ffn.shared_experts.w1", "ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", LINEAR),
    _rule("ffn.shared_experts.w3", "ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", LINEAR),
    _rule("ffn.shared_experts.w2", "ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", LINEAR),
]
ROOT_RULES = [
    _rule("embed", "embed.weight", "model.embed_tokens.weight"),
    _rule("head", "head.weight", "lm_head.weight", LINEAR),
    _rule("norm.weight", "norm.weight", "model.norm.weight"),
    _rule("hc_head.fn", "hc_head_fn", "model.hc_head.hc_fn", HC_FN),
    _rule("hc_head.base", "hc_head_base", "model.hc_head.hc_base"),
    _rule("hc_head.scale", "hc_head_scale", "model.hc_head.hc_scale"),
]
# dsv4 tensors exported in float32 whatever --dtype (HF keeps these modules in float32)
FLOAT32_PARAMS = re.compile(r"(^|\.)(hc_\w+\.(fn|base|scale)|attn_sink|ape|gate\.bias)$")


def _lookup(layout: str) -> tuple[dict[str, list[Rule]], dict[str, list[Rule]]]:
    def index(rules):
        table: dict[str, list[Rule]] = {}
        for r in rules:
            for name in (r.name(layout),) + (r.aliases if layout == "transformers" else ()):
                table.setdefault(name.replace("{e}", "*"), []).append(r)
        return table
    return index(LAYER_RULES), index(ROOT_RULES)


_TABLES = {layout: _lookup(layout) for layout in LAYOUTS}
_BY_OURS = {r.ours: r for r in LAYER_RULES + ROOT_RULES}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Match:
    """An HF tensor name resolved: the rules it feeds, its decoder layer and routed expert (or None)."""

    rules: tuple[Rule, ...]
    layer: int | None
    expert: int | None


def match(name: str, layout: str) -> Match | None:
    """The rules an HF tensor name feeds in `layout`, or None if it matches no row."""
    layer_table, root_table = _TABLES[layout]
    m = re.fullmatch(re.escape(PREFIX[layout]) + r"(\d+)\.(.+)", name)
    if not m:
        rules = root_table.get(name)
        return Match(tuple(rules), None, None) if rules else None
    rest, expert = m.group(2), None
    e = _EXPERT.fullmatch(rest) if layout == "official" else None
    if e:
        rest, expert = f"ffn.experts.*.{e.group(2)}", int(e.group(1))
    rules = layer_table.get(rest)
    return Match(tuple(rules), int(m.group(1)), expert) if rules else None


def detect_layout(names) -> str:
    """"transformers" when the names carry the `model.` prefix, else "official"."""
    names = [n for n in names if not MTP.match(n)]
    return "transformers" if any(n.startswith("model.") for n in names) else "official"


def dims_of(cfg) -> dict[str, int]:
    """The sizes the converters need, from a Config."""
    return dict(n=cfg.mhc_expansion_rate, emb=cfg.emb, heads=cfg.num_heads, head_dim=cfg.head_dim,
                indexer_heads=cfg.indexer_n_heads, indexer_head_dim=cfg.indexer_head_dim, o_groups=cfg.o_groups)


def rule_to_ours(rule: Rule, layout: str, value: np.ndarray, dims: dict) -> np.ndarray:
    """One HF tensor (or its part) in dsv4 layout (a view where the layout allows)."""
    if layout == "transformers" and rule.part is not None:
        index, count = rule.part
        size = value.shape[1] // count
        value = value[:, index * size:(index + 1) * size]
    return rule.conv(layout).to_ours(value, dims)


def logical_path(rule: Rule, layer: int | None) -> str:
    return rule.ours if layer is None else f"layers.{layer}.{rule.ours}"


def rule_of(path: str) -> tuple[Rule, int | None]:
    """(the rule, the decoder layer or None) of a dsv4 logical path."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
    return (_BY_OURS[m.group(2)], int(m.group(1))) if m else (_BY_OURS[path], None)


def scale_name(weight: str) -> str:
    """The official name of an FP8 / FP4 weight's e8m0 block scales: `<module>.weight` -> `<module>.scale`."""
    return weight.removesuffix(".weight") + ".scale"


def held_to_official(path: str, codes: np.ndarray, scales: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A weight held in the released format (core/model/quant.py: official [out, in] codes and e8m0 scales,
    one layer's slice) -> its official tensors unchanged: `<module>.weight` = codes, `<module>.scale` =
    scales, one pair per routed expert where the official layout splits them (the leading axis)."""
    rule, layer = rule_of(path)
    prefix = "" if layer is None else f"{PREFIX['official']}{layer}."
    if rule.per_expert("official"):
        for e in range(codes.shape[0]):
            name = prefix + rule.official.format(e=e)
            yield name, codes[e]
            yield scale_name(name), scales[e]
    else:
        yield prefix + rule.official, codes
        yield scale_name(prefix + rule.official), scales


# ----------------------------------------------------------------------------- whole dicts


def hf_to_dsv4(hf_params: dict[str, np.ndarray], dims: dict[str, int], layout: str = "transformers") -> dict[str, np.ndarray]:
    """HF state dict -> {dsv4 logical path: array in dsv4 layout} (per-expert tensors stacked).

    Raises:
      CheckpointError: an HF tensor matches no rule (`mtp.*` ones are dropped).
    """
    out, experts = {}, {}
    for name, value in hf_params.items():
        if MTP.match(name):
            continue
        m = match(name, layout)
        if m is None:
            raise CheckpointError(f"HF tensor {name} has no dsv4 counterpart in the name map")
        for rule in m.rules:
            path, arr = logical_path(rule, m.layer), rule_to_ours(rule, layout, value, dims)
            if m.expert is None:
                out[path] = arr
            else:
                experts.setdefault(path, {})[m.expert] = arr
    for path, by_expert in experts.items():
        out[path] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def dsv4_to_hf(params: dict[str, np.ndarray], dims: dict[str, int], layout: str) -> Iterator[tuple[str, np.ndarray]]:
    """{dsv4 logical path: array} -> (HF name, array in HF layout), in dsv4 path order.

    A fused transformers tensor is yielded once, after all of its parts are present.
    """
    rules = _BY_OURS
    pending: dict[str, dict[int, np.ndarray]] = {}
    for path, value in params.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        layer, ours = (int(m.group(1)), m.group(2)) if m else (None, path)
        rule = rules[ours]
        prefix = "" if layer is None else f"{PREFIX[layout]}{layer}."
        conv = rule.conv(layout)
        if rule.per_expert(layout):
            for e in range(value.shape[0]):
                yield prefix + rule.official.format(e=e), conv.to_hf(value[e], dims)
        elif layout == "transformers" and rule.part is not None:
            name = prefix + rule.transformers
            parts = pending.setdefault(name, {})
            parts[rule.part[0]] = conv.to_hf(value, dims)
            if len(parts) == rule.part[1]:
                yield name, np.concatenate([parts.pop(i) for i in range(rule.part[1])], axis=1)
                del pending[name]
        else:
            yield prefix + rule.name(layout), conv.to_hf(value, dims)


def hf_shape(rule: Rule, layout: str, ours_shape: tuple, dims: dict) -> tuple:
    """The HF shape of one tensor of `rule` given its dsv4 shape (one expert's slice if per-expert)."""
    shape = rule.conv(layout).hf_shape(tuple(ours_shape), dims)
    if layout == "transformers" and rule.part is not None:
        shape = (shape[0], shape[1] * rule.part[1]) + shape[2:]
    return shape


# ----------------------------------------------------------------------------- into a model


def state_slots(cfg) -> tuple[dict[str, tuple[str, int | None]], dict[str, object], object]:
    """Where each logical path lives in the model state (scanned segments of core.model.transformer.layer_plan).

    Returns:
      ({logical path: (flat '/'-joined state key, index on the stacked layer axis or None)},
       {flat key: abstract leaf (ShapeDtypeStruct)} in state order, the state's treedef).
    """
    import jax
    from flax import nnx

    from core.tree import flatten
    from core.model import transformer
    from core.spec.resolve import parameter_spec

    abstract = transformer.abstract(parameter_spec(cfg))
    pure = nnx.to_pure_dict(nnx.state(abstract))
    leaves = flatten(pure)
    where = {}
    for key in leaves:
        parts = key.split("/")
        if parts[0] != "layers":
            where[".".join(parts)] = (key, None)
            continue
        start, unit, reps = abstract.segments[int(parts[1])]
        if reps == 1:
            where[f"layers.{start}." + ".".join(parts[2:])] = (key, None)
        else:  # layers/<s>/blocks/<u>/...: layer start + j * unit + u
            u, rest = int(parts[3]), ".".join(parts[4:])
            for j in range(reps):
                where[f"layers.{start + j * unit + u}.{rest}"] = (key, j)
    return where, leaves, jax.tree_util.tree_structure(pure)



def block_slot(model, layer: int):
    """(Block module, index into its stacked leading axis or None) of decoder layer `layer`."""
    for segment, (start, unit, reps) in zip(model.layers, model.segments):
        if start <= layer < start + unit * reps:
            if reps == 1:
                return segment, None
            j, u = divmod(layer - start, unit)
            return segment.blocks[u], j
    raise IndexError(f"layer {layer} is in no segment of {model.segments}")


def _variable(module, path: str):
    """The variable at dotted `path` under `module` (digits index nnx.List entries)."""
    from flax import nnx

    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    if not isinstance(module, nnx.Variable):
        raise KeyError(f"dsv4 path {path} is not a variable (got {type(module).__name__})")
    return module


def set_params(model, params: dict[str, np.ndarray]) -> set[int]:
    """Write mapped arrays ({logical path: array}) into a `core.model.transformer.Transformer`; returns the
    ids of the variables written. Works on abstract (nnx.eval_shape) models too."""
    import jax
    import jax.numpy as jnp

    written = set()
    for path, value in params.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        if m:
            block, j = block_slot(model, int(m.group(1)))
            var = _variable(block, m.group(2))
        else:
            var, j = _variable(model, path), None
        current = var.get_value()  # an array, or a ShapeDtypeStruct in an abstract model
        want = current.shape if j is None else current.shape[1:]
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"{path}: the checkpoint gives shape {list(value.shape)}, dsv4 has {list(want)}")
        value = jnp.asarray(value, current.dtype)
        if j is not None:  # one slice of a scanned (stacked) parameter
            stack = current if isinstance(current, jax.Array) else jnp.zeros(current.shape, current.dtype)
            value = stack.at[j].set(value)
        var.set_value(value)
        written.add(id(var))
    return written
