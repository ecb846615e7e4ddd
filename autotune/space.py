"""Search spaces: YAML files of dimensions, conditions and rules, sampled through Optuna.

A space is resolved once per study against the global batch (micro-batch sizes that don't
divide it go) and the hardware (choices it can't run go, with the reason). Sampling walks the
dimensions in order; a dimension whose ``when`` does not hold is absent, and a ``forbid`` rule
narrows the last dimension it names. Both come from the file and, inherited, from the
registered techniques (``Technique.whens``, ``Technique.forbids``). A narrowed dimension is
suggested under its own parameter name (``micro_batch_size|1/2/4``) because Optuna
distributions must not change between trials.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.availability import Hardware, dimension_unavailable_reason, unavailable_reason
from autotune.errors import UserError
from autotune.yaml_limits import load_yaml, parse_yaml
from trials.techniques import FIDELITY_CLASSES, TECHNIQUES, Choice, choice_fidelity
from trials.techniques.micro_batch import MICRO_BATCH

__all__ = ["Choice", "Dimension", "Rule", "SearchSpace"]

#: YAML 1.1 reads bare yes/no/on/off as booleans, and 5e6 (no dot) as a string: accept both
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}

_TOP_LEVEL = {"dimensions", "rules", "reference", "name", "description"}
_DIM_KEYS = {"choices", "when"}

#: (name, choices) -> chosen value; an Optuna trial's ``suggest_categorical`` fits.
Chooser = Callable[[str, list[Choice]], Choice]


@dataclass(frozen=True)
class Dimension:
    name: str
    choices: tuple[Choice, ...]
    when: Mapping[str, tuple[Choice, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """Forbid the values of ``target`` when every condition holds."""

    conditions: Mapping[str, tuple[Choice, ...]]
    target: str
    forbidden: tuple[Choice, ...]


@dataclass
class SearchSpace:
    dimensions: list[Dimension]
    rules: list[Rule]
    reference: dict[str, Choice]
    source: str = "default"
    dropped: list[str] = field(default_factory=list)  # "dimension=choice: reason"

    # --- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path | None = None) -> SearchSpace:
        """Read and validate a space file; ``None`` is the packaged ``default.yaml``."""
        if path is None:
            text = resources.files("search_spaces").joinpath("default.yaml").read_text()
            return cls.from_dict(parse_yaml(text, "search space default"), "default")
        return cls.from_dict(load_yaml(Path(path), "search space"), str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> SearchSpace:
        def bad(msg: str) -> UserError:
            return UserError(f"search space {source}: {msg}")

        if not isinstance(data, dict):
            raise bad("expected a mapping with a 'dimensions' key")
        unknown = set(data) - _TOP_LEVEL
        if unknown:
            raise bad(
                f"unknown key '{sorted(unknown)[0]}' (allowed: {', '.join(sorted(_TOP_LEVEL))})"
            )
        raw_dims = data.get("dimensions")
        if not isinstance(raw_dims, dict) or not raw_dims:
            raise bad("'dimensions' must be a non-empty mapping")

        dims: list[Dimension] = []
        for name, spec in raw_dims.items():
            where = f"dimensions.{name}"
            known = TECHNIQUES.known_dimensions()  # every registered technique's dimensions
            if name not in known:
                raise bad(f"unknown dimension '{name}' (known: {', '.join(known)})")
            if not isinstance(spec, dict):
                raise bad(f"{where} must be a mapping with 'choices'")
            extra = set(spec) - _DIM_KEYS
            if extra:
                raise bad(f"{where}: unknown key '{sorted(extra)[0]}'")
            choices = spec.get("choices")
            if not isinstance(choices, list):
                raise bad(f"{where}.choices must be a list")
            if not choices:
                raise bad(f"{where}.choices is empty")
            values = tuple(_check_value(name, c, f"{where}.choices", bad) for c in choices)
            when = _conditions(spec.get("when", {}), f"{where}.when", dims, bad)
            dims.append(Dimension(name, values, when))
        dims = _inherited_whens(dims, bad)

        by_name = {d.name: d for d in dims}
        rules = []
        raw_rules = data.get("rules") or []
        if not isinstance(raw_rules, list):
            raise bad("'rules' must be a list")
        for i, raw in enumerate(raw_rules):
            where = f"rules[{i}]"
            if not isinstance(raw, dict) or set(raw) != {"forbid"}:
                raise bad(f"{where} must be a mapping with the single key 'forbid'")
            cond = _conditions(raw["forbid"], f"{where}.forbid", dims, bad)
            if len(cond) < 2:
                raise bad(f"{where}.forbid must name at least two dimensions")
            order = [d.name for d in dims]
            target = max(cond, key=order.index)
            left = [c for c in by_name[target].choices if c not in cond[target]]
            if not left:
                raise bad(f"{where} is impossible: it forbids every choice of '{target}'")
            rules.append(Rule({k: v for k, v in cond.items() if k != target}, target, cond[target]))
        rules += _inherited(dims, rules, bad)

        reference = data.get("reference") or {}
        if not isinstance(reference, dict):
            raise bad("'reference' must be a mapping")
        for key, value in reference.items():
            if key not in by_name:
                raise bad(f"reference.{key}: not a dimension of this space")
            reference[key] = _check_value(key, value, f"reference.{key}", bad)
            if reference[key] not in by_name[key].choices:
                choices = ", ".join(map(str, by_name[key].choices))
                raise bad(
                    f"reference.{key}: {reference[key]!r} is not one of its choices ({choices}); "
                    "add it to the choices or change the reference"
                )
        return cls(dims, rules, dict(reference), source)

    # --- resolving against a study ------------------------------------------------------------

    def resolve(
        self,
        global_batch_size: int,
        hardware: Hardware,
        allow: tuple[str, ...] = FIDELITY_CLASSES,
        documents: bool = False,
    ) -> SearchSpace:
        """Drop micro-batches that don't divide the global batch, choices the hardware lacks,
        choices of a fidelity class outside ``allow`` (``trials.techniques.classes_up_to``) and,
        without variable-length ``documents``, the dimensions that need them (packing)."""
        dropped: list[str] = []
        dims = []
        present = {d.name for d in self.dimensions}
        for d in self.dimensions:
            knob = TECHNIQUES.knob(d.name)
            whole = dimension_unavailable_reason(hardware, d.name)
            if not whole and not documents and knob is not None:
                whole = knob.needs_documents
            if whole:  # the dimension means nothing here: dropped whole, its choices with it
                dropped.append(f"{d.name}: {whole}")
                continue
            keep = []
            for c in d.choices:
                if (
                    knob is not None
                    and knob.fits_batch
                    and not knob.fits_batch(c, global_batch_size)
                ):
                    continue  # e.g. a micro-batch that does not divide the global batch
                reason = unavailable_reason(hardware, d.name, c, present)
                cls = choice_fidelity(d.name, c)
                if not reason and cls not in allow:
                    reason = f"fidelity class {cls} is not searched (--allow {cls} includes it)"
                if reason:
                    dropped.append(f"{d.name}={c}: {reason}")
                else:
                    keep.append(c)
            if not keep:
                raise UserError(
                    f"search space {self.source}: no choice of '{d.name}' can run here "
                    f"(global batch {global_batch_size}, {hardware.backend}, "
                    f"fidelity classes {', '.join(allow)})"
                )
            dims.append(Dimension(d.name, tuple(keep), d.when))
        # a reference value this machine or batch can't run falls back to the first choice
        # (reference_config); it is left out so the stored space reloads
        dims = _reachable(dims)
        kept = {d.name: d.choices for d in dims}
        reference = {k: v for k, v in self.reference.items() if v in kept.get(k, ())}
        rules = _rules_within(self.rules, dims)
        rules += _whole_batch_rules(dims, global_batch_size, self.source)
        return SearchSpace(dims, rules, reference, self.source, dropped)

    def has_exact(self) -> bool:
        """Whether some configuration of the space is exact (every dimension has an exact
        choice), so that an exact reference can be trained."""
        return all(
            any(choice_fidelity(d.name, c) == "exact" for c in d.choices) for d in self.dimensions
        )

    def restrict(self, allow: tuple[str, ...]) -> SearchSpace:
        """The same space with only the choices of the fidelity classes in ``allow``."""
        dims = [
            Dimension(
                d.name, tuple(c for c in d.choices if choice_fidelity(d.name, c) in allow), d.when
            )
            for d in self.dimensions
        ]
        empty = next((d.name for d in dims if not d.choices), None)
        if empty is not None:
            raise UserError(f"search space {self.source}: no choice of '{empty}' is in {allow}")
        dims = _reachable(dims)
        return SearchSpace(
            dims, _rules_within(self.rules, dims), dict(self.reference), self.source, []
        )

    # --- sampling -----------------------------------------------------------------------------

    def sample(self, choose: Chooser) -> dict[str, Choice]:
        """One configuration; ``choose`` is typically ``trial.suggest_categorical``."""
        config: dict[str, Choice] = {}
        for d in self.dimensions:
            if not _holds(d.when, config):
                continue
            choices = self._allowed(d, config)
            name = d.name if len(choices) == len(d.choices) else _narrowed(d.name, choices)
            config[d.name] = choose(name, choices)
        return config

    def _allowed(self, d: Dimension, config: Mapping[str, Choice]) -> list[Choice]:
        """The choices of ``d`` the rules leave after the dimensions chosen in ``config``."""
        choices = list(d.choices)
        for rule in self.rules:
            if rule.target == d.name and _holds(rule.conditions, config):
                choices = [c for c in choices if c not in rule.forbidden]
        return choices

    def params_for(self, config: Mapping[str, Choice]) -> dict[str, Choice]:
        """The Optuna parameters that make ``sample`` return ``config`` (for enqueue_trial)."""
        params: dict[str, Choice] = {}

        def fixed(name: str, choices: list[Choice]) -> Choice:
            dim = _dimension(name)
            value = config.get(dim, choices[0])
            if value not in choices:
                raise UserError(f"{dim}={value} is not allowed here (choices: {choices})")
            params[name] = value
            return value

        self.sample(fixed)
        return params

    def reference_config(self) -> dict[str, Choice]:
        """The exact reference: the space's ``reference`` values where allowed, else the first."""

        def pick(name: str, choices: list[Choice]) -> Choice:
            wanted = self.reference.get(_dimension(name), choices[0])
            return wanted if wanted in choices else choices[0]

        return self.sample(pick)

    def grid(self) -> list[dict[str, Choice]]:
        """Every configuration the space allows, in the order ``sample`` would branch: a
        depth-first walk over the dimensions that keeps the choices made above each branch (the
        GPU trial space at global batch 16 is about a million configurations)."""
        out: list[dict[str, Choice]] = []
        dims = self.dimensions
        config: dict[str, Choice] = {}

        def walk(i: int) -> None:
            if i == len(dims):
                out.append(dict(config))
                return
            d = dims[i]
            if not _holds(d.when, config):
                walk(i + 1)
                return
            for c in self._allowed(d, config):
                config[d.name] = c
                walk(i + 1)
            config.pop(d.name, None)

        walk(0)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "dimensions": {
                d.name: {
                    "choices": list(d.choices),
                    **({"when": {k: list(v) for k, v in d.when.items()}} if d.when else {}),
                }
                for d in self.dimensions
            },
            "rules": [
                {
                    "forbid": {
                        **{k: list(v) for k, v in r.conditions.items()},
                        r.target: list(r.forbidden),
                    }
                }
                for r in self.rules
            ],
            "reference": self.reference,
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]


