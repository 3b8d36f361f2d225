"""core.data.batches: sources, tokenizers, packing invariants, held-out evaluation, exact resume, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import tiny_data
from core.data import batches as data
from core.data import sources as data_sources
from core.errors import DataError

BATCH = 3


def _docs_file(tmp_path, n=12, kind="jsonl"):
    texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + 3 * (i % 5)) for i in range(n)]
    if kind == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    elif kind == "json":
        path = tmp_path / "docs.json"
        path.write_text(json.dumps([{"text": t} for t in texts]))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": texts}), path)
    else:
        path = tmp_path / "docs.txt"
        path.write_text("\n\n".join(texts) + "\n")
    return path, texts


def _pairs(batches, row=None):
    """The (input, target) pairs of non-padding positions (of one row, or all rows), in stream order."""
    out = []
    for b in batches:
        b = b if row is None else {k: v[row:row + 1] for k, v in b.items()}
        m = b["loss_mask"].astype(bool)
        out += list(zip(b["tokens"][m].tolist(), b["targets"][m].tolist()))
    return out


def _reference_pairs(texts):
    """Independent of the packer: each document's [BOS] bytes [EOS] as consecutive pairs."""
    pairs = []
    for t in texts:
        ids = [data_sources.BYTE_BOS, *t.encode("utf-8"), data_sources.BYTE_EOS]
        pairs += list(zip(ids[:-1], ids[1:]))
    return pairs


def _check_row_invariants(b, length):
    for k in data.BATCH_KEYS:
        assert b[k].dtype == np.int32 and b[k].shape == (BATCH, length), k
    seg, pos = b["segment_ids"], b["positions"]
    np.testing.assert_array_equal(b["loss_mask"], (seg > 0).astype(np.int32))
    for r in range(BATCH):
        for t in range(length):
            if seg[r, t] == 0:
                assert pos[r, t] == 0 and b["tokens"][r, t] == 0
                continue
            starts = t == 0 or seg[r, t] != seg[r, t - 1]
            assert pos[r, t] == (0 if starts else pos[r, t - 1] + 1)
            if not starts:  # same document: the previous target is this token
                assert b["targets"][r, t - 1] == b["tokens"][r, t]
                assert seg[r, t] == seg[r, t - 1]
        real = seg[r][seg[r] > 0]
        assert np.all(np.diff(real) >= 0) and (real.size == 0 or real[0] == 1)


def test_embedded_default_packs_documents_in_shuffled_order():
    cfg = tiny_data()
    stream = data.train_batches(cfg, BATCH)
    batches = [next(stream) for _ in range(40)]
    for b in batches[:3]:
        _check_row_invariants(b, cfg.max_target_length)
        assert b["segment_ids"].min() >= 1  # training rows are never padded
    docs = data_sources.embedded_documents()
    n_train = len(docs) - round(len(docs) * cfg.eval_holdout_fraction)
    orders = [np.random.default_rng([cfg.data_shuffle_seed, e]).permutation(n_train) for e in range(2)]
    for row in range(BATCH):  # row r packs positions r, r + BATCH, ... of each epoch's order
        expected = _reference_pairs([docs[i] for order in orders for i in order[row::BATCH]])
        got = _pairs(batches, row)
        assert len(got) == 40 * cfg.max_target_length and got == expected[:len(got)], row


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "txt"])
def test_local_files_stream_over_epochs_and_hold_out_eval(tmp_path, kind):
    path, texts = _docs_file(tmp_path, kind=kind)
    cfg = tiny_data(f"hf_path={path}", "eval_holdout_fraction=0.25")
    stream = data.train_batches(cfg, BATCH)
    batches = [next(stream) for _ in range(30)]
    for b in batches[:4]:
        _check_row_invariants(b, cfg.max_target_length)
    if kind == "txt":  # paragraphs split at blank lines; the file's final newline stays on the last
        texts[-1] += "\n"
    train_texts, eval_texts = texts[:9], texts[9:]
    epochs = [[train_texts[i] for i in np.random.default_rng([0, e]).permutation(9)] for e in range(40)]
    for row in range(BATCH):  # row r packs positions r, r + BATCH, ... of each epoch's order
        expected = _reference_pairs([t for epoch in epochs for t in epoch[row::BATCH]])
        got = _pairs(batches, row)
        assert len(got) == 30 * cfg.max_target_length and got == expected[:len(got)], row
    assert all(epoch >= 1 for epoch, _, _ in stream.state()["rows"])
    ev = list(data.eval_batches(cfg, BATCH))
    _check_row_invariants(ev[-1], cfg.max_target_length)
    assert _pairs(ev) == _reference_pairs(eval_texts)
    assert ev[-1]["segment_ids"][-1, -1] == 0  # the evaluation tail is padded, never wrapped


