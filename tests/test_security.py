"""Security defaults, checked on the source itself: user files are read with ``yaml.safe_load``
only, nothing unpickles or evaluates what a user hands us, Ray's token authentication is never
turned off, and nothing we start listens beyond loopback unless the user asks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("autotune", "trainables", "bench") for p in (ROOT / folder).rglob("*.py"))
UNPICKLING_ALLOWED = {
    # each rank pickles its BurstResult into a private temporary directory the launcher created
    # and reads back; no user file is ever unpickled
    "trainables/launch.py",
    # a kept rank process unpickles its next request, which its zygote sends over a socket pair
    # only the two hold (the zygote got it from a requester on its socket in a private directory)
    "trainables/zygote.py",
}


def calls(path: Path) -> list[str]:
    """Dotted names of every call in a file (``yaml.load``, ``eval``, ``pickle.loads`` ...)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            names.append(ast.unparse(node.func))
    return names


def test_sources_are_found() -> None:
    assert len(SOURCES) > 50 and ROOT / "autotune/yaml_io.py" in SOURCES


def test_yaml_is_only_ever_safe_loaded() -> None:
    for path in SOURCES:
        for name in calls(path):
            if name.startswith("yaml.") and name.endswith(("load", "load_all")):
                assert name in ("yaml.safe_load", "yaml.safe_load_all"), f"{path}: {name}"


def test_nothing_evaluates_or_unpickles_user_input() -> None:
    for path in SOURCES:
        relative = path.relative_to(ROOT).as_posix()
        for name in calls(path):
            assert name not in ("eval", "exec", "compile"), f"{relative}: {name}"
            if re.fullmatch(r"(cloud)?pickle\.loads?|torch\.load|marshal\.loads?", name):
                assert relative in UNPICKLING_ALLOWED, f"{relative}: {name}"


def cluster_files() -> list[Path]:
    """What cluster/ starts things with (not cluster/schemas/: upstream CRDs, data)."""
    return [path for path in (ROOT / "cluster").iterdir() if path.is_file()]


def test_token_authentication_is_never_turned_off() -> None:
    for path in [*SOURCES, *cluster_files()]:
        text = path.read_text()
        assert not re.search(r"RAY_AUTH_MODE\W+disabled", text), path


def test_what_we_start_listens_on_loopback() -> None:
    for path in [*SOURCES, *cluster_files()]:
        text = path.read_text()
        assert "0.0.0.0" not in text, path
        for host in re.findall(r"dashboard[-_]host[\"']?\s*[:=]\s*[\"']?([\w.]+)", text):
            assert host == "127.0.0.1", (path, host)
