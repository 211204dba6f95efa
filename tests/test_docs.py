"""The docs: the site in docs/ builds with `mkdocs build --strict` (a broken link or anchor, or a page
missing from mkdocs.yml's nav, fails it), and the README stays short, its links resolving.

    python -m pytest -q tests/test_docs.py
"""

import re
import subprocess
import sys

from qad_pipeline.core.config import PROJECT_ROOT

README_MAX_LINES = 250


def test_the_docs_build_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(PROJECT_ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_is_short():
    lines = len((PROJECT_ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move the rest to docs/"


def test_the_readmes_links_resolve():
    """README's relative links (to docs/*.md and infra/README.md) name files that exist, on GitHub too."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (PROJECT_ROOT / "README.md").read_text())
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local)
    missing = [t for t in local if not (PROJECT_ROOT / t).exists()]
    assert missing == [], f"README.md links to missing files: {missing}"
