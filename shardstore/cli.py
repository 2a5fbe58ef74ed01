"""The command line: argument parsing, progress bars and error lines. Every command calls the API."""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import click

from . import __version__
from .errors import ShardstoreError, StoreError
from .progress import QUIET, ConsoleProgress, Progress, size_text

if TYPE_CHECKING:
    import numpy as np

    from . import api, values
else:
    class _Later(types.ModuleType):
        """A module imported when first used: `shardstore --version` and `--help` load click and this
        file, not the API behind the commands (numpy, zarr, the readers and writers)."""

        def __getattr__(self, name: str) -> Any:
            module = importlib.import_module(self.__name__)
            self.__dict__.update(module.__dict__)
            return getattr(module, name)

    api, values, np = _Later("shardstore.api"), _Later("shardstore.values"), _Later("numpy")


class _Choice(click.Choice):
    """A choice among names a registry gives, asked for only when a value is checked or help is shown."""

    def __init__(self, names: Callable[[], Sequence[str]], case_sensitive: bool = True) -> None:
        self._names = functools.cache(names)
        self.case_sensitive = case_sensitive

    @property  # type: ignore[override]
    def choices(self) -> Sequence[str]:
        return tuple(self._names())

    @choices.setter
    def choices(self, value: Sequence[str]) -> None:
        raise AttributeError("the names come from the registry")


def _formats() -> Sequence[str]:
    from .export import FORMATS
    return FORMATS


