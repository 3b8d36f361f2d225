"""`dsv4 plan --search`: which meshes and batches fit a target, compiled and ranked (DESIGN.md, "Planning").

1. Enumerate (`candidates`): every ordered factorization of one granule's devices over
   (data, fsdp, tensor, expert) for ici_*, and of the granules (TPU slices, GPU hosts) for dcn_*, times the
   per-device batches 1, 2, 4, ... up to `max_batch`. On a GPU target of several hosts the dcn_* include
   expert_outer (the experts split across the hosts, every other weight replicated there: core/parallel/mesh.py).
   Kept where the model's sharding rules hold: query heads divisible by tensor (the rules would replicate
   them, wasting the axis), routed experts by expert_outer x expert (expert parallelism's exchange needs
   it), the global batch by the data x fsdp x expert_outer x expert batch shards. Axes and the batch that
   the user's overrides set (to anything but -1) stay fixed. On a GPU target the granules are its hosts of
   8 GPUs (`Target.granules`).
2. Prune without compiling: the exact per-device state (parameters, optimizer state, batch) from
   shapes and shardings on a `jax.sharding.AbstractMesh` (`report.state_bytes` over
   `program.abstract_inputs`, the plan's own count), in one child process for all candidates, against
   `report.usable_memory`. State alone over the usable memory cannot fit: the compiler only adds
   temporaries and code. On one mesh, the batches above one that does not fit are not compiled
   either (temporaries grow with the batch); they count as pruned, with that reason.
3. Compile each survivor with `compile.plan`, in its own child process bounded by `timeout_s`.
4. Rank those that fit by the roofline's estimated tokens/s; fake CPU devices have no peak
   figures, so there by tokens per step over the matmul FLOPs per device (the same ceiling for all).

Cache: one JSON file per candidate in `cache_dir`, named by a hash of the candidate's resolved
config, the stage, the target, the overrides, `top`, the dsv4 version and a digest of the core/
sources (a code change is a new plan, also in a checkout whose version does not move); it holds the exact state
bytes and, once compiled, the plan (or the compile error). A rerun reads them and starts no
process; an interrupted search resumes where it stopped. Timeouts are not cached.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from core.errors import ConfigError, DsvError, RunWriteError
from core.parallel.mesh import CONFIG_AXES, EXPERT_OUTER_AXIS, MESH_AXES, mesh_axes
from core.plan import compile as plan_compile
from core.plan import report
from core.plan import targets as tg
from core.process import tune_garbage_collector
from core.spec.resolve import resolve

CACHE_LAYOUT = 2  # bump when a cache file's content changes meaning
DEFAULT_CACHE = "runs/plan-cache"
DEFAULT_MAX_BATCH = 8
DEFAULT_TIMEOUT_S = 900.0
STATUSES = ("fits", "does not fit", "pruned", "failed")  # the order of the result's candidates
_GIB = 1 << 30

# (done, total, what): before each compile (or skip) of the survivors that the cache lacks
Progress = Callable[[int, int, str], None]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: ici_* and dcn_* sizes over CONFIG_AXES, and the per-device batch."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]
    per_device_batch_size: int

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh's axis sizes, by name (expert_outer only where above 1, as the mesh holds it)."""
        sizes = {a: i * d for a, i, d in zip(CONFIG_AXES, self.ici, self.dcn)}
        return {a: sizes[a] for a in mesh_axes(sizes)}

    def fields(self) -> dict[str, int]:
        """The config keys that select this candidate."""
        return {**{f"ici_{a}_parallelism": n for a, n in zip(CONFIG_AXES, self.ici)},
                **{f"dcn_{a}_parallelism": n for a, n in zip(CONFIG_AXES, self.dcn)},
                "per_device_batch_size": self.per_device_batch_size}

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.fields().items()]

    def label(self) -> str:
        dcn = dict(zip(CONFIG_AXES, self.dcn))
        axes = [f"{a} {n}" + (f" (dcn {dcn[a]})" if dcn[a] > 1 else "") for a, n in self.mesh.items() if n > 1]
        return f"{' x '.join(axes) or 'single device'}, batch {self.per_device_batch_size}"


# ----------------------------------------------------------------------------- enumeration


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, parts - 1)]


def pinned(cfg, overrides: Sequence[str]) -> dict[str, int]:
    """The search keys (ici_*, dcn_*, per_device_batch_size) that `overrides` set, except to -1."""
    from core.config.schema import canonical_key
    from core.config.values import parse_override

    keys = {canonical_key(parse_override(text)[0], f"override {text!r}") for text in overrides}
    names = [f"{p}_{a}_parallelism" for p in ("ici", "dcn") for a in CONFIG_AXES] + ["per_device_batch_size"]
    return {k: getattr(cfg, k) for k in names if k in keys and getattr(cfg, k) != -1}