def _reachable(dims: list[Dimension]) -> list[Dimension]:
    """The dimensions whose ``when`` can still hold once choices were dropped, each condition
    narrowed to the values left (``lora_rank`` goes with ``adapter``'s lora and dora): a
    condition on a dimension that is gone, or on none of its remaining values, never holds."""
    kept: dict[str, tuple[Choice, ...]] = {}
    out = []
    for d in dims:
        when = {k: tuple(v for v in vals if v in kept.get(k, ())) for k, vals in d.when.items()}
        if all(when.values()):
            kept[d.name] = d.choices
            out.append(Dimension(d.name, d.choices, when))
    return out


def _rules_within(rules: list[Rule], dims: list[Dimension]) -> list[Rule]:
    """The rules restated over the choices left after resolving (a resolved space is stored
    and reloaded, so it must not name a dropped choice); a rule left with nothing to match or
    nothing to forbid (or naming a dimension that is gone) goes."""
    kept = {d.name: d.choices for d in dims}
    out = []
    for rule in rules:
        conditions = {
            k: tuple(v for v in vals if v in kept.get(k, ())) for k, vals in rule.conditions.items()
        }
        forbidden = tuple(v for v in rule.forbidden if v in kept.get(rule.target, ()))
        if forbidden and all(conditions.values()):
            out.append(Rule(conditions, rule.target, forbidden))
    return out


