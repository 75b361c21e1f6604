"""Named registries (model families, data loaders, benchmarks, rewards) that other packages extend.

The core never imports its extensions: `text_corl` (or a user's package) adds entries either by calling
`REGISTRY.register(name)` when imported, or by declaring a Python entry point in the group
`vlm_corl.<kind>` in its `pyproject.toml`, which is loaded only when that name is looked up.
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

from vlm_corl.errors import UserError

T = TypeVar("T")


class UnknownNameError(UserError, KeyError):
    """A name that no registry entry or entry point provides; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class Registry(Generic[T]):
    """A name -> object map filled by `register` and by the `vlm_corl.<kind>` entry-point group."""

    def __init__(self, kind: str, file_loader: str | None = None):
        self.kind = kind
        self._items: dict[str, T] = {}
        # "module:function" that builds an entry from a YAML file, for names that are .yaml/.yml paths
        self._file_loader = file_loader

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator (or call with the object) that adds `name`; a second registration of a name is an error."""

        def add(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return add

    def _entry_points(self) -> dict:
        return {ep.name: ep for ep in entry_points(group=f"vlm_corl.{self.kind}")}

    def names(self) -> list[str]:
        """Every available name: registered ones and installed entry points."""
        return sorted(set(self._items) | set(self._entry_points()))

    def get(self, name: str) -> T:
        """The object for `name`; `module:attr` names an object directly (for user extensions), and a registry
        with a file loader reads a `.yaml`/`.yml` path with it."""
        if name in self._items:
            return self._items[name]
        if self._file_loader and name.endswith((".yaml", ".yml")):
            module, _, attr = self._file_loader.partition(":")
            return getattr(importlib.import_module(module), attr)(name)
        eps = self._entry_points()
        if name in eps:
            return self.register(name)(eps[name].load())
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as err:  # a typo in a user's extension name, not our bug
                raise UnknownNameError(f"cannot load {self.kind} {name!r}: {err}") from err
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(
            f"unknown {self.kind} {name!r}.{hint} Available: {', '.join(self.names()) or 'none'}"
            f" (or give 'module:attribute')."
        )


# The extension points. Entry-point groups: vlm_corl.families, vlm_corl.loaders, vlm_corl.rewards,
# vlm_corl.benchmarks.
FAMILIES: Registry = Registry("families")  # model family name -> vlm_corl.members.families.Family
LOADERS: Registry = Registry("loaders")  # dataset loader name -> loader function (see vlm_corl.data.loaders)
REWARDS: Registry = Registry("rewards")  # reward mode name -> cohort reward function (training/rewards/modes.py)
# benchmark name (or a benchmark YAML file, vlm_corl.evaluation.benchmark_file) -> vlm_corl.evaluation.scoring.Benchmark
BENCHMARKS: Registry = Registry("benchmarks", file_loader="vlm_corl.evaluation.benchmark_file:load_benchmark_file")
