"""Wheel sets for GPU nodes without a package index (`make gpu-wheels`, `make gpu-wheels-install`).

build (a connected machine): one folder of wheels per set of envs/gpu/locks/ for CPython 3.12 on
Linux x86_64, whatever Python and platform run the build, plus SHA256SUMS over all of them.
install (the GPU node, no index): checks SHA256SUMS, installs each set with `pip --target` into a
folder of its own and writes a wrapper `bin/python` that puts that folder on PYTHONPATH in front of
the node's own python3 (the one with CUDA torch): a set sits on top of the image's packages, and the
image may have no venv/ensurepip anyway. Python reads `.pth` files only in its site directories,
never in a PYTHONPATH folder, so the wrapper also names the folders a set's `.pth` files add.

Only the standard library and the running interpreter's pip: the GPU node has nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LOCKS = Path(__file__).resolve().parent.parent / "envs" / "gpu" / "locks"

# One tag per `pip download`: pip 23, given all of them at once, skipped wheels that it finds with
# one tag per try. manylinux before `any`: soundfile's pure wheel needs a system libsndfile that
# the GPU image lacks, its manylinux wheel bundles it.
PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "linux_x86_64",
    "any",
]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]

# sglang-kernel's FA3 library (1.1 GB unpacked) and its Blackwell kernels: what NO_FA3=1 leaves
# out. SGLang then starts with --attention-backend triton --sampling-backend pytorch.
FA3_WHEEL = "sglang-kernel"
FA3_DROPPED = re.compile(r"^sgl_kernel/(flash_ops\.abi3\.so$|sm100/)")


def canonical(name: str) -> str:
    """PEP 503: pip freeze, locks and wheel file names spell one project differently."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str, source: str = "") -> dict[str, str]:
    """NAME==VERSION lines of a lock or a `pip freeze` (canonical name -> version). Comments and
    blank lines are ignored; in a freeze, so are editable installs and direct references, which no
    lock line can equal."""
    pins = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-e ") or " @ " in line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)", line)
        if not match:
            raise ValueError(f"{source}:{number}: not NAME==VERSION: {raw.strip()}")
        pins[canonical(match[1])] = match[2]
    return pins


def read_lock(path: Path) -> dict[str, str]:
    return parse_pins(path.read_text(), str(path))


# Distributions that install into one another's folders: nvidia-cutlass-dsl's libs-* wheels put
# their files (the CUDA flavour of the compiler, _cutlass_ir.cu13*.so) inside the package folder of
# nvidia-cutlass-dsl, so a set's cutlass finds only the flavours in that set. A set holding
# nvidia-cutlass-dsl without one killed SGLang 0.5.17's server at start on an H100 ("No CTK flavor
# installed"), where without cutlass it ran.
SPLIT_DISTRIBUTIONS = {
    "nvidia-cutlass-dsl": {
        "parts": ("nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core"),
        "one_of": ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13"),
    },
}


def split_members(name: str) -> tuple[str, ...]:
    """Every distribution of the split one ``name`` belongs to (just ``name`` for most)."""
    for head, group in SPLIT_DISTRIBUTIONS.items():
        members = (head, *group["parts"], *group["one_of"])
        if name in members:
            return members
    return (name,)


def subtract_base(pins: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    """What the base environment lacks: a pin leaves only when the base has the very same version
    (a different one is the reason the set carries it, e.g. SGLang's own transformers), and only
    with every part of its split distribution (SPLIT_DISTRIBUTIONS: one that stays keeps them all)."""
    stays = {name for name, version in pins.items() if base.get(name) != version}
    return {name: version for name, version in pins.items() if stays & set(split_members(name))}


def incomplete_splits(names: set[str]) -> list[str]:
    """The split distributions among ``names`` (canonical) that lack a part, one phrase each."""
    problems = []
    for head, group in SPLIT_DISTRIBUTIONS.items():
        if head not in names:
            continue
        missing = [part for part in group["parts"] if part not in names]
        if not any(flavour in names for flavour in group["one_of"]):
            missing.append(" or ".join(group["one_of"]))
        if missing:
            problems.append(f"{head} without {', '.join(missing)} (they install into its folder)")
    return problems


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = filename[: -len(".whl")].split("-")
    return canonical(parts[0]), parts[1]


def wheel_fits(filename: str) -> bool:
    """Whether a wheel installs on CPython 3.12 / Linux x86_64 (what a wheel built here from an
    sdist must show: a build on another Python may be tagged for that one)."""
    parts = filename[: -len(".whl")].split("-")
    pythons, abis, platforms = (set(p.split(".")) for p in parts[-3:])

    def python_ok(tag: str) -> bool:
        if tag in ("py3", "cp312"):
            return True
        # pyXY: pure Python from 3.Y on (interegular's py37); cpXY-abi3: the stable ABI from 3.Y on.
        match = re.fullmatch(r"(py|cp)3(\d+)", tag)
        return bool(match) and int(match[2]) <= 12 and (match[1] == "py" or "abi3" in abis)

    return (
        any(python_ok(t) for t in pythons)
        and bool(abis & {"none", "abi3", "cp312"})
        and any(p == "any" or p == "linux_x86_64" or re.fullmatch(r"manylinux\w*_x86_64", p) for p in platforms)
    )


def has_fa3(wheel: Path) -> bool:
    with zipfile.ZipFile(wheel) as archive:
        return any(FA3_DROPPED.match(name) for name in archive.namelist())


def strip_fa3(wheel: Path) -> None:
    """Repack sglang-kernel without FA3 and sm100, RECORD to match (pip checks it on install)."""
    tmp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if FA3_DROPPED.match(info.filename):
                continue
            if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):
                lines = src.read(info).decode().splitlines(keepends=True)
                kept = [line for line in lines if not FA3_DROPPED.match(line.split(",", 1)[0])]
                dst.writestr(info, "".join(kept))
                continue
            with src.open(info) as reader, dst.open(info, "w") as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)
    os.replace(tmp, wheel)


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