def _inherited(
    dims: list[Dimension], written: list[Rule], bad: Callable[[str], UserError]
) -> list[Rule]:
    """The registered techniques' rules (``Technique.forbids``) over this space, in registry
    order, after the rules the file writes: each narrowed to the space's choices, the one of its
    dimensions declared last as the target (as a written rule's); one naming a dimension or
    choices the space lacks does not apply, and one the file already states (a stored space
    states them all) is not added twice."""
    kept = {d.name: d.choices for d in dims}
    order = list(kept)
    seen = {_meaning(r) for r in written}
    out = []
    for forbid in TECHNIQUES.forbids():
        cond = {
            k: tuple(v for v in vals if v in kept.get(k, ())) for k, vals in forbid.choices.items()
        }
        if not all(cond.values()):
            continue
        target = max(cond, key=order.index)
        rule = Rule({k: v for k, v in cond.items() if k != target}, target, cond[target])
        if _meaning(rule) in seen:
            continue
        if set(kept[target]) <= set(rule.forbidden):
            raise bad(
                f"no choice of '{target}' is left where {_described(rule.conditions)}: {forbid.why}"
            )
        seen.add(_meaning(rule))
        out.append(rule)
    return out


def _inherited_whens(dims: list[Dimension], bad: Callable[[str], UserError]) -> list[Dimension]:
    """The dimensions with the registered techniques' conditions on their presence
    (``Technique.whens``) added to the ``when`` the file writes (every one must hold; a
    condition on a dimension the file's ``when`` names too keeps the values both list), each
    narrowed to the space's choices. A condition on a dimension the space lacks holds when that
    dimension's baseline is listed (it keeps its baseline) and is left out; otherwise, or where
    none of the listed values is a choice, the dimension would never exist: the space is
    refused, as it is when the condition's dimension is declared after the one it governs."""
    order = [d.name for d in dims]
    by_name = {d.name: d for d in dims}
    plain = TECHNIQUES.baseline()
    out = []
    for d in dims:
        when = dict(d.when)
        for rule in TECHNIQUES.whens():
            if rule.dimension != d.name:
                continue
            for dim, values in rule.conditions.items():
                needs = f"'{d.name}' exists only where {_described({dim: values})} ({rule.why})"
                if dim not in by_name:
                    if dim in plain and plain[dim] in values:
                        continue
                    raise bad(f"{needs}: add '{dim}' to the space, before '{d.name}'")
                if order.index(dim) > order.index(d.name):
                    raise bad(f"{needs}: declare '{dim}' before '{d.name}'")
                narrowed = tuple(v for v in values if v in by_name[dim].choices)
                if dim in when:
                    narrowed = tuple(v for v in when[dim] if v in narrowed)
                if not narrowed:
                    raise bad(f"{needs}: no choice of '{dim}' it can exist with")
                when[dim] = narrowed
        out.append(Dimension(d.name, d.choices, when))
    return out


