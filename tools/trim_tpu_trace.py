"""Build tests/fixtures/tpu_trace/: one step of a real TPU profile, small enough for the repository.

Input: a folder with a compiled step's HLO text (`hlo.txt` or `hlo.txt.gz`, `compiled.as_text()`)
and a `jax.profiler` trace of a few executions of it (`trace.xplane.pb` or `.pb.gz`), as
tools/chip_step.py `--out DIR --trace N` writes them. Output, gzipped:

- trace.xplane.pb.gz: a valid XSpace with one plane, the input's first TPU device plane
  ("/device:TPU:0": its name and stats) with four of its lines for ONE step (`--step`, default 1,
  not the first traced one): "Steps" (that step's event), and "XLA Modules", "XLA Ops" and "Async
  XLA Ops" (the events that start inside it). Event names, times and the Steps and XLA Modules
  events' stats are the input's (times in whole nanoseconds, as `jax.profiler.ProfileData` reads
  them); the other events' own stats are left out (an op's repeat its times; an async copy's name
  its done op and flow ids); event and stat metadata ids are renumbered. The XSpace is written as a
  text proto and serialised by jax's own converter (`ProfileData.text_proto_to_serialized_xspace`),
  so no protobuf schema is needed here. The converter writes the metadata maps in hash order:
  a rerun gives the same content, not always the same bytes.
- hlo.txt.gz (same bytes on a rerun): the HLO text with what core/bench/hlo_owners.py reads: the
  header's module name, the FileNames / FunctionNames / FileLocations / StackFrames tables, the
  entry computation, every loop body, condition and called computation, and the fused
  computations of the fusions without a stack frame of their own (rule 2 reads them); the fused
  computations of framed fusions and the scalar reducers are left out, and so are the attributes
  no rule reads (backend_config, operand_layout_constraints, frontend_attributes).

    python tools/trim_tpu_trace.py /path/to/run tests/fixtures/tpu_trace [--step 1]

It prints the sizes and the fixture's attribution (core/bench/trace.py `profile_times`): the
figures tests/bench/test_trace.py checks, there in nanoseconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.bench import hlo_owners  # noqa: E402

LINES = ("Steps", "XLA Modules", "XLA Ops", "Async XLA Ops")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CUT = re.compile(r",\s*(backend_config|operand_layout_constraints|frontend_attributes)=")


def _read(folder: Path, name: str) -> bytes:
    plain, packed = folder / name, folder / f"{name}.gz"
    return plain.read_bytes() if plain.exists() else gzip.decompress(packed.read_bytes())


def _write(path: Path, data: bytes) -> None:
    """gzip with no name and mtime 0: the same data gives the same file."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as out:
        out.write(data)


def _quote(text: str) -> str:
    """A text-proto string literal (bytes outside printable ASCII as octal escapes)."""
    out = []
    for byte in text.encode():
        char = chr(byte)
        out.append("\\" + char if char in '"\\' else char if 32 <= byte < 127 else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _value_end(line: str, start: int) -> int:
    """End of the attribute value starting at `start`: a {...} group or a quoted string, quotes respected."""
    depth, quoted, i = 0, False, start
    while i < len(line):
        char = line[i]
        if quoted:
            i += 1 if char == "\\" else 0
            quoted = char != '"'
        elif char == '"':
            quoted = True
            if depth == 0 and i > start:
                return i + 1
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and char == "," and i > start:
            return i
        i += 1
    return len(line)


def _cut_attributes(line: str) -> str:
    while (match := _CUT.search(line)) is not None:
        line = line[:match.start()] + line[_value_end(line, match.end()):]
    return line


def trim_hlo(text: str) -> str:
    """The HLO text cut to what the attribution reads (module docstring)."""
    module = hlo_owners.parse(text)
    by_computation: dict[str, list] = {}
    for ins in module.instructions.values():
        by_computation.setdefault(ins.computation, []).append(ins)
    keep, todo = set(), [module.entry]
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += [c for ins in by_computation.get(name, []) for key, c in ins.called
                     if ins.opcode != "fusion" or ins.frame is None]
    out, computation = [f"HloModule {module.name}"], None
    for line in text.splitlines()[1:]:
        head = _HEADER.match(line)
        if head:
            computation = head.group(1)
        if computation is None:
            if line.strip() or out[-1].strip():
                out.append(line)
        elif computation in keep:
            out.append(_cut_attributes(line))
        if line.startswith("}"):
            computation = None
    return "\n".join(out) + "\n"


def trim_trace(serialized: bytes, step: int) -> str:
    """The text proto of an XSpace holding one step of the first TPU plane's op lines."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_serialized_xspace(serialized)
    plane = next(p for p in sorted(profile.planes, key=lambda p: p.name) if p.name.startswith("/device:TPU:"))
    lines = {line.name: list(line.events) for line in plane.lines}
    window = sorted(lines["Steps"], key=lambda e: e.start_ns)[step]
    start, end = window.start_ns, window.start_ns + window.duration_ns
    events, stats = {}, {}

    def stat_text(name, value):
        key = stats.setdefault(name, len(stats) + 1)
        if isinstance(value, str):
            return f"stats {{ metadata_id: {key} str_value: {_quote(value)} }}"
        if isinstance(value, float):
            return f"stats {{ metadata_id: {key} double_value: {value!r} }}"
        return f"stats {{ metadata_id: {key} int64_value: {int(value)} }}"

    body = [f"id: 0 name: {_quote(plane.name)}"] + [stat_text(k, v) for k, v in plane.stats]
    for n, name in enumerate(LINES):
        chosen = [e for e in lines.get(name, []) if e is window or (name != "Steps" and start <= e.start_ns < end)]
        chosen.sort(key=lambda e: (e.start_ns, -e.duration_ns))
        base = int(start)
        out = [f"lines {{ id: {n + 1} display_id: {n + 1} name: {_quote(name)} timestamp_ns: {base}"]
        for e in chosen:
            key = events.setdefault(e.name, len(events) + 1)
            kept = [stat_text(k, v) for k, v in e.stats] if name in ("Steps", "XLA Modules") else []
            out.append(f"events {{ metadata_id: {key} offset_ps: {round((e.start_ns - base) * 1000)} "
                       f"duration_ps: {round(e.duration_ns * 1000)} {' '.join(kept)} }}")
        body.append("\n".join(out) + " }")
    body += [f"event_metadata {{ key: {k} value {{ id: {k} name: {_quote(n)} }} }}" for n, k in events.items()]
    body += [f"stat_metadata {{ key: {k} value {{ id: {k} name: {_quote(n)} }} }}" for n, k in stats.items()]
    return "planes {\n" + "\n".join(body) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="folder with hlo.txt[.gz] and trace.xplane.pb[.gz]")
    parser.add_argument("out", type=Path, help="fixture folder to write")
    parser.add_argument("--step", type=int, default=1, help="which traced step to keep (0-based)")
    args = parser.parse_args()
    from jax.profiler import ProfileData

    from core.bench.trace import profile_times

    hlo = trim_hlo(_read(args.run, "hlo.txt").decode())
    xspace = ProfileData.text_proto_to_serialized_xspace(trim_trace(_read(args.run, "trace.xplane.pb"), args.step))
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out / "hlo.txt.gz", hlo.encode())
    _write(args.out / "trace.xplane.pb.gz", xspace)
    result = profile_times(hlo, ProfileData.from_serialized_xspace(xspace))
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(json.dumps({"sizes": sizes, **{k: v for k, v in result.items() if k != "top_ops"}},
                     indent=1))


if __name__ == "__main__":
    main()
