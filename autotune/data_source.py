"""The user's dataset (``autotune run --data``): read, tokenized, described, and the documents a
trial trains on chosen.

What ``--data`` takes, nothing downloaded ever:
- a JSON Lines file (``.jsonl``; ``.json``: JSON Lines or one array of rows), a Parquet file
  (``.parquet``) or a text file (any other name: one document per line, as ``datasets``'
  ``text`` loader reads it, empty lines skipped);
- a folder a ``datasets`` dataset was saved to (``save_to_disk``: its ``train`` split, or its
  only one), or a folder of such files (all of them, the ``train`` ones where names say);
- a Hub dataset name (``owner/name``) already in the local Hugging Face cache: its snapshot
  there, read as a folder.
The text is the field ``--data-field`` names, else ``text``, else a chat ``messages`` list
(rendered with the tokenizer's chat template, or as ``role: content`` lines where it has none),
else the one string field; it is tokenized with the model's tokenizer (``--tokenizer``, else the
one in the ``--model`` folder or cached Hub model), special tokens included, and a document
longer than ``--seq-len`` is cut to it, as a trainer's ``max_length`` would. Documents of fewer
than 2 tokens train nothing and are left out.

The study records the data's identity (``StudySettings.data``): where it was, its size, the
SHA-256 of its bytes, the tokenizer's, the field, and the histogram of its documents' token
lengths; a study is continued only on the same bytes and tokenizer (``check_same``, ``ready``).

The trial's documents (``trial_order``), in a fixed, seeded order: the last warm-up step (the
last one the CPU tracker sees, after the first step made the optimizer's states) trains on
the step's worth of the longest documents, longest first, so every rank's first micro-batch
holds the ``micro`` longest: padded, no micro-batch of the data is larger (``micro`` rows of the
longest document, capped at the sequence); packed, none holds more real tokens. Every other
step draws from a seeded shuffle of the rest, so the timed steps run at the data's usual
lengths. The estimator lays out the same micro-batches (``trials.data.DatasetDocuments``): the
memory at the largest, the speed at the mean of the timed steps'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UserError
from autotune.terminal import printable
from trials.user_data import file_sha256, write_documents

#: the study's documents files: one per dataset, tokenizer and draw, beside the trial folders
DOCUMENTS_DIR = Path("autotune_runs") / "data"
#: settings.data keys that make the data the same data (the path may change: a moved file)
SAME_DATA = ("sha256", "field", "tokenizer_sha256")
TEXT_SUFFIXES = (".txt", ".text", ".md")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", *TEXT_SUFFIXES)
#: a document needs a token to predict and one to predict it
MIN_TOKENS = 2
BATCH = 1000


# --- finding and reading the data ------------------------------------------------------------


def _hub_snapshot(name: str, repo_type: str) -> Path | None:
    """The local snapshot of Hub repo ``name`` in the Hugging Face cache, or None (no network:
    ``local_files_only``)."""
    if name.count("/") > 1 or name.startswith((".", "/")) or not name.strip():
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, repo_type=repo_type, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repo id
        return None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def locate(source: str) -> Path:
    """The file or folder ``--data`` names: a path, or a cached Hub dataset's snapshot."""
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    snapshot = _hub_snapshot(source, "dataset")
    if snapshot is not None:
        return snapshot
    raise UserError(
        f"--data {printable(source)}: no such file or folder, and no dataset of that name in "
        f"the local Hugging Face cache ({_hub_cache()}); nothing is downloaded"
    )


def _files(folder: Path) -> list[Path]:
    """A folder's data files: the ``train`` ones where some names say so, else all."""
    found = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in DATA_SUFFIXES and ".cache" not in p.parts
    )
    found = [p for p in found if p.suffix not in TEXT_SUFFIXES or p.stem.lower() != "readme"]
    train = [p for p in found if "train" in p.relative_to(folder).as_posix().lower()]
    return train or found


