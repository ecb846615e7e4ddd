"""The user's dataset (``--data``, ``autotune/data_source.py``, ``trials/user_data.py``): read from
JSON Lines, Parquet, text, a saved ``datasets`` folder and the Hub cache, tokenized by a real
tokenizer trained here (a word-level one: a document's tokens are its words, counted by hand),
recorded in the study, trained on at its real lengths (the peak at its longest micro-batch,
tokens/s in real tokens), and refused when it changed or is missing."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.data_source import Prepared, histogram, prepare, trial_order
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import gpu_spec
from autotune.estimator.workload import Workload
from autotune.study import settings_of
from tests.conftest import NO_PROBES, TINY, cli, tiny_spec
from trials.data import micro_shapes
from trials.spec import trial_documents

WORDS = [f"w{i}" for i in range(200)]
SEQ = 64
#: skewed: many short documents, a few longer than the sequence (cut to it)
SHORT = [3, 5, 7, 9, 11, 6, 4, 9]  # 54 tokens: two measured steps of 27 on average
LONG = [70, 80, 90, 100]


def _text(n: int, salt: int = 0) -> str:
    return " ".join(WORDS[(salt * 7 + i) % len(WORDS)] for i in range(n))


def make_tokenizer(folder: Path, chat: bool = False) -> Path:
    """A word-level tokenizer over ``WORDS`` (no special tokens added to a text), saved as a
    model folder's tokenizer is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    if chat:  # each message's words, then the next
        fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return folder


def rows(lengths: list[int]) -> list[dict[str, Any]]:
    return [{"id": i, "text": _text(n, i)} for i, n in enumerate(lengths)]


def write_jsonl(path: Path, lengths: list[int]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(lengths)))
    return path


def _prepare(source: Path | str, tokenizer: Path, **kw: Any) -> Prepared:
    args: dict[str, Any] = {
        "seq_len": SEQ,
        "vocab_size": TINY["vocab_size"],
        "per_step": 4,
        "warmup_steps": 1,
        "measured_steps": 2,
        "seed": 0,
        **kw,
    }
    field = args.pop("field", None)
    return prepare(str(source), field, str(tokenizer), "tiny-llama", **args)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_every_format_gives_the_same_documents(tmp_path: Path, tok: Path) -> None:
    """JSONL, JSON, Parquet, text and a saved ``datasets`` folder of the same rows: the same
    token lengths (each document's words, by hand), histogram and trial documents."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = SHORT + LONG
    write_jsonl(tmp_path / "d.jsonl", lengths)
    (tmp_path / "d.json").write_text(json.dumps(rows(lengths)))
    pq.write_table(pa.Table.from_pylist(rows(lengths)), tmp_path / "d.parquet")
    (tmp_path / "d.txt").write_text("\n\n".join(r["text"] for r in rows(lengths)) + "\n")
    datasets.Dataset.from_list(rows(lengths)).save_to_disk(str(tmp_path / "saved"))
    made = {}
    for name in ("d.jsonl", "d.json", "d.parquet", "d.txt", "saved"):
        made[name] = _prepare(tmp_path / name, tok)
        a = made[name].attrs
        assert a["field"] == "text" and a["documents"] == len(lengths)
        assert a["tokens"] == sum(lengths) and a["longest"] == 100 and a["shortest"] == 3
        # 3 in [2, 4), 4, 5, 6, 7 in [4, 8), 9, 9, 11 in [8, 16), 70-100 in [64, 128)
        assert a["histogram"] == {"edges": [1, 2, 4, 8, 16, 32, 64, 128],
                                  "counts": [0, 1, 4, 3, 0, 0, 4]}  # fmt: skip
        assert a["cut"] == 4
    first = made["d.jsonl"]
    for p in made.values():
        assert p.documents == first.documents
    # the file's identity: its own bytes' SHA-256 and size
    raw = (tmp_path / "d.jsonl").read_bytes()
    assert first.attrs["sha256"] == hashlib.sha256(raw).hexdigest()
    assert first.attrs["bytes"] == len(raw)


def test_the_trial_s_documents_by_hand(tmp_path: Path, tok: Path) -> None:
    """Warm-up 1, measured 2, 4 a step: step 0 the four longest (cut to the sequence), steps
    1-2 the eight others, each once; their tokens are the documents' words."""
    p = _prepare(write_jsonl(tmp_path / "d.jsonl", SHORT + LONG), tok)
    order = p.attrs["order"]
    assert order[:4] == [SEQ] * 4
    assert sorted(order[4:]) == sorted(SHORT)
    for n, ids in zip(order, p.documents, strict=True):
        assert len(ids) == n and all(2 <= t < 202 for t in ids)
    # with two warm-up steps the longest are in the second (after the optimizer's first step)
    assert trial_order([5, 1, 9, 2, 7, 3], 2, 2, 1, 0)[2:4] == [2, 4]