def _dtypes() -> Sequence[str]:
    from .dtypes import CAST_DTYPES, DTYPE_ALIASES
    return CAST_DTYPES + tuple(DTYPE_ALIASES)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"5GB" -> 5_000_000_000 (decimal, as transformers reads it); "2GiB" -> 2 * 2**30; "123" -> 123."""
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"not a size: {text!r} (try 5GB, 500MB or 2GiB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * ((1024 if m.group(3) else 1000) ** power))


@contextmanager
def _progress(quiet: bool) -> Iterator[Progress]:
    if quiet:
        yield QUIET
        return
    phases = ConsoleProgress()
    try:
        yield phases
    except BaseException:
        phases.abandon()
        raise
    phases.end()


class _Group(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """`--storage-options` is the group's option, but is taken wherever it stands on the line
        (`shardstore ingest s3://b/s.zarr ... --storage-options '{...}'` as well as before the command)."""
        front: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(args):
            if args[i] == "--storage-options" and i + 1 < len(args):
                front += args[i:i + 2]
                i += 2
                continue
            (front if args[i].startswith("--storage-options=") else rest).append(args[i])
            i += 1
        return super().parse_args(ctx, front + rest)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardstoreError as exc:
            click.echo(f"shardstore: error: {exc}{_kept(ctx)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo(f"shardstore: interrupted; {ctx.meta.get(_LEFT, lambda: 'nothing was left behind')()}", err=True)
            sys.exit(130)


# ctx.meta's key for what an interrupted command leaves, as the end of its Ctrl-C line (a function: asked
# then); a command that sets none leaves nothing (it reads, or removes its scratch folders on the way out)
_LEFT = "shardstore.interrupted"


def _leaves_a_store(store: str, left: str) -> None:
    """For the Ctrl-C line: `left` (what is kept in `store`, and what a rerun does) if `store` is there by
    then (a store that took nothing yet is removed), else that nothing was written."""
    from .store.store import Store

    options = _options()
    click.get_current_context().meta[_LEFT] = lambda: left if Store.exists(store, options) else "nothing was written"


def _leaves_outputs(what: str) -> None:
    """For the Ctrl-C line of a command writing files into OUT, each under a temporary name until whole."""
    click.get_current_context().meta[_LEFT] = \
        lambda: f"no half-written file was left under its final name; rerun to write {what} again"


def _kept(ctx: click.Context) -> str:
    """Where the work of a failed run is kept, for the end of its one line ("" if nowhere)."""
    where = ctx.meta.get("shardstore.kept", lambda: None)()
    return f"; the work so far is kept in {where}: once that is put right, a rerun into the same OUT resumes from it" \
        if where else ""


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardstore")
@click.option("--storage-options", "storage_options", default=None, metavar="JSON",
              help='fsspec options for s3:// (and other URL) stores and rank files, e.g. \'{"anon": false}\'. '
                   "AWS_* variables and AWS_ENDPOINT_URL are read as usual.")
@click.pass_context
def main(ctx: click.Context, storage_options: str | None) -> None:
    """Unshard sharded PyTorch checkpoints through a Zarr store: per-rank torch.save files of FSDP
    ShardedTensors (rank0.pt ... rankN.pt, OLMo, Composer) or DTensors (FSDP2, veRL),
    torch.distributed.checkpoint folders (DCP, and its Hugging Face safetensors), OLMo `local` and
    OLMo-core folders, DeepSpeed ZeRO 1/2/3 checkpoints. Out come safetensors, a Hugging Face folder,
    torch files or DCP.

    STORE, SRC and rank files may be local paths or URLs (s3://bucket/path, gs://..., file://...).
    """
    try:
        ctx.obj = json.loads(storage_options) if storage_options else {}
    except ValueError:
        raise click.BadParameter("not JSON", param_hint="--storage-options") from None
    if not isinstance(ctx.obj, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--storage-options")


def _options() -> dict[str, Any]:
    return click.get_current_context().find_root().obj or {}


_quiet = click.option("--quiet", "-q", is_flag=True, help="No progress output (for scripts).")
_json = click.option("--json", "as_json", is_flag=True,
                     help="One JSON object on stdout, for scripts (docs/commands.md gives its schema).")
_strict = click.option("--strict", is_flag=True,
                       help="Refuse any pickled class outside shardstore's allowlist (paths, a trainer's own "
                            "classes) instead of keeping it as an opaque record.")
_verify = click.option("--verify-replicas", is_flag=True,
                       help="Hybrid sharding: check every replica group's copy of a shard is bit-identical.")
_scheduler = click.option("--scheduler", default=None, metavar="ADDRESS",
                          help="Run on Dask, one task per rank file (ingest) or per safetensors file (export): a "
                               "scheduler address (tcp://host:8786), or 'dask' for a local cluster of --jobs "
                               "worker processes.")
_jobs = click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
                     help="Worker processes, one rank file each at a time [default: number of cores].")


def _export_options(f: Any) -> Any:
    """The export's options, each named as `api.export` and `api.unshard` take it: the commands pass them on
    as they are (`**export`)."""
    for opt in reversed([
        click.option("--format", "format", type=_Choice(_formats), default="safetensors", show_default=True,
                     help="safetensors: model weights, HF-style. torch: model.pt/optim.pt/train.pt (OLMo) "
                          "or checkpoint.pt. dcp: a torch.distributed.checkpoint folder, loadable at any world "
                          "size. hf: a folder transformers' from_pretrained loads (OLMo 1/2 from the run's "
                          "config.yaml, OLMo-core from its config.json, Composer HF models and veRL from "
                          "their own config, else --hf-config)."),
        click.option("--hf-config", type=click.Path(exists=True), default=None, metavar="PATH",
                     help="For --format hf: a Hugging Face config.json, or a folder holding one and tokenizer "
                          "files (copied), for checkpoints that carry no config of their own."),
        click.option("--select", default=None, help="Store path of the subtree to export as the model "
                                                    "[default: detected, e.g. model or state/model]."),
        click.option("--strip-prefix", default=None, help="Drop this prefix from output keys (e.g. 'model.')."),
        click.option("--dtype", type=_Choice(_dtypes, case_sensitive=False),
                     default=None, help="Cast floating tensors (bf16, fp16, fp32 say the same)."),
        click.option("--keep-dtype", "keep_dtype", multiple=True, metavar="PATTERN",
                     help="With --dtype: output tensors whose name matches stay in their own dtype (a glob, "
                          "'*norm*', or a regex as 're:...'); repeatable; recorded in the output's metadata."),
        click.option("--single-file", is_flag=True,
                     help="With --format torch: the whole state in one checkpoint.pt in the input's nesting (what "
                          "torch's dcp_to_torch_save writes), not the files the trainer resumes from."),
        click.option("--max-shard-size", default="5GB", show_default=True, type=parse_size, metavar="SIZE",
                     help="Split safetensors output above this size (decimal units, like transformers)."),
        click.option("--overwrite", is_flag=True,
                     help="Replace an earlier export in OUT: its files that this export does not rewrite are "
                          "removed once this one is complete. Other files are never touched."),
        click.option("--adapter", is_flag=True,
                     help="With --format hf, of a PEFT model or a Megatron LoRA: its LoRA (DoRA) adapter alone, as "
                          "peft saves it (adapter_model.safetensors, adapter_config.json): PeftModel.from_pretrained "
                          "loads it."),
        click.option("--merge-adapter", is_flag=True,
                     help="With --format hf or safetensors, of a PEFT model or a Megatron LoRA: the model with its "
                          "LoRA (DoRA) adapter merged into the base weights (in float32, rounded once), under the "
                          "model's own names."),
        click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="With --adapter or --merge-adapter, of a checkpoint that keeps no adapter_config.json "
                          "(the HF Trainer's under FSDP): the LoRA's alpha, as trained."),
        click.option("--rslora/--no-rslora", default=None,
                     help="With --lora-alpha: whether the LoRA was trained as rsLoRA (its scale alpha/sqrt(r))."),
        click.option("--base", default=None, metavar="FOLDER|ORG/NAME",
                     help="With --merge-adapter, of a checkpoint holding the adapter only (the HF Trainer's under "
                          "FSDP): the base model's Hugging Face folder, or its id in the local Hugging Face cache "
                          "(never downloaded), read in place."),
        click.option("--vocab-multiple", type=click.IntRange(min=1), default=None, metavar="N",
                     help="With --format megatron: pad the vocabulary to a multiple of N rows, as the job that loads "
                          "it computes it (Megatron-LM's --make-vocab-size-divisible-by times its tensor-parallel "
                          "size) [default: 128]; with --format nemo, likewise [default: unpadded, as NeMo's "
                          "importers leave it]."),
        click.option("--transformer-impl", type=click.Choice(["transformer_engine", "local"]), default=None,
                     help="With --format megatron or nemo: the layer spec of the model that loads it, as Megatron-LM's "
                          "--transformer-impl says [default: transformer_engine, Megatron-LM's]. The keys differ for "
                          "MoE layers' and multi-latent attention's norms, and TE keeps an _extra_state per norm."),
        click.option("--names", default=None, metavar="torchtitan|FILE.json",
                     help="With --format dcp, of a model --format hf maps: its tensors under a trainer's names, "
                          "for dcp.load into its model at any world size: torchtitan's (0.3), or a JSON "
                          "file of renames {\"regex\": \"replacement\" or null}."),
    ]):
        f = opt(f)
    return f


def _report(result: Any, quiet: bool, started: float, what: str, as_json: bool = False) -> None:
    if as_json:
        tensors, parameters, written = _totals(result)
        _echo_json({"files": [str(p) for p in result.files], "replaced": [str(p) for p in result.replaced],
                    "tensors": tensors, "parameters": parameters,
                    "dtypes": {d: {"tensors": n, "parameters": e} for d, (n, e) in sorted(result.dtypes.items())},
                    "read_bytes": result.read, "write_bytes": written,
                    "seconds": round(time.perf_counter() - started, 3), "skipped": result.skipped,
                    "notes": result.notes, "partial": result.partial})
        return
    if quiet:
        return
    for path in result.replaced:
        click.echo(f"removed {path} (earlier export)")
    for path in result.files:
        click.echo(f"wrote {path}")
    click.echo(summary_line(result, time.perf_counter() - started, what), err=True)
    if result.skipped:
        click.echo(f"left out {len(result.skipped)} non-tensor value(s): {', '.join(result.skipped[:5])}"
                   f"{' ...' if len(result.skipped) > 5 else ''}", err=True)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)


def _echo_plan(plan: api.Plan, out: str, as_json: bool) -> None:
    """`unshard --dry-run`'s answer: text, or one JSON object (docs/commands.md)."""
    if as_json:
        _echo_json({"checkpoint": plan.checkpoint, "reader": plan.reader, "trainer": plan.trainer, "units": plan.units,
                    "world_size": plan.world_size, "read_bytes": plan.read, "write_bytes": plan.write,
                    "one_pass": plan.one_pass, "files": [{"name": n, "bytes": b} for n, b in plan.files],
                    "casts": plan.casts, "free_bytes": plan.free, "read_speed": plan.speed,
                    "seconds": plan.seconds, "would_start": True})
        return
    click.echo(f"checkpoint: {plan.checkpoint} ({plan.reader}" + (f", {plan.trainer}'s folder" if plan.trainer else "")
               + f"): {plan.units} unit files, world size {plan.world_size}")
    click.echo(f"read: {size_text(plan.read) if plan.read is not None else 'unknown (object storage)'}; write: "
               f"{size_text(plan.write)} of tensors, " + ("in one pass" if plan.one_pass else "through the store"))
    for name, size in plan.files:
        click.echo(f"  {Path(out) / name}  {size_text(size) if size is not None else '(size known once written)'}")
    if not plan.files:
        click.echo("  (the files depend on values the data brings: known once it is read)")
    for cast, n in plan.casts.items():
        click.echo(f"cast: {cast}: {n} tensors")
    for where, free in plan.free.items():
        click.echo(f"free: {size_text(free)} on {where}")
    if plan.seconds is not None and plan.speed is not None:
        click.echo(f"estimate: {plan.seconds:.1f} s at {size_text(plan.speed)}/s (this disk's read speed, measured)")
    click.echo("a real run would start (nothing was written)")


def _totals(result: Any) -> tuple[int, int, int]:
    """An export's tensors, parameters and bytes written."""
    return (sum(n for n, _ in result.dtypes.values()), sum(e for _, e in result.dtypes.values()),
            sum(p.stat().st_size for p in result.files if p.is_file()))


def summary_line(result: Any, seconds: float, what: str) -> str:
    """One line after a run: tensors and parameters by output dtype, bytes read and written, time, speed."""
    tensors, parameters, written = _totals(result)
    by_dtype = ", ".join(f"{dtype} {n} ({_count(elements)})" for dtype, (n, elements) in sorted(result.dtypes.items()))
    read = f"read {size_text(result.read)}, " if result.read is not None else ""
    return (f"{what}: {tensors} tensors, {_count(parameters)} parameters "
            f"[{by_dtype}]; {read}wrote {size_text(written)} in {seconds:.1f} s "
            f"({size_text(written / max(seconds, 1e-9))}/s)")


def _count(n: int) -> str:
    """1234567 -> "1.23 M"."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


@main.command()
@click.argument("store", type=click.Path())
@click.argument("files", nargs=-1, required=True, type=click.Path())
@_verify
@_strict
@_scheduler
@_jobs
@_quiet
@_json
def ingest(store: str, files: tuple[str, ...], verify_replicas: bool, strict: bool, scheduler: str | None,
           jobs: int | None, quiet: bool, as_json: bool) -> None:
    """Ingest rank FILES into STORE (created if needed). Any subset, any order; ranks already in are skipped."""
    _leaves_a_store(store, f"the files ingested so far are kept in {store} (one cut short is not among them): "
                           f"rerun to ingest the rest")
    with _progress(quiet or as_json) as progress:
        st = api.ingest(store, list(files), jobs=jobs, verify_replicas=verify_replicas, storage_options=_options(),
                        scheduler=scheduler, strict=strict, progress=progress)
    status = st.status()
    if as_json:
        _echo_json(_store_json(st, _summary(st)[0]))
    elif not quiet:
        click.echo(f"{store}: {len(status.ranks_done)}/{status.world_size} ranks ingested"
                   + ("" if status.ok else f"; missing {_ranks(status.ranks_missing)}"))


@main.command()
@click.argument("store", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
@_export_options
@click.option("--allow-partial", is_flag=True,
              help="Export an incomplete store: holes become NaN (zero for integers), recorded in the output.")
@_scheduler
@_jobs
@_quiet
@_json
def export(store: str, out: str, allow_partial: bool, scheduler: str | None, jobs: int | None, quiet: bool,
           as_json: bool, **export: Any) -> None:
    """Export the unsharded checkpoint in STORE to the folder OUT."""
    _leaves_outputs("the export")
    started = time.perf_counter()
    with _progress(quiet or as_json) as progress:
        result = api.export(store, out, progress=progress, allow_partial=allow_partial, storage_options=_options(),
                            scheduler=scheduler, jobs=jobs, **export)
    if result.partial and not as_json:
        click.echo(f"warning: partial export: ranks {result.partial['shardstore_missing_ranks'] or 'none'} missing, "
                   f"holes filled with NaN/zero in {len(result.partial['shardstore_incomplete_tensors'].split(','))} "
                   f"tensor(s); recorded in the output's metadata", err=True)
    _report(result, quiet, started, "export", as_json)


@main.command()
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--store", "store", type=click.Path(), default=None,
              help="Keep the Zarr store here (for lazy inspection or more exports) instead of a scratch one.")
@click.option("--tag", default=None,
              help="Which checkpoint, when SRC holds several: a file prefix or sub-folder (ep0-ba20), or 'latest'.")
@click.option("--step", type=int, default=None, help="Which checkpoint, by step, in the trainer's own names (checkpoint-N, epoch=E-step=N.ckpt, "
                   "step-N, global_stepN, iter_000000N, baN, stepN) [default: the newest].")
@_export_options
@_verify
@_strict
@_scheduler
@_jobs
@_quiet
@click.option("--dry-run", is_flag=True, help="Read only what planning needs and say what the run would do "
                                             "(files, sizes, casts, bytes, free space, time); write nothing.")
@_json
@click.pass_context
def unshard(ctx: click.Context, src: str, out: str, store: str | None, tag: str | None, step: int | None,
            verify_replicas: bool, strict: bool, scheduler: str | None, jobs: int | None, quiet: bool, dry_run: bool,
            as_json: bool, **export: Any) -> None:
    """Unshard the checkpoint in folder SRC into folder OUT: ingest, then export.

    Without --store, the work in progress is kept in OUT/.shardstore-scratch until the export is complete,
    so an interrupted or failed run resumes where it stopped when rerun.
    """
    started = time.perf_counter()
    run = functools.partial(api.unshard, src, out, store=store, tag=tag, step=step, jobs=jobs,
                            verify_replicas=verify_replicas, storage_options=_options(), scheduler=scheduler,
                            strict=strict, **export)
    if dry_run:
        planned = run(plan=True)
        assert isinstance(planned, api.Plan)  # (what plan=True returns)
        _echo_plan(planned, out, as_json)
        return
    scratch = api.scratch_location(out)
    if store is None:
        ctx.meta["shardstore.kept"] = lambda: scratch if scratch.is_dir() and not scratch.is_symlink() else None
    _leaves_a_store(store or str(scratch), f"the work so far is kept in {store or scratch}: a rerun "
                                           f"{'with the same --store' if store else 'into the same OUT'} resumes from it")
    with _progress(quiet or as_json) as progress:
        result = run(progress=progress)
    _report(result, quiet, started, "unshard", as_json)


@main.command()
@click.argument("run", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--every", type=click.IntRange(min=1), default=None, help="Publish only steps that are multiples of N.")
@click.option("--keep", type=click.IntRange(min=1), default=None,
              help="Keep the newest K published folders; older ones are removed once a newer one is published.")
@click.option("--poll", type=click.FloatRange(min=0.05), default=30.0, show_default=True, help="Seconds between looks at RUN.")
@click.option("--once", is_flag=True, help="Publish the checkpoints complete now, then exit.")
@_export_options
@_strict
@_jobs
@_json
def follow(run: str, out: str, every: int | None, keep: int | None, poll: float, once: bool, strict: bool,
           jobs: int | None, as_json: bool, **export: Any) -> None:
    """Follow a running job: each checkpoint of RUN (local, or on object storage) that becomes complete by its
    trainer's rule is unsharded into OUT/<its name>/, published by one rename, and OUT/latest then names it.
    One line per checkpoint published, skipped or removed (--json: one JSON object per line). Runs until
    interrupted; killed, it resumes where it stopped when started again."""
    from .follow import Published, Skipped

    def said(event: Any) -> None:
        if as_json:
            click.echo(json.dumps({"event": type(event).__name__.lower(), **{k: v for k, v in vars(event).items()}},
                                  default=str))
        elif isinstance(event, Published):
            early = f"; {event.early} of its files taken as they landed" if event.early else ""
            click.echo(f"published {event.folder} (step {event.step}; {event.lag:.1f} s after its last file, "
                       f"unsharded in {event.seconds:.1f} s{early})")
        elif isinstance(event, Skipped):
            click.echo(f"skipped {event.name}: {event.why}", err=True)
        else:
            click.echo(f"removed {Path(out) / event.name} (--keep {keep})")
    api.follow(run, out, every=every, keep=keep, poll=poll, once=once, on_event=said, jobs=jobs,
               storage_options=_options(), strict=strict, **export)


VERIFY_LINES = 50  # difference lines `verify` prints; --json gives every one


@main.command()
@click.argument("src", type=click.Path())
@click.argument("output", type=click.Path(exists=True))
@click.option("--format", "fmt", type=_Choice(_formats), default=None,
              help="Check OUTPUT as this export [default: hf for a folder with a config.json, dcp for one with a "
                   ".metadata, torch for torch files (.pt, .bin, .pth: one whole state, a state dict, or the "
                   "split files of --format torch), else safetensors].")
@click.option("--hf-config", type=click.Path(exists=True), default=None, metavar="PATH",
              help="As given to the export: the config that named the weights (hf) [default: the checkpoint's "
                   "own description, else OUTPUT's config.json].")
@click.option("--select", default=None, help="As given to the export: the subtree exported as the model.")
@click.option("--strip-prefix", default=None, help="As given to the export: the prefix dropped from keys.")
@click.option("--tag", default=None, help="Which checkpoint, when SRC holds several.")
@click.option("--step", type=int, default=None, help="Which checkpoint, by step [default: the newest].")
@click.option("--merge-adapter", is_flag=True, help="As given to the export: OUTPUT is the model with its PEFT "
                                                    "adapter merged (an adapter folder is known by itself).")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=None,
              help="As given to the export (--merge-adapter of a checkpoint that keeps no adapter_config.json).")
@click.option("--rslora/--no-rslora", default=None, help="As given to the export, with --lora-alpha.")
@click.option("--base", default=None, metavar="FOLDER|ORG/NAME", help="As given to the export (--merge-adapter).")
@click.option("--names", default=None, metavar="torchtitan|FILE.json", help="As given to the export (--format dcp): "
              "OUTPUT holds the tensors under a trainer's names.")
@_jobs
@_quiet
@_json
def verify(src: str, output: str, fmt: str | None, hf_config: str | None, select: str | None,
           strip_prefix: str | None, tag: str | None, step: int | None, merge_adapter: bool, lora_alpha: float | None,
           rslora: bool | None, base: str | None, names: str | None, jobs: int | None, quiet: bool,
           as_json: bool) -> None:
    """Check OUTPUT (safetensors files, a Hugging Face folder, torch files or a DCP folder, from any tool) against the sharded
    checkpoint in SRC: every tensor there, of its shape, and bit for bit (or, for a cast, as torch casts).
    One line per difference; exits 1 if there is any."""
    adapter = {k: v for k, v in (("lora_alpha", lora_alpha), ("rslora", rslora), ("base", base), ("names", names))
               if v is not None}
    adapter.update({"merge_adapter": True} if merge_adapter else {})
    result = api.verify(src, output, format=fmt, select=select, strip_prefix=strip_prefix, hf_config=hf_config,
                        tag=tag, step=step, jobs=jobs, storage_options=_options(), **adapter)
    if as_json:
        _echo_json({"ok": result.ok, "format": result.format, "tensors": result.tensors, "bytes": result.nbytes,
                    "differences": [{"name": d.name, "what": d.what} for d in result.differences]})
    elif quiet:  # the exit status alone
        sys.exit(0 if result.ok else 1)
    else:  # the first lines: a wholly wrong output of thousands of tensors would bury the summary
        for difference in result.differences[:VERIFY_LINES]:
            click.echo(str(difference))
        if len(result.differences) > VERIFY_LINES:
            click.echo(f"... and {len(result.differences) - VERIFY_LINES} more (--json lists every one)")
    click.echo(result.summary(), err=True)
    sys.exit(0 if result.ok else 1)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--weights", default=None, metavar="W1,W2,...", help="One weight per checkpoint [default: equal].")
@click.option("--format", "fmt", type=_Choice(_formats), default="safetensors",
              show_default=True, help="What to write, as unshard writes it (torch, dcp: the whole last checkpoint, "
              "its model averaged).")
@click.option("--include-optimizer", is_flag=True,
              help="With --format torch or dcp, average the optimizer's moments too (every floating sharded "
              "tensor).")
@click.option("--hf-config", type=click.Path(exists=True), default=None, metavar="PATH",
              help="For --format hf, as for unshard.")
@click.option("--select", default=None, help="The subtree to average as the model [default: detected].")
@click.option("--strip-prefix", default=None, help="Drop this prefix from output keys.")
@click.option("--dtype", type=_Choice(_dtypes, case_sensitive=False), default=None,
              help="Write the mean in this floating dtype [default: each tensor's own].")
@_jobs
@_quiet
@_json
def average(paths: tuple[str, ...], weights: str | None, fmt: str, include_optimizer: bool, hf_config: str | None,
            select: str | None, strip_prefix: str | None, dtype: str | None, jobs: int | None, quiet: bool,
            as_json: bool) -> None:
    """Average CHECKPOINTS... (two or more of one run, each a folder as unshard takes it, any format and world
    size each) into OUT, the last of PATHS: the weighted mean of every floating tensor of the model, written
    once as safetensors, a Hugging Face folder, or the last checkpoint's torch files or DCP folder with its
    model averaged (its other state, and with --include-optimizer its optimizer's moments averaged too)."""
    from .export.registry import output_format

    if len(paths) < 3:
        raise click.UsageError("give two checkpoints or more, then OUT")
    _leaves_outputs("the average")
    try:
        parsed = [float(w) for w in weights.split(",")] if weights else None
    except ValueError:
        raise click.BadParameter(f"not numbers: {weights!r}", param_hint="--weights") from None
    result = api.average(paths[:-1], paths[-1], weights=parsed, format=fmt, select=select, strip_prefix=strip_prefix,
                         dtype=dtype, hf_config=hf_config, jobs=jobs, include_optimizer=include_optimizer)
    if as_json:
        _echo_json({"files": [str(p) for p in result.files], "averaged": result.averaged, "checkpoints": len(paths) - 1,
                    "kept": result.kept, "values": result.values})
        return
    if quiet:
        return
    for path in result.files:
        click.echo(f"wrote {path}")
    if result.kept:
        why = "not averaged (not floating, or outside the model)" if not output_format(fmt).subtree else "not floating"
        click.echo(f"note: {len(result.kept)} tensor(s) {why}, taken from the last checkpoint: "
                   f"{', '.join(result.kept[:5])}{' ...' if len(result.kept) > 5 else ''}", err=True)
    if result.values:
        click.echo(f"note: {result.values} other value(s) (counters, RNG states, ...) taken from the last checkpoint",
                   err=True)
    click.echo(f"average: {result.averaged} tensors, the mean of {len(paths) - 1} checkpoints", err=True)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (" ..." if len(ranks) > 20 else "")


@main.command()
@click.argument("store", type=click.Path())
@click.argument("src", type=click.Path())
@click.option("--expect", type=click.IntRange(min=1), default=None,
              help="World size to wait for [default: what the first rank file declares].")
@click.option("--timeout", type=click.FloatRange(min=0), default=None, help="Give up after this many seconds.")
@click.option("--tag", default=None, help="Which checkpoint, when SRC receives several.")
@click.option("--poll", type=click.FloatRange(min=0.05), default=0.5, show_default=True, help="Seconds between looks.")
@_strict
@_jobs
@_quiet
@_json
def watch(store: str, src: str, expect: int | None, timeout: float | None, tag: str | None, poll: float,
          strict: bool, jobs: int | None, quiet: bool, as_json: bool) -> None:
    """Ingest rank files into STORE as they arrive in the local folder SRC; exit 0 once STORE is complete."""
    _leaves_a_store(store, f"the files ingested so far are kept in {store}: rerun to watch for the rest")
    if quiet or as_json:
        st = api.watch(store, src, expect=expect, timeout=timeout, jobs=jobs, poll=poll, tag=tag,
                       storage_options=_options(), strict=strict)
        if as_json:
            _echo_json(_store_json(st, _summary(st)[0]))
        return
    if not sys.stderr.isatty():  # a log: one plain line per rank, no bar frames
        count, total = [0], [expect]

        def line(d: Any) -> None:
            count[0] += 1
            click.echo(f"watch: rank {d.rank} ingested ({count[0]}/{total[0] or '?'}, {size_text(d.nbytes)})", err=True)

        st = api.watch(store, src, expect=expect, timeout=timeout, jobs=jobs, poll=poll, tag=tag, on_done=line,
                       on_world_size=lambda n: total.__setitem__(0, n), storage_options=_options(), strict=strict)
        click.echo(f"{store}: complete, {st.manifest.world_size} ranks")
        return
    from tqdm import tqdm

    with tqdm(total=expect, desc="watch", unit="rank", file=sys.stderr, dynamic_ncols=True) as bar:
        started, moved = time.monotonic(), [0]

        def done(d: Any) -> None:
            moved[0] += d.nbytes
            bar.set_postfix_str(f"{moved[0] / max(time.monotonic() - started, 1e-9) / 2**20:.0f} MiB/s rank {d.rank}")
            bar.update(1)

        def world(n: int) -> None:
            bar.total = n
            bar.refresh()

        st = api.watch(store, src, expect=expect, timeout=timeout, jobs=jobs, poll=poll, tag=tag,
                       on_done=done, on_world_size=world, storage_options=_options(), strict=strict)
    click.echo(f"{store}: complete, {st.manifest.world_size} ranks")


def _summary(st: Any, checkpoint: str | None = None) -> tuple[Any, list[str]]:
    """(status, the lines that describe the store and it): what `status` and `ls` start with. For a
    `checkpoint` read without ingesting it (`ls CHECKPOINT`: a scratch plan of it), its folder and the files
    it has, not ranks ingested."""
    from .read.registry import get
    from .trainers.registry import trainer

    s = st.status()
    m = st.manifest
    fmt = m.facts.format
    found = [] if checkpoint is None else [f"checkpoint: {checkpoint}"]
    if m.facts.units is not None:  # a format whose units are files the store names (not ranks)
        files = list(m.facts.units)
        missing = [files[r] for r in s.ranks_missing]
        counts: dict[str, int] = {}
        for f in files:
            kind = get(fmt).unit_kind(f)
            counts[kind] = counts.get(kind, 0) + 1
        described = " + ".join(f"{n} {kind}" for kind, n in counts.items())
        replicas = m.facts.replicas
        return s, found + [f"format: {fmt} ({described})", f"layout: {trainer(m.layout).title}"]\
            + ([f"hybrid sharding: {replicas} replica groups"] if replicas > 1 else []) \
            + [f"files{' ingested' if checkpoint is None else ''}: {len(s.ranks_done)}/{len(files)}"
               + (f"; missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}" if missing else "")]
    replicas = m.facts.replicas
    return s, found + [f"format: {get(fmt).title} rank files", f"layout: {trainer(m.layout).title}",
                       f"world size: {m.world_size}" + (f" ({replicas} replica groups of {m.facts.group_size})"
                                                        if replicas > 1 else ""),
                       f"{'ranks ingested' if checkpoint is None else 'rank files'}: {len(s.ranks_done)}/{m.world_size}"
                       + (f"; missing: {_ranks(s.ranks_missing)}" if s.ranks_missing else "")]


def _store_json(st: Any, s: Any, checkpoint: str | None = None) -> dict[str, Any]:
    """What `status --json` and `ls --json` say of a store as a whole; of a `checkpoint` read without
    ingesting it, what its plan says (no store, nothing ingested)."""
    m = st.manifest
    facts = {"format": m.facts.format, "layout": m.layout, "world_size": m.world_size,
             "replica_groups": m.facts.replicas, "units": list(m.facts.units) if m.facts.units is not None else None}
    if checkpoint is not None:
        return {"checkpoint": checkpoint, **facts, "ranks_missing": sorted(s.ranks_missing), "tensors": len(m.arrays)}
    return {"store": str(st.location), **facts,
            "ranks_ingested": sorted(s.ranks_done), "ranks_missing": sorted(s.ranks_missing),
            "tensors": len(m.arrays), "tensors_complete": len(s.complete),
            "tensors_partial": {path: round(frac, 6) for path, frac in s.partial.items()}, "ready": s.ok}


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, default=str))


