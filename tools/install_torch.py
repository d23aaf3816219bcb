"""Install torch into an environment (`make setup`, `make vllm-env`), from plain package indexes.

PyPI has no ``+cpu`` (or ``+cu130``) builds of torch: PyTorch publishes them on its own index,
https://download.pytorch.org/whl/<tag>. A pip whose configuration already provides the build (a
local wheel folder or a mirror) must not be sent there, and a stock pip must be. So:

- ``TORCH_INDEX`` set: the requirement from that index alone (``--index-url``), its dependencies
  from PyPI (``--extra-index-url https://pypi.org/simple``);
- the requirement names an index itself (``torch==2.11.0 --index-url ...``): exactly that;
- otherwise pip's configured indexes first, and only if pip finds no matching distribution, again
  with PyTorch's index of the build's local tag (``+cpu``: .../whl/cpu) as an extra index.

An importable torch is never replaced (a GPU machine's CUDA build, installed first): nothing runs.

    python tools/install_torch.py [--python PY] [TORCH WORDS...]   (default: torch==2.13.0+cpu)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

DEFAULT_TORCH = "torch==2.13.0+cpu"
PYPI = "https://pypi.org/simple"
PYTORCH_INDEX = "https://download.pytorch.org/whl"
# pip's options that choose where packages come from: a requirement that names one is taken as is.
INDEX_OPTIONS = ("--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--no-index")
# What pip prints when no index holds the requirement (pip 23-26), the one failure worth a retry.
NOT_FOUND = ("No matching distribution found", "Could not find a version that satisfies")


def _names_an_index(words: Sequence[str]) -> bool:
    return any(w == opt or w.startswith(opt + "=") for w in words for opt in INDEX_OPTIONS)


def local_tag(words: Sequence[str]) -> str | None:
    """The build tag of the torch requirement (``torch==2.13.0+cpu`` -> ``cpu``), if it has one."""
    for word in words:
        match = re.fullmatch(r"torch\s*===?\s*[\w.!]+\+([a-z0-9]+)", word.strip())
        if match:
            return match.group(1)
    return None


def install_attempts(words: Sequence[str], torch_index: str | None = None) -> list[list[str]]:
    """The ``pip install`` arguments to try in turn (each after the previous found no distribution)."""
    words = list(words) or [DEFAULT_TORCH]
    if torch_index:
        return [[*words, "--index-url", torch_index, "--extra-index-url", PYPI]]
    if _names_an_index(words):
        return [words]
    attempts = [words]
    tag = local_tag(words)
    if tag:
        attempts.append([*words, "--extra-index-url", f"{PYTORCH_INDEX}/{tag}"])
    return attempts


def _run_pip(python: str, args: list[str]) -> tuple[int, str]:
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sys.stdout.write(proc.stdout)
    return proc.returncode, proc.stdout


def torch_importable(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def install(
    python: str,
    words: Sequence[str],
    torch_index: str | None = None,
    run: Callable[[str, list[str]], tuple[int, str]] = _run_pip,
) -> int:
    """Install torch into ``python``'s environment; pip's exit status (0 when torch imports already)."""
    if torch_importable(python):
        print(f"install_torch: {python} already imports torch; left as it is")
        return 0
    attempts = install_attempts(words, torch_index)
    rc = 1
    for i, args in enumerate(attempts):
        if i:
            print(f"install_torch: no matching torch on the configured indexes; trying: pip install {' '.join(args)}")
        rc, output = run(python, args)
        if rc == 0 or not any(text in output for text in NOT_FOUND):
            return rc
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's python (default: this one)")
    parser.add_argument(
        "torch", nargs=argparse.REMAINDER, help=f"requirement and pip options (default: {DEFAULT_TORCH})"
    )
    args = parser.parse_args(argv)
    # TORCH="torch==2.11.0 --index-url ..." arrives as one word when quoted: split it as a shell would.
    words = [w for word in args.torch for w in word.split()]
    return install(args.python, words, os.environ.get("TORCH_INDEX") or None)


if __name__ == "__main__":
    sys.exit(main())
