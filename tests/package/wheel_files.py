"""Every file of kvchat's package folders is in the wheel, at its place under kvchat/.

    python wheel_files.py CHECKOUT WHEEL

The package folders are the checkout's top-level folders with an __init__.py, and the root's
own modules; caches and byte code are not part of them. Exits 1 naming what is missing.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path


def package_files(checkout: Path) -> set[str]:
    """The files git tracks in the package folders (what a clone has), as wheel paths."""
    tracked = subprocess.run(
        ["git", "-C", str(checkout), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    top = {init.parent.name for init in checkout.glob("*/__init__.py")}
    return {
        f"kvchat/{name}"
        for name in tracked
        if name.split("/")[0] in top or ("/" not in name and name.endswith(".py"))
    } - {"kvchat/setup.py"}


def main(checkout: Path, wheel: Path) -> int:
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    missing = sorted(package_files(checkout) - shipped)
    for name in missing:
        print(f"missing from {wheel.name}: {name}", file=sys.stderr)
    print(f"{wheel.name}: {len(shipped)} files, none of the package's missing" * (not missing))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