@main.command()
@click.argument("store", type=click.Path())
@_json
def status(store: str, as_json: bool) -> None:
    """What STORE holds and lacks; exit status 0 only when it is complete enough to export."""
    st = api.open(store, _options())
    s, lines = _summary(st)
    if as_json:
        _echo_json(_store_json(st, s))
        sys.exit(0 if s.ok else 1)
    click.echo("\n".join(lines))
    click.echo(f"tensors complete: {len(s.complete)}/{len(st.manifest.arrays)}")
    for path, frac in list(s.partial.items())[:20]:
        click.echo(f"  partial: {path} ({frac:.0%})")
    if len(s.partial) > 20:
        click.echo(f"  ... and {len(s.partial) - 20} more")
    click.echo("ready to export" if s.ok else "not ready to export")
    sys.exit(0 if s.ok else 1)


_which = [click.option("--tag", default=None, help="Given a folder of several checkpoints: which one, as for unshard."),
          click.option("--step", type=int, default=None, help="Given a folder of several checkpoints: which one, by "
                                                              "step, as for unshard [default: the newest].")]


def _which_checkpoint(f: Any) -> Any:
    for opt in reversed(_which):
        f = opt(f)
    return f


@main.command()
@click.argument("location", metavar="STORE|CHECKPOINT", type=click.Path())
@click.argument("key")
@click.option("--slice", "selection", default=None, help='Numpy-style selection, e.g. "0:4,:" or "-1" or "..., 0:8".')
@click.option("--stats", "with_stats", is_flag=True, help="min/max/mean/std, NaN/Inf counts and L2 norm.")
@_which_checkpoint
@_json
def show(location: str, key: str, selection: str | None, with_stats: bool, tag: str | None, step: int | None,
         as_json: bool) -> None:
    """Show one tensor (or value) of STORE, reading only the chunks it needs; or of a CHECKPOINT (anything
    unshard takes), reading only that tensor's pieces into a scratch store removed afterwards."""
    from .inspect import inspect

    sel = parse_selection(selection) if selection else None
    with inspect(location, key, sel, tag, step, _options()) as seen:
        _show(seen.store, seen.checkpoint or location, key, sel, selection, with_stats, as_json)