def test_chat_messages_use_the_template(tmp_path: Path) -> None:
    chat_tok = make_tokenizer(tmp_path / "tok", chat=True)
    data = tmp_path / "chat.jsonl"
    said = [[{"role": "user", "content": _text(4)}, {"role": "assistant", "content": _text(n)}]
            for n in (3, 6)]  # fmt: skip
    convo = [{"messages": m} for m in said]
    data.write_text("".join(json.dumps(r) + "\n" for r in convo))
    a = _prepare(data, chat_tok, per_step=1).attrs
    assert a["field"] == "messages" and a["tokens"] == (4 + 3) + (4 + 6)


def test_histogram_by_hand() -> None:
    assert histogram([1, 2, 3, 4, 8]) == {"edges": [1, 2, 4, 8, 16], "counts": [1, 2, 1, 1]}


def test_the_estimator_reads_the_longest_and_the_timed_batches(tmp_path: Path, tok: Path) -> None:
    """The estimator's memory is that of the longest micro-batch (4 rows of the sequence: the
    same as fixed-length data), its speed the timed steps' mean (the short documents)."""
    p = _prepare(write_jsonl(tmp_path / "d.jsonl", SHORT + LONG), tok)
    spec = tiny_spec({"micro_batch_size": 4}, seq_len=SEQ, global_batch_size=4)
    spec.warmup_steps, spec.measured_steps = 1, 2
    spec.data = {"file": "unused", "sha256": "", "order": p.attrs["order"]}
    docs = trial_documents(spec)
    big, mean = micro_shapes(spec.config, SEQ, 4, docs)
    assert (big.rows, big.length, big.tokens) == (4, SEQ, 4 * SEQ)
    assert mean.tokens == round(sum(SHORT) / 2)
    kw: dict[str, Any] = {
        "seq_len_tokens": SEQ,
        "global_batch_sequences": 4,
        "gpu": gpu_spec("h100"),
    }
    est = AnalyticalEstimator().estimate
    fixed = est(Workload(TINY, documents=None, **kw), spec.config)
    on_data = est(Workload(TINY, documents=docs, **kw), spec.config)
    assert on_data.peak_bytes == fixed.peak_bytes
    # without the longest step (the short documents in every step): the same speed, as it is
    # the timed steps', and a lower peak
    shorter = replace(docs, order=tuple(docs.order[4:8]) + tuple(docs.order[4:]))
    without = est(Workload(TINY, documents=shorter, **kw), spec.config)
    assert without.tokens_per_s == on_data.tokens_per_s
    assert without.peak_bytes < on_data.peak_bytes


def _run_spec(spec: Any, folder: Path) -> Any:
    from autotune.runner import SubprocessRunner

    result = SubprocessRunner(folder, timeout_s=600).run(spec, folder.name)
    assert result.status == "ok", result.error + result.stderr_tail
    return result


def _data_spec(tmp_path: Path, prepared: Prepared, **config: Any) -> Any:
    from trials.user_data import write_documents

    path = tmp_path / "docs.bin"
    sha = write_documents(path, prepared.documents)
    spec = tiny_spec({"micro_batch_size": 4, **config}, seq_len=SEQ, global_batch_size=4)
    spec.data = {"file": str(path), "sha256": sha, "order": prepared.attrs["order"]}
    spec.documents = [min(prepared.attrs["order"]), max(prepared.attrs["order"])]
    return spec


