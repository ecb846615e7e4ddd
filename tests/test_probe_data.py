"""The loss probe on the user's dataset (``--data``) and pretrained weights (``--model FOLDER``)
at the user's ``--lr``: its loss is the checkpoint's on the data's tokens (the oracle: a
hand-built forward of transformers' own ``from_pretrained`` model on the documents' words,
tokenized by hand), and a whole study on both records them, probes on them and exports the
learning rate. ``resume``/``worker`` follow data that moved (the same bytes elsewhere) and
refuse other bytes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import optuna
import pytest
import torch

from autotune.data_source import prepare, ready
from autotune.lossguard import PROXY_BATCH, Prober, ProbeSettings
from autotune.models import resolve_model
from autotune.runner import InProcessRunner
from autotune.study import settings_of
from tests.conftest import NO_PROBES, cli
from tests.test_user_data import WORDS, make_tokenizer, write_jsonl

PRETRAINED = Path(__file__).parent / "data" / "pretrained-llama"
SEQ = 32
#: as many documents as the probe's batch: its first step trains every one of them, whatever
#: their order; two of them longer than the sequence (cut to it)
LENGTHS = [3, 5, 9, 12, 17, 26, 40, 50]
SPACE = """dimensions:
  precision:
    choices: [fp32, bf16]
  micro_batch_size:
    choices: [8]
reference:
  precision: fp32
  micro_batch_size: 8
"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _by_hand(text: str) -> list[int]:
    """The word-level tokenizer's ids: [UNK]=0, [PAD]=1, then each word's place in WORDS."""
    return [WORDS.index(w) + 2 for w in text.split()]


def _hand_loss(texts: list[str]) -> float:
    """The mean next-token cross-entropy over every document (cut to SEQ), each run alone
    through transformers' own model loaded from the folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(PRETRAINED, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([_by_hand(text)[:SEQ]])
            logits = model(input_ids=ids).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
    return total / count


def _documents(path: Path) -> list[list[int]]:
    """A documents file read by hand (``trials.user_data``: the header, N, N + 1 offsets, the
    ids)."""
    import numpy as np

    raw = path.read_bytes()
    at = raw.index(b"\n") + 1
    n = int(np.frombuffer(raw, "<i8", 1, at)[0])
    offsets = np.frombuffer(raw, "<i8", n + 1, at + 8)
    ids = np.frombuffer(raw, "<i4", offset=at + 8 + 8 * (n + 1))
    return [ids[a:b].tolist() for a, b in itertools.pairwise(offsets)]


def test_the_probe_trains_the_checkpoint_on_the_data_s_tokens(
    in_tmp: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    assert len(LENGTHS) == PROXY_BATCH
    data = write_jsonl(in_tmp / "mine.jsonl", LENGTHS)
    entry = resolve_model(str(PRETRAINED))
    prepared = prepare(str(data), None, str(tok), str(PRETRAINED), seq_len=SEQ,
                       vocab_size=int(entry.config["vocab_size"]), per_step=PROXY_BATCH,
                       warmup_steps=1, measured_steps=1, seed=0)  # fmt: skip
    ready(prepared.attrs, "s", needs_file=True)  # the study's documents file, as run writes it
    settings = ProbeSettings(steps=3, seeds=2, lr=1e-5, backend="cpu", data=prepared.attrs,
                             seq_len=SEQ)  # fmt: skip
    prober = Prober(entry.config, settings, InProcessRunner(), entry.weights)
    losses, why = prober.curve({}, 0)
    assert losses is not None, why
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    assert losses[0] == pytest.approx(_hand_loss(texts), rel=1e-5)
    # another seed: the same documents in another order (its own file), the same checkpoint
    other, why = prober.curve({}, 1)
    assert other is not None, why
    assert other != losses
    folder = in_tmp / "autotune_runs" / "data"
    (shuffled,) = folder.glob("probe-*-seed1.bin")
    (study_file,) = set(folder.glob("documents-*.bin"))
    assert sorted(_documents(shuffled)) == sorted(_documents(study_file))
    assert _documents(shuffled) != _documents(study_file)
    verdict = prober.judge({"precision": "bf16"}, tolerance=0.5)
    assert verdict.via == "probe", verdict
    assert "pretrained weights (2 layers) on mine.jsonl" in verdict.note
    assert "lr 1e-05" in verdict.note


def test_a_random_proxy_on_the_data_keeps_the_model_s_vocabulary(
    in_tmp: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without weights the probe's proxy is random, but its vocabulary is the model's: the
    data's ids reach past the synthetic proxy's."""
    from autotune.models import MODELS

    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    config = MODELS["tiny-llama"].config
    data = write_jsonl(in_tmp / "mine.jsonl", LENGTHS)
    prepared = prepare(str(data), None, str(tok), "tiny-llama", seq_len=SEQ,
                       vocab_size=int(config["vocab_size"]), per_step=PROXY_BATCH,
                       warmup_steps=1, measured_steps=1, seed=0)  # fmt: skip
    ready(prepared.attrs, "s", needs_file=True)
    settings = ProbeSettings(steps=2, seeds=1, lr=1e-3, backend="cpu", data=prepared.attrs,
                             seq_len=SEQ)  # fmt: skip
    prober = Prober(config, settings, InProcessRunner())
    assert prober.proxy["vocab_size"] == config["vocab_size"]
    losses, why = prober.curve({}, 0)
    assert losses is not None, why
    # a random model's loss is about ln(vocabulary) on any tokens
    assert losses[0] == pytest.approx(float(torch.tensor(config["vocab_size"]).log()), rel=0.1)