def _meaning(rule: Rule) -> tuple[frozenset[tuple[str, frozenset[Choice]]], str, frozenset[Choice]]:
    """What a rule forbids, whatever the order its values are written in."""
    conditions = frozenset((k, frozenset(v)) for k, v in rule.conditions.items())
    return conditions, rule.target, frozenset(rule.forbidden)


def _described(conditions: Mapping[str, tuple[Choice, ...]]) -> str:
    return ", ".join(f"{k} is {'/'.join(map(str, v))}" for k, v in conditions.items())


def _whole_batch_rules(dims: list[Dimension], global_batch_size: int, source: str) -> list[Rule]:
    """The choices that can't run with gradient accumulation (``Knob.whole_batch_only``)
    forbidden with every micro-batch smaller than the global batch: a rule on whichever of the
    two dimensions is declared later, as a YAML rule would be."""
    order = [d.name for d in dims]
    if MICRO_BATCH not in order:
        return []  # no micro-batch dimension: the whole batch in one step
    micro = dims[order.index(MICRO_BATCH)]
    accumulating = tuple(c for c in micro.choices if c != global_batch_size)
    rules = []
    for d in dims:
        knob = TECHNIQUES.knob(d.name)
        banned = tuple(c for c in d.choices if knob is not None and c in knob.whole_batch_only)
        if not banned or not accumulating:
            continue
        if order.index(d.name) > order.index(MICRO_BATCH):
            rule = Rule({MICRO_BATCH: accumulating}, d.name, banned)
        else:
            rule = Rule({d.name: banned}, MICRO_BATCH, accumulating)
        target = dims[order.index(rule.target)]
        if set(target.choices) <= set(rule.forbidden):
            raise UserError(
                f"search space {source}: {d.name}={banned[0]} runs without gradient "
                f"accumulation only, and no micro_batch_size choice is the global batch "
                f"({global_batch_size}) for it"
            )
        rules.append(rule)
    return rules


