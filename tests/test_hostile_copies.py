"""Damaged and forged copies of every trainer's genuine folder (tests/fixtures/data/, tests/corpus/data/),
unsharded through the real command line (its `--dry-run` twin too: tests/refusals.py).

Each case copies a genuine folder into tmp_path and changes it in one generic, deterministic way: a unit
file truncated (to half, to its length minus one byte) or emptied, a file replaced by the same-named file
of another save of the run, a required file removed, a side file (JSON, a pointer's text) replaced by what
its writer never writes, a pointer made a link that leads out of the run, nowhere or into a loop, a file
made a directory, a save's folder renamed to another step. Whatever was changed, the outcome is one of two:
- exit 0 and the very output of the genuine folder (every tensor bit for bit): what was changed is not
  read, or is read the same way;
- exit 1, exactly one `shardstore: error:` line naming a file of the copy, no traceback, and nothing in
  OUT that looks finished.
Some cases have only the second (REFUSE): a folder reached through a link out of the run (the user can name
its target), a save whose recorded step is not its name's. What docs/commands.md says content cannot
tell apart (a DCP `.distcp` of another save with the same layout) is held to "no traceback, no output
of another kind": it may export.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_bitwise_equal
from tests.refusals import assert_refused, cli

FIXTURES = Path(__file__).parent / "fixtures" / "data"
CORPUS = Path(__file__).parent / "corpus" / "data"


@dataclass(frozen=True)
class Folder:
    """A genuine run folder: `root` is copied whole, `src` (inside it) is what the user names."""
    root: Path
    src: str = "."
    torch: bool = True  # the trainer has a resumable torch form (`--format torch`)


FOLDERS = {
    "torchtitan": Folder(FIXTURES / "torchtitan" / "tt-w4-tp2", "checkpoint"),
    "lightning": Folder(FIXTURES / "lightning" / "trainer-w3", "checkpoints"),
    "megatron-dist": Folder(FIXTURES / "megatron" / "core0.19.2" / "tp2-pp1"),
    "megatron-torch": Folder(FIXTURES / "megatron" / "core0.19.2" / "tp2-pp1-legacy"),
    "megatron-torch-ep": Folder(FIXTURES / "megatron" / "core0.19.2" / "tp2-pp2-dp2-legacy-qwen2moe-optim"),
    "megatron-dist-ep": Folder(FIXTURES / "megatron" / "core0.19.2" / "tp1-pp1-dp2-dsv3"),
    "megatron-fsdp": Folder(FIXTURES / "megatron" / "fsdp_dtensor" / "fsdp-dp2-qwen2moe"),
    "deepspeed-z2": Folder(FIXTURES / "deepspeed" / "z2-w3"),
    "deepspeed-z3": Folder(FIXTURES / "deepspeed" / "z3-w3"),
    "accelerate": Folder(FIXTURES / "accelerate" / "fsdp2-w2"),
    "accelerate-bin": Folder(FIXTURES / "accelerate" / "fsdp2-w3-bin"),
    "fsdp2-tp": Folder(FIXTURES / "fsdp2-tp" / "t2.6"),
    "olmo-core": Folder(FIXTURES / "olmo-core-trainer"),
    "verl": Folder(FIXTURES / "verl" / "t2.6" / "fsdp2-w4"),
    "olmo-local": Folder(CORPUS / "olmo-local-t2.0-w2"),
    "composer": Folder(CORPUS / "composer-t2.13-hsdp-w4"),
}

# What an export holds: the files whose tensors are compared. Side files it copies (a tokenizer, the
# trainer's config) are the input's own bytes, whatever they say.
PAYLOAD = (".safetensors", ".safetensors.index.json", ".pt", ".bin", ".pth", ".ckpt")


# ------------------------------------------------------------------------------------------- mutations
Mutation = Callable[[Path, Path], None]  # (the copy's root, a scratch folder outside it)


def truncate(rel: str, keep: Callable[[int], int]) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        path = root / rel
        data = path.read_bytes()
        path.write_bytes(data[:keep(len(data))])
    return change


def half(rel: str) -> Mutation:
    return truncate(rel, lambda n: n // 2)


def minus1(rel: str) -> Mutation:
    return truncate(rel, lambda n: n - 1)


def empty(rel: str) -> Mutation:
    return truncate(rel, lambda n: 0)


def remove(rel: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        path = root / rel
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return change


def text(rel: str, content: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        path = root / rel
        path.unlink()
        path.write_text(content, encoding="utf-8")
    return change


def swap(rel: str, other: str) -> Mutation:
    """`rel` replaced by the same-named file of another save of the run (`other`, in the copy too)."""
    def change(root: Path, outside: Path) -> None:
        shutil.copyfile(root / other, root / rel)
    return change


def as_dir(rel: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        (root / rel).unlink()
        (root / rel).mkdir()
        (root / rel / "x").write_bytes(b"\0" * 16)
    return change


def link_out(rel: str) -> Mutation:
    """`rel` a link to a copy of what it was (or led to), outside the run: another run's checkpoint as the
    same bytes, so only where it leads can tell."""
    def change(root: Path, outside: Path) -> None:
        path = root / rel
        target = outside / "other-run" / path.name
        target.parent.mkdir(parents=True)
        real = path.resolve()
        shutil.copytree(real, target) if real.is_dir() else shutil.copyfile(real, target)
        remove(rel)(root, outside)
        path.symlink_to(target)
    return change


def link_nowhere(rel: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        remove(rel)(root, outside)
        (root / rel).symlink_to(root / "no-such-thing")
    return change


def link_loop(rel: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        path = root / rel
        remove(rel)(root, outside)
        path.symlink_to(path.with_name(path.name + ".loop"))
        path.with_name(path.name + ".loop").symlink_to(path)
    return change


def rename(rel: str, new: str) -> Mutation:
    def change(root: Path, outside: Path) -> None:
        (root / rel).rename(root / new)
    return change


def renamed_step(rel: str, new: str, pointer: str | None = None, says: str = "") -> Mutation:
    """The save's folder (and each file named by it) renamed to another step, the run's pointer following
    it: what the save records of its step no longer agrees with its name."""
    def change(root: Path, outside: Path) -> None:
        old, path = Path(rel).name, root / new
        (root / rel).rename(path)
        for f in sorted(path.glob(f"{old}-*")):
            f.rename(f.with_name(Path(new).name + f.name[len(old):]))
        if pointer and (root / pointer).is_symlink():
            (root / pointer).unlink()
            (root / pointer).symlink_to(Path(new).name)
        elif pointer:
            (root / pointer).write_text(says)
    return change


def json_cases(rel: str, where: str, *kinds: str) -> list[tuple[str, Mutation]]:
    """A JSON side file replaced by what no writer writes (the `kinds` named, default all): not JSON, the
    wrong type, a number too large for anything, non-ASCII digits, `where` (a key) holding a list."""
    every = {"invalid": '{"global_step": 4,', "list": "[1, 2]", "number": "7",
             "huge": json.dumps({where: 10**400}), "arabic": '{"%s": "\u0669"}' % where,
             "key-list": json.dumps({where: [4]})}
    return [(f"{rel}:{kind}", text(rel, every[kind])) for kind in kinds or every]


def pointer_cases(rel: str, step: str, *kinds: str) -> list[tuple[str, Mutation]]:
    """A plain-text pointer (DeepSpeed's `latest`, Megatron's latest_checkpointed_iteration.txt) holding
    what its writer never writes (the `kinds` named, default all): non-ASCII digits, a huge number, JSON,
    nothing, a way out of the run; or made a link out of the run, to nowhere, into a loop."""
    every = {"arabic": text(rel, step + "\u0669"), "huge": text(rel, step + "9" * 40), "json": text(rel, "[10]"),
             "empty": text(rel, ""), "dotdot": text(rel, "../../.."), "link-out-file": link_out(rel),
             "link-nowhere": link_nowhere(rel), "link-loop": link_loop(rel)}
    return [(f"{rel}:{kind}", every[kind]) for kind in kinds or every]


def damaged(*rels: str) -> list[tuple[str, Mutation]]:
    """Each unit file damaged one way: truncated to half, to its length minus one byte, emptied (cycling
    through the ways so that every file and every way is covered without their product)."""
    ways = [("half", half), ("minus1", minus1), ("empty", empty)]
    return [(f"{rel}:{ways[i % 3][0]}", ways[i % 3][1](rel)) for i, rel in enumerate(rels)]


# Mutations whose only right outcome is a refusal: a folder reached through a link out of the run. (A unit
# of another save is refused unless what is read of it is this save's own: the same export.)
REFUSE = ("link-out", "renamed-step")

TT = "checkpoint/step-4"
LIGHTNING = "checkpoints/epoch=1-step=4.ckpt"
MEG = "iter_0000010"
DS2, DS3 = "global_step2", "global_step2"
ACC = "checkpoint-4"
VERL = "global_step_7/actor"

CASES: dict[str, list[tuple[str, Mutation]]] = {
    "torchtitan": [
        *damaged(f"{TT}/__0_0.distcp", f"{TT}/__1_0.distcp", f"{TT}/.metadata"),
        (f"{TT}/.metadata:removed", remove(f"{TT}/.metadata")),
        (f"{TT}/__3_0.distcp:removed", remove(f"{TT}/__3_0.distcp")),
        (f"{TT}/.metadata:swap", swap(f"{TT}/.metadata", "checkpoint/step-2/.metadata")),
        (f"{TT}/__0_0.distcp:swap", swap(f"{TT}/__0_0.distcp", "checkpoint/step-2/__0_0.distcp")),  # train_state
        (f"{TT}/__1_0.distcp:swap-undetectable", swap(f"{TT}/__1_0.distcp", "checkpoint/step-2/__1_0.distcp")),
        (f"{TT}:link-out", link_out(TT)),
        (f"{TT}:link-nowhere", link_nowhere(TT)),
        (f"{TT}/.metadata:dir", as_dir(f"{TT}/.metadata")),
        (f"{TT}:renamed-step", renamed_step(TT, "checkpoint/step-6")),
        ("checkpoint/step-2:renamed-arabic-9", rename("checkpoint/step-2", "checkpoint/step-\u0669")),
    ],
    "lightning": [
        *damaged(f"{LIGHTNING}/__0_0.distcp", f"{LIGHTNING}/meta.pt"),
        (f"{LIGHTNING}/meta.pt:removed", remove(f"{LIGHTNING}/meta.pt")),
        (f"{LIGHTNING}/.metadata:removed", remove(f"{LIGHTNING}/.metadata")),
        ("checkpoints/last.ckpt:link-out", link_out("checkpoints/last.ckpt")),
        (f"{LIGHTNING}:renamed-step", renamed_step(LIGHTNING, "checkpoints/epoch=1-step=5.ckpt", "checkpoints/last.ckpt")),
        ("checkpoints/last.ckpt:link-nowhere", link_nowhere("checkpoints/last.ckpt")),
        ("checkpoints/last.ckpt:link-loop", link_loop("checkpoints/last.ckpt")),
        (f"{LIGHTNING}/meta.pt:dir", as_dir(f"{LIGHTNING}/meta.pt")),
    ],
    "megatron-dist": [
        *damaged(f"{MEG}/__0_0.distcp", f"{MEG}/.metadata"),
        (f"{MEG}/metadata.json:removed", remove(f"{MEG}/metadata.json")),
        *json_cases(f"{MEG}/metadata.json", "sharded_backend", "invalid", "list", "huge", "key-list"),
        *pointer_cases("latest_checkpointed_iteration.txt", "", "arabic", "huge", "link-out-file", "link-loop"),
        (f"{MEG}:link-out", link_out(MEG)),
        (f"{MEG}:renamed-step", renamed_step(MEG, "iter_0000020", "latest_checkpointed_iteration.txt", "20")),
        ("latest_checkpointed_iteration.txt:missing-step", text("latest_checkpointed_iteration.txt", "20")),
        (f"{MEG}/metadata.json:dir", as_dir(f"{MEG}/metadata.json")),
    ],
    "megatron-torch": [
        *damaged(f"{MEG}/mp_rank_01/model_optim_rng.pt", f"{MEG}/mp_rank_00/model_optim_rng.pt"),
        (f"{MEG}/mp_rank_01/model_optim_rng.pt:removed", remove(f"{MEG}/mp_rank_01/model_optim_rng.pt")),
        (f"{MEG}/mp_rank_01/model_optim_rng.pt:dir", as_dir(f"{MEG}/mp_rank_01/model_optim_rng.pt")),
        *pointer_cases("latest_checkpointed_iteration.txt", "1", "arabic", "link-nowhere"),
        (f"{MEG}:renamed-step", renamed_step(MEG, "iter_0000020", "latest_checkpointed_iteration.txt", "20")),
    ],
    "megatron-torch-ep": [  # EP 2 x TP 2 x PP 2: mp_rank_TT_PPP_EEE
        *damaged(f"{MEG}/mp_rank_01_001_001/model_optim_rng.pt", f"{MEG}/mp_rank_00_000_001/distrib_optim.pt"),
        (f"{MEG}/mp_rank_00_001_001:removed", remove(f"{MEG}/mp_rank_00_001_001")),
        (f"{MEG}/mp_rank_01_000_001/model_optim_rng.pt:removed", remove(f"{MEG}/mp_rank_01_000_001/model_optim_rng.pt")),
        (f"{MEG}/mp_rank_00_000_001:renamed-ep", rename(f"{MEG}/mp_rank_00_000_001", f"{MEG}/mp_rank_00_000_002")),
    ],
    "megatron-dist-ep": [  # DeepSeek-V3's blocks at EP 2: every expert in the other rank's file
        *damaged(f"{MEG}/__1_0.distcp", f"{MEG}/.metadata"),
        (f"{MEG}/__1_0.distcp:removed", remove(f"{MEG}/__1_0.distcp")),
        (f"{MEG}/metadata.json:removed", remove(f"{MEG}/metadata.json")),
    ],
    "megatron-fsdp": [  # Megatron-FSDP's fsdp_dtensor: no metadata.json, the args in the .distcp files
        *damaged(f"{MEG}/__0_0.distcp", f"{MEG}/__1_0.distcp", f"{MEG}/.metadata"),
        (f"{MEG}/__1_0.distcp:removed", remove(f"{MEG}/__1_0.distcp")),
        *pointer_cases("latest_checkpointed_iteration.txt", "", "arabic", "huge", "link-out-file"),
        (f"{MEG}:renamed-step", renamed_step(MEG, "iter_0000020", "latest_checkpointed_iteration.txt", "20")),
    ],
    "deepspeed-z2": [
        *damaged(f"{DS2}/zero_pp_rank_1_mp_rank_00_optim_states.pt", f"{DS2}/mp_rank_00_model_states.pt"),
        (f"{DS2}/mp_rank_00_model_states.pt:removed", remove(f"{DS2}/mp_rank_00_model_states.pt")),
        (f"{DS2}/zero_pp_rank_2_mp_rank_00_optim_states.pt:removed",
         remove(f"{DS2}/zero_pp_rank_2_mp_rank_00_optim_states.pt")),
        *pointer_cases("latest", "global_step", "arabic", "huge", "dotdot", "link-out-file", "link-nowhere",
                       "link-loop"),
        (f"{DS2}:link-out", link_out(DS2)),
        (f"{DS2}:renamed-step", renamed_step(DS2, "global_step3", "latest", "global_step3")),
        ("latest:missing-step", text("latest", "global_step3")),
        *json_cases("config.json", "model_type", "invalid", "list"),
    ],
    "deepspeed-z3": [
        *damaged(f"{DS3}/zero_pp_rank_1_mp_rank_00_model_states.pt", f"{DS3}/zero_pp_rank_2_mp_rank_00_optim_states.pt"),
        (f"{DS3}/zero_pp_rank_2_mp_rank_00_model_states.pt:removed",
         remove(f"{DS3}/zero_pp_rank_2_mp_rank_00_model_states.pt")),
        (f"{DS3}/zero_pp_rank_1_mp_rank_00_optim_states.pt:swap",
         swap(f"{DS3}/zero_pp_rank_1_mp_rank_00_optim_states.pt", f"{DS3}/zero_pp_rank_0_mp_rank_00_optim_states.pt")),
    ],
    "accelerate": [
        *damaged(f"{ACC}/pytorch_model_fsdp_0/__0_0.distcp", f"{ACC}/optimizer_0/__1_0.distcp"),
        (f"{ACC}/pytorch_model_fsdp_0/.metadata:removed", remove(f"{ACC}/pytorch_model_fsdp_0/.metadata")),
        (f"{ACC}/optimizer_0/.metadata:removed", remove(f"{ACC}/optimizer_0/.metadata")),
        (f"{ACC}/optimizer_0:removed", remove(f"{ACC}/optimizer_0")),  # scheduler.pt is saved after it
        (f"{ACC}/scheduler.pt:empty", empty(f"{ACC}/scheduler.pt")),  # side files kept byte for byte
        (f"{ACC}/training_args.bin:minus1", minus1(f"{ACC}/training_args.bin")),
        (f"{ACC}/rng_state_0.pth:removed", remove(f"{ACC}/rng_state_0.pth")),
        (f"{ACC}/trainer_state.json:removed", remove(f"{ACC}/trainer_state.json")),
        *json_cases(f"{ACC}/trainer_state.json", "global_step", "invalid", "number", "huge", "arabic"),
        (f"{ACC}:link-out", link_out(ACC)),
        (f"{ACC}:renamed-step", renamed_step(ACC, "checkpoint-5")),
        (f"{ACC}/trainer_state.json:dir", as_dir(f"{ACC}/trainer_state.json")),
    ],
    "accelerate-bin": [
        *damaged(f"{ACC}/pytorch_model_fsdp_0_rank1.bin", f"{ACC}/scheduler.bin"),
        (f"{ACC}/optimizer_0_rank2.bin:removed", remove(f"{ACC}/optimizer_0_rank2.bin")),
        (f"{ACC}/random_states_0.pkl:removed", remove(f"{ACC}/random_states_0.pkl")),
    ],
    "fsdp2-tp": [
        *damaged("model_rank1.pt", "model_rank3.pt", "model_rank0.pt"),
        ("model_rank2.pt:removed", remove("model_rank2.pt")),
        ("model_rank1.pt:dir", as_dir("model_rank1.pt")),
    ],
    "olmo-core": [
        *damaged("step1/model_and_optim/__0_0.distcp", "step1/train/rank1.pt"),
        ("step1/model_and_optim/.metadata:removed", remove("step1/model_and_optim/.metadata")),
        ("step1/train/rank0.pt:removed", remove("step1/train/rank0.pt")),
        *json_cases("step1/config.json", "model", "invalid", "list"),
        *json_cases("step1/.metadata.json", "version", "number"),
        ("step1:link-out", link_out("step1")),
        ("step1:renamed-step", renamed_step("step1", "step2")),
    ],
    "verl": [
        *damaged(f"{VERL}/model_world_size_4_rank_1.pt", f"{VERL}/optim_world_size_4_rank_2.pt",
                 f"{VERL}/extra_state_world_size_4_rank_0.pt"),
        (f"{VERL}/model_world_size_4_rank_3.pt:removed", remove(f"{VERL}/model_world_size_4_rank_3.pt")),
        *pointer_cases("latest_checkpointed_iteration.txt", "", "arabic", "json", "link-out-file"),
        *json_cases(f"{VERL}/fsdp_config.json", "world_size", "invalid"),
        *json_cases(f"{VERL}/huggingface/config.json", "model_type", "list"),
        ("global_step_7:link-out", link_out("global_step_7")),
    ],
    "olmo-local": [
        *damaged("model/rank1.pt", "optim/rank0.pt", "train/rank1.pt"),
        ("train/rank0.pt:removed", remove("train/rank0.pt")),
        ("model/rank1.pt:swap", swap("model/rank1.pt", "model/rank0.pt")),
        ("metadata.yaml:invalid", text("metadata.yaml", "{[: 4")),
    ],
    "composer": [
        *damaged("ep0-ba1/ep0-ba1-rank2.pt", "ep0-ba1/ep0-ba1-rank0.pt"),
        ("ep0-ba1/ep0-ba1-rank3.pt:removed", remove("ep0-ba1/ep0-ba1-rank3.pt")),
        ("ep0-ba1:link-out", link_out("ep0-ba1")),
        ("ep0-ba1:renamed-step", renamed_step("ep0-ba1", "ep0-ba2")),
    ],
}

# A damaged or missing unit runs as `--format torch` where the trainer has one (it reads every unit, the
# optimizer's and the trainer state's too); a side file, a pointer or a link as safetensors (which save
# and which files are taken does not depend on the format). These run both ways: what each format takes
# differs there.
BOTH = {f"{ACC}/pytorch_model_fsdp_0/.metadata:removed", f"{ACC}/trainer_state.json:removed",
        f"{LIGHTNING}/meta.pt:removed", f"{MEG}/metadata.json:removed"}
UNIT_DAMAGE = (":half", ":minus1", ":empty", ":removed", ":dir", ":swap", ":swap-undetectable")


# Cases whose right export is another save's: torchtitan takes the newest step folder holding a `.metadata`
# (CheckpointManager._find_load_step), so a step-4 without one, or a link to nowhere, gives step-2.
OTHER_SAVE = {f"{TT}/.metadata:{way}": ("--step", "2") for way in ("removed", "dir")} | {
    f"{TT}:link-nowhere": ("--step", "2")}

def _formats(folder: str, case: str) -> list[str]:
    torch_too = FOLDERS[folder].torch
    if case in BOTH and torch_too:
        return ["safetensors", "torch"]
    return ["torch"] if torch_too and case.endswith(UNIT_DAMAGE) else ["safetensors"]


def _params() -> list[Any]:
    params = []
    for folder, cases in CASES.items():
        for name, _ in cases:
            for fmt in _formats(folder, name):
                params.append(pytest.param(folder, name, fmt, id=f"{folder}:{name}:{fmt}"))
    return params


# ------------------------------------------------------------------------------------------- outcomes
def _copy(folder: str, dest: Path) -> Path:
    shutil.copytree(FOLDERS[folder].root, dest, symlinks=True)
    return dest


def _payload(out: Path) -> dict[str, Any]:
    """The export's files holding tensors, loaded (safetensors as its tensors, torch files whole)."""
    got: dict[str, Any] = {}
    for path in sorted(out.rglob("*")):
        name = str(path.relative_to(out))
        if name.startswith(".shardstore") or not path.is_file() or not path.name.endswith(PAYLOAD):
            continue
        if path.name.endswith(".safetensors"):
            got[name] = load_file(path)
        elif path.name.endswith(".json"):
            got[name] = json.loads(path.read_text())
        else:  # an export of the tests' own fixtures: trusted
            got[name] = _plain(torch.load(path, weights_only=False))
    return got