def test_directory_and_glob_sources(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"part{i}.jsonl").write_text(json.dumps({"text": f"part {i}"}) + "\n")
    for hf_path in (tmp_path / "d", tmp_path / "d" / "part*.jsonl"):
        docs = data_sources.Documents(tiny_data(f"hf_path={hf_path}", "eval_holdout_fraction=0"), "train")
        assert sorted(docs.epoch(0, 0, shuffle=False)) == ["part 0", "part 1", "part 2"]


@pytest.mark.parametrize("source", ["embedded", "jsonl", "streaming", "synthetic"])
def test_restored_position_continues_exactly(tmp_path, source):
    extra = {"embedded": [], "synthetic": ["dataset_type=synthetic"]}.get(source)
    if extra is None:
        path, _ = _docs_file(tmp_path, n=7)
        extra = [f"hf_path={path}", f"hf_streaming={source == 'streaming'}"]
    cfg = tiny_data(*extra)
    straight = data.train_batches(cfg, BATCH)
    for _ in range(5):
        next(straight)
    state = json.loads(json.dumps(straight.state()))  # what the checkpoint stores
    expected = [next(straight) for _ in range(12)]  # crosses an epoch on the small files
    resumed = data.train_batches(cfg, BATCH)
    resumed.restore(state)
    for want in expected:
        got = next(resumed)
        for k in data.BATCH_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_streaming_holds_out_every_nth_document(tmp_path):
    path, texts = _docs_file(tmp_path, n=10)
    cfg = tiny_data(f"hf_path={path}", "hf_streaming=true", "eval_holdout_fraction=0.2")
    eval_docs = list(data_sources.Documents(cfg, "eval").epoch(0, 0, shuffle=False))
    train_docs = list(data_sources.Documents(cfg, "train").epoch(0, 0, shuffle=True))
    assert eval_docs == [texts[4], texts[9]]
    assert sorted(train_docs) == sorted(t for i, t in enumerate(texts) if i not in (4, 9))


def test_synthetic_batches():
    cfg = tiny_data("dataset_type=synthetic")
    b = next(data.train_batches(cfg, BATCH))
    assert b["tokens"].max() < cfg.vocab_size and b["tokens"].dtype == np.int32
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
    np.testing.assert_array_equal(b["positions"][0], np.arange(cfg.max_target_length))
    ev = next(data.eval_batches(cfg, BATCH))
    assert not np.array_equal(ev["tokens"], b["tokens"])


def test_hf_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "lorem": 1, "ipsum": 2, "<s>": 3, "</s>": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path, _ = _docs_file(tmp_path, n=3)
    cfg = tiny_data(f"hf_path={path}", f"tokenizer_path={tmp_path / 'tokenizer.json'}", "eval_holdout_fraction=0")
    b = next(data.train_batches(cfg, 1))
    # <s> "document" "0" ":" -> [UNK] x3, then "lorem ipsum"; </s> closes each document
    assert b["tokens"][0, :6].tolist() == [3, 0, 0, 0, 1, 2]
    assert set(b["tokens"][0].tolist()) <= {0, 1, 2, 3, 4} and 4 in b["targets"][0].tolist()


@pytest.mark.parametrize("override,needle", [
    ("hf_path=/nonexistent/dir/data.jsonl", "/nonexistent/dir/data.jsonl"),
    ("hf_path=some-org/some-dataset", "some-org/some-dataset"),  # offline hub
    ("tokenizer_path=/nonexistent/tokenizer.json", "/nonexistent/tokenizer.json"),
    ("vocab_size=200", "vocab_size=200"),
    ("hf_text_column=body", "body"),
])
def test_bad_inputs_are_one_line_data_errors(tmp_path, override, needle):
    path, _ = _docs_file(tmp_path, n=3)
    cfg = tiny_data(f"hf_path={path}", override)
    with pytest.raises(DataError) as e:
        next(data.train_batches(cfg, BATCH))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_restore_refuses_other_data_settings(tmp_path):
    stream = data.train_batches(tiny_data(), BATCH)
    next(stream)
    other = data.train_batches(tiny_data("data_shuffle_seed=1"), BATCH)
    with pytest.raises(DataError, match="data_shuffle_seed"):
        other.restore(stream.state())