def _saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of the data at ``path`` (a file, a saved dataset, a folder of files)."""
    if path.is_dir():
        if _saved_dataset(path):
            return _load_from_disk(path)
        files = _files(path)
        if not files:
            raise UserError(f"--data {path}: no data file in this folder (looked for "
                            f"{', '.join(DATA_SUFFIXES)} and a saved dataset)")  # fmt: skip
        return [row for f in files for row in _file_rows(f)]
    return _file_rows(path)


def _load_from_disk(folder: Path) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"--data {folder}: a saved dataset needs the `datasets` package "
                        "(pip install datasets)") from None  # fmt: skip
    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" not in loaded and len(splits) != 1:
            raise UserError(f"--data {folder}: a dataset of splits {', '.join(splits)}: save "
                            "the one to train on alone, or name it train")  # fmt: skip
        loaded = loaded["train" if "train" in loaded else splits[0]]
    return list(loaded.to_list())


def _file_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist())
        if suffix == ".arrow":
            import pyarrow as pa

            with pa.memory_map(str(path)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
            return list(table.to_pylist())
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--data {path}: not UTF-8 text, JSON Lines or Parquet") from None
    except ImportError as exc:
        raise UserError(f"--data {path}: reading it needs {exc.name} (pip install pyarrow)"
                        ) from None  # fmt: skip
    except OSError as exc:
        raise UserError(f"--data {path}: cannot read it: {exc.strerror or exc}") from None
    except Exception as exc:  # pyarrow's errors: not a Parquet or Arrow file
        raise UserError(f"--data {path}: not a readable {suffix[1:]} file: "
                        f"{str(exc).splitlines()[0][:200]}") from None  # fmt: skip
    if suffix in (".jsonl", ".json"):
        return _json_rows(path, text)
    return [{"text": line} for line in text.splitlines() if line.strip()]


def _json_rows(path: Path, text: str) -> list[dict[str, Any]]:
    stripped = text.lstrip()
    try:
        if path.suffix == ".json" and stripped.startswith("["):
            rows = json.loads(stripped)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UserError(f"--data {path}: not JSON Lines (line {exc.lineno}: {exc.msg})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise UserError(f"--data {path}: every line must be a JSON object (a row of fields)")
    return rows


def content_sha256(path: Path) -> tuple[str, int]:
    """(SHA-256, bytes) of a file, or of a folder's files (their paths and bytes, in order)."""
    if path.is_file():
        return file_sha256(path), path.stat().st_size
    digest, size = hashlib.sha256(), 0
    for f in sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(file_sha256(f)))
        size += f.stat().st_size
    return digest.hexdigest(), size


# --- the text field and the tokenizer ---------------------------------------------------------


def text_field(rows: list[dict[str, Any]], named: str | None, where: str) -> str:
    """The field holding each document: ``named``, else ``text``, else ``messages``, else the
    one string field."""
    if not rows:
        raise UserError(f"--data {where}: no rows in it")
    fields = list(rows[0])
    if named is not None:
        if named not in fields:
            raise UserError(f"--data-field {printable(named)}: not a field of {where} "
                            f"(its fields: {', '.join(map(str, fields))})")  # fmt: skip
        return named
    for usual in ("text", "messages"):
        if usual in fields:
            return usual
    strings = [k for k in fields if isinstance(rows[0][k], str)]
    if len(strings) == 1:
        return strings[0]
    raise UserError(f"--data {where}: which field is the text? its fields: "
                    f"{', '.join(map(str, fields))}; name one with --data-field")  # fmt: skip


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    )


def load_tokenizer(tokenizer: str | None, model: str) -> tuple[Any, str]:
    """The tokenizer, and where it was found: ``--tokenizer`` (a folder or a cached Hub id),
    else the ``--model`` folder (or the folder of its ``config.json``) or cached Hub model."""
    from transformers import AutoTokenizer

    def attempt(where: str) -> Any:
        try:
            return AutoTokenizer.from_pretrained(where, local_files_only=True)
        except Exception:
            return None

    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if path.is_file():
            path = path.parent
        found = attempt(str(path) if path.exists() else tokenizer)
        if found is None:
            where = (f"no tokenizer files in {path}" if path.exists() else
                     f"no such folder, nor a model of that name in the local Hugging Face "
                     f"cache ({_hub_cache()})")  # fmt: skip
            raise UserError(f"--tokenizer {printable(tokenizer)}: {where}; nothing is downloaded")
        return found, str(path.resolve()) if path.exists() else tokenizer
    candidates = []
    model_path = Path(model).expanduser()
    if model_path.exists():
        candidates.append(str(model_path.parent if model_path.is_file() else model_path))
    elif "/" in model:
        candidates.append(model)
    for where in candidates:
        found = attempt(where)
        if found is not None:
            return found, str(Path(where).resolve()) if Path(where).exists() else where
    looked = f" (none in {candidates[0]})" if candidates else ""
    raise UserError(f"--data needs the model's tokenizer to count its tokens, and --model "
                    f"{printable(model)} has none{looked}: give --tokenizer PATH (a tokenizer or "
                    "model folder, or a Hub id in the local cache)")  # fmt: skip


