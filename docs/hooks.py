"""mkdocs hook (mkdocs.yml `hooks:`): publish the measured results under benchmarks/results/ in the
site at the same path, so that the Performance page links to each number's JSON and shows its plot
without a copy of them in docs/ (and `mkdocs build --strict` checks those links). Only data and
plots go: the result folders' READMEs are not pages of this site, and their scripts are not published."""
from __future__ import annotations

import os

from mkdocs.structure.files import File

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULTS = os.path.join("benchmarks", "results")
_PUBLISHED = (".json", ".png", ".txt", ".csv", ".svg")


def on_files(files, config):
    for folder, _, names in os.walk(os.path.join(_ROOT, _RESULTS)):
        for name in sorted(names):
            if not name.endswith(_PUBLISHED):
                continue
            rel = os.path.relpath(os.path.join(folder, name), _ROOT).replace(os.sep, "/")
            files.append(File(rel, src_dir=_ROOT, dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