def fetch(requirement: str, folder: Path) -> tuple[Path | None, str]:
    """One wheel for CPython 3.12 / Linux x86_64 into folder: a published wheel, one platform tag
    per try, else one built from the sdist (connection-pool has no wheel). (path, "") or
    (None, why)."""
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".download-") as tmp:
        why = ""
        found = None
        for number, platform in enumerate(PLATFORMS):
            if found and platform == "any":
                break
            into = Path(tmp) / str(number)
            result = pip(
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                *TARGET,
                "--platform",
                platform,
                "-d",
                str(into),
                requirement,
            )
            if result.returncode != 0:
                why = why or last_line(result)
                continue
            wheels = sorted(into.glob("*.whl"))
            if len(wheels) != 1:
                return None, f"pip left {len(wheels)} wheels"
            found = found or wheels[0]
            # pip takes a pure wheel under any platform tag, and does not count manylinux_2_28 as
            # within manylinux_2_35: a pure wheel only counts when no later tag has a built one
            # (soundfile's pure wheel needs a libsndfile that the GPU image lacks).
            if not wheels[0].name.endswith("-any.whl"):
                found = wheels[0]
                break
        if not found:
            result = pip("wheel", "-q", "--no-deps", "-w", str(Path(tmp) / "built"), requirement)
            if result.returncode != 0:
                return None, f"no wheel for these tags ({why}); pip wheel from the sdist failed: {last_line(result)}"
            wheels = sorted((Path(tmp) / "built").glob("*.whl"))
            if len(wheels) != 1:
                return None, f"pip wheel left {len(wheels)} wheels"
            found = wheels[0]
        if not wheel_fits(found.name):
            return None, f"the only wheel is {found.name}, not for CPython 3.12 / Linux x86_64"
        path = folder / found.name
        os.replace(found, path)
        return path, ""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(args: argparse.Namespace) -> int:
    out = Path(args.wheels)
    base = parse_pins(Path(args.base).read_text(), args.base) if args.base else {}
    skip = re.compile(args.skip) if args.skip else None
    allowed_missing = {canonical(name) for name in args.allow_missing.split()}
    failed = []
    for leftover in out.glob(".download-*"):  # an interrupted run's
        shutil.rmtree(leftover, ignore_errors=True)
    for set_name in args.sets.split():
        pins = subtract_base(read_lock(LOCKS / f"{set_name}.lock"), base)
        folder = out / set_name
        folder.mkdir(parents=True, exist_ok=True)
        have = {wheel_name_version(p.name): p for p in folder.glob("*.whl")}
        # A wheel name starts with NAME-VERSION-: SKIP leaves a pin out before anything is fetched.
        wanted = {
            name: version
            for name, version in pins.items()
            if not (skip and skip.search(f"{name.replace('-', '_')}-{version}-"))
        }
        split = incomplete_splits(set(wanted))
        if split:
            # SKIP's doing where the lock (less BASE, which keeps these whole) had every part.
            cause = "SKIP would leave" if not incomplete_splits(set(pins)) else "its lock holds"
            for problem in split:
                print(f"{set_name}: {cause} {problem}", file=sys.stderr)
            return 1
        keep = set()
        todo = []
        for name, version in sorted(wanted.items()):
            path = have.get((name, version))
            # A kernel repacked without FA3 by an earlier run is fetched again when FA3 is wanted.
            if path and not (name == FA3_WHEEL and not args.no_fa3 and not has_fa3(path)):
                keep.add(path)
            else:
                if path:
                    path.unlink()
                todo.append(f"{name}=={version}")
        print(
            f"{set_name}: {len(wanted)} wheels ({len(pins) - len(wanted)} skipped), {len(todo)} to download", flush=True
        )
        with ThreadPoolExecutor(args.jobs) as pool:
            for requirement, (path, why) in zip(todo, pool.map(lambda r, folder=folder: fetch(r, folder), todo)):
                if path is None:
                    allowed = canonical(requirement.split("==")[0]) in allowed_missing
                    note = " (allowed missing: left out)" if allowed else ""
                    print(f"{set_name}: no wheel for {requirement}: {why}{note}", file=sys.stderr, flush=True)
                    if not allowed:
                        failed.append(f"{set_name}: {requirement}")
                elif skip and skip.search(path.name):
                    path.unlink()
                else:
                    keep.add(path)
        # What an earlier run left that the lock (or BASE, SKIP) no longer asks for.
        for path in folder.glob("*.whl"):
            if path not in keep:
                path.unlink()
        for path in keep:
            if args.no_fa3 and wheel_name_version(path.name)[0] == FA3_WHEEL and has_fa3(path):
                strip_fa3(path)
        mib = sum(p.stat().st_size for p in keep) / 2**20
        print(f"{set_name}: {len(keep)} wheels, {mib:.0f} MiB in {folder}", flush=True)
    wheels = sorted(out.glob("*/*.whl"))
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(out).as_posix()}\n" for p in wheels))
    if failed:
        print(f"gpu-wheels: no wheel for {', '.join(failed)} (see above)", file=sys.stderr)
        return 1
    print(
        f"{out}/SHA256SUMS: {len(wheels)} wheels. Copy {out} to the GPU node, there: make gpu-wheels-install WHEELS=<copy>"
    )
    return 0


