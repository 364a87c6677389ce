"""The command a measurement script records in its result file, so that the docs can quote it.

WHY from ``sys.argv`` where it can be: the arguments as typed reproduce the run, where a line rebuilt from
the parsed options names only the options its author thought of.  The default model's path is
machine-specific (a cache folder), so it is written as the docs write it, and only when it is the model
given: the scripts that rebuild their line wrote the default model whatever model they were given.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence

from ..default_model import default_model_cache_path

DEFAULT_MODEL_ARG = '"$(python scripts/default_model.py)"'  # how the docs name the default target


def is_default_model(arg: str) -> bool:
    """``arg`` is the default target's requantization in this machine's cache (``default_model_path``'s file,
    for a shipped file of any size)."""
    p = Path(arg)
    size = p.name.partition("-")[0]
    return size.isdigit() and p.resolve() == default_model_cache_path(int(size)).resolve()


def model_arg(path: str | Path) -> str:
    """A model path as a recorded command names it: the default target as the docs do, any other shell-quoted."""
    return DEFAULT_MODEL_ARG if is_default_model(str(path)) else shlex.quote(str(path))


def script_command(argv: Sequence[str]) -> str:
    """``argv`` (a script's ``sys.argv``) as the command that reproduces its run: ``python scripts/NAME.py`` and
    the arguments shell-quoted, the default model as ``"$(python scripts/default_model.py)"``."""
    return " ".join([f"python scripts/{Path(argv[0]).name}", *map(model_arg, argv[1:])])
