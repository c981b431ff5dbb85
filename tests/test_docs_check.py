"""docs/check_site.py, the checks the README's docs command runs after `mkdocs build --strict`:
each finds what it is for on a made-up site, passes what is right, and the repository's own
README and pages name no commit and no issue of ours (the rule needs no built site)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_site", ROOT / "docs" / "check_site.py")
check_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_site)


def _page(site: Path, rel: str, body: str) -> None:
    path = site / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><body>{body}</body></html>", encoding="utf-8")


def _api_object(name: str, description: str) -> str:
    return (f'<div class="doc doc-object doc-function"><h3 id="{name}" class="doc doc-heading">'
            f'<span>{name.rsplit(".", 1)[-1]}</span></h3><div class="doc-signature highlight"><pre><code>'
            f'{name}(x: int = 1) -&gt; None</code></pre></div><div class="doc doc-contents">{description}</div></div>')


def test_an_api_object_without_a_description_is_found(tmp_path):
    _page(tmp_path, "index.html", "<p>home</p>")
    _page(tmp_path, "reference/optimizers/index.html",
          _api_object("accum_fused.SGD.step", "<p>Accumulate this micro-batch's gradients.</p>")
          + _api_object("accum_fused.SGD.flush", ""))
    problems = check_site.api_descriptions(tmp_path)
    assert len(problems) == 1 and "accum_fused.SGD.flush has no description" in problems[0]


def test_markdown_shown_literally_and_missing_images_are_found(tmp_path):
    (tmp_path / "plot.png").write_bytes(b"\x89PNG")
    _page(tmp_path, "index.html", '<p>fine <code>**kwargs</code> and <code>`x`</code></p><img src="plot.png">')
    _page(tmp_path, "guide/index.html", "<p>**`AdamW.run()` …</p>\n<p>broken</p><img src=\"../gone.png\">"
          '<img src="https://example.com/x.png">')
    problems = check_site.rendered_pages(tmp_path)
    assert len(problems) == 3, problems
    assert "markdown shown literally" in problems[0] and "guide/index.html" in problems[0]
    assert "image not in the site: ../gone.png" in problems[1]
    assert "image from elsewhere" in problems[2]


def test_commits_and_issue_numbers_in_the_docs_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "Since 733499d the hooks write them.",                # a commit
        "What issue 31 asked for.",                           # our issue
        "Fixed in #412.",                                     # our issue, by number
        "PyTorch's own bug (pytorch #46516), transformers #986, https://github.com/a/b/issues/7.",
        "0.945× the native loop; 12 B/param; deadbeef is a word; 1234567 is a number.",
        "[json](benchmarks/results/gpu_check_h100_20261126/bench_cpu_20261121-144558.json)",
    ]), encoding="utf-8")
    problems = check_site.sources([page])
    assert [p.split(":")[1] for p in problems] == ["1", "2", "3"], problems


def test_the_readme_and_the_pages_say_what_is():
    assert check_site.sources() == []
