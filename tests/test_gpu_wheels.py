"""Wheel sets for GPU nodes without a package index (tools/gpu_wheels.py, `make gpu-wheels` and
`make gpu-wheels-install`), as far as a CPU machine without network can check them: the locks, the
BASE subtraction, the repack without FA3, a rerun that downloads nothing, and a real install of
hand-made wheels through the wrappers it writes."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tools" / "gpu_wheels.py"
LOCKS = REPO / "envs" / "gpu" / "locks"
_spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
gw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gw)


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, str | bytes], tag="py3-none-any") -> Path:
    """A minimal valid wheel: the files, METADATA, WHEEL and a RECORD with their hashes."""
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    path = folder / f"{dist}-{version}-{tag}.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            archive.writestr(name, data)
            record.append(f"{name},{record_hash(data)},{len(data)}\n")
        archive.writestr(f"{info}/RECORD", "".join(record) + f"{info}/RECORD,,\n")
    return path


def write_sums(wheels: Path) -> None:
    lines = [f"{gw.sha256(p)}  {p.relative_to(wheels).as_posix()}\n" for p in sorted(wheels.glob("*/*.whl"))]
    (wheels / "SHA256SUMS").write_text("".join(lines))


def install(wheels: Path, envs: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "install", "--wheels", str(wheels), "--envs", str(envs)]
    return subprocess.run(command + ["--checkout", str(REPO)], capture_output=True, text=True, timeout=300)


def test_every_lock_is_pinned_and_named_for_its_set():
    locks = {path.stem: gw.read_lock(path) for path in LOCKS.glob("*.lock")}
    assert set(locks) == {"pipeline", "sglang-0.5.23", "vllm-0.34.0"}
    assert locks["sglang-0.5.23"]["sglang"] == "0.5.23"
    assert locks["sglang-0.5.23"]["transformers"] == "5.19.0"  # its own pin, not the image's 5.17.0
    assert locks["vllm-0.34.0"]["vllm"] == "0.34.0"
    # The engines need a newer torch than the image's 2.11 (DFlash2: vLLM >= 0.28, SGLang >= 0.5.19),
    # each its own pin; the pipeline's set sits on the image's.
    assert (locks["vllm-0.34.0"]["torch"], locks["sglang-0.5.23"]["torch"]) == ("2.14.0", "2.14.1")
    assert "snakemake" in locks["pipeline"] and "snakemake-storage-plugin-s3" in locks["pipeline"]
    for name, pins in locks.items():
        if name == "pipeline":  # the pipeline sits on the image's torch
            assert "torch" not in pins and "triton" not in pins, name
        text = (LOCKS / f"{name}.lock").read_text()
        assert text.startswith("#") and "uv pip compile" in text and "base-freeze.txt" in text
        # The locks were made minus the base: what they share with it is named in their header.
        base = gw.parse_pins((LOCKS / "base-freeze.txt").read_text())
        shared = {k: v for k, v in pins.items() if k not in gw.subtract_base(pins, base)}
        assert all(f"{k} {v}" in text for k, v in shared.items()), shared
    assert gw.subtract_base(locks["pipeline"], base) == locks["pipeline"]


def test_a_lock_line_that_is_not_an_exact_pin_is_refused_with_its_place(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("# header\nfoo==1.0  # why\n\nbar>=2\n")
    with pytest.raises(ValueError, match=r"x\.lock:4: not NAME==VERSION: bar>=2"):
        gw.read_lock(lock)


def test_base_leaves_out_exactly_the_pins_it_has_under_any_spelling_of_the_name():
    lock = gw.parse_pins("Foo_Bar==1.0\nzope.interface==7.0\nbaz==2.0\nqux==3.0\n")
    freeze = "foo-bar==1.0\nZope-Interface==7.0\nbaz==2.1\n-e git+https://x/y#egg=qux\nqux @ file:///tmp/qux\n"
    assert gw.subtract_base(lock, gw.parse_pins(freeze)) == {"baz": "2.0", "qux": "3.0"}
    assert gw.canonical("Snakemake_Storage.Plugin--S3") == "snakemake-storage-plugin-s3"


def test_a_split_distribution_leaves_with_all_its_parts_or_not_at_all():
    # The base has cutlass-dsl's CUDA flavours but not its head: its libs install into the head's
    # folder, so the set keeps them (without, SGLang's server died at start on a GPU).
    lock = gw.parse_pins(
        "nvidia-cutlass-dsl==4.6.0\nnvidia-cutlass-dsl-libs-base==4.6.0\nnvidia-cutlass-dsl-libs-cu13==4.6.0\nfoo==1.0\n"
    )
    base = gw.parse_pins("nvidia-cutlass-dsl-libs-base==4.6.0\nnvidia_cutlass_dsl_libs_cu13==4.6.0\nfoo==1.0\n")
    assert gw.subtract_base(lock, base) == {
        "nvidia-cutlass-dsl": "4.6.0", "nvidia-cutlass-dsl-libs-base": "4.6.0", "nvidia-cutlass-dsl-libs-cu13": "4.6.0"
    }  # fmt: skip
    # The base has all of it: all of it leaves.
    assert gw.subtract_base(lock, {**base, "nvidia-cutlass-dsl": "4.6.0"}) == {}


def test_a_set_holding_a_split_distribution_without_a_part_is_refused_by_name(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels / "eng-1.0", "nvidia_cutlass_dsl", "4.6.0", {"nvidia_cutlass_dsl/__init__.py": ""})
    make_wheel(wheels / "eng-1.0", "nvidia_cutlass_dsl_libs_base", "4.6.0", {"nvidia_cutlass_dsl/base.py": ""})
    make_wheel(wheels / "eng-1.0", "nvidia_cutlass_dsl_libs_core", "4.6.0", {"nvidia_cutlass_dsl/core.py": ""})
    write_sums(wheels)
    envs = tmp_path / "gpu-envs"
    result = install(wheels, envs)
    assert result.returncode == 1 and not envs.exists()
    assert (
        f"{wheels / 'eng-1.0'}: nvidia-cutlass-dsl without nvidia-cutlass-dsl-libs-cu12 or nvidia-cutlass-dsl-libs-cu13"
        in result.stderr
    )
    make_wheel(wheels / "eng-1.0", "nvidia_cutlass_dsl_libs_cu13", "4.6.0", {"nvidia_cutlass_dsl/cu13.py": ""})
    write_sums(wheels)
    assert gw.verify(wheels) == []
    # A SKIP that would split it is refused before anything is fetched.
    assert gw.incomplete_splits({"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core"})
    assert not gw.incomplete_splits({"foo", "nvidia-cutlass-dsl-libs-cu13"})  # no head: nothing to complete


def test_only_wheels_for_cpython_312_on_linux_x86_64_fit():
    assert gw.wheel_fits("connection_pool-0.0.3-py3-none-any.whl")
    assert gw.wheel_fits("orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert gw.wheel_fits("sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl")
    assert gw.wheel_fits("interegular-0.3.3-py37-none-any.whl")
    assert not gw.wheel_fits("x-1.0-py313-none-any.whl")
    assert not gw.wheel_fits("orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl")  # built on 3.11
    assert not gw.wheel_fits("orjson-3.13.0-cp312-cp312-macosx_11_0_arm64.whl")
    assert not gw.wheel_fits("x-1.0-cp313-abi3-manylinux2014_x86_64.whl")


def test_no_fa3_repacks_sglang_kernel_without_fa3_and_sm100_and_its_record_agrees(tmp_path):
    wheel = make_wheel(
        tmp_path,
        "sglang_kernel",
        "0.4.5",
        {
            "sgl_kernel/__init__.py": "X = 1\n",
            "sgl_kernel/common_ops.abi3.so": b"\x7fELF keep",
            "sgl_kernel/flash_ops.abi3.so": b"\x7fELF fa3",
            "sgl_kernel/sm100/common_ops.abi3.so": b"\x7fELF sm100",
        },
        tag="cp310-abi3-manylinux2014_x86_64",
    )
    assert gw.has_fa3(wheel)
    gw.strip_fa3(wheel)
    assert not gw.has_fa3(wheel)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read("sglang_kernel-0.4.5.dist-info/RECORD").decode()
        assert archive.read("sgl_kernel/common_ops.abi3.so") == b"\x7fELF keep"
    assert "sgl_kernel/common_ops.abi3.so" in names and "sgl_kernel/__init__.py" in names
    assert not any("flash_ops" in n or "sm100" in n for n in names)
    assert "flash_ops" not in record and "sm100" not in record
    assert len(record.splitlines()) == len(names)


def test_a_rerun_downloads_nothing_it_has_drops_what_the_lock_no_longer_asks_and_names_what_is_missing(
    tmp_path, monkeypatch, capsys
):
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "tiny-1.0.lock").write_text("# a set\ntiny==1.0\nTy_Skipped==2.0\nllguidance==1.9.1\n")
    monkeypatch.setattr(gw, "LOCKS", locks)
    wheels = tmp_path / "wheels"
    have = make_wheel(wheels / "tiny-1.0", "tiny", "1.0", {"tiny.py": "X = 1\n"})
    stale = make_wheel(wheels / "tiny-1.0", "tiny", "0.9", {"tiny.py": "X = 0\n"})
    fetched = []

    def no_wheel(requirement, folder):
        fetched.append(requirement)
        return None, "no matching distribution"

    monkeypatch.setattr(gw, "fetch", no_wheel)
    build = ["build", "--wheels", str(wheels), "--sets", "tiny-1.0", "--skip", "^ty_skipped-"]

    assert gw.main(build + ["--allow-missing", "llguidance"]) == 0
    assert fetched == ["llguidance==1.9.1"]  # tiny is there, ty_skipped is skipped before any download
    assert have.exists() and not stale.exists()
    assert (wheels / "SHA256SUMS").read_text() == f"{gw.sha256(have)}  tiny-1.0/{have.name}\n"
    assert "no wheel for llguidance==1.9.1: no matching distribution (allowed missing" in capsys.readouterr().err

    assert gw.main(build) == 1
    assert "gpu-wheels: no wheel for tiny-1.0: llguidance==1.9.1" in capsys.readouterr().err


def test_a_skip_that_would_split_a_distribution_fails_the_build_before_any_download(tmp_path, monkeypatch, capsys):
    locks = tmp_path / "locks"
    locks.mkdir()
    parts = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core")
    flavours = ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")
    (locks / "eng-1.0.lock").write_text("".join(f"{name}==4.6.0\n" for name in parts + flavours))
    monkeypatch.setattr(gw, "LOCKS", locks)
    fetched = []
    monkeypatch.setattr(gw, "fetch", lambda requirement, folder: (fetched.append(requirement), (None, "offline"))[1])
    build = ["build", "--wheels", str(tmp_path / "wheels"), "--sets", "eng-1.0", "--skip"]

    assert gw.main(build + ["^nvidia_cutlass_dsl_libs_cu1[23]-"]) == 1 and fetched == []
    assert (
        "eng-1.0: SKIP would leave nvidia-cutlass-dsl without nvidia-cutlass-dsl-libs-cu12 or"
        in capsys.readouterr().err
    )
    assert gw.main(build + ["^nvidia_cutlass_dsl_libs_cu12-"]) == 1  # one flavour is enough: it gets to the downloads
    assert sorted(fetched) == sorted(f"{name}==4.6.0" for name in parts + flavours[1:])
    # A lock that itself lacks a part is named as the cause.
    (locks / "eng-1.0.lock").write_text("".join(f"{name}==4.6.0\n" for name in parts))
    assert gw.main(build + ["^nothing-"]) == 1
    assert "eng-1.0: its lock holds nvidia-cutlass-dsl without" in capsys.readouterr().err


def test_install_puts_each_set_in_its_own_folder_behind_a_wrapper_of_this_python(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels / "pipeline", "tinypipe", "0.1", {"tinypipe.py": "WHERE = 'pipeline set'\n"})
    make_wheel(wheels / "tiny-1.0", "tiny", "1.0", {"tiny.py": "WHERE = 'engine set'\n"})
    write_sums(wheels)
    envs = tmp_path / "gpu-envs"

    result = install(wheels, envs)
    assert result.returncode == 0, result.stderr
    wrapper = envs / "tiny-1.0" / "bin" / "python"
    assert f"  tiny: {{python: {wrapper}}}" in result.stdout
    assert f"{envs}/pipeline/bin/python -m snakemake" in result.stdout
    assert os.access(wrapper, os.X_OK)
    assert wrapper.read_text() == (
        f'#!/bin/sh\nPYTHONPATH={envs}/tiny-1.0/site${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(python: Path, code: str, **extra) -> str:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env | extra)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run(wrapper, "import tiny; print(tiny.WHERE)") == "engine set"
    # A PYTHONPATH already set stays behind the set's folder.
    assert run(wrapper, "import sys; print(sys.path[1:3])", PYTHONPATH="/elsewhere") == str(
        [f"{envs}/tiny-1.0/site", "/elsewhere"]
    )
    # The pipeline's wrapper has the checkout on the path too.
    pipeline = envs / "pipeline" / "bin" / "python"
    assert run(pipeline, "import tinypipe, dflash_pipeline; print(tinypipe.WHERE)") == "pipeline set"

    # A rerun replaces the sets (nothing of the old set is left).
    (wheels / "tiny-1.0" / "tiny-1.0-py3-none-any.whl").unlink()
    make_wheel(wheels / "tiny-1.0", "tiny", "1.0", {"tiny2.py": "X = 2\n"})
    write_sums(wheels)
    assert install(wheels, envs).returncode == 0
    assert run(wrapper, "import tiny2, importlib.util; print(importlib.util.find_spec('tiny'))") == "None"


def test_the_wrapper_names_what_a_sets_pth_files_put_on_the_path(tmp_path):
    # nvidia-cutlass-dsl reaches its `cutlass` package only through a .pth import line; Python
    # reads .pth files in site directories, not in a PYTHONPATH folder (an H100 run of vLLM lost
    # FlashInfer's CuTe DSL kernels that way). Built like that wheel, plus a plain path line.
    wheels = tmp_path / "wheels"
    make_wheel(
        wheels / "dsl-1.0",
        "dsl",
        "1.0",
        {
            "dsl/__init__.py": "",
            "dsl/packages/cute/__init__.py": "WHERE = 'behind the import line'\n",
            "dsl_packages.pth": "import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'packages'))",
            "extra/plain.py": "WHERE = 'behind the path line'\n",
            "dsl_extra.pth": "extra\n",
        },
    )
    write_sums(wheels)
    envs = tmp_path / "gpu-envs"
    result = install(wheels, envs)
    assert result.returncode == 0, result.stderr
    site = envs / "dsl-1.0" / "site"
    wrapper = envs / "dsl-1.0" / "bin" / "python"
    assert f"PYTHONPATH={site}:{site}/dsl/packages:{site}/extra$" in wrapper.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import cute, plain; print(cute.WHERE, '/', plain.WHERE)"
    done = subprocess.run([str(wrapper), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.stdout.strip() == "behind the import line / behind the path line", done.stderr


def test_a_damaged_wheel_is_refused_by_name_and_nothing_is_installed(tmp_path):
    wheels = tmp_path / "wheels"
    good = make_wheel(wheels / "tiny-1.0", "tiny", "1.0", {"tiny.py": "X = 1\n"})
    bad = make_wheel(wheels / "other-2.0", "other", "2.0", {"other.py": "X = 2\n"})
    write_sums(wheels)
    bad.write_bytes(bad.read_bytes()[:-10])
    envs = tmp_path / "gpu-envs"

    result = install(wheels, envs)
    assert result.returncode == 1
    assert f"gpu-wheels-install: {bad}: checksum mismatch" in result.stderr
    assert str(good) not in result.stderr
    assert not envs.exists()

    # A wheel that SHA256SUMS does not list is refused too.
    write_sums(wheels)
    extra = make_wheel(wheels / "tiny-1.0", "extra", "1.0", {"extra.py": ""})
    result = install(wheels, envs)
    assert result.returncode == 1 and f"{extra}: not in SHA256SUMS" in result.stderr


def test_an_engine_set_whose_package_has_another_version_fails_the_check(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels / "tiny-2.0", "tiny", "1.0", {"tiny.py": ""})
    write_sums(wheels)
    result = install(wheels, tmp_path / "gpu-envs")
    assert result.returncode == 1 and "tiny-2.0: the import check failed" in result.stderr


def test_a_wheel_built_for_linux_wins_over_a_pure_one_and_an_sdist_is_the_last_resort(tmp_path, monkeypatch):
    """pip accepts a pure wheel under any --platform: soundfile's (which needs a system
    libsndfile) would win over its manylinux_2_28 wheel unless later tags are tried too."""
    calls = []

    def fake_pip(*args):
        command, requirement = args[0], args[-1]
        into = Path(args[args.index("-d" if command == "download" else "-w") + 1])
        platform = args[args.index("--platform") + 1] if command == "download" else None
        calls.append((requirement, platform or command))
        name = requirement.split("==")[0]
        into.mkdir(parents=True, exist_ok=True)
        if name == "sdistonly" and command == "download":
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")
        tag = (
            "py2.py3-none-manylinux_2_28_x86_64"
            if name == "soundfile" and platform == "manylinux_2_28_x86_64"
            else "py3-none-any"
        )
        (into / f"{name}-1.0-{tag}.whl").write_bytes(b"")
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(gw, "pip", fake_pip)
    folder = tmp_path / "set"
    folder.mkdir()
    assert gw.fetch("soundfile==1.0", folder)[0].name == "soundfile-1.0-py2.py3-none-manylinux_2_28_x86_64.whl"
    assert [p for r, p in calls if r == "soundfile==1.0"][-1] == "manylinux_2_28_x86_64"
    assert gw.fetch("pure==1.0", folder)[0].name == "pure-1.0-py3-none-any.whl"
    assert [p for r, p in calls if r == "pure==1.0"] == gw.PLATFORMS[:-1]  # every tag but `any` itself
    assert gw.fetch("sdistonly==1.0", folder)[0].name == "sdistonly-1.0-py3-none-any.whl"
    assert [p for r, p in calls if r == "sdistonly==1.0"] == gw.PLATFORMS + ["wheel"]
