"""Property-based: whatever is wrong with a campaign or space file, loading it ends in a clear
:class:`InputFileError` naming the file and a field, never a traceback from inside the tool.

Files are made by breaking the shipped ones: a key deleted, a value replaced by junk of another
shape, a key nobody knows added, or the YAML itself mangled.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from autotune.campaign import load_campaign
from autotune.core.errors import InputFileError
from autotune.space import load_space

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = yaml.safe_load((ROOT / "campaigns/cpu_demo.yaml").read_text())
SPACE = yaml.safe_load((ROOT / "search_spaces/cpu_demo.yaml").read_text())
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
    | st.text(max_size=12) | st.just("") | st.just("-1") | st.just("1e400"),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a document (into mappings and lists)."""
    found = []
    if isinstance(document, dict):
        for key, value in document.items():
            found.append(prefix + (key,))
            found += paths(value, prefix + (key,))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.append(prefix + (index,))
            found += paths(value, prefix + (index,))
    return found


@st.composite
def broken(draw, document: dict) -> dict | Any:
    document = copy.deepcopy(document)
    how = draw(st.sampled_from(["delete", "replace", "add", "whole"]))
    if how == "whole":
        return draw(junk)
    path = draw(st.sampled_from(paths(document)))
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[path[-1]]
    elif how == "replace":
        parent[path[-1]] = draw(junk)
    elif isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=8))] = draw(junk)
    else:
        parent.append(draw(junk))
    return document


def loads_or_says_where(load, path: Path) -> None:
    try:
        load(path)
    except InputFileError as error:
        event("rejected with a clear error")
        assert error.path == path and error.field and error.message
        assert str(path) in str(error)
    else:
        event("still valid")


@SETTINGS
@given(document=broken(SPACE))
def test_a_broken_space_file_is_an_error_naming_the_field(tmp_path_factory, document) -> None:
    path = tmp_path_factory.mktemp("space") / "space.yaml"
    path.write_text(yaml.safe_dump(document))
    loads_or_says_where(load_space, path)


@SETTINGS
@given(document=broken(CAMPAIGN))
def test_a_broken_campaign_file_is_an_error_naming_the_field(tmp_path_factory, document) -> None:
    folder = tmp_path_factory.mktemp("campaign")
    shutil.copyfile(ROOT / "search_spaces/cpu_demo.yaml", folder / "cpu_demo.yaml")
    if isinstance(document, dict) and document.get("space") == "cpu_demo":
        document["space"] = "cpu_demo.yaml"
    path = folder / "campaign.yaml"
    path.write_text(yaml.safe_dump(document))
    loads_or_says_where(load_campaign, path)


@SETTINGS
@given(text=st.text(max_size=80), cut=st.integers(0, 400))
def test_mangled_yaml_is_an_error_naming_the_file(tmp_path_factory, text: str, cut: int) -> None:
    folder = tmp_path_factory.mktemp("mangled")
    source = (ROOT / "campaigns/cpu_demo.yaml").read_text()
    path = folder / "campaign.yaml"
    path.write_text(source[:cut] + text + source[cut:])
    loads_or_says_where(load_campaign, path)
