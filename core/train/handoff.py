"""Stage hand-off and stage checks (DESIGN.md, "Stages"): what `--init-from` takes from another
run, and when the indexer's top-k cannot bind.

`--init-from` loads every variable of the source checkpoint into the new model. The one tolerated
difference: a source with no indexer parameters at all (a `use_indexer: false` model, or a
checkpoint imported without an indexer) into a model that has them; the indexer then keeps its
fresh initialisation. Any other difference stays `core.checkpoint.store.check_compatible`'s error.

Top-k binds on a query row when the row sees more compressed blocks than `indexer_topk`. A row of
T tokens sees at most T // 4 CSA blocks (its last query, one document filling the row), so when
indexer_topk >= max_target_length // 4 no row is ever narrowed: sparse attention equals dense and
a warm-up's KL scores blocks that attention uses anyway. The training commands warn of it
(core/train/preflight.py `topk_warning`); `dsv4 eval-indexer` warns per swept k (core/eval/report.py
`topk_warnings`).
"""

from __future__ import annotations

from typing import Any, Iterable

CSA_RATIO = 4


def is_indexer(path: str) -> bool:
    """True for a '/'-joined variable path inside an indexer (`.../attn/indexer/...`)."""
    return "indexer" in path.split("/")


def without_indexer(tree: dict[str, Any]) -> dict[str, Any]:
    """A nested dict with every "indexer" subtree removed."""
    return {k: without_indexer(v) if isinstance(v, dict) else v for k, v in tree.items() if k != "indexer"}


def lacks_indexer(saved: Iterable[str], expected: Iterable[str]) -> bool:
    """True when the model (variable paths `expected`) has indexer parameters and the checkpoint
    (paths `saved`, its tree as `core.checkpoint.store.read_checkpoint` read it) has none."""
    return any(is_indexer(p) for p in expected) and not any(is_indexer(p) for p in saved)


def topk_never_binds(indexer_topk: int, max_target_length: int) -> bool:
    """True when no query row can see more than `indexer_topk` CSA blocks."""
    return indexer_topk >= max_target_length // CSA_RATIO
