"""Loading a cascade's levels for the command lines (`specray generate`, `specray bench`): the levels are built
with a progress bar over the model levels as they load. Its own module so both command lines share it without
importing each other."""

from __future__ import annotations

import sys

from specray.config import CascadeConfig
from specray.coordinator.state import Level


def load_levels(cfg: CascadeConfig, progress: bool) -> list[Level]:
    """Build the levels with a progress bar over the model levels as they load."""
    from tqdm.auto import tqdm

    from specray.coordinator.generate import build_levels

    models = [lc for lc in cfg.levels if lc.kind != "ngram"]
    with tqdm(total=len(models), desc="loading models", unit="model", disable=not progress, file=sys.stderr) as bar:
        if models:
            bar.set_postfix_str(models[0].display_name)

        def loaded(level: Level) -> None:
            if level.worker is None:
                return
            bar.update(1)
            rest = models[bar.n:] if bar.n < len(models) else []
            bar.set_postfix_str(rest[0].display_name if rest else "")

        return build_levels(cfg, on_level=loaded)