def tokenizer_sha256(tokenizer: Any) -> str:
    """What makes the tokenizer's ids: its vocabulary and rules, special tokens and chat
    template (where it was loaded from does not count)."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
                   ).encode())  # fmt: skip
    digest.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def documents_text(rows: list[dict[str, Any]], field: str, tokenizer: Any) -> list[str]:
    """Each row's document as text (a chat rendered), empty ones left out."""
    out = []
    for row in rows:
        value = row.get(field)
        if isinstance(value, str):
            text = value
        elif isinstance(value, list) and _is_chat(value):
            text = _render(tokenizer, value)
        elif value is None:
            continue
        else:
            raise UserError(f"--data: field '{field}' holds {type(value).__name__}, not text "
                            "or chat messages; name another with --data-field")  # fmt: skip
        if text.strip():
            out.append(text)
    return out


def tokenize(tokenizer: Any, texts: list[str]) -> Iterable[list[int]]:
    for i in range(0, len(texts), BATCH):
        yield from tokenizer(texts[i : i + BATCH], add_special_tokens=True)["input_ids"]


# --- what the study records, and the trial's documents -----------------------------------------


def histogram(lengths: list[int]) -> dict[str, list[int]]:
    """Counts of token lengths in [edge, next edge), edges 1, 2, 4, ... up past the longest."""
    edges = [1]
    while edges[-1] <= max(lengths):
        edges.append(edges[-1] * 2)
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        counts[n.bit_length() - 1] += 1
    return {"edges": edges, "counts": counts}


def trial_order(
    lengths: list[int], per_step: int, warmup_steps: int, measured_steps: int, seed: int
) -> list[int]:
    """The indices of the documents a trial trains on, step after step (``per_step`` a step):
    the last warm-up step the ``per_step`` longest, longest first; every other step the next
    ones of a seeded shuffle of the rest (again from its start when it runs out)."""
    import random

    n = len(lengths)
    by_length = sorted(range(n), key=lambda i: (-lengths[i], i))
    longest = by_length[:per_step]
    rest = sorted(set(range(n)) - set(longest)) or longest
    random.Random(seed).shuffle(rest)
    peak = max(0, warmup_steps - 1)
    order: list[int] = []
    drawn = 0
    for step in range(warmup_steps + measured_steps):
        if step == peak:
            order += [longest[i % len(longest)] for i in range(per_step)]
        else:
            order += [rest[(drawn + i) % len(rest)] for i in range(per_step)]
            drawn += per_step
    return order


@dataclass
class Prepared:
    """The data read and tokenized: what the study records, and the trial's documents."""

    attrs: dict[str, Any]
    documents: list[list[int]]  # the trial's, in order, each cut to the sequence length

    def summary(self) -> str:
        a = self.attrs
        cut = f", {a['cut']:,} cut to --seq-len {a['seq_len']}" if a["cut"] else ""
        left = f", {a['dropped']:,} empty or of one token left out" if a["dropped"] else ""
        return (
            f"data {a['source']}: {a['documents']:,} documents, {a['tokens']:,} tokens "
            f"(shortest {a['shortest']}, mean {a['mean']:.1f}, longest {a['longest']}{cut}"
            f"{left}); trials train on its longest micro-batch and on seeded draws of the rest"
        )


