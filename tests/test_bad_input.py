"""Bad input: one line on stderr, exit code 2 (1 for the machine's faults), no traceback, and
nothing on disk changed.

Each case runs the real CLI in a folder holding real SQLite databases (autotune studies, an
empty Optuna storage, a foreign SQLite file, an empty file) and broken input files; every file
in that folder is hashed before and after, so a read-only command that created a schema, or a
run that wrote a trial, fails the case. PostgreSQL "down" is a port nothing listens on.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest
import torch
from click.testing import CliRunner
from optuna.trial import TrialState

from autotune.cli import main
from autotune.cli import run as run_cmd
from autotune.space import SearchSpace
from autotune.storage import open_storage
from tests.conftest import DATA, SMALL_ARGS, SMALL_SPACE
from tests.studies import make_study

STUDY = "existing"
CUDA_STUDY = "measured-on-cuda"
FITTED = "fitted"
SECRET = "hunter2-secret"
TINY = ["--model", "tiny-llama"]
RUN_1GB = ["run", *TINY, "--budget", "1GB", "--space", str(SMALL_SPACE), *SMALL_ARGS]
#: the existing study's own settings, to which one option at a time is changed
EXISTING = [*RUN_1GB, "--study-name", STUDY]
DOWN = "127.0.0.1:9"  # the discard port: nothing listens there
PG_DOWN = f"postgresql://user:{SECRET}@{DOWN}/db"

#: a space whose every value is shared: 2^20 nodes once the aliases are expanded
ALIAS_BOMB = "\n".join(
    ["dimensions:", "  precision: {choices: [fp32]}", 'a0: &a0 ["x", "x", "x", "x"]']
    + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 10)]
)

SPACES: dict[str, str | bytes] = {
    "unknown_key.yaml": "dimensions:\n  precision: {choices: [fp32]}\ncolour: blue\n",
    "wrong_type.yaml": "dimensions:\n  precision: {choices: fp32}\n",
    "empty_choices.yaml": "dimensions:\n  precision: {choices: []}\n",
    "impossible_rule.yaml": (
        "dimensions:\n  precision: {choices: [fp32, bf16]}\n"
        "  micro_batch_size: {choices: [1, 8]}\n"
        "rules:\n  - forbid: {precision: fp32, micro_batch_size: [1, 8]}\n"
    ),
    "bad_value.yaml": "dimensions:\n  micro_batch_size: {choices: [0]}\n",
    "not_yaml.yaml": "dimensions: [unclosed\n",
    "duplicate_key.yaml": (
        "dimensions:\n  precision: {choices: [fp32]}\n"
        "  micro_batch_size: {choices: [1]}\n  precision: {choices: [bf16]}\n"
    ),
    "alias_bomb.yaml": ALIAS_BOMB,
    "binary.yaml": bytes(range(256)) * 4,
    "latin1.yaml": "dimensions:\n  precision: {choices: [fp32]}\n# café\n".encode("latin-1"),
    "deep.yaml": "dimensions: " + "[" * 5000 + "]" * 5000 + "\n",
    "huge.yaml": "# padding\n" * 200_000,
    "empty.yaml": "",
    "list.yaml": "- precision\n- fp32\n",
    "python_tag.yaml": "dimensions: !!python/object/apply:os.system ['touch pwned']\n",
    "unknown_dim.yaml": "dimensions:\n  colour: {choices: [blue]}\n",
    "reference_missing.yaml": (
        "dimensions:\n  precision: {choices: [bf16]}\n  micro_batch_size: {choices: [1, 8]}\n"
        "reference: {precision: fp32}\n"
    ),
    "reference_unknown.yaml": "dimensions:\n  precision: {choices: [fp32]}\nreference: {zz: 1}\n",
    "estimate_config_dup.yaml": "precision: bf16\nprecision: fp32\n",
    "estimate_config_unknown.yaml": "colour: blue\n",
    "estimate_config_micro0.yaml": "micro_batch_size: 0\n",
    "estimate_config_micro3.yaml": "micro_batch_size: 3\n",
    "estimate_config_nested.yaml": "precision: {bf16: [1]}\n",
}


@dataclass
class Case:
    name: str
    args: list[str]
    message: str  # what the one line must say (case-insensitive)
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)


def _ex(args: list[str], *more: str) -> list[str]:
    return [*args, *more]


CASES: list[Case] = [
    # --- run: CLI options --------------------------------------------------------------------
    Case("budget unit", ["run", *TINY, "--budget", "24XB"], "invalid budget '24XB'"),
    Case("budget negative", ["run", *TINY, "--budget", "-1GB"], "greater than zero"),
    Case("budget zero", ["run", *TINY, "--budget", "0"], "invalid budget '0'"),
    Case("budget no number", ["run", *TINY, "--budget", "GB"], "invalid budget 'GB'"),
    Case("budget rounds to zero bytes", ["run", *TINY, "--budget", "0.5B"], "under 1 MiB"),
    Case("budget under a MiB", ["run", *TINY, "--budget", "100KB"], "under 1 MiB"),
    Case("budget overflows a float", ["run", *TINY, "--budget", "1" + "0" * 400 + "GB"],
         "per device"),
    Case("budget of petabytes", ["run", *TINY, "--budget", "5000TB"], "more than"),
    Case("budget nan", ["run", *TINY, "--budget", "nanGB"], "invalid budget 'nanGB'"),
    Case("unknown model", ["run", "--model", "lama-7b", "--budget", "24GB"],
         "did you mean llama-7b"),
    Case("hub id, never downloaded",
         ["run", "--model", "meta-llama/Llama-2-7b-hf", "--budget", "1GB"],
         "not in the local Hugging Face cache"),
    Case("trials zero", [*RUN_1GB, "--trials", "0"], "'--trials'"),
    Case("trials negative", [*RUN_1GB, "--trials", "-3"], "'--trials'"),
    Case("trials not a number", [*RUN_1GB, "--trials", "many"], "'many' is not a valid integer"),
    Case("loss tolerance nan", [*RUN_1GB, "--loss-tolerance", "nan"], "'--loss-tolerance'"),
    Case("loss tolerance inf", [*RUN_1GB, "--loss-tolerance", "inf"], "'--loss-tolerance'"),
    Case("loss tolerance negative", [*RUN_1GB, "--loss-tolerance", "-0.1"],
         "'--loss-tolerance'"),
    Case("loss tolerance text", [*RUN_1GB, "--loss-tolerance", "2%"], "'--loss-tolerance'"),
    Case("seed of 2^32", [*RUN_1GB, "--seed", str(2**32)], "'--seed'"),
    Case("seed negative", [*RUN_1GB, "--seed", "-1"], "'--seed'"),
    Case("seq-len beyond the model's positions",
         ["run", *TINY, "--budget", "1GB", "--seq-len", "4096"],
         "longer than tiny-llama's max_position_embeddings (1024)"),
    Case("seq-len too short", [*RUN_1GB, "--seq-len", "4"], "'--seq-len'"),
    Case("documents not MIN:MAX", [*RUN_1GB, "--documents", "8-64"], "expected MIN:MAX"),
    Case("documents of one token", [*RUN_1GB, "--documents", "1:64"], "need 2 <= MIN <= MAX"),
    Case("documents reversed", [*RUN_1GB, "--documents", "64:8"], "need 2 <= MIN <= MAX"),
    Case("documents longer than the sequence", [*RUN_1GB, "--documents", "2000:3000"],
         "longer than the sequence"),
    Case("global batch zero", [*RUN_1GB, "--global-batch-size", "0"], "'--global-batch-size'"),
    Case("global batch absurd", [*RUN_1GB, "--global-batch-size", str(2**40)],
         "'--global-batch-size'"),
    Case("trial timeout nan", [*RUN_1GB, "--trial-timeout", "nan"], "'--trial-timeout'"),
    Case("trial timeout inf", [*RUN_1GB, "--trial-timeout", "inf"], "'--trial-timeout'"),
    Case("trial timeout floor nan", [*RUN_1GB, "--trial-timeout-floor", "nan"],
         "'--trial-timeout-floor'"),
    Case("timeout zero", [*RUN_1GB, "--timeout", "0"], "'--timeout'"),
    Case("backend unknown", [*RUN_1GB, "--backend", "tpu"], "'--backend'"),
    Case("strategy unknown", [*RUN_1GB, "--strategy", "grid"], "'--strategy'"),
    Case("nproc zero", [*RUN_1GB, "--nproc", "0"], "'--nproc'"),
    Case("nproc absurd", [*RUN_1GB, "--nproc", "100000"], "'--nproc'"),
    # no GPU here: "needs the cuda backend"; on a GPU machine: "only N CUDA GPU(s) visible"
    Case("gpus more than present", [*RUN_1GB, "--gpus", "64"], "cuda"),
    Case("cuda backend without a GPU", [*RUN_1GB, "--backend", "cuda"], "no CUDA GPU"),
    Case("estimate for an unknown GPU", [*RUN_1GB, "--backend", "estimate", "--gpu", "h900"],
         "unknown GPU 'h900'"),
    Case("study name of 500 characters", [*RUN_1GB, "--study-name", "x" * 500],
         "--study-name is 500 characters long; use at most 200"),
    Case("study name with a newline", [*RUN_1GB, "--study-name", "a\nb"], "control characters"),
    Case("study name empty", [*RUN_1GB, "--study-name", " "], "--study-name is empty"),
    Case("missing --model", ["run", "--budget", "1GB"], "Missing option '--model'"),
    Case("missing --budget", ["run", *TINY], "Missing option '--budget'"),
    Case("unknown option", [*RUN_1GB, "--budgett", "1GB"], "No such option '--budgett'"),
    Case("unknown command", ["rnu"], "No such command 'rnu'"),
    # --- run: settings of an existing study ------------------------------------------------
    Case("study with another model",
         ["run", "--model", "small-llama", "--budget", "1GB", "--space", str(SMALL_SPACE),
          *SMALL_ARGS, "--study-name", STUDY], "exists with model='tiny-llama'"),
    Case("study with another budget",
         ["run", *TINY, "--budget", "2GB", "--space", str(SMALL_SPACE), *SMALL_ARGS,
          "--study-name", STUDY], f"exists with budget_bytes={10**9}"),
    Case("study with another seq-len", [*EXISTING[:-6], "--seq-len", "32",
         "--global-batch-size", "8", "--study-name", STUDY], "exists with seq_len=64"),
    Case("study with another space", _ex(EXISTING, "--space", str(DATA / "tiny_space.yaml")),
         "exists with another search space"),
    Case("study with another loss tolerance", _ex(EXISTING, "--loss-tolerance", "0.05"),
         "has loss_tolerance=0.02, not 0.05 (--loss-tolerance); omit --loss-tolerance"),
    Case("study with another seed", _ex(EXISTING, "--seed", "7"),
         "has seed=0, not 7 (--seed)"),
    Case("study with other data", _ex(EXISTING, "--documents", "8:32"),
         "exists with documents=None"),
    Case("study not made by autotune", [*RUN_1GB, "--study-name", "foreign-study"],
         "was not made by autotune"),
    # --- model configs (files) ---------------------------------------------------------------
    Case("not a model config", ["run", "--model", "not_model.json", "--budget", "1GB"],
         "not a causal-LM model config"),
    Case("model config not JSON", ["run", "--model", "broken.json", "--budget", "1GB"],
         "is not valid JSON"),
    Case("model config missing", ["run", "--model", "missing.json", "--budget", "1GB"],
         "model config file not found"),
    Case("model config binary", ["run", "--model", "binary.json", "--budget", "1GB"],
         "is not valid JSON"),
    Case("model config negative size", ["run", "--model", "negative.json", "--budget", "1GB"],
         "hidden_size must be a positive integer"),
    Case("model config missing size", ["estimate", "--model", "nosize.json", "--budget", "1GB"],
         "hidden_size"),
    Case("model config unknown type", ["run", "--model", "unknown.json", "--budget", "1GB"],
         "is not a causal LM transformers can build"),
    Case("model config a JSON list", ["run", "--model", "list.json", "--budget", "1GB"],
         "not a causal-LM model config"),
    Case("model config a folder", ["run", "--model", "folder.json", "--budget", "1GB"],
         "model config file not found"),
    Case("seq-len beyond a config's positions",
         ["run", "--model", "short.json", "--budget", "1GB", "--seq-len", "64"],
         "longer than short's max_position_embeddings (32)"),
    # --- search spaces (YAML) ----------------------------------------------------------------
    *[
        Case(f"space {what}", ["run", *TINY, "--budget", "1GB", "--space", file], message)
        for what, file, message in [
            ("unknown key", "unknown_key.yaml", "unknown key 'colour'"),
            ("wrong type", "wrong_type.yaml", "choices must be a list"),
            ("empty choices", "empty_choices.yaml", "choices is empty"),
            ("impossible rule", "impossible_rule.yaml", "is impossible"),
            ("bad value", "bad_value.yaml", "not a positive integer"),
            ("not YAML", "not_yaml.yaml", "invalid YAML: line 2"),
            ("missing", "missing.yaml", "search space file not found"),
            ("duplicate key", "duplicate_key.yaml",
             "line 4: duplicate key 'precision' (first at line 2)"),
            ("alias bomb", "alias_bomb.yaml", "expands to more than 100,000 values"),
            ("binary", "binary.yaml", "a binary file, not YAML text"),
            ("not UTF-8", "latin1.yaml", "line 3: not UTF-8 text"),
            ("nested 5000 deep", "deep.yaml", "nested deeper than 32 levels"),
            ("of 2 MB", "huge.yaml", "larger than 1,000,000 bytes"),
            ("empty", "empty.yaml", "expected a mapping"),
            ("a list", "list.yaml", "expected a mapping"),
            ("python tag", "python_tag.yaml", "invalid YAML: line 1"),
            ("unknown dimension", "unknown_dim.yaml", "unknown dimension 'colour'"),
            ("reference not among the choices", "reference_missing.yaml",
             "reference.precision: 'fp32' is not one of its choices (bf16)"),
            ("reference of no dimension", "reference_unknown.yaml",
             "reference.zz: not a dimension"),
        ]
    ],
    Case("space a folder", ["run", *TINY, "--budget", "1GB", "--space", "folder.json"],
         "is a directory"),
    # --- storage URLs ------------------------------------------------------------------------
    Case("storage folder missing", [*RUN_1GB, "--storage", "sqlite:////no/such/dir/x.db"],
         "folder /no/such/dir does not exist"),
    Case("storage a folder", [*RUN_1GB, "--storage", "sqlite:///folder.json"],
         "is a folder, not a database file"),
    Case("storage not a database", ["show", "--storage", "sqlite:///not_a_db.db"],
         "is not an SQLite database"),
    Case("run on a file that is no database", [*RUN_1GB, "--storage", "sqlite:///not_a_db.db"],
         "is not an SQLite database"),
    Case("storage server down", [*RUN_1GB, "--storage", PG_DOWN],
         f"cannot reach the database server at {DOWN}", code=1),
    Case("storage server down, password masked", ["show", "--storage", PG_DOWN],
         f"postgresql://user:***@{DOWN}/db", code=1),
    Case("storage empty user", ["show", "--storage", f"postgresql://:{SECRET}@{DOWN}/db"],
         f"postgresql://:***@{DOWN}/db", code=1),
    Case("storage password in the query", ["show", "--storage",
         f"postgresql://user@{DOWN}/db?password={SECRET}"], "?password=***", code=1),
    Case("storage password with an @", ["show", "--storage",
         f"postgresql://user:hun@{SECRET}@{DOWN}/db"], "percent-encode it as %40"),
    Case("storage unknown dialect", [*RUN_1GB, "--storage", "nosuchdb://x/y"],
         "cannot open storage"),
    Case("storage driver not installed", ["show", "--storage",
         f"mysql://user:{SECRET}@{DOWN}/db"], "driver is not installed"),
    Case("show of a missing file", ["show", "--storage", "sqlite:///typo.db"], "no database at"),
    Case("show of an empty file", ["show", "--storage", "sqlite:///empty.db"],
         "holds no Optuna study"),
    Case("show of a foreign database", ["show", "--storage", "sqlite:///foreign.db"],
         "holds no Optuna study"),
    Case("export from a foreign database",
         ["export", "--format", "deepspeed", "--out", "x.json", "--storage",
          "sqlite:///foreign.db"], "holds no Optuna study"),
    Case("report of an empty file", ["report", "--storage", "sqlite:///empty.db"],
         "holds no Optuna study"),
    Case("show of an in-memory database", ["show", "--storage", "sqlite://"],
         "holds no Optuna study"),
    Case("show of storage without studies", ["show", "--storage", "sqlite:///no_studies.db"],
         "no study in this storage yet"),
    # --- environment variables ---------------------------------------------------------------
    Case("heartbeat not a number", ["show"], "AUTOTUNE_HEARTBEAT_S='abc'",
         env={"AUTOTUNE_HEARTBEAT_S": "abc"}),
    Case("heartbeat zero", ["show"], "AUTOTUNE_HEARTBEAT_S='0'",
         env={"AUTOTUNE_HEARTBEAT_S": "0"}),
    Case("AUTOTUNE_STORAGE server down, masked", ["show"], "postgresql://user:***@", code=1,
         env={"AUTOTUNE_STORAGE": PG_DOWN}),
    Case("AUTOTUNE_STORAGE typo", ["show"], "no database at typo.db",
         env={"AUTOTUNE_STORAGE": "sqlite:///typo.db"}),
    Case("AUTOTUNE_STORAGE a folder", [*RUN_1GB], "is a folder",
         env={"AUTOTUNE_STORAGE": "sqlite:///folder.json"}),
    # --- show, resume, worker, report, export --------------------------------------------------
    Case("show unknown study", ["show", "--study", "nope"], "no study named 'nope'"),
    Case("show a study of 500 characters", ["show", "--study", "y" * 500], "no study named"),
    Case("resume unknown study", ["resume", "--study", "nope"], "no study named 'nope'"),
    Case("resume trials negative", ["resume", "--study", STUDY, "--trials", "-1"],
         "'--trials'"),
    Case("resume on a missing file", ["resume", "--study", STUDY, "--storage",
         "sqlite:///typo.db"], "no database at"),
    Case("worker unknown study", ["worker", "--study", "nope"], "no study named 'nope'"),
    Case("worker without the study's GPUs", ["worker", "--study", CUDA_STUDY], "no CUDA GPU"),
    Case("worker trials zero", ["worker", "--study", STUDY, "--trials", "0"], "'--trials'"),
    Case("resume --data for a study made without data",
         ["resume", "--study", STUDY, "--data", "moved.jsonl"], "made on synthetic data"),
    Case("worker --data for a study made without data",
         ["worker", "--study", STUDY, "--data", "moved.jsonl"], "made on synthetic data"),
    Case("export before a fit",
         ["export", "--study", STUDY, "--format", "deepspeed", "--out", "x"],
         "nothing to export"),
    Case("export unknown format", ["export", "--format", "xml", "--out", "x"],
         "unknown export format 'xml'"),
    Case("export folder missing",
         ["export", "--study", STUDY, "--format", "deepspeed", "--out", "no/such/dir/ds.json"],
         "does not exist"),
    Case("export onto a device",
         ["export", "--study", FITTED, "--format", "deepspeed", "--out", "/dev/full"],
         "cannot write /dev/full: not a regular file"),
    Case("export onto a FIFO",
         ["export", "--study", FITTED, "--format", "deepspeed", "--out", "pipe.json"],
         "not a regular file"),
    Case("export onto the study's database",
         ["export", "--study", FITTED, "--format", "hf", "--out", "autotune.db", "--force"],
         "the study's own database"),
    Case("export onto a file it did not write",
         ["export", "--study", FITTED, "--format", "deepspeed", "--out", "broken.json"],
         "autotune did not write it"),
    Case("export lr inf",
         ["export", "--study", FITTED, "--format", "hf", "--out", "x.json", "--lr", "inf"],
         "'--lr'"),
    Case("export lr nan",
         ["export", "--study", FITTED, "--format", "hf", "--out", "x.json", "--lr", "nan"],
         "'--lr'"),
    Case("export weight decay inf", ["export", "--study", FITTED, "--format", "hf", "--out",
         "x.json", "--weight-decay", "Infinity"], "'--weight-decay'"),
    Case("export onto a folder",
         ["export", "--study", FITTED, "--format", "deepspeed", "--out", "folder.json"],
         "is a directory"),
    Case("report into a missing folder", ["report", "--study", STUDY, "--out", "no/such/r"],
         "does not exist"),
    Case("report onto a file", ["report", "--study", STUDY, "--out", "broken.json"],
         "is a file"),
    Case("gpu with the cpu backend", [*RUN_1GB, "--backend", "cpu", "--gpu", "h100"],
         "which --gpu does not change"),
    Case("gpu with a model the auto backend runs on the cpu", [*RUN_1GB, "--gpu", "h100"],
         "add --backend estimate"),
    Case("storage read-only for a run", [*RUN_1GB, "--storage", "sqlite:///autotune.db?mode=ro"],
         "asks for a read-only database"),
    Case("storage immutable for a worker", ["worker", "--study", STUDY, "--storage",
         "sqlite:///autotune.db?immutable=1"], "asks for a read-only database"),
    Case("show of a damaged database", ["show", "--storage", "sqlite:///damaged.db"],
         "the database file is damaged (SQLite: database disk image is malformed)"),
    Case("run on a damaged database",
         [*RUN_1GB, "--storage", "sqlite:///damaged.db", "--backend", "cpu"],
         "the database file is damaged"),
    # --- Slurm options: what reaches a job script ----------------------------------------------
    Case("partition with a newline", [*RUN_1GB, "--launcher", "slurm", "--partition",
         "debug\ntouch pwned"], "--partition 'debug\\ntouch pwned': not a Slurm partition"),
    Case("account with a carriage return", [*RUN_1GB, "--launcher", "slurm", "--account",
         "lab\rtouch pwned"], "--account"),
    Case("account with a space and a semicolon", [*RUN_1GB, "--launcher", "slurm", "--account",
         "lab; touch pwned"], "not a Slurm account name"),
    Case("sbatch option with a newline", [*RUN_1GB, "--launcher", "slurm", "--sbatch-option",
         "--qos=high\ntouch pwned"], "no newline"),
    Case("sbatch option with a C1 control", [*RUN_1GB, "--launcher", "slurm", "--sbatch-option",
         "--qos=high\x85touch pwned"], "--sbatch-option"),
    Case("slurm time in full-width digits", [*RUN_1GB, "--launcher", "slurm", "--slurm-time",
         "\uff11\uff10"], "--slurm-time"),
    # --- estimate ----------------------------------------------------------------------------
    Case("estimate unknown GPU", ["estimate", *TINY, "--budget", "24GB", "--gpu", "h900"],
         "unknown GPU 'h900'"),
    Case("estimate budget rounds to zero", ["estimate", *TINY, "--budget", "0.1B"],
         "invalid budget '0.1B'"),
    Case("estimate config missing",
         ["estimate", *TINY, "--budget", "24GB", "--config", "missing.yaml"],
         "config file not found"),
    Case("estimate config duplicate key",
         ["estimate", *TINY, "--budget", "24GB", "--config", "estimate_config_dup.yaml"],
         "line 2: duplicate key 'precision'"),
    Case("estimate config binary",
         ["estimate", *TINY, "--budget", "24GB", "--config", "binary.yaml"], "binary file"),
    Case("estimate config unknown dimension",
         ["estimate", *TINY, "--budget", "24GB", "--config", "estimate_config_unknown.yaml"],
         "unknown dimension 'colour'"),
    Case("model of 10^12 layers", ["estimate", "--model", "layers.json", "--budget", "24GB"],
         "num_hidden_layers 1,000,000,000,000 is more than 1,024"),
    Case("model of width 2^40", ["run", "--model", "wide.json", "--budget", "1GB"],
         "hidden_size"),
    Case("model vocabulary of 10^9", ["estimate", "--model", "vocab.json", "--budget", "24GB"],
         "vocab_size"),
    Case("kv heads not dividing the heads",
         ["estimate", "--model", "kv_heads.json", "--budget", "24GB"],
         "num_key_value_heads 3 does not divide num_attention_heads 4"),
    Case("max_position_embeddings zero",
         ["run", "--model", "positions0.json", "--budget", "1GB"],
         "max_position_embeddings must be a positive integer"),
    Case("model config nested 100,000 deep",
         ["estimate", "--model", "nested.json", "--budget", "24GB"], "nested deeper than 32"),
    Case("model config nested 40 deep", ["run", "--model", "nested40.json", "--budget", "1GB"],
         "nested deeper than 32"),
    Case("budget in full-width digits", ["run", *TINY, "--budget", "\uff11\uff10GB"],
         "invalid budget"),
    Case("estimate budget in Arabic-Indic digits",
         ["estimate", *TINY, "--budget", "\u0661\u0660GB"], "invalid budget"),
    Case("estimate nproc 10^9", ["estimate", *TINY, "--budget", "24GB", "--nproc",
         "1000000000"], "'--nproc'"),
    Case("run nproc 10^9", [*RUN_1GB, "--nproc", "1000000000"], "'--nproc'"),
    Case("estimate global batch 10^21", ["estimate", *TINY, "--budget", "24GB",
         "--global-batch-size", str(10**21)], "'--global-batch-size'"),
    Case("estimate seq-len beyond the model's positions",
         ["estimate", *TINY, "--budget", "24GB", "--seq-len", "4096"],
         "max_position_embeddings (1024)"),
    Case("documents longer than any sequence",
         [*RUN_1GB, "--documents", "2:99999999999999999999999"], "--documents"),
    Case("estimate config micro-batch zero",
         ["estimate", *TINY, "--budget", "24GB", "--config", "estimate_config_micro0.yaml"],
         "micro_batch_size 0"),
    Case("estimate config micro-batch not dividing the batch",
         ["estimate", *TINY, "--budget", "24GB", "--config", "estimate_config_micro3.yaml"],
         "does not divide"),
    Case("estimate config nested value",
         ["estimate", *TINY, "--budget", "24GB", "--config", "estimate_config_nested.yaml"],
         "not one choice"),
    Case("estimate top zero", ["estimate", *TINY, "--budget", "24GB", "--top", "0"], "'--top'"),
]  # fmt: skip


def _fit_trial(storage_url: str) -> None:
    """Study FITTED with one finished trial that fits (as the objective records one)."""
    study = make_study(storage_url, FITTED, SMALL_SPACE, "1GB")
    space = SearchSpace.load(SMALL_SPACE)
    config = space.reference_config()
    params: dict[str, object] = {}
    dists: dict[str, optuna.distributions.BaseDistribution] = {}

    def fixed(name: str, choices: list[object]) -> object:
        params[name] = config[name]
        dists[name] = optuna.distributions.CategoricalDistribution(choices)  # type: ignore[arg-type]
        return config[name]

    space.sample(fixed)  # type: ignore[arg-type]
    study.add_trial(
        optuna.trial.create_trial(
            params=params,
            distributions=dists,
            values=[1000.0, 140.0],
            user_attrs={"config": config, "status": "ok", "peak_bytes": 140 * 2**20,
                        "tokens_per_s": 1000.0, "losses": [9.0, 8.9, 8.8, 8.7]},
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real SQLite databases and broken inputs beside them."""
    path = tmp_path_factory.mktemp("bad_input")
    db = f"sqlite:///{path / 'autotune.db'}"
    make_study(db, STUDY, SMALL_SPACE, "1GB")
    make_study(db, CUDA_STUDY, SMALL_SPACE, "1GB", "cuda")
    _fit_trial(db)
    foreign = optuna.create_study(study_name="foreign-study", storage=open_storage(db))
    foreign.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    open_storage(f"sqlite:///{path / 'no_studies.db'}")
    with sqlite3.connect(path / "foreign.db") as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    (path / "empty.db").write_bytes(b"")
    for name, text in SPACES.items():
        target = path / name
        target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)
    (path / "not_model.json").write_text(json.dumps({"name": "a tokenizer, not a model"}))
    (path / "broken.json").write_text("{not json")
    (path / "binary.json").write_bytes(bytes(range(256)))
    (path / "list.json").write_text("[1, 2]")
    (path / "folder.json").mkdir()
    os.mkfifo(path / "pipe.json")
    short = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
             "max_position_embeddings": 32}  # fmt: skip
    (path / "short.json").write_text(json.dumps(short))
    (path / "negative.json").write_text(json.dumps({**short, "hidden_size": -4}))
    (path / "nosize.json").write_text(
        json.dumps({k: v for k, v in short.items() if k != "hidden_size"})
    )
    (path / "unknown.json").write_text(json.dumps({**short, "model_type": "nonesuch"}))
    (path / "layers.json").write_text(json.dumps({**short, "num_hidden_layers": 10**12}))
    (path / "wide.json").write_text(json.dumps({**short, "hidden_size": 2**40}))
    (path / "vocab.json").write_text(json.dumps({**short, "vocab_size": 10**9}))
    (path / "kv_heads.json").write_text(json.dumps({**short, "num_attention_heads": 4,
                                                     "num_key_value_heads": 3}))  # fmt: skip
    (path / "positions0.json").write_text(json.dumps({**short, "max_position_embeddings": 0}))
    (path / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    (path / "nested40.json").write_text(json.dumps({**short, "x": json.loads("[" * 40 + "]" * 40)}))
    (path / "not_a_db.db").write_text("plain text, not SQLite\n" * 100)
    make_study(f"sqlite:///{path / 'damaged.db'}", STUDY, SMALL_SPACE, "1GB")
    with open(path / "damaged.db", "r+b") as f:  # pages past the header overwritten
        f.seek(8192)
        f.write(b"\xff" * 8192)
    return path


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


_HAS_GPUS = "gpus" in {p.name for p in run_cmd.params}


def _param(case: Case) -> object:
    if "--gpus" in case.args and not _HAS_GPUS:
        return pytest.param(case, id=case.name, marks=pytest.mark.skip("run has no --gpus yet"))
    needs_no_gpu = CUDA_STUDY in case.args or "cuda" in case.args
    if needs_no_gpu and torch.cuda.is_available():
        return pytest.param(case, id=case.name, marks=pytest.mark.skip("a GPU is visible"))
    return pytest.param(case, id=case.name)


def _running_or_waiting(folder: Path) -> list[tuple[str, int]]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{folder / 'autotune.db'}")
    found = []
    for summary in storage.get_all_studies():
        for t in storage.get_all_trials(summary._study_id, deepcopy=False):
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                found.append((summary.study_name, t.number))
    storage.engine.dispose()
    return found


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_one_line_nothing_changed(
    case: Case, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)
    for key in ("AUTOTUNE_STORAGE", "AUTOTUNE_HEARTBEAT_S"):
        monkeypatch.delenv(key, raising=False)
    before = _snapshot(folder)
    assert "autotune.db" in before
    result = CliRunner().invoke(main, case.args, env=case.env, catch_exceptions=False)
    assert result.exit_code == case.code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("Error: ") and case.message.lower() in line.lower(), line
    assert len(line) < 1000, line
    assert "Traceback" not in result.output
    assert SECRET not in result.output
    assert _snapshot(folder) == before  # read-only commands and refused runs wrote nothing
    assert not _running_or_waiting(folder)  # no trial half-written or left RUNNING


def test_the_table_covers_every_command_and_input() -> None:
    assert len(CASES) >= 80
    assert len({c.name for c in CASES}) == len(CASES)
    commands = {c.args[0] for c in CASES}
    assert {"run", "resume", "worker", "show", "report", "export", "estimate"} <= commands
    assert any(c.env for c in CASES) and any(c.code == 1 for c in CASES)


# --- the same rules where the table can't reach: another user, a broken Python -------------


def _without_root_rights() -> None:
    """In the child, before exec: as root, give up the capabilities that ignore file modes
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a file owned by another user is refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # linux/capability.h
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


PR_CAPBSET_DROP = 24
NOBODY = 65534


@pytest.mark.parametrize("command", ["show", "run"])
def test_a_permission_error_says_so(command: str) -> None:
    """show: a database it may not read; run: one it may read but not write."""
    root = Path(tempfile.mkdtemp(prefix="autotune-perm-"))
    try:
        db = root / "autotune.db"
        make_study(f"sqlite:///{db}", STUDY, SMALL_SPACE, "1GB")
        db.chmod(0o600 if command == "show" else 0o644)
        if os.geteuid() == 0:  # another user's file, and no root rights to override its mode
            os.chown(db, NOBODY, NOBODY)
        else:  # the file is ours: take our own rights away
            db.chmod(0o000 if command == "show" else 0o444)
        before = hashlib.sha256(db.read_bytes()).hexdigest() if os.geteuid() == 0 else None
        args = ["show"] if command == "show" else [*RUN_1GB, "--study-name", STUDY]
        proc = subprocess.run(
            [sys.executable, "-m", "autotune.cli", *args, "--storage", f"sqlite:///{db}"],
            capture_output=True, text=True, cwd=root, timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "HOME": str(root)},
            preexec_fn=_without_root_rights if os.geteuid() == 0 else None,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "permission denied" in lines[0], proc.stderr
        assert ("cannot read" if command == "show" else "cannot write") in lines[0]
        if before is not None:
            assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    finally:
        shutil.rmtree(root, ignore_errors=True)