@pytest.mark.real_trial
def test_the_peak_is_the_longest_micro_batch_s(tmp_path: Path, tok: Path) -> None:
    """Warm-up 2: the second step (the last the CPU tracker sees, with the optimizer's states
    made) trains the four longest documents, 4 x 64 positions; the oracle is a separate trial
    of fixed-length 64-token rows of the same configuration, whose every step is that shape:
    the same activations at the peak. (The short documents alone peak 1.5 MB lower.)"""
    p = _prepare(write_jsonl(tmp_path / "d.jsonl", SHORT + LONG), tok, warmup_steps=2,
                 measured_steps=1)  # fmt: skip
    spec = _data_spec(tmp_path, p)
    spec.warmup_steps, spec.measured_steps = 2, 1
    on_data = _run_spec(spec, tmp_path / "data")
    fixed = tiny_spec({"micro_batch_size": 4}, seq_len=SEQ, global_batch_size=4)
    fixed.warmup_steps, fixed.measured_steps = 2, 1
    full = _run_spec(fixed, tmp_path / "fixed")
    # the same activations; the rest apart by the labels tensor alone (fixed-length rows are
    # their own labels; documents' labels skip each one's first token: 4 x 64 int64)
    assert on_data.memory_breakdown["activations"] == full.memory_breakdown["activations"]
    assert 0 <= on_data.peak_bytes - full.peak_bytes <= 4 * SEQ * 8


@pytest.mark.real_trial
def test_padded_and_packed_count_real_tokens(tmp_path: Path, tok: Path) -> None:
    """Warm-up 1 (the four longest), then two measured steps of the eight short documents: a
    measured step trains sum(SHORT) / 2 real tokens on average, padded or packed, whatever
    the padding."""
    p = _prepare(write_jsonl(tmp_path / "d.jsonl", SHORT + LONG), tok)
    results = {}
    for packed in (False, True):
        spec = _data_spec(tmp_path / str(packed), p, packing=packed)
        spec.warmup_steps, spec.measured_steps = 1, 2
        results[packed] = _run_spec(spec, tmp_path / f"run{packed}")
    for r in results.values():
        assert r.tokens_per_s * r.step_time_s == pytest.approx(sum(SHORT) / 2, rel=1e-6)
    assert results[True].losses == pytest.approx(results[False].losses, rel=1e-4)


def _db_digest(db: Path) -> list[Any]:
    with sqlite3.connect(db) as con:
        return [
            con.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
            for t in ("trials", "study_user_attributes", "trial_user_attributes")
        ]