def prepare(
    source: str,
    field: str | None,
    tokenizer_arg: str | None,
    model: str,
    *,
    seq_len: int,
    vocab_size: int,
    per_step: int,
    warmup_steps: int,
    measured_steps: int,
    seed: int,
) -> Prepared:
    """Read, tokenize and describe ``--data``; choose the trial's documents."""
    tokenizer, tokenizer_at = load_tokenizer(tokenizer_arg, model)
    path = locate(source)
    rows = read_rows(path)
    name = text_field(rows, field, str(path))
    texts = documents_text(rows, name, tokenizer)
    all_lengths, kept, top = [], [], 0
    for i, ids in enumerate(tokenize(tokenizer, texts)):
        if len(ids) >= MIN_TOKENS:
            kept.append(i)
            all_lengths.append(len(ids))
            top = max(top, max(ids))
    if not kept:
        raise UserError(f"--data {path}: no document of {MIN_TOKENS} tokens or more in it")
    if top >= vocab_size:
        raise UserError(f"--data: the tokenizer's ids reach {top:,}, beyond the model's "
                        f"vocabulary of {vocab_size:,}: use the model's own tokenizer")  # fmt: skip
    order = trial_order(all_lengths, per_step, warmup_steps, measured_steps, seed)
    chosen = sorted(set(order))
    ids_of = dict(zip(chosen, tokenize(tokenizer, [texts[kept[i]] for i in chosen]), strict=True))
    documents = [ids_of[i][:seq_len] for i in order]
    sha, size = content_sha256(path)
    attrs: dict[str, Any] = {
        "source": str(path),
        "given": source,
        "bytes": size,
        "sha256": sha,
        "field": name,
        "tokenizer": tokenizer_at,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "documents": len(kept),
        "dropped": len(rows) - len(kept),
        "tokens": sum(all_lengths),
        "shortest": min(all_lengths),
        "longest": max(all_lengths),
        "mean": sum(all_lengths) / len(all_lengths),
        "seq_len": seq_len,
        "cut": sum(n > seq_len for n in all_lengths),
        "histogram": histogram(all_lengths),
        # the trial's documents: their place among the kept ones, and their lengths (cut)
        "indices": order,
        "order": [len(d) for d in documents],
    }
    attrs["documents_sha256"] = _documents_sha(documents)
    return Prepared(attrs, documents)


def _documents_sha(documents: list[list[int]]) -> str:
    """The SHA-256 of the documents file these documents make (``trials.user_data``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return write_documents(Path(tmp) / "documents", documents)


def documents_path(data: dict[str, Any]) -> Path:
    """Where this process keeps the study's documents file (named by its hash)."""
    return (DOCUMENTS_DIR / f"documents-{data['documents_sha256'][:16]}.bin").resolve()


def spec_data(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """A trial spec's ``data`` (``trials.spec.TrialSpec``) from the study's."""
    if not data:
        return None
    return {
        "file": str(documents_path(data)),
        "sha256": data["documents_sha256"],
        "order": data["order"],
    }


def check_same(name: str, stored: dict[str, Any] | None, given: dict[str, Any] | None) -> None:
    """Refuse to add trials on other data (another file's bytes, field or tokenizer) to study
    ``name``."""
    if stored == given:
        return
    if stored is None or given is None:
        had = f"data {stored['source']}" if stored else "synthetic data (no --data)"
        raise UserError(f"study '{name}' was made on {had}; use another --study-name")
    for key in SAME_DATA:
        if stored.get(key) != given.get(key):
            what = {"sha256": "the bytes of", "field": "the field of",
                    "tokenizer_sha256": "the tokenizer of"}[key]  # fmt: skip
            raise UserError(
                f"study '{name}' was made on other data: {what} {given['source']} differ from "
                f"its data's ({stored['source']}, sha256 {stored['sha256'][:12]}...); use "
                "another --study-name"
            )


#: data already checked by this process: (source, size, mtime) -> sha256
_CHECKED: dict[tuple[str, int, float], str] = {}


def _stat_key(path: Path) -> tuple[str, int, float]:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime)


def remember(prepared: Prepared) -> None:
    """The data ``prepare`` just hashed: ``ready`` need not hash it again in this process."""
    path = Path(prepared.attrs["source"])
    if path.is_file():
        _CHECKED[_stat_key(path)] = prepared.attrs["sha256"]


