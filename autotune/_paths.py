"""Where the shipped data lives. The tool is installed from a checkout (``pip install -e .``), so
built-in spaces and campaigns are read from the repository's top-level folders."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN_SPACES_DIR = REPO_ROOT / "search_spaces"
BUILTIN_CAMPAIGNS_DIR = REPO_ROOT / "campaigns"
