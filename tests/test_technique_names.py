"""No technique is named outside its module: outside ``trials/techniques/`` no module looks a
configuration's dimension up by name or compares a looked-up value with a choice by name; they
ask the registry (``trials.techniques.TECHNIQUES``) or the technique's own helpers.

Read from the syntax tree, a use is a string constant that is a registered dimension's name
used as a subscript (``config["zero_stage"]``), as the key of ``.get`` / ``.pop`` /
``.setdefault`` or of the accessor ``setting(config, "precision")``, in a comparison
(``"lora" in config``) or as a key of a dict literal that is a configuration (every key a
dimension, or merged into another with ``**``); or a string choice compared with a looked-up
value (``config.get(k) == "cpu"``), alone or in a tuple, list or set."""

from __future__ import annotations

import ast
from pathlib import Path

from trials.techniques import TECHNIQUES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autotune", "trials")
#: the techniques' own package: where their names belong
OWN = "trials/techniques/"
#: the modules exempt, each for its reason: none (every estimator module, the formula libraries
#: ``states.py``, ``activations.py`` and ``paging.py`` included, reads the techniques through
#: their terms and helpers)
EXEMPT: tuple[str, ...] = ()
LOOKUPS = ("get", "pop", "setdefault")
ACCESSOR = "setting"


def named_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of a technique's dimension or choice by name in ``source``."""
    dimensions = set(TECHNIQUES.known_dimensions())
    choices = {c for k in TECHNIQUES.knobs() for c in k.choices or () if isinstance(c, str)}

    def dimension(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if node.value in dimensions else None
        return None

    def accessor(node: ast.AST) -> bool:
        """A call of ``trials.techniques.setting`` (the accessor that takes a dimension)."""
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            return False
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name == ACCESSOR

    def looked_up(node: ast.AST) -> bool:
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        return (
            isinstance(node, ast.Subscript)
            or (call and node.func.attr in LOOKUPS)  # type: ignore[attr-defined]
            or accessor(node)
        )

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys.append(node.slice)
        elif accessor(node):
            keys.append(node.args[1])  # type: ignore[attr-defined]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOOKUPS
            and node.args
        ):
            keys.append(node.args[0])
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                elements = (
                    operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else []
                )
                keys += [operand, *elements]
            if any(looked_up(o) for o in operands):
                found += [
                    (node.lineno, f"choice {o.value!r} compared with a looked-up value")
                    for o in keys  # the operands and the elements of tuples, lists, sets
                    if isinstance(o, ast.Constant) and o.value in choices
                ]
        elif isinstance(node, ast.Dict):
            named = [k for k in node.keys if k is not None and dimension(k)]
            merged = any(k is None for k in node.keys)
            if named and (merged or len(named) == len(node.keys)):
                keys += named
        found += [(node.lineno, f"dimension {dimension(k)!r}") for k in keys if dimension(k)]
    return found


def test_no_module_outside_the_techniques_names_one() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(OWN) or rel.startswith(EXEMPT):
                continue
            offenders += [f"{rel}:{line}: {what}" for line, what in named_uses(path.read_text())]
    assert offenders == []


def test_each_kind_of_named_use_is_found() -> None:
    """The uses this test exists to catch, written out (and what is not one)."""
    source = "\n".join(
        [
            'stage = config["zero_stage"]',
            'adapter = config.get("adapter", "none")',
            'lora = "adapter" in config',
            'probe = {**numerics, "attention": "sdpa"}',
            'alpha = {"precision": 1.0}',
            'offloaded = config.get(key, "none") != "none"',
            'engines = {"torch": 1, "fsdp": 2}',  # an engine's name, not a configuration
            'cpu = device.type == "cpu"',  # a device, not a looked-up choice
            'half = setting(config, "precision") in ("bf16", "fp16")',
        ]
    )
    assert named_uses(source) == [
        (1, "dimension 'zero_stage'"),
        (2, "dimension 'adapter'"),
        (3, "dimension 'adapter'"),
        (4, "dimension 'attention'"),
        (5, "dimension 'precision'"),
        (6, "choice 'none' compared with a looked-up value"),
        (9, "choice 'bf16' compared with a looked-up value"),
        (9, "choice 'fp16' compared with a looked-up value"),
        (9, "dimension 'precision'"),
    ]