def _show(st: Any, where: str, key: str, sel: tuple[Any, ...] | None, selection: str | None, with_stats: bool,
          as_json: bool) -> None:
    """`show`'s answer, from a store holding `key` (the user's, or a checkpoint's scratch store), which
    errors call `where`."""
    if key not in st.manifest.arrays:
        if with_stats or selection:
            raise StoreError(f"{where}: {key} is a value, not a tensor: --stats and --slice apply to tensors")
        by_rank = st.values(key)
        if not by_rank:
            raise StoreError(f"{where}: {key}: no rank holding it has been ingested yet")
        if as_json:
            _echo_json({"key": key, "kind": "value", "by_rank": {str(r): repr(v) for r, v in by_rank.items()}})
            return
        if len({repr(v) for v in by_rank.values()}) <= 1:
            click.echo(f"{key}: {next(iter(by_rank.values()))!r}")
        else:
            for rank, value in by_rank.items():
                click.echo(f"{key} [rank {rank}]: {value!r}")
        return
    h = st[key]
    first_rows = sel is None and not with_stats and h.nbytes > 64 << 10
    if first_rows:
        sel = (slice(0, min(4, h.entry.shape[0])),)
    h.check(... if sel is None else sel)  # before printing anything: an error is then the only line
    status = st.status()
    if as_json:
        out: dict[str, Any] = {"key": key, "kind": "tensor", "dtype": h.entry.dtype, "shape": list(h.entry.shape),
                               "complete": round(status.partial.get(key, 1.0), 6), "ranks": h.ranks,
                               "selection": selection}
        if with_stats:
            out["stats"] = h.stats(sel)
        else:
            out["values"] = h.numpy(... if sel is None else sel).tolist()
        _echo_json(out)
        return
    where = "complete" if key not in status.partial else f"{status.partial[key]:.0%} present"
    click.echo(f"{key}: torch.{h.entry.dtype} {list(h.entry.shape)}, {where}, from ranks {_ranks(h.ranks)}")
    if with_stats:
        for name, value in h.stats(sel).items():
            click.echo(f"  {name:<6} {value:.6g}" if isinstance(value, float) else f"  {name:<6} {value}")
        return
    if first_rows:
        click.echo(f"(first {min(4, h.entry.shape[0])} rows; use --slice for others)")
    # numpy, not torch, so the answer comes in well under a second (importing torch alone takes longer)
    values_ = h.numpy(... if sel is None else sel)
    click.echo(np.array2string(values_, precision=6, threshold=1000, edgeitems=4, max_line_width=120))