def _plain(obj: Any) -> Any:
    """`obj` with every pickled object of a class (a trainer's data-loader state, argparse's Namespace) as a
    dict of its class and attributes, so that two loads of the same bytes compare equal."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        return {"__class__": type(obj).__qualname__, **_plain(vars(obj))}
    return obj


def _finished(out: Path) -> list[str]:
    """What a refused run left in OUT that is not its resumable scratch."""
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".shardstore")) if out.exists() else []


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict[str, Any]]:
    """genuine(folder, format, *args) -> the export of the untouched folder (a copy, as the cases are), loaded."""
    made: dict[tuple[str, ...], dict[str, Any]] = {}

    def get(folder: str, fmt: str, *args: str) -> dict[str, Any]:
        key = (folder, fmt, *args)
        if key not in made:
            base = tmp_path_factory.mktemp(f"genuine-{folder}-{fmt}")
            root = _copy(folder, base / "run")
            proc = cli("unshard", root / FOLDERS[folder].src, base / "out", "--format", fmt, *args, "-j", "1", "-q")
            assert proc.returncode == 0, proc.stderr[-2000:]
            made[key] = _payload(base / "out")
            assert made[key], f"{folder}: the genuine export holds no tensors"
        return made[key]

    return get


@pytest.mark.parametrize("folder, case, fmt", _params())
def test_a_damaged_or_forged_copy_exports_the_same_or_is_refused_in_one_line(
        folder: str, case: str, fmt: str, genuine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    want = genuine(folder, fmt, *OTHER_SAVE.get(case, ()))
    root = _copy(folder, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    dict(CASES[folder])[case](root, outside)
    out = tmp_path / "out"
    proc = cli("unshard", root / FOLDERS[folder].src, out, "--format", fmt, "-j", "1", "-q")
    assert "Traceback" not in proc.stderr and "Traceback" not in (proc.dry.stderr if proc.dry else ""), \
        proc.stderr[-3000:] + (proc.dry.stderr[-3000:] if proc.dry else "")
    must_refuse = any(case.endswith(f":{word}") for word in REFUSE)
    if proc.returncode == 0 and case.endswith(":swap-undetectable"):
        assert set(_payload(out)) == set(want)
        return
    if proc.returncode == 0 and not must_refuse:
        assert_bitwise_equal(_payload(out), want, case)
        return
    line = assert_refused(proc)
    assert str(root) in line or str(outside) in line, f"the line names no file of the copy: {line}"
    assert not _finished(out), f"a refused run left {_finished(out)} in {out}"
