"""``autotune show``: the trials table and the winner, from the database alone."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from autotune.commands.options import storage_option
from autotune.commands.output import answer
from autotune.selector import selection_json
from autotune.storage import open_storage
from autotune.study import load_existing


@click.command()
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the trials and winner as JSON.")
def show(study_name: str | None, storage: str, as_json: bool) -> None:
    """Print the trials table and the winner from the database alone."""
    study = load_existing(open_storage(storage, read_only=True), study_name)
    if as_json:
        # strict JSON: a non-finite number (an inf loss regression) is null, not Infinity
        click.echo(json.dumps(finite(selection_json(study)), indent=2, allow_nan=False))
        return
    answer(study, storage)


def finite(value: Any) -> Any:
    """``value`` with every nan/inf float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