def parse_selection(text: str) -> tuple[Any, ...]:
    """ "0:4,:" -> (slice(0, 4), slice(None)); "-1" -> (-1,); "..." -> (Ellipsis,)."""
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if part == "...":
                out.append(Ellipsis)
            elif ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3:
                    raise ValueError
                out.append(slice(*bits))
            else:
                out.append(int(part))
        except ValueError:
            raise click.BadParameter(f"not a selection: {text!r} (try \"0:4,:\")", param_hint="--slice") from None
    return tuple(out)


@main.command(name="ls")
@click.argument("location", metavar="STORE|CHECKPOINT", type=click.Path())
@click.argument("pattern", required=False)
@_which_checkpoint
@_json
def ls(location: str, pattern: str | None, tag: str | None, step: int | None, as_json: bool) -> None:
    """List STORE: layout, ranks, and every key with its shape, dtype and completeness; or a CHECKPOINT
    (anything unshard takes), planned without ingesting it (its values are read, no tensor). With PATTERN
    (a glob: 'model/*attn*', or a plain part of the key: 'blocks.3.'), only the keys it matches."""
    from .inspect import inspect

    with inspect(location, tag=tag, step=step, storage_options=_options()) as seen:
        _ls(seen.store, seen.checkpoint, pattern, as_json)