def verify(out: Path) -> list[str]:
    """Problems with the wheel folder against its SHA256SUMS, one line each (none: all good)."""
    sums = out / "SHA256SUMS"
    if not sums.exists():
        return [f"{sums}: missing (written by make gpu-wheels)"]
    problems = []
    listed = set()
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        name = name.lstrip("*")
        listed.add(name)
        path = out / name
        if not path.exists():
            problems.append(f"{path}: missing")
        elif sha256(path) != digest:
            problems.append(
                f"{path}: checksum mismatch (damaged or changed since SHA256SUMS was written); copy it again"
            )
    for path in sorted(out.glob("*/*.whl")):
        if path.relative_to(out).as_posix() not in listed:
            problems.append(f"{path}: not in SHA256SUMS")
    for set_folder in sorted({path.parent for path in out.glob("*/*.whl")}):
        held = {wheel_name_version(path.name)[0] for path in set_folder.glob("*.whl")}
        problems += [f"{set_folder}: {problem}" for problem in incomplete_splits(held)]
    return problems


WRAPPER = '#!/bin/sh\nPYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}} exec {python} "$@"\n'

# What the set's .pth files add to sys.path, as Python's site module would add them for a site
# directory (their import lines run: nvidia-cutlass-dsl's inserts the folder of `cutlass`).
PTH_PATHS = (
    "import json, site, sys\n"
    "before = list(sys.path)\n"
    "site.addsitedir(sys.argv[1])\n"
    "print(json.dumps([p for p in sys.path if p not in before and p != sys.argv[1]]))\n"
)


