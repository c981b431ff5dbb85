"""Checks of the built site (``site/``) and of the pages' sources that `mkdocs build --strict`
does not make, run after it by the README's docs command (and so by CI):

- every object of the API reference (``site/reference/``) has a description, not just a
  signature;
- no markdown shows literally on a page: ``**`` or a backtick in the text a reader sees (outside
  code);
- README.md and docs/ name no commit hash and no issue number: they say what is, and how a
  result was reached belongs in CHANGELOG.md and benchmarks/results/;
- every image a page shows is in the site.

    python docs/check_site.py [SITE_DIR]

Prints each problem with its page and exits 1 if there is any.
"""
from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A commit as the docs would name one: 7 to 40 hex digits with a letter and a digit among them.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
ISSUE = re.compile(r"\b(?:issue|issues|PR)\s+#?\d+|(?<![\w/&])#\d{1,5}\b", re.IGNORECASE)
# Links to torch's and the frameworks' trackers cite their issues, not ours.
FOREIGN_ISSUE = re.compile(r"\b(?:pytorch|transformers|Lightning|lightning|accelerate|DeepSpeed|torchtitan|"
                           r"nanoGPT|llm\.c)\s+(?:issue\s+)?#\d+|github\.com/\S+")


class _Text(HTMLParser):
    """The text a reader sees, outside code, with the line it starts on; and the images."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code = 0
        self.skip = 0
        self.text: list[tuple[int, str]] = []
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("code", "pre", "kbd", "samp"):
            self.code += 1
        if tag in ("script", "style", "svg", "textarea"):
            self.skip += 1
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")

    def handle_endtag(self, tag):
        if tag in ("code", "pre", "kbd", "samp"):
            self.code = max(0, self.code - 1)
        if tag in ("script", "style", "svg", "textarea"):
            self.skip = max(0, self.skip - 1)

    def handle_data(self, data):
        if not self.code and not self.skip and data.strip():
            self.text.append((self.getpos()[0], data))


def api_descriptions(site: Path) -> list[str]:
    problems = []
    heading = re.compile(r'<h[2-6] id="(accum_fused[^"]+)" class="doc doc-heading">')
    for page in sorted((site / "reference").glob("*/index.html")):
        html = page.read_text(encoding="utf-8")
        found = list(heading.finditer(html))
        for i, m in enumerate(found):
            part = html[m.end():found[i + 1].start() if i + 1 < len(found) else len(html)]
            part = re.sub(r'<div class="doc-signature.*?</div>', "", part, flags=re.S)
            part = re.sub(r"<h[2-6].*?</h[2-6]>", "", part, flags=re.S)
            text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", part)).strip()
            if len(text) < 15:
                problems.append(f"{page.relative_to(site)}: {m.group(1)} has no description")
    return problems


def rendered_pages(site: Path) -> list[str]:
    problems = []
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue
        parser = _Text()
        parser.feed(page.read_text(encoding="utf-8"))
        where = page.relative_to(site)
        for line, text in parser.text:
            if "**" in text or "`" in text:
                problems.append(f"{where}:{line}: markdown shown literally: {text.strip()[:100]!r}")
        for src in parser.images:
            if re.match(r"[a-z]+:", src):
                problems.append(f"{where}: image from elsewhere (the site must hold it): {src}")
                continue
            target = (page.parent / src.split("#")[0]).resolve()
            if not target.is_file():
                problems.append(f"{where}: image not in the site: {src}")
    return problems


def sources(paths: list[Path] | None = None) -> list[str]:
    problems = []
    for path in paths or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if path.name == "changelog.md":  # (the changelog's page: CHANGELOG.md is history by design)
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "benchmarks/results/" in line:  # (a result's folder or file is named by its date and run)
                line = re.sub(r"benchmarks/results/\S+", "", line)
            for pattern, what in ((COMMIT, "a commit hash"), (ISSUE, "an issue number")):
                for m in pattern.finditer(FOREIGN_ISSUE.sub("", line)):
                    problems.append(f"{path.name}:{n}: {what} ({m.group(0)}): say what is; history "
                                    "goes to CHANGELOG.md or benchmarks/results/")
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[1]) if len(argv) > 1 else ROOT / "site"
    if not (site / "index.html").is_file():
        print(f"{site} holds no built site: run `mkdocs build --strict` first")
        return 1
    problems = api_descriptions(site) + rendered_pages(site) + sources()
    for problem in problems:
        print(problem)
    print(f"check_site: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