def _run_args(data: Path, tok: Path, space: Path) -> list[str]:
    return ["run", "--model", str(PRETRAINED), "--data", str(data), "--tokenizer", str(tok),
            "--lr", "1e-5", "--budget", "1GB", "--space", str(space), "--seq-len", str(SEQ),
            "--global-batch-size", "8", "--probe-steps", "8", "--probe-seeds", "2",
            "--confirm-rounds", "0", "--trials", "2"]  # fmt: skip


@pytest.mark.real_trial
def test_a_study_on_the_model_and_the_data_end_to_end(
    in_tmp: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run --model FOLDER --data FILE --lr``: both identities recorded, the trials and the
    probe on them, the lr in every export; then the data moved: ``resume``/``worker`` with
    ``--data`` at its new place go on, other bytes are refused with nothing written."""
    import hashlib

    import yaml

    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    data = write_jsonl(in_tmp / "mine.jsonl", [*LENGTHS, 4, 6, 8, 10])
    space = in_tmp / "space.yaml"
    space.write_text(SPACE)
    result = cli(*_run_args(data, tok, space))
    assert result.exit_code == 0, result.output
    storage = "sqlite:///autotune.db"
    study = optuna.load_study(study_name=None, storage=storage)
    settings = settings_of(study)
    assert settings.weights == str(PRETRAINED.resolve()) and settings.user_lr == 1e-5
    assert settings.data is not None
    assert settings.data["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    trials = [t.user_attrs for t in study.trials]
    assert len(trials) == 2 and all(a["status"] == "ok" for a in trials), trials
    probed = [a["loss_verdict"] for a in trials if a["loss_verdict"]["via"] == "probe"]
    assert probed, [a["loss_verdict"] for a in trials]
    assert "pretrained weights (2 layers) on mine.jsonl" in probed[0]["note"]
    assert "lr 1e-05" in probed[0]["note"]
    for fmt, name in [("deepspeed", "ds.json"), ("hf", "hf.json"), ("axolotl", "ax.yaml")]:
        exported = cli("export", "--format", fmt, "--out", name)
        assert exported.exit_code == 0, exported.output
    assert json.loads(Path("ds.json").read_text())["optimizer"]["params"]["lr"] == 1e-5
    assert json.loads(Path("hf.json").read_text())["learning_rate"] == 1e-5
    assert yaml.safe_load(Path("ax.yaml").read_text())["learning_rate"] == 1e-5

    # the data moved
    moved = data.rename(in_tmp / "elsewhere.jsonl")
    name = study.study_name
    gone = cli("resume", "--study", name, "--trials", "0")
    assert gone.exit_code == 2 and "which is missing" in gone.output, gone.output
    changed = in_tmp / "changed.jsonl"
    changed.write_text(moved.read_text().replace("w1 ", "w2 ", 1))
    before = optuna.load_study(study_name=name, storage=storage).user_attrs
    for command in ("resume", "worker"):
        refused = cli(command, "--study", name, "--trials", "1", "--data", str(changed))
        assert refused.exit_code == 2, refused.output
        assert refused.output.count("\n") == 1 and "not the study's data" in refused.output
    after = optuna.load_study(study_name=name, storage=storage)
    assert after.user_attrs == before and len(after.trials) == 2
    resumed = cli("resume", "--study", name, "--trials", "1", "--data", str(moved))
    assert resumed.exit_code == 0, resumed.output
    after = optuna.load_study(study_name=name, storage=storage)
    assert len(after.trials) == 3 and settings_of(after).data["source"] == str(moved)
    # from now on the study reads its data at the new place
    worker = cli("worker", "--study", name, "--trials", "1")
    assert worker.exit_code == 0, worker.output
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 4


@pytest.mark.real_trial
def test_data_for_a_study_without_data_is_refused(in_tmp: Path) -> None:
    space = in_tmp / "space.yaml"
    space.write_text(SPACE)
    run = ["run", "--model", "tiny-llama", "--budget", "1GB", "--seq-len", str(SEQ), "--space",
           str(space), "--global-batch-size", "8", *NO_PROBES, "--trials", "1"]  # fmt: skip
    assert cli(*run).exit_code == 0
    name = optuna.get_all_study_summaries("sqlite:///autotune.db")[0].study_name
    data = write_jsonl(in_tmp / "mine.jsonl", LENGTHS)
    result = cli("resume", "--study", name, "--trials", "0", "--data", str(data))
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "synthetic data" in result.output
