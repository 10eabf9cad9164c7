"""verl's own released files, outside the repository: the contract our compat layer is tested against.

verl publishes its wheels on PyPI with its package and its `tests/` folder inside. `verl_release(version)` downloads
one (pinned by SHA-256, cached under $HYBRIDRL_CACHE_DIR/verl-releases) and unpacks it; `port(text)` turns one of
its files into what a verl user would write here: `verl.` becomes `hybridrl.compat.verl.` in the import lines and
nowhere else. No line of verl's is kept in this repository.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# verl's releases of 2026, oldest first: (version, SHA-256 of the py3-none-any wheel on PyPI)
RELEASES = {
    "0.7.0": "676d40f12214df482ec2d2298dc1e8590966ce75a1ab8a5e5afaf26d31cb58fd",  # January 2026
    "0.7.1": "0f7fb1dd6a37d20f7d8795c65ed0d1b9797ffb9947f283bbefd758dced08e216",  # March 2026
    "0.8.0": "4e32830aae80771ee3b5f0d26a2b794d793f3bcece67aff07c2a7c62e948714f",  # June 2026
    "0.9.0": "6e9374db1e2ab346a0aafe9a202bee1b239a042def2f2ccd6db2a4cd04c6308b",  # August 2026
    "0.9.1": "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14",  # September 2026
}
LATEST = "0.9.1"


def _cache_dir() -> Path:
    root = os.environ.get("HYBRIDRL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hybridrl")
    return Path(root) / "verl-releases"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verl_release(version: str) -> Path:
    """The unpacked wheel of verl `version` (a folder holding `verl/` and `tests/`), downloaded once."""
    expected = RELEASES[version]
    root = _cache_dir() / version
    unpacked = root / "unpacked"
    if (unpacked / ".complete").is_file():
        return unpacked
    wheel = root / f"verl-{version}-py3-none-any.whl"
    if not wheel.is_file() or _sha256(wheel) != expected:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(root), f"verl=={version}"], check=True, timeout=300)
        got = _sha256(wheel)
        if got != expected:
            raise RuntimeError(f"{wheel}: SHA-256 {got}, expected {expected} (the pinned verl {version} wheel)")
    staging = root / f"unpacked.{os.getpid()}"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(staging)
    (staging / ".complete").write_text(expected)
    try:
        os.replace(staging, unpacked)  # another process may have finished first: theirs is the same
    except OSError:
        pass
    return unpacked


_FROM = re.compile(r"^(\s*)from(\s+)verl(?=[.\s])", re.MULTILINE)
_IMPORT = re.compile(r"^(\s*)import(\s+)verl(\.[\w.]+)?(\s+as\s+\w+)?[ \t]*$", re.MULTILINE)


def _import_line(match: re.Match) -> str:
    """`import verl.a.b` binds the name `verl`, which the file then uses (`verl.a.b.X`): the ported line binds it too."""
    indent, space, dotted, alias = match.group(1), match.group(2), match.group(3) or "", match.group(4)
    line = f"{indent}import{space}hybridrl.compat.verl{dotted}"
    return line + alias if alias else f"{line}; from hybridrl.compat import verl"


def port(text: str) -> str:
    """A verl file as a verl user ports it: `verl.` → `hybridrl.compat.verl.` in import lines only."""
    return _IMPORT.sub(_import_line, _FROM.sub(r"\1from\2hybridrl.compat.verl", text))