# ----------------------------------------------------------------------------- rows per process

ROWS = 4


def _split(processes):
    """The rows of each of `processes` equal processes (contiguous, as `local_batch_slice` gives them)."""
    per = ROWS // processes
    return [range(p * per, (p + 1) * per) for p in range(processes)]


@pytest.mark.parametrize("source", ["embedded", "streaming", "synthetic"])
def test_any_process_count_gives_the_same_global_batches_and_positions(tmp_path, source):
    """1, 2 and 4 processes (simulated: each reads `rows`) give one process's global batches, and their
    positions, joined as a checkpoint joins them, resume under the same process count bitwise."""
    extra = {"embedded": [], "synthetic": ["dataset_type=synthetic"]}.get(source)
    if extra is None:
        path, _ = _docs_file(tmp_path, n=9)
        extra = [f"hf_path={path}", "hf_streaming=true", "eval_holdout_fraction=0"]
    cfg = tiny_data(*extra)
    one = data.train_batches(cfg, ROWS)
    want = [next(one) for _ in range(12)]  # crosses epochs on the small file
    for processes in (2, 4):
        streams = [data.train_batches(cfg, ROWS, rows) for rows in _split(processes)]
        for step in range(12):
            parts = [next(s) for s in streams]
            for k in data.BATCH_KEYS:
                np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), want[step][k],
                                              err_msg=f"{processes} processes, step {step}, {k}")
            if step == 5:
                joined = json.loads(json.dumps(data.merge_positions([s.state() for s in streams])))
        resumed = [data.train_batches(cfg, ROWS, rows) for rows in _split(processes)]
        for s in resumed:
            s.restore(joined)
        for step in range(6, 12):
            got = np.concatenate([next(s)["tokens"] for s in resumed])
            np.testing.assert_array_equal(got, want[step]["tokens"], err_msg=f"{processes} processes resumed, step {step}")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_process_tokenises_only_the_documents_of_its_rows(tmp_path, monkeypatch, streaming):
    path, texts = _docs_file(tmp_path, n=16)
    cfg = tiny_data(f"hf_path={path}", f"hf_streaming={streaming}", "eval_holdout_fraction=0")
    tokenised = []
    ids = data.document_ids
    monkeypatch.setattr(data, "document_ids", lambda tok, text: tokenised.append(text) or ids(tok, text))
    stream = data.train_batches(cfg, ROWS, range(2, 3))  # process 2 of 4
    for _ in range(6):
        next(stream)
    epoch, position, _ = stream.state()["rows"][2]
    assert stream.state()["rows"][:2] == [None, None] and stream.state()["rows"][3] is None
    docs = data_sources.Documents(cfg, "train")
    orders = [list(docs.epoch(e, 0, shuffle=True)) for e in range(epoch + 1)]
    mine = [t for e, order in enumerate(orders) for p, t in enumerate(order) if p % ROWS == 2 and (e, p) <= (epoch, position)]
    assert tokenised == mine[:len(tokenised)] and len(tokenised) >= len(mine) - 1


def test_a_position_for_another_global_batch_is_refused():
    stream = data.train_batches(tiny_data(), ROWS)
    next(stream)
    with pytest.raises(DataError, match="global batch of 4 rows, not 2 rows"):
        data.train_batches(tiny_data(), 2).restore(stream.state())
    old = {"epoch": 0, "document": 3, "offset": 5, "data": stream.state()["data"]}  # one stream for all rows
    with pytest.raises(DataError, match="an older dsv4"):
        data.train_batches(tiny_data(), ROWS).restore(old)
    notices = data.train_batches(tiny_data("allow_data_change=true"), ROWS).check(old)
    assert any("starts from its beginning" in n for n in notices)


def test_too_few_documents_for_the_rows_is_one_line(tmp_path):
    path, _ = _docs_file(tmp_path, n=3)
    cfg = tiny_data(f"hf_path={path}", "eval_holdout_fraction=0")
    with pytest.raises(DataError, match="row 3 of the 4-row global batch") as e:
        for _ in range(50):
            next(data.train_batches(cfg, ROWS))
    assert "\n" not in str(e.value)