def run_apart(argv: list[str]) -> subprocess.CompletedProcess:
    """A Python command without the caller's PYTHONPATH, from an empty folder: what it imports
    comes from the path it is given (a wrapper's, a site folder's), not from the caller or the cwd."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)


def pth_paths(site: Path) -> list[str]:
    """The folders a set's .pth files put on sys.path, for its wrapper to name. Without them a
    package reached only through a .pth does not import from the set: nvidia-cutlass-dsl's
    `cutlass`, so FlashInfer's CuTe DSL kernels were missing and vLLM 0.26's Hopper prefill of
    Gated-DeltaNet layers failed ("SM90 GDN prefill DSL kernel is unavailable", on an H100).
    Lines that only have side effects (setuptools' distutils shim) are not carried over."""
    if not any(site.glob("*.pth")):
        return []
    done = run_apart([sys.executable, "-c", PTH_PATHS, str(site)])
    if done.returncode != 0:
        raise RuntimeError(f"reading the .pth files of {site} failed: {last_line(done)}")
    if done.stderr.strip():  # site names a .pth line that failed, and goes on
        print(f"gpu-wheels-install: {site}: {done.stderr.strip()}", file=sys.stderr)
    return json.loads(done.stdout)


def check_command(set_name: str) -> tuple[str, str, str | None]:
    """The import check of a set: (package, code, version the set's name promises or None)."""
    if set_name == "pipeline":
        return "snakemake", "import snakemake, dflash_pipeline; print('snakemake', snakemake.__version__)", None
    # An engine set is named ENGINE-VERSION; importing the engine may need a GPU, its metadata not.
    match = re.fullmatch(r"(.+?)-(\d[^-]*)", set_name)
    engine, version = (match[1], match[2]) if match else (set_name, None)
    return engine, f"import importlib.metadata as m; print({engine!r}, m.version({engine!r}))", version


def install(args: argparse.Namespace) -> int:
    out = Path(args.wheels)
    problems = verify(out)
    if problems:
        for line in problems:
            print(f"gpu-wheels-install: {line}", file=sys.stderr)
        print("gpu-wheels-install: nothing installed", file=sys.stderr)
        return 1
    envs = Path(args.envs).resolve()
    checkout = Path(args.checkout).resolve()
    sets = args.sets.split() if args.sets else sorted(p.parent.name for p in out.glob("*/*.whl"))
    sets = list(dict.fromkeys(sets))
    engines = []
    for set_name in sets:
        wheels = sorted((out / set_name).glob("*.whl"))
        if not wheels:
            print(f"gpu-wheels-install: no wheels in {out / set_name}", file=sys.stderr)
            return 1
        home = envs / set_name
        site = home / "site"
        # Into a fresh folder, then in place: a rerun or a changed set never mixes with the old.
        fresh = home / "site.new"
        shutil.rmtree(fresh, ignore_errors=True)
        home.mkdir(parents=True, exist_ok=True)
        result = pip(
            "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(fresh), *map(str, wheels)
        )
        if result.returncode != 0:
            print(result.stdout + result.stderr, file=sys.stderr)
            print(f"gpu-wheels-install: {set_name}: pip install failed", file=sys.stderr)
            return 1
        shutil.rmtree(site, ignore_errors=True)
        os.replace(fresh, site)
        # The pipeline's wrapper also puts the checkout on the path: dflash_pipeline and the
        # Snakemake logger plugin import from it, as from the editable install of `make setup`.
        try:
            added = pth_paths(site)
        except RuntimeError as exc:
            print(f"gpu-wheels-install: {set_name}: {exc}", file=sys.stderr)
            return 1
        path = ":".join([str(site), *added, *([str(checkout)] if set_name == "pipeline" else [])])
        wrapper = home / "bin" / "python"
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(WRAPPER.format(path=path, python=sys.executable))
        wrapper.chmod(0o755)
        package, code, version = check_command(set_name)
        check = run_apart([str(wrapper), "-c", code])
        found = check.stdout.strip()
        if check.returncode != 0 or (version and not found.endswith(f" {version}")):
            print(check.stderr, file=sys.stderr)
            print(
                f"gpu-wheels-install: {set_name}: the import check failed: {wrapper} -c {code!r} -> {found or 'error'}",
                file=sys.stderr,
            )
            return 1
        print(f"{set_name}: {len(wheels)} wheels in {site}; {found}")
        if set_name != "pipeline":
            engines.append((package, wrapper))
    if "pipeline" in sets:
        print(f"Run the pipeline with: {envs}/pipeline/bin/python -m snakemake ...")
    if engines:
        print("In the run's config:\nengines:")
        for engine, wrapper in engines:
            print(f"  {engine}: {{python: {wrapper}}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download (or build) the wheel sets: a connected machine")
    b.add_argument("--wheels", required=True, help="output folder: WHEELS/<set>/*.whl and WHEELS/SHA256SUMS")
    b.add_argument("--sets", default="pipeline sglang-0.5.17 vllm-0.26.0", help="lock names of envs/gpu/locks/")
    b.add_argument("--base", help="`pip freeze` of the GPU node: its exact NAME==VERSION pins are left out")
    b.add_argument("--skip", default="", help="regex of wheel file names to leave out")
    b.add_argument("--allow-missing", default="", help="names that may lack a wheel (left out, no failure)")
    b.add_argument("--no-fa3", action="store_true", help="repack sglang-kernel without FA3 and sm100")
    b.add_argument("--jobs", type=int, default=8, help="parallel downloads")
    i = sub.add_parser("install", help="verify and install the wheel sets: the GPU node, no index")
    i.add_argument("--wheels", required=True)
    i.add_argument("--envs", default=".gpu-envs", help="ENVS/<set>/site and ENVS/<set>/bin/python")
    i.add_argument("--sets", default="", help="default: every set folder in WHEELS")
    i.add_argument("--checkout", default=str(LOCKS.parent.parent.parent), help="on the pipeline's path")
    args = parser.parse_args(argv)
    return build(args) if args.command == "build" else install(args)


if __name__ == "__main__":
    sys.exit(main())
