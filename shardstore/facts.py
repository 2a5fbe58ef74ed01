"""What a store keeps of the checkpoint it was planned from, besides its tree and arrays: the facts the
formats give with their spec (read/contract.py `CheckpointSpec.facts`) and the store records
(store/manifest.py), typed and versioned, each spelled once.

At the bottom of the package: read/ makes them, store/ keeps them, export/ reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable

from .errors import StoreError
from .paths import pick

FACTS_VERSION = 2
# What version-1 facts (before the format's flags were recorded) imply, by the format that planned them:
# (ranked, group_claims, keeps_empty_values). Any format not named here had (False, False, True).
_V1_FLAGS = {"torch-save": (True, True, True), "dtensor-files": (True, False, True), "dcp": (False, False, False)}


@dataclass(frozen=True)
class _Codec:
    """How one fact is written into the manifest (`dump`), read back (`load`, given what the manifest holds,
    None where it holds nothing), and checked once read (`valid`)."""

    dump: Callable[[Any], Any] = lambda v: v
    load: Callable[[Any], Any] = lambda v: v
    valid: Callable[[Any], bool] = lambda v: True


def _of(*types: type) -> _Codec:
    return _Codec(valid=lambda v: type(v) in types)


_TEXT, _MAYBE_TEXT, _NUMBER, _FLAG = _of(str), _of(str, type(None)), _of(int), _of(bool)
_MAPPING = _Codec(load=lambda v: v or {}, valid=lambda v: isinstance(v, dict))


def _fact(default: Any, codec: _Codec) -> Any:
    """A typed fact: its default (a callable for a fresh container) and its codec; spelled once, in the
    dataclass, from which `of`, `to_json`, `from_json` and the checks all follow."""
    if callable(default):
        return field(default_factory=default, metadata={"codec": codec})
    return field(default=default, metadata={"codec": codec})


# The names a format gives, in its reader's facts, to a table keyed by store path (a fact per tensor, which
# grows with the model): a task is sent its own paths' entries alone (`CheckpointFacts.part`).
PATH_TABLES = frozenset({"shapes"})


@dataclass(frozen=True)
class CheckpointFacts:
    """What a store keeps of the checkpoint it was planned from, besides its tree and arrays: typed and
    versioned (`FACTS_VERSION`). Everything but `reader` is read across shardstore; `reader` holds the
    format's own facts for its workers (the format's `reader` dict), which only that
    format reads, and which `open_unit` gets back as they were (`reader_view`)."""

    format: str = _fact("torch-save", _TEXT)  # the registry name of the format that planned the store
    group_size: int = _fact(1, _NUMBER)  # units per replica group (hybrid sharding)
    replicas: int = _fact(1, _NUMBER)  # the most units holding any one box
    # name -> base64: the run's config, written back
    side_files: dict[str, str] = _fact(dict, _MAPPING)
    # the unit files by name, for formats whose checkpoint lists them
    units: tuple[str, ...] | None = _fact(None, _Codec(lambda v: None if v is None else list(v),
                                                       lambda v: None if v is None else tuple(v)))
    metadata: str | None = _fact(None, _MAYBE_TEXT)  # a digest of what the plan was read from (a unit of another is refused)
    reader: dict[str, Any] = _fact(dict, _MAPPING)
    version: int = _fact(FACTS_VERSION, _NUMBER)
    # tied names: (the keys of a name that is another's tensor, the store path of that tensor), written as
    # the same tensor where the output can share one (torch) and left out where it cannot
    tied: tuple[tuple[tuple[str, ...], str], ...] = _fact((), _Codec(
        lambda v: [[list(keys), path] for keys, path in v], lambda v: tuple((tuple(keys), path) for keys, path in v or ())))
    # store paths of values the plan knows are not tensors (DCP's bytes items): an export of tensors alone
    # leaves them out without their data, so it can be laid out before any unit is read
    not_tensors: frozenset[str] = _fact(frozenset(), _Codec(sorted, lambda v: frozenset(v or ()),
                                                            lambda v: all(isinstance(p, str) for p in v)))
    # the trainer whose resume files `--format torch` writes (read/formats/resume.py), and those files: output
    # name -> base64 of the trainer's own file (its scheduler, RNG and trainer state), written back unchanged
    trainer: str | None = _fact(None, _MAYBE_TEXT)
    resume_files: dict[str, str] = _fact(dict, _MAPPING)
    # what exports need to know of the format that planned the store (read/contract.py: Format), so that
    # export/ never asks the input format's registry; version-1 facts lack them (`_flags`)
    ranked: bool = _fact(True, _FLAG)
    group_claims: bool = _fact(True, _FLAG)
    keeps_empty_values: bool = _fact(True, _FLAG)
    # Megatron-LM's model description, read with the plan: its args (plain values), and the store path of
    # the subtree holding its common state (read from the data when the plan could not read the args)
    megatron_args: dict[str, Any] | None = _fact(None, _of(dict, type(None)))
    megatron_common: str | None = _fact(None, _MAYBE_TEXT)

    @classmethod
    def typed(cls) -> tuple[str, ...]:
        """The facts a format's spec gives by name (`extra`); the rest of it is the reader's own."""
        return tuple(f.name for f in fields(cls) if f.name not in ("reader", "version"))

    @classmethod
    def _loaded(cls, d: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
        return {f.name: f.metadata["codec"].load(d[f.name]) for f in fields(cls) if f.name in names and f.name in d}

    @classmethod
    def of(cls, format: str, group_size: int, replicas: int, extra: dict[str, Any]) -> "CheckpointFacts":
        """From a format's spec: its typed facts taken out of `extra`, the rest kept for its reader."""
        typed = cls.typed()
        return cls(**{"replicas": replicas, **cls._loaded(extra, typed), "format": format, "group_size": group_size,
                      **cls._flags(format, extra), "reader": {k: v for k, v in extra.items() if k not in typed}})

    @staticmethod
    def _flags(format: str, d: dict[str, Any]) -> dict[str, bool]:
        """The format's flags as recorded, or as version-1 facts imply them."""
        v1 = dict(zip(("ranked", "group_claims", "keeps_empty_values"), _V1_FLAGS.get(format, (False, False, True))))
        return {k: d.get(k, v1[k]) for k in v1}

    def part(self, exact: Iterable[str], subtrees: frozenset[str]) -> "CheckpointFacts":
        """What a task that holds only the store paths `exact` (and those within `subtrees`) needs of the
        facts (`Manifest.part`): the reader's tables by store path (`PATH_TABLES`) and `not_tensors` cut to
        those paths, and none of the files an export writes back (side and resume files, a tokenizer's
        megabytes). Sent whole, DeepSeek-V3's structure's shapes made each task 8 MB of pickle."""
        exact = list(exact)
        reader = {name: {k: pick(v, exact, subtrees) if k in PATH_TABLES and isinstance(v, dict) else v
                         for k, v in own.items()} if isinstance(own, dict) else own
                  for name, own in self.reader.items()}
        return replace(self, reader=reader, side_files={}, resume_files={},
                       not_tensors=frozenset(pick(dict.fromkeys(self.not_tensors), exact, subtrees)))

    def reader_view(self) -> dict[str, Any]:
        """What the format's `open_unit` is given: its own facts, and the units and digest it planned."""
        return {**self.reader, "units": list(self.units or ()), "metadata": self.metadata}

    def to_json(self) -> dict[str, Any]:
        return {f.name: f.metadata["codec"].dump(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "CheckpointFacts":
        if not isinstance(d, dict):
            raise StoreError(f"{where}: corrupt manifest (checkpoint facts)")
        if d.get("version", 0) > FACTS_VERSION:
            raise StoreError(f"{where}: checkpoint facts of version {d.get('version')}, written by a newer "
                             f"shardstore; upgrade shardstore")
        values = cls._loaded(d, [f.name for f in fields(cls)])
        reader = values.get("reader", {})
        if isinstance(reader, dict) and "megatron_args" in reader:  # version 1 kept them with the reader's
            values.setdefault("megatron_args", reader["megatron_args"])
            values["reader"] = {k: v for k, v in reader.items() if k != "megatron_args"}
        facts = cls(**{**values, **cls._flags(values.get("format", "torch-save"), d)})
        if not all(f.metadata["codec"].valid(getattr(facts, f.name)) for f in fields(facts)):
            raise StoreError(f"{where}: corrupt manifest (checkpoint facts)")
        return facts

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "CheckpointFacts":
        """A store written before the facts were typed (its manifest's untyped `extra`)."""
        return cls.of(extra.get("format", "torch-save"), extra.get("group_size", 1), extra.get("replicas", 1),
                      extra)