def _dimension(param_name: str) -> str:
    return param_name.split("|", 1)[0]


def _narrowed(name: str, choices: list[Choice]) -> str:
    return f"{name}|{'/'.join(map(str, choices))}"


def _holds(conditions: Mapping[str, tuple[Choice, ...]], config: Mapping[str, Choice]) -> bool:
    return all(k in config and config[k] in v for k, v in conditions.items())


def _check_value(dim: str, value: Any, where: str, bad: Callable[[str], UserError]) -> Choice:
    knob = TECHNIQUES.knob(dim)
    if isinstance(value, bool) and knob is not None and knob.from_bool is not None:
        value = knob.from_bool[0] if value else knob.from_bool[1]  # YAML 1.1: bare `off` = false
    allowed = knob.choices if knob is not None else None
    if allowed is None:
        value = _as_count(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"{where}: {value!r} is not a positive integer")
        return value
    boolean = all(isinstance(a, bool) for a in allowed)
    if boolean and isinstance(value, str) and value.lower() in _BOOL_WORDS:
        value = _BOOL_WORDS[value.lower()]
    elif value is False and "none" in allowed:
        value = "none"  # `offload_optimizer: off`
    if isinstance(value, bool) != boolean or value not in allowed:
        raise bad(
            f"{where}: unknown choice {value!r} for {dim} (allowed: {', '.join(map(str, allowed))})"
        )
    return value  # type: ignore[no-any-return]


def _as_count(value: Any) -> Any:
    """5e6, 5.0e+6 and "5e6" as the integer 5000000 (other values unchanged)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _conditions(
    raw: Any, where: str, earlier: list[Dimension], bad: Callable[[str], UserError]
) -> dict[str, tuple[Choice, ...]]:
    if not isinstance(raw, dict):
        raise bad(f"{where} must be a mapping of dimension: value(s)")
    known = {d.name: d for d in earlier}
    out: dict[str, tuple[Choice, ...]] = {}
    for dim, values in raw.items():
        if dim not in TECHNIQUES.known_dimensions():
            raise bad(f"{where}: unknown dimension '{dim}'")
        vals = values if isinstance(values, list) else [values]
        if not vals:
            raise bad(f"{where}.{dim}: empty list")
        checked = tuple(_check_value(dim, v, f"{where}.{dim}", bad) for v in vals)
        if dim in known:
            missing = [v for v in checked if v not in known[dim].choices]
            if missing:
                raise bad(f"{where}.{dim}: {missing[0]!r} is not one of its choices")
        elif not where.startswith("rules"):
            raise bad(f"{where}: '{dim}' must be declared before the dimension that depends on it")
        out[dim] = checked
    if where.startswith("rules"):
        undeclared = [d for d in out if d not in known]
        if undeclared:
            raise bad(f"{where}: '{undeclared[0]}' is not a dimension of this space")
    return out