def _ls(st: Any, checkpoint: str | None, pattern: str | None, as_json: bool) -> None:
    """`ls`'s answer; of a `checkpoint` (a scratch plan of it), no completeness: nothing was ingested."""
    from .patterns import matcher

    status, lines = _summary(st, checkpoint)
    m = st.manifest
    keys = st.keys()
    if pattern:
        glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
        matches = matcher(glob, "PATTERN")
        keys = [k for k in keys if matches(k)]
        if not keys:
            raise StoreError(f"{checkpoint or st.location}: no key matches {pattern!r}")
    if as_json:
        _echo_json({**_store_json(st, status, checkpoint), "keys": [_key_json(st, status, key, checkpoint is None)
                                                                    for key in keys]})
        return
    click.echo("   ".join(lines))
    width = max((len(k) for k in keys), default=0)
    for key in keys:
        entry = m.arrays.get(key)
        if entry is not None:
            done = "" if checkpoint is not None else "complete" if key not in status.partial \
                else f"{status.partial[key]:.0%}"
            click.echo(f"{key:<{width}}  {entry.dtype:<13} {str(list(entry.shape)):<18} {done}".rstrip())
        else:
            ranks = st.object_values(key)
            if not ranks:
                click.echo(f"{key:<{width}}  {'value':<13} {'(no rank holding it ingested yet)'}")
                continue
            same = len({json.dumps(v, sort_keys=True) for v in ranks.values()}) <= 1
            shown = values.preview(ranks[min(ranks)])
            click.echo(f"{key:<{width}}  {'value':<13} {shown}"
                       + ("" if same else f"  (rank {min(ranks)}; differs per rank)"))


def _key_json(st: Any, status: Any, key: str, stored: bool = True) -> dict[str, Any]:
    """One key of `ls --json`; a tensor's completeness only where it is `stored` (not a checkpoint's plan)."""
    entry = st.manifest.arrays.get(key)
    if entry is not None:
        return {"key": key, "kind": "tensor", "dtype": entry.dtype, "shape": list(entry.shape)} \
            | ({"complete": round(status.partial.get(key, 1.0), 6)} if stored else {})
    ranks = st.object_values(key)
    return {"key": key, "kind": "value", "preview": values.preview(ranks[min(ranks)]) if ranks else None,
            "same_on_every_rank": len({json.dumps(v, sort_keys=True) for v in ranks.values()}) <= 1}


if __name__ == "__main__":
    main()