def ready(
    data: dict[str, Any] | None,
    study_name: str,
    needs_file: bool,
    say: Callable[[str], None] | None = None,
) -> None:
    """Before a study's trials run (``run``, ``resume``, ``worker``): its data is still the
    same bytes (else one line, nothing written), and its documents file is there (written from
    the data again if not)."""
    if not data:
        return
    path = Path(data["source"])
    if not path.exists():
        raise UserError(f"study '{study_name}' trains on {path}, which is missing (looked for "
                        f"it at that path); put it back to continue")  # fmt: skip
    key = _stat_key(path) if path.is_file() else None
    sha = _CHECKED.get(key) if key else None
    if sha is None:
        sha = content_sha256(path)[0]
    if sha != data["sha256"]:
        raise UserError(f"study '{study_name}' was made on other data: {path} has changed "
                        f"(sha256 {sha[:12]}..., the study's {data['sha256'][:12]}...); "
                        "nothing was run; use another --study-name")  # fmt: skip
    if key:
        _CHECKED[key] = sha
    target = documents_path(data)
    if not needs_file or (target.exists() and file_sha256(target) == data["documents_sha256"]):
        return
    documents = _MADE.get(data["documents_sha256"]) or _documents_again(data, path, study_name)
    if say is not None:
        say(f"writing the trial's documents of {path} to {target}")
    written = write_documents(target, documents)
    if written != data["documents_sha256"]:
        target.unlink(missing_ok=True)
        raise UserError(f"study '{study_name}': {data['tokenizer']} tokenizes {path} otherwise "
                        "than when the study was made; use another --study-name")  # fmt: skip


def moved_to(data: dict[str, Any] | None, source: str, study_name: str) -> dict[str, Any]:
    """``resume``/``worker`` ``--data``: the study's data found at ``source`` (it moved): its
    settings' ``data`` reading from there when the bytes hash to the study's SHA-256; else one
    line (nothing is written)."""
    if not data:
        raise UserError(f"study '{study_name}' was made on synthetic data (no --data): --data "
                        "names where a study's dataset has moved to")  # fmt: skip
    path = locate(source)
    sha = content_sha256(path)[0]
    if sha != data["sha256"]:
        raise UserError(f"--data {printable(source)} is not the study's data: sha256 "
                        f"{sha[:12]}..., the study's {data['sha256'][:12]}... (made on "
                        f"{data['source']}); nothing was run")  # fmt: skip
    if path.is_file():
        _CHECKED[_stat_key(path)] = sha
    return {**data, "source": str(path), "given": source}


def _documents_again(data: dict[str, Any], path: Path, study_name: str) -> list[list[int]]:
    tokenizer, _ = load_tokenizer(data["tokenizer"], data["tokenizer"])
    if tokenizer_sha256(tokenizer) != data["tokenizer_sha256"]:
        raise UserError(f"study '{study_name}': the tokenizer at {data['tokenizer']} is not the "
                        "one the study was made with; use another --study-name")  # fmt: skip
    texts = documents_text(read_rows(path), data["field"], tokenizer)
    kept = [i for i, ids in enumerate(tokenize(tokenizer, texts)) if len(ids) >= MIN_TOKENS]
    chosen = sorted(set(data["indices"]))
    ids_of = dict(zip(chosen, tokenize(tokenizer, [texts[kept[i]] for i in chosen]), strict=True))
    return [ids_of[i][: data["seq_len"]] for i in data["indices"]]


#: the trial's documents ``prepare`` made in this process, by their file's hash (``ready``
#: writes them without tokenizing the data again)
_MADE: dict[str, list[list[int]]] = {}


def attach(
    settings: Any, source: str | None, field: str | None, tokenizer: str | None, model: str
) -> Prepared | None:
    """``run --data``: the data read and described into the study's ``settings`` (a
    ``StudySettings``: its ``data``, and ``documents`` as the shortest and longest trained)."""
    if source is None:
        for given, option in ((field, "--data-field"), (tokenizer, "--tokenizer")):
            if given is not None:
                raise UserError(f"{option} is for --data (the dataset to train on); give --data")
        return None
    if settings.documents:
        raise UserError("--data trains on your documents' lengths, --documents on drawn ones: "
                        "give one of them")  # fmt: skip
    prepared = prepare(
        source,
        field,
        tokenizer,
        model,
        seq_len=settings.seq_len,
        vocab_size=int(settings.model_config["vocab_size"]),
        per_step=settings.global_batch_size * settings.nproc,
        warmup_steps=settings.warmup_steps,
        measured_steps=settings.measured_steps,
        seed=settings.seed,
    )
    remember(prepared)
    _MADE[prepared.attrs["documents_sha256"]] = prepared.documents
    settings.data = prepared.attrs
    order = prepared.attrs["order"]
    settings.documents = [min(order), max(order)]
    return prepared