def valid_for_model(cfg, mesh: dict[str, int], devices: int, batch: int) -> bool:
    """Heads divisible by tensor, experts by expert_outer x expert, the global batch by the batch shards."""
    experts = mesh.get(EXPERT_OUTER_AXIS, 1) * mesh["expert"]
    shards = mesh["data"] * mesh["fsdp"] * experts
    return cfg.num_heads % mesh["tensor"] == 0 and cfg.num_experts % experts == 0 and (batch * devices) % shards == 0


def candidates(cfg, target: tg.Target, *, max_batch: int = DEFAULT_MAX_BATCH,
               pins: dict[str, int] | None = None) -> list[Candidate]:
    """The candidates of `target` for `cfg` (module docstring, step 1), each exactly once.

    Returns:
      Candidates ordered by dcn, then ici, then batch (ascending): every mesh multiplies to
      `target.devices`.
    """
    pins = pins or {}
    batches = ([pins["per_device_batch_size"]] if "per_device_batch_size" in pins
               else [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch])
    # expert_outer spans granules: GPU hosts (a TPU slice's mesh keeps its axes as they are)
    outer = target.platform == "cuda" and target.granules > 1
    dcn_axes = CONFIG_AXES if outer else MESH_AXES
    out = []
    for dcn_sizes in factorizations(target.granules, len(dcn_axes)):
        dcn = tuple(dict(zip(dcn_axes, dcn_sizes)).get(a, 1) for a in CONFIG_AXES)
        for ici_sizes in factorizations(target.devices // target.granules, len(MESH_AXES)):
            ici = tuple(dict(zip(MESH_AXES, ici_sizes)).get(a, 1) for a in CONFIG_AXES)
            for b in batches:
                c = Candidate(ici, dcn, b)
                if all(c.fields()[k] == v for k, v in pins.items()) and valid_for_model(cfg, c.mesh, target.devices, b):
                    out.append(c)
    return out


# ----------------------------------------------------------------------------- exact state bytes (the prune)


def state_total(state: dict[str, int]) -> int:
    """Parameters + optimizer state + batch per device: what the step holds before any temporary."""
    return state["parameter_bytes"] + state["optimizer_bytes"] + state["batch_bytes"]


def state_figures(model: str, stage: str | None, overrides: Sequence[str], config_file: str | None,
                  target: tg.Target, cands: Sequence[Candidate], timeout_s: float | None = None) -> list[dict[str, int]]:
    """`report.state_bytes` of every candidate, from one child process (no devices, no compile)."""
    args = {"model": model, "stage": stage, "overrides": list(overrides), "config_file": config_file,
            "platform": target.platform, "candidates": [dataclasses.asdict(c) for c in cands]}
    return plan_compile.run_child("core.plan.search", args, target, timeout_s=timeout_s, what="the state pass")["state"]


def _state_child(args: dict[str, Any]) -> dict[str, Any]:
    """In the child: the abstract model once, then each candidate's shardings on an AbstractMesh."""
    from jax.sharding import AbstractMesh, AxisType

    from core.train import program

    try:
        cfg = plan_compile.load(args["model"], args["stage"], args["overrides"], args["config_file"])
        platform = args["platform"]
        # the parameters and the optimizer state depend on neither the mesh nor the batch
        model = program.abstract_model_and_optimizer(resolve(cfg, platform))
        out = []
        for fields in args["candidates"]:
            c = Candidate(tuple(fields["ici"]), tuple(fields["dcn"]), fields["per_device_batch_size"])
            ccfg = resolve(cfg.replace(**c.fields()), platform, c.mesh).cfg
            mesh = AbstractMesh(tuple(c.mesh.values()), tuple(c.mesh), axis_types=(AxisType.Auto,) * len(c.mesh))
            _, state, batch, _ = program.abstract_inputs(ccfg.per_device_batch_size, ccfg.max_target_length, model, mesh)
            out.append(report.state_bytes(ccfg, state, batch))
        return {"state": out}
    except DsvError as e:
        return {"error": str(e)}


# ----------------------------------------------------------------------------- cache


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the core package's Python sources (paths and contents): what the plans come from."""
    import core

    root = Path(core.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(cfg, stage: str | None, target: tg.Target, overrides: Sequence[str], top: int) -> tuple[str, dict[str, Any]]:
    """(file stem, the fields it hashes) of a candidate whose resolved config is `cfg`."""
    from core.train.run import dsv4_version

    config = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()
    fields = {"config_sha256": config, "stage": stage, "target": target.name.strip().lower(),
              "overrides": list(overrides), "top": top, "dsv4_version": dsv4_version(),
              "core_sha256": source_digest(), "layout": CACHE_LAYOUT}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32], fields


def _cache_dir(path: str | os.PathLike) -> Path:
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--cache {directory}: it is a file, not a directory; give a directory (default {DEFAULT_CACHE}).")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunWriteError(f"--cache {directory}: cannot create it ({e.strerror}); give a writable directory.") from None
    return directory


def _read(path: Path, fields: dict[str, Any]) -> dict[str, Any]:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or torn (a search stopped mid-write): recomputed
    return entry if entry.get("key") == fields else {}


def _write(path: Path, entry: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except OSError as e:
        raise RunWriteError(f"--cache {path.parent}: cannot write {path.name} ({e.strerror}); give a writable directory.") from None


# ----------------------------------------------------------------------------- the search


def _record(c: Candidate, state: dict[str, int], usable: int) -> dict[str, Any]:
    return {"label": c.label(), "mesh": c.mesh, "ici": dict(zip(CONFIG_AXES, c.ici)), "dcn": dict(zip(CONFIG_AXES, c.dcn)),
            "per_device_batch_size": c.per_device_batch_size, "overrides": c.overrides(), "status": "pruned",
            "reason": None, "cached": False, "compiled_now": False, "state": state, "state_bytes": state_total(state),
            "total_bytes": None, "usable_bytes": usable, "headroom_bytes": None, "estimated_tokens_per_s": None,
            "estimated_step_s": None, "flops_per_step": None, "rank_value": None, "top_temporaries": [], "plan": None}


def _apply(rec: dict[str, Any], outcome: dict[str, Any], tokens: int) -> None:
    """Fill a record from a compile's outcome ({"plan": report} or {"error": message})."""
    if "error" in outcome:
        rec.update(status="failed", reason=outcome["error"])
        return
    r = outcome["plan"]
    rec.update(status="fits" if r["fits"] else "does not fit", plan=r, total_bytes=r["per_device"]["total_bytes"],
               usable_bytes=r["per_device"]["usable_bytes"], headroom_bytes=r["headroom_bytes"],
               estimated_tokens_per_s=r.get("estimated_tokens_per_s"), estimated_step_s=r.get("estimated_step_s"),
               flops_per_step=r.get("flops_per_step"), top_temporaries=r.get("top_temporaries", []),
               reason=(r.get("refused") or {}).get("message"))
    flops = rec["flops_per_step"]
    rec["rank_value"] = rec["estimated_tokens_per_s"] or (tokens / flops if flops else None)


def _order(rec: dict[str, Any]) -> tuple:
    headroom = rec["headroom_bytes"] if rec["headroom_bytes"] is not None else rec["usable_bytes"] - rec["state_bytes"]
    return STATUSES.index(rec["status"]), -(rec["rank_value"] or 0.0), -headroom


def search(model: str, stage: str | None, target_name: str, overrides: Sequence[str] = (), *,
           config_file: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
           cache_dir: str | os.PathLike = DEFAULT_CACHE, timeout_s: float | None = DEFAULT_TIMEOUT_S,
           top: int = 3, progress: Progress | None = None) -> dict[str, Any]:
    """Search the meshes and batches of `target_name` for `model`'s `stage` step (module docstring).

    Args:
      overrides: KEY=VALUE as the training command takes them; ici_*, dcn_* and
        per_device_batch_size set there (not to -1) are held fixed.
      max_batch: the largest per-device batch tried (powers of two from 1).
      cache_dir: where each candidate's JSON lives; timeout_s: each compile's limit.
      top: the largest temporaries kept per compiled candidate.
      progress: (done, total, what) before each compile or skip, when anything is left to compile.
    Returns:
      {"target", "platform", "devices", "model", "stage", "max_target_length", "usable_bytes",
       "usable_rule", "ranked_by", "candidates": records (fits, by rank; does not fit; pruned;
       failed), "counts": {status: n, "candidates", "compiled", "cached"}, "best": the first
       record if it fits, else None}.
    Raises:
      ConfigError: bad target, config or override, max_batch < 1, timeout_s <= 0, no candidate, a cache
        path that is a file.
      MissingExtraError: the target's extra is missing. RunWriteError: the cache cannot be written.
    """
    target = tg.parse_target(target_name)
    cfg = plan_compile.load(model, stage, overrides, config_file)
    tg.require_extra(target)
    if max_batch < 1:
        raise ConfigError(f"--max-batch {max_batch}: give a per-device batch of at least 1.")
    if timeout_s is not None and timeout_s <= 0:
        raise ConfigError(f"--compile-timeout {timeout_s:g}: give a positive number of seconds.")
    pins = pinned(cfg, overrides)
    cands = candidates(cfg, target, max_batch=max_batch, pins=pins)
    if not cands:
        fixed = ", ".join(f"{k}={v}" for k, v in pins.items()) or "no key fixed"
        raise ConfigError(f"--search on {target.name}: no mesh of its {target.devices} devices fits the model's sharding "
                          f"rules ({cfg.num_heads} heads divisible by tensor, {cfg.num_experts} experts by expert_outer x expert) with "
                          f"{fixed}: fix fewer ici_*/dcn_* keys, or set them to -1 to search them.")
    directory = _cache_dir(cache_dir)
    usable, rule = report.usable_memory(target)
    entries = []
    for c in cands:
        stem, fields = cache_key(cfg.replace(**c.fields()), stage, target, [*overrides, *c.overrides()], top)
        path = directory / f"{stem}.json"
        entries.append((c, path, _read(path, fields) or {"key": fields}))
    missing = [i for i, (_, _, e) in enumerate(entries) if "state" not in e]
    if missing:
        states = state_figures(model, stage, overrides, config_file, target, [entries[i][0] for i in missing], timeout_s)
        for i, state in zip(missing, states):
            entries[i][2]["state"] = state
            _write(entries[i][1], entries[i][2])
    records = _compile_survivors(entries, usable, (model, stage, target, overrides, config_file, cfg.max_target_length),
                                 top=top, timeout_s=timeout_s, progress=progress)
    records.sort(key=_order)
    counts = {s: sum(r["status"] == s for r in records) for s in STATUSES}
    counts.update(candidates=len(records), compiled=sum(r["compiled_now"] for r in records),
                  cached=sum(r["cached"] for r in records))
    return {"target": target.name, "platform": target.platform, "devices": target.devices, "model": cfg.model_name,
            "stage": stage, "max_target_length": cfg.max_target_length, "usable_bytes": usable, "usable_rule": rule,
            "ranked_by": "estimated tokens/s (roofline)" if target.chip is not None else
            "tokens per step over matmul FLOPs per device (fake CPU devices have no peak figures)",
            "candidates": records, "counts": counts, "best": records[0] if records[0]["status"] == "fits" else None}


def _compile_survivors(entries, usable: int, what: tuple, *, top: int, timeout_s: float | None,
                       progress: Progress | None) -> list[dict[str, Any]]:
    """The records of `entries` ((candidate, cache path, cache entry)): pruned, cached or compiled now."""
    model, stage, target, overrides, config_file, length = what
    records, todo, too_big = [], [], {}  # too_big: (ici, dcn) -> the smallest batch that does not fit
    for c, path, entry in entries:
        rec = _record(c, entry["state"], usable)
        if rec["state_bytes"] > usable:
            rec["reason"] = (f"parameters, optimizer state and batch alone need {rec['state_bytes'] / _GIB:.2f} GiB "
                             f"of {usable / _GIB:.2f} GiB usable")
        elif "outcome" in entry:
            _apply(rec, entry["outcome"], c.per_device_batch_size * target.devices * length)
            rec["cached"] = True
            _note_too_big(too_big, c, rec)
        else:
            todo.append((c, path, entry, rec))
        records.append(rec)
    for done, (c, path, entry, rec) in enumerate(todo):
        smaller = too_big.get((c.ici, c.dcn))
        skip = smaller is not None and smaller < c.per_device_batch_size
        if progress is not None:
            progress(done, len(todo), f"{'skipping' if skip else 'compiling'} {c.label()}")
        if skip:
            rec["reason"] = f"batch {smaller} on this mesh does not fit"
            continue
        timed_out = False
        try:
            outcome = {"plan": plan_compile.plan(model, stage, target.name, [*overrides, *c.overrides()],
                                                 config_file=config_file, top=top, analytic=False, timeout_s=timeout_s)}
        except plan_compile.CompileTimeout as e:  # not cached: a longer --compile-timeout may finish it
            outcome, timed_out = {"error": str(e)}, True
        except ConfigError as e:
            outcome = {"error": str(e)}
        if not timed_out:
            _write(path, {**entry, "outcome": outcome})
        rec["compiled_now"] = True
        _apply(rec, outcome, c.per_device_batch_size * target.devices * length)
        _note_too_big(too_big, c, rec)
    if todo and progress is not None:
        progress(len(todo), len(todo), "done")
    return records


def _note_too_big(too_big: dict[tuple, int], c: Candidate, rec: dict[str, Any]) -> None:
    if rec["status"] == "does not fit":
        too_big[(c.ici, c.dcn)] = min(too_big.get((c.ici, c.dcn), c.per_device_batch_size), c.per_device_batch_size)


if __name__ == "__main__":  # python -m core.plan.search '{"model": ..., "candidates": [...]}'  (the state pass)
    tune_garbage_collector()
    print(plan_compile.MARKER + json.dumps(_state_child(json.loads(sys.argv[1]))), flush=True)
