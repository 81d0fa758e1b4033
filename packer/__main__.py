"""`python -m packer ...`: the packer command under a name no other tool shadows
(HashiCorp's `packer` is often first on PATH on infrastructure machines)."""
import os
import sys


def drop_shadowing_folder() -> None:
    """Run from a folder that holds a `packer/` folder with no __init__.py (a clone's parent),
    Python imports that folder as a namespace package `packer`, ahead of the installed one, and
    only this file is found in it. Leave the folders on sys.path that hold such a folder out and
    import packer again, so the installed package is the one that runs."""
    package = sys.modules.get("packer")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    sys.path[:] = [entry for entry in sys.path if not is_shadowing(entry)]
    for name in [name for name in sys.modules if name == "packer" or name.startswith("packer.")]:
        del sys.modules[name]


def is_shadowing(entry: str) -> bool:
    folder = os.path.join(entry or os.curdir, "packer")
    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))


drop_shadowing_folder()
from packer.cli import main  # noqa: E402 (after the path is mended)

main(prog_name="python -m packer")
