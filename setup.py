"""kvchat's packages, found instead of listed (pyproject.toml holds everything else).

The repository's root is the package `kvchat`: its top-level folders with an __init__.py are
its subpackages, and every folder below one of them is a package too, so a new module, a
new folder or a kernel source is in the wheel without a line here.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent
TOP = sorted(init.parent.name for init in ROOT.glob("*/__init__.py"))
FOUND = find_namespace_packages(
    where=str(ROOT), include=[*TOP, *(f"{top}.*" for top in TOP)], exclude=["*.__pycache__"]
)

# script_name: build_py leaves the setup script out of the package it sits in when it knows
# which file that is (a build backend runs in this folder; left unset, it names pip's own).
setup(packages=["kvchat", *(f"kvchat.{package}" for package in FOUND)], script_name="setup.py")