@pytest.mark.real_trial
def test_a_study_on_the_data_records_it_and_refuses_other_data(in_tmp: Path, tok: Path) -> None:
    """``autotune run --data``: the identity recorded (the file's own SHA-256 and size, the
    histogram counted by hand), packing searched both ways, the documents' lengths in the
    spec; then ``resume`` and ``worker`` on changed bytes, ``resume`` on a missing file and
    ``run`` on other data refused, nothing written."""
    data = write_jsonl(in_tmp / "mine.jsonl", SHORT + LONG)
    space = in_tmp / "space.yaml"
    space.write_text("dimensions:\n  micro_batch_size:\n    choices: [4]\n  packing:\n"
                     "    choices: [false, true]\n")  # fmt: skip
    run = ["run", "--model", "tiny-llama", "--budget", "1GB", "--space", str(space),
           "--seq-len", str(SEQ), "--global-batch-size", "4", *NO_PROBES,
           "--data", str(data), "--tokenizer", str(tok)]  # fmt: skip
    result = cli(*run, "--trials", "2")
    assert result.exit_code == 0, result.output
    assert "data " in result.output and "12 documents" in result.output
    storage = "sqlite:///autotune.db"
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.study_name == "tiny-llama-1GB-cpu-data-mine.jsonl"
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    recorded = settings_of(study).data
    assert recorded is not None
    assert recorded["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert recorded["bytes"] == data.stat().st_size and recorded["source"] == str(data)
    assert recorded["histogram"]["counts"] == [0, 1, 4, 3, 0, 0, 4]
    ran = {t.user_attrs["config"]["packing"]: t.user_attrs for t in study.trials}
    assert set(ran) == {False, True} and all(a["status"] == "ok" for a in ran.values())
    # the trial documents are the study's: a trial ran on a file of those lengths
    spec = json.loads(next(in_tmp.glob("autotune_runs/*/trial-*/spec.json")).read_text())
    assert spec["data"]["order"] == recorded["order"]

    before = (_db_digest(in_tmp / "autotune.db"), len(study.trials))
    data.write_text(data.read_text().replace("w1 ", "w2 ", 1))  # one word changed
    for command in ("resume", "worker"):
        refused = cli(command, "--study", summary.study_name, "--trials", "1")
        assert refused.exit_code == 2, refused.output
        assert refused.output.count("\n") == 1 and "has changed" in refused.output
    moved = data.rename(in_tmp / "moved.jsonl")
    gone = cli("resume", "--study", summary.study_name, "--trials", "1")
    assert gone.exit_code == 2 and gone.output.count("\n") == 1
    assert f"{data}, which is missing" in gone.output
    moved.rename(data)
    other = write_jsonl(in_tmp / "other.jsonl", SHORT)
    again = cli(*run[:-4], "--data", str(other), "--tokenizer", str(tok),
                "--study-name", summary.study_name, "--trials", "1")  # fmt: skip
    assert again.exit_code == 2 and "other data" in again.output, again.output
    assert again.output.count("\n") == 1
    assert (_db_digest(in_tmp / "autotune.db"), len(study.trials)) == before


def test_a_dataset_in_the_hub_cache(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub name is read from the local cache's snapshot (laid out as huggingface_hub keeps
    it), never downloaded: an uncached name is one line."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "datasets--me--tiny"
    commit = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit / "data"
    snap.mkdir(parents=True)
    write_jsonl(snap / "train.jsonl", SHORT + LONG)
    write_jsonl(snap / "test.jsonl", [2, 2])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    a = _prepare("me/tiny", tok).attrs
    assert a["documents"] == len(SHORT + LONG)  # the train split only
    with pytest.raises(Exception, match=r"no dataset of that name in the local Hugging Face cache"):
        _prepare("me/absent", tok)


RUN_1GB = ["run", "--model", "tiny-llama", "--budget", "1GB", "--seq-len", str(SEQ)]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--data", "nowhere.jsonl", "--tokenizer", "TOK"], "no such file or folder"),
        (["--data", "DATA"], "needs the model's tokenizer"),
        (["--data", "DATA", "--tokenizer", "no/such-tokenizer"], "--tokenizer no/such-tokenizer"),
        (["--data", "DATA", "--tokenizer", "TOK", "--data-field", "body"], "not a field"),
        (["--data-field", "text"], "--data-field is for --data"),
        (["--data", "DATA", "--tokenizer", "TOK", "--documents", "8:32"], "give one of them"),
        (["--data", "BAD", "--tokenizer", "TOK"], "not JSON Lines"),
    ],
)
def test_bad_data_input_is_one_line(
    in_tmp: Path, tok: Path, extra: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(in_tmp / "empty-cache"))
    write_jsonl(in_tmp / "d.jsonl", SHORT)
    (in_tmp / "bad.jsonl").write_text("{not json\n")
    subst = {"DATA": str(in_tmp / "d.jsonl"), "TOK": str(tok), "BAD": str(in_tmp / "bad.jsonl")}
    result = cli(*RUN_1GB, *[subst.get(a, a) for a in extra])
    assert result.exit_code == 2, result.output
    assert needle in result.output and result.output.count("\n") == 1, result.output
    assert not (in_tmp / "autotune.db").exists() or "documents" in needle


def test_same_data_is_the_same_bytes_field_and_tokenizer(tmp_path: Path, tok: Path) -> None:
    """A moved file of the same bytes is the same data; a word changed, another field or
    another tokenizer is not."""
    from autotune.data_source import check_same
    from autotune.errors import UserError

    data = write_jsonl(tmp_path / "d.jsonl", SHORT + LONG)
    stored = _prepare(data, tok).attrs
    moved = _prepare(data.rename(tmp_path / "moved.jsonl"), tok).attrs
    check_same("s", stored, moved)
    (tmp_path / "moved.jsonl").write_text(
        (tmp_path / "moved.jsonl").read_text().replace("w1 ", "w2 ", 1)
    )
    changed = _prepare(tmp_path / "moved.jsonl", tok).attrs
    assert changed["order"] == stored["order"]  # the same lengths: only the bytes tell
    other_tok = make_tokenizer(tmp_path / "tok2", chat=True)
    for other in (changed, {**stored, "field": "body"}, _prepare(data.parent / "moved.jsonl",
                                                                  other_tok).attrs):  # fmt: skip
        with pytest.raises(UserError, match="was made on other data"):
            check_same("s", stored, other)
    with pytest.raises(UserError, match="synthetic data"):
        check_same("s", None, stored)
