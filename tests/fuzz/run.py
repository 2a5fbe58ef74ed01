"""Build the fuzz harness for the C scanner and skimmer (fuzz_pickle_scan.c) and run it.

    python -m tests.fuzz.run [SECONDS] [--libfuzzer]

Without `--libfuzzer`, gcc builds the harness's own driver with AddressSanitizer and UBSan, and it runs
every seed, then random mutations of them, for SECONDS (the test suite runs it briefly on every CI run).
With `--libfuzzer`, clang builds it for libFuzzer (coverage-guided; `apt-get install clang`), to run by
hand for as long as you like: its findings land in tests/fuzz/findings/.

The seeds are the pickles of the corpus's real rank files (tests/corpus/data), which hold the shard lists
the skimmer cuts, and a few pickles that once found bugs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).parent
CORPUS = HERE.parent / "corpus" / "data"
# Pickles that once found a bug: a memo PUT first (memcpy of 0 bytes to NULL), a list memoised after its items.
KNOWN = [b"q\x00.", b"\x80\x02]q\x00(K\x01e.", b"\x80\x02}X\x0f\x00\x00\x00shards_metadata](K\x01K\x02eq\x01h\x01s."]
# An embedded Python's own allocations are not the harness's business: ASan sees them (PYTHONMALLOC=malloc)
# for bounds, and the harness counts the extension's own buffers itself.
ENV = {"PYTHONMALLOC": "malloc", "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def seeds(folder: Path) -> list[Path]:
    """Write every seed into `folder`; the pickles of the corpus's rank files, then the known ones."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, data in enumerate(KNOWN):
        out.append(folder / f"known-{i}")
        out[-1].write_bytes(data)
    for f in sorted(CORPUS.rglob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                name = next(n for n in z.namelist() if n.endswith("data.pkl"))
                data = z.read(name)
        except (zipfile.BadZipFile, StopIteration):
            continue
        out.append(folder / f"{f.parent.name}-{f.stem}.pkl")
        out[-1].write_bytes(data)
    return out


def build(target: Path, libfuzzer: bool = False) -> Path:
    """Compile the harness against this Python; returns the executable."""
    include, libdir = sysconfig.get_paths()["include"], sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION")
    compiler = "clang" if libfuzzer else "gcc"
    if shutil.which(compiler) is None:
        raise SystemExit(f"{compiler} is not installed")
    sanitizers = "fuzzer,address,undefined" if libfuzzer else "address,undefined"
    cmd = [compiler, "-g", "-O1", f"-fsanitize={sanitizers}", "-fno-sanitize-recover=undefined",
           "-fno-omit-frame-pointer", f"-I{include}", str(HERE / "fuzz_pickle_scan.c"), "-o", str(target),
           f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-lpython{version}", "-lm"]
    if not libfuzzer:
        cmd.insert(1, "-DSTANDALONE")
    subprocess.run(cmd, check=True)
    return target


def run(seconds: float, workdir: Path) -> subprocess.CompletedProcess[str]:
    """The gcc-built driver over every seed and `seconds` of mutations of them."""
    exe = build(workdir / "fuzz")
    inputs = seeds(workdir / "seeds")
    return subprocess.run([str(exe), str(seconds), *map(str, inputs)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=seconds + 300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seconds", type=float, nargs="?", default=60)
    parser.add_argument("--libfuzzer", action="store_true")
    args = parser.parse_args()
    if not args.libfuzzer:
        with tempfile.TemporaryDirectory() as tmp:
            proc = run(args.seconds, Path(tmp))
        sys.stdout.write(proc.stdout + proc.stderr)
        raise SystemExit(proc.returncode)
    work = HERE / "findings"
    exe = build(Path(tempfile.mkdtemp()) / "fuzz", libfuzzer=True)
    inputs = seeds(work / "corpus")
    raise SystemExit(subprocess.run([str(exe), str(work / "corpus"), f"-max_total_time={int(args.seconds)}",
                                     f"-artifact_prefix={work}/", "-rss_limit_mb=4096"],
                                    env={**os.environ, **ENV}).returncode if inputs else 1)


if __name__ == "__main__":
    main()
