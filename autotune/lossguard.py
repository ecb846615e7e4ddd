"""The loss guard: one verdict per trial, computed here and nowhere else, stored on the trial.

How a verdict is reached depends on the configuration's fidelity class
(``trials.techniques.fidelity_class``):

* **exact** (checkpointing, ZeRO, offload, kernels, buckets, accumulation): against the study's
  reference, the least-memory exact configuration, trained on the same tokens from the same
  initialisation. Every step must match within ``EXACT_RTOL`` (float reordering); more is a bug.
* **lossy** (mixed precision, reduced-precision state, other optimizers): a few steps at full
  size cannot tell a regression from noise, so the numerics-changing choices alone
  (``trials.techniques.numerics_of``) are trained for hundreds of steps on a small *proxy* of the
  same architecture (``proxy_config``), from several seeds, next to fp32 AdamW on the same
  seeds. The regression is the mean over seeds of the paired relative difference of the final
  loss; the noise band is how far the fp32 AdamW final loss moves from seed to seed. Probes are
  cached per model family (``~/.cache/autotune/probes``), so each combination runs once. A study
  of a pretrained model (``--model`` a model folder) probes the checkpoint itself (or its first
  layers, ``pretrained_slice``) at the study's learning rate: the fine-tuning failure of lossy
  numerics (updates below the weights' resolution, lost) shows only there. A study on the
  user's dataset (``--data``) probes on its documents (``probe_documents``): seed 0 trains on
  the trial's documents in the trials' order, every other seed on a seeded shuffle of them.
* **adapters** (LoRA on a frozen, quantized base) train a different problem: no verdict, and the
  selector keeps them in their own class.

A trial without a verdict says why (``LossVerdict.note``); the guard is never silently off.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autotune.data_source import DOCUMENTS_DIR, documents_path
from autotune.model_source import folder_identity
from autotune.runner import TrialRunner
from trials.spec import TrialSpec
from trials.techniques import TECHNIQUES, fidelity_class, numerics_of

#: per-step relative loss difference allowed for exact techniques (float reassociation noise)
EXACT_RTOL = 1e-3
#: the proxy's shape: a few narrow layers of the same architecture (same model_type and flags)
PROXY_HIDDEN = 64
PROXY_LAYERS = 2
PROXY_HEADS = 4
PROXY_VOCAB = 512  # the synthetic data uses the first 256 ids (trials/data.py)
PROXY_SEQ = 32
PROXY_BATCH = 8
#: a probe on the user's data trains on each document's first tokens, up to this many
PROBE_DATA_SEQ = 128
#: a pretrained model's probe keeps its first layers up to about this many parameters
PRETRAINED_PROBE_PARAMS = 30_000_000
#: the final loss of a probe: the mean over the last tenth of its steps (at least this many)
FINAL_WINDOW_MIN = 5
#: config keys that only set the size of a model; the rest names its family
_SIZE_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
}


@dataclass(frozen=True)
class LossVerdict:
    """How a trial's loss was judged. ``via``: ``reference`` (full size, per step, exact),
    ``probe`` (proxy, hundreds of steps, several seeds) or ``none`` (``note`` says why)."""

    via: str
    ok: bool | None
    regression: float | None = None  # relative; > 0 is worse than the reference
    tolerance: float | None = None
    noise: float | None = None  # probe: relative seed-to-seed spread of the reference's loss
    note: str = ""

    def to_attrs(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any] | None) -> LossVerdict | None:
        return cls(**attrs) if attrs else None


# --- exact: against the full-size reference ------------------------------------------------------


def against_reference(losses: Sequence[float], reference: Sequence[float]) -> LossVerdict:
    """An exact configuration's per-step losses against the reference's (same seed, same data)."""
    n = min(len(losses), len(reference))
    if n == 0:
        return LossVerdict("none", None, note="no loss curve to compare")
    if any(not math.isfinite(x) for x in losses[:n]):
        return LossVerdict("reference", False, math.inf, EXACT_RTOL, note="non-finite loss")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n], strict=True))
    return LossVerdict("reference", worst <= EXACT_RTOL, worst, EXACT_RTOL, note=f"{n} steps")


# --- lossy: the probe on a proxy ------------------------------------------------------------------


def proxy_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """The same architecture (model_type and every non-size key) at a size that trains hundreds
    of steps in seconds; grouped-query attention keeps its ratio."""
    cfg = dict(model_config)
    heads = int(cfg.get("num_attention_heads", PROXY_HEADS))
    kv = int(cfg.get("num_key_value_heads", heads))
    ratio = int(cfg.get("intermediate_size", 4 * cfg.get("hidden_size", 1))) / int(
        cfg.get("hidden_size", 1)
    )
    cfg.update(
        vocab_size=min(int(cfg.get("vocab_size", PROXY_VOCAB)), PROXY_VOCAB),
        hidden_size=PROXY_HIDDEN,
        intermediate_size=round(PROXY_HIDDEN * ratio),
        num_hidden_layers=PROXY_LAYERS,
        num_attention_heads=PROXY_HEADS,
        num_key_value_heads=max(1, PROXY_HEADS * kv // heads),
        max_position_embeddings=max(PROXY_SEQ, 64),
    )
    cfg.pop("head_dim", None)
    return cfg


def model_family(model_config: dict[str, Any]) -> str:
    """``llama-1a2b3c``: the model_type and a digest of the non-size keys (two models of one
    family share their probes)."""
    shape = {k: v for k, v in sorted(model_config.items()) if k not in _SIZE_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:6]
    return f"{model_config.get('model_type', 'model')}-{digest}"


def final_loss(losses: Sequence[float]) -> float:
    k = max(FINAL_WINDOW_MIN, len(losses) // 10)
    tail = list(losses[-k:])
    return sum(tail) / len(tail) if tail else math.nan


def _cache_dir() -> Path:
    root = os.environ.get("AUTOTUNE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "autotune"
    )
    return Path(root) / "probes"


@dataclass(frozen=True)
class ProbeSettings:
    steps: int  # 0: no probes (lossy configurations get no verdict, and say so)
    seeds: int
    lr: float
    backend: str  # where probes train: cpu or cuda (the study's trial backend)
    #: the study's dataset (``StudySettings.data``): probes train on its documents; None:
    #: on synthetic progressions
    data: dict[str, Any] | None = None
    seq_len: int = PROXY_SEQ  # the study's; a probe on the data cuts documents to it


def probe_documents(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """A probe's ``TrialSpec.data``: the study's documents file (``ready`` wrote it) for seed 0,
    in the trials' own order; for another seed a file of the same documents in a seeded shuffle
    (beside it, named by the study's file and the seed). The probe's shorter sequence cuts each
    document as a trial's does (``trials.data.DatasetDocuments``)."""
    import random

    from trials.user_data import load_store, write_documents

    study_file = documents_path(data)
    if not seed:
        return {"file": str(study_file), "sha256": data["documents_sha256"],
                "order": data["order"]}  # fmt: skip
    store = load_store(str(study_file), data["documents_sha256"])
    positions = list(range(len(store)))
    random.Random(seed).shuffle(positions)
    documents = [store.document(i).tolist() for i in positions]
    name = f"probe-{data['documents_sha256'][:16]}-seed{seed}.bin"
    target = (DOCUMENTS_DIR / name).resolve()
    sha = write_documents(target, documents)
    return {"file": str(target), "sha256": sha, "order": [len(d) for d in documents]}


_CACHE_LOCK = threading.Lock()
_PROBE_LOCKS: dict[str, threading.Lock] = {}


def _probe_lock(key: str) -> threading.Lock:
    with _CACHE_LOCK:
        return _PROBE_LOCKS.setdefault(key, threading.Lock())


def pretrained_slice(model_config: dict[str, Any]) -> dict[str, Any]:
    """The pretrained model itself, or its first layers when it is bigger than
    ``PRETRAINED_PROBE_PARAMS`` (at least one layer: the embeddings and head stay whole)."""
    from autotune.models import stats_of

    stats = stats_of(model_config)
    over = stats.n_params - PRETRAINED_PROBE_PARAMS
    drop = math.ceil(over / stats.layer_params) if over > 0 else 0
    return {**model_config, "num_hidden_layers": max(1, stats.layers - drop)}


class Prober:
    """Runs and caches probes: one curve per (family, numerics, steps, lr, seed, backend).

    With ``weights`` (a model folder) the probe fine-tunes the pretrained model (or its first
    layers, ``pretrained_slice``) instead of training a random proxy: the failure of lossy
    numerics in fine-tuning (updates at a small learning rate below the weights' resolution,
    lost) shows only on trained weights."""

    def __init__(
        self,
        model_config: dict[str, Any],
        settings: ProbeSettings,
        runner: TrialRunner,
        weights: str | None = None,
    ) -> None:
        self.weights = weights
        self.proxy = pretrained_slice(model_config) if weights else proxy_config(model_config)
        self.family = model_family(model_config)
        if weights:  # the cache is per checkpoint (a retrained one is another model)
            self.family += "-" + hashlib.sha256(folder_identity(weights).encode()).hexdigest()[:8]
        data = settings.data
        self.seq_len = PROXY_SEQ
        if data:  # the data's token ids: the whole vocabulary, the documents' first tokens
            self.proxy["vocab_size"] = model_config["vocab_size"]
            longest = int(self.proxy.get("max_position_embeddings", PROBE_DATA_SEQ))
            self.seq_len = min(settings.seq_len, PROBE_DATA_SEQ, longest)
            self.family += f"-data-{data['documents_sha256'][:8]}-seq{self.seq_len}"
        self.settings = settings
        self.runner = runner
        self.path = _cache_dir() / f"{self.family}.json"
        #: hears a line before each probe that trains (not for a cached curve)
        self.say: Callable[[str], None] | None = None

    def _proxy_name(self) -> str:
        on = f" on {Path(self.settings.data['source']).name}" if self.settings.data else ""
        if self.weights:
            return f"pretrained weights ({self.proxy['num_hidden_layers']} layers){on}"
        return f"{PROXY_LAYERS}x{PROXY_HIDDEN} proxy{on}"

    def _key(self, numerics: dict[str, str], seed: int) -> str:
        s = self.settings
        choices = ",".join(f"{k}={v}" for k, v in sorted(numerics.items()))
        return f"{choices}|steps={s.steps}|lr={s.lr:g}|seed={seed}|{s.backend}"

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _store(self, key: str, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _CACHE_LOCK:  # threads of one controller (--in-flight) write one at a time
            data = self._load()  # merge: another process may have added probes meanwhile
            data[key] = entry
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data))
            os.replace(tmp, self.path)

    def curve(self, numerics: dict[str, str], seed: int) -> tuple[list[float] | None, str]:
        """The proxy's loss curve for these numerics and seed (cached), or None and why not."""
        key = self._key(numerics, seed)
        with _probe_lock(key):  # two trials needing the same probe: one runs it, one reads it
            return self._curve(key, numerics, seed)

    def _curve(
        self, key: str, numerics: dict[str, str], seed: int
    ) -> tuple[list[float] | None, str]:
        cached = self._load().get(key)
        if cached is not None and cached.get("losses"):
            return cached["losses"], ""
        data = probe_documents(self.settings.data, seed) if self.settings.data else None
        spec = TrialSpec(
            model_config=self.proxy,
            config={**numerics, **TECHNIQUES.probe_plain(PROXY_BATCH)},
            seq_len=self.seq_len,
            global_batch_size=PROXY_BATCH,
            budget_bytes=None,
            backend="cuda" if self.settings.backend == "cuda" else "cpu",
            warmup_steps=0,
            measured_steps=self.settings.steps,
            seed=seed,
            lr=self.settings.lr,
            weights=self.weights,
            documents=[min(data["order"]), max(data["order"])] if data else None,
            data=data,
        )
        name = "probe-" + hashlib.sha256(key.encode()).hexdigest()[:10]
        if self.say is not None:
            what = ", ".join(f"{k}={v}" for k, v in sorted(numerics.items())) or "fp32 AdamW"
            self.say(
                f"loss probe: {what}, seed {seed}, {self.settings.steps} steps on the "
                f"{self._proxy_name()} (cached for later studies)"
            )
        result = self.runner.run(spec, name)
        if result.status != "ok" or not result.losses:
            # not cached: a probe that failed (a busy machine, a lost job) is tried again later
            return None, f"{result.status}: {result.error}"[:300]
        self._store(key, {"losses": result.losses})
        return result.losses, ""

    def judge(self, config: dict[str, Any], tolerance: float) -> LossVerdict:
        s = self.settings
        numerics = numerics_of(config)
        plain = numerics_of({})
        what = (
            f"proxy {self.family} {PROXY_LAYERS}x{PROXY_HIDDEN}, {s.steps} steps x {s.seeds} seeds"
        )
        if self.weights or s.data:
            what = f"{self._proxy_name()}, {s.steps} steps x {s.seeds} seeds at lr {s.lr:g}"
        diffs, refs = [], []
        for seed in range(s.seeds):
            ref, why = self.curve(plain, seed)
            if ref is None:
                return LossVerdict("none", None, note=f"probe of fp32 AdamW failed: {why}")
            cand, why = self.curve(numerics, seed)
            if cand is None:
                return LossVerdict("none", None, note=f"probe failed: {why}")
            r, c = final_loss(ref), final_loss(cand)
            refs.append(r)
            diffs.append((c - r) / abs(r) if math.isfinite(c) else math.inf)
        regression = statistics.fmean(diffs)
        noise = (max(refs) - min(refs)) / abs(statistics.fmean(refs))
        note = what
        if noise > tolerance:
            note += "; the noise band is wider than the tolerance: more --probe-steps"
        return LossVerdict("probe", regression <= tolerance, regression, tolerance, noise, note)


# --- the one place a verdict is computed --------------------------------------------------------


def judge(
    config: dict[str, Any],
    losses: Sequence[float],
    *,
    is_reference: bool,
    reference: Sequence[float] | None,
    no_reference_why: str,
    prober: Prober | None,
    no_probe_why: str,
    tolerance: float,
) -> LossVerdict:
    """The verdict of one trial that ran to the end (see the module docstring)."""
    cls = fidelity_class(config)
    if is_reference:
        return LossVerdict("reference", True, 0.0, EXACT_RTOL, note="this is the reference")
    if cls == "exact":
        if reference is None:
            return LossVerdict("none", None, note=f"exact; no reference curve: {no_reference_why}")
        return against_reference(losses, reference)
    if cls == "adapters":
        return LossVerdict("none", None, note="adapters train a different problem: not compared")
    if prober is None:
        return LossVerdict("none", None, note=f"{cls}; no loss probe: {no_probe_why}")
    return prober.judge(config, tolerance)
