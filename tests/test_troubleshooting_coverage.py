"""Every error message the library raises has an entry in docs/troubleshooting.md.

The library's source (``accum_fused/``, every module: core, backends, integrations, nn, recovery,
bench; and ``setup.py``, whose build errors a user meets first) is parsed with :mod:`ast`, and
each ``raise`` is reduced to a *key*, a piece of its message's literal text; the test asserts
that each key appears in docs/troubleshooting.md, with runs of whitespace collapsed on both sides
(so the page may wrap a message over several lines).
A new error without a doc entry fails here, naming its file:line and the key to add.

How a message's key is taken (``_segments``, ``_key``):

* The message is the first positional argument of the exception's constructor: a string, an
  f-string, implicit or ``+`` concatenations of them, ``"..." % x`` or ``"...".format(x)``. Its
  *literal segments* are the runs of text between placeholders.
* The key is the message's leading text: its segments from the first, placeholders in between
  kept as "…", until at least ``MIN_KEY`` (20) literal characters are taken; cut at a word
  boundary after at most ``MAX_KEY`` (80). A placeholder that opens the message is dropped
  (``f"{type(self).__name__} does not ..."`` is keyed from "does not ..."). On the page a "…"
  matches any text of up to 60 characters on one line, so the page may quote the message with an
  example value (``unknown backend 'cuda': choose one of``) or a name in angle brackets.
  The page must therefore quote each message's stable leading text, not all of a long one.
* Messages built elsewhere are followed within the same module, a few calls deep:
  - ``raise RuntimeError(msg)``: ``msg``'s assignments in the enclosing function;
  - ``raise RuntimeError(_miscount(...))`` / ``self.problem(...)``: the ``return`` values of the
    function of that name in the module;
  - ``raise _accelerate_error(...)``: a helper that *returns* the exception: its ``return``
    statements' constructors.
* ``warnings.warn`` calls are collected by the same rules and must appear on the page too (its
  "Warnings" section).

Left out, by rule (``Site.excluded``; counted and listed with ``pytest -s``):

* raises without a message: a bare ``raise``, ``raise exc`` / ``raise exc from ...`` of a caught
  exception (its message is torch's or an earlier raise's), ``raise NotImplementedError`` with no
  argument (abstract methods, never reached by a user);
* ``SystemExit(str(exc))``: the CLI re-raising a message raised (and keyed) elsewhere;
* the sites in ``UNRESOLVED_OK`` below, each with the reason: a message passed in from a caller,
  whose text is keyed at the site that builds it.

A raise the rules cannot reduce, and that is not in ``UNRESOLVED_OK``, fails the test: widen the
rules or list it with its reason, never drop it silently.

Not covered, knowingly:

* text computed at run time is keyed only by its literal part: ``f"... with {'; '.join(problems)}"``
  checks "got DTensor parameters with", not each problem the list can hold (the page lists them);
* the C++ extension's ``TORCH_CHECK``s (csrc/): argument checks of the kernels' entry points,
  which the Python side validates before calling them; a user meets them only by calling
  ``accum_fused._C`` directly;
* errors raised by torch, the frameworks or Python itself on accum_fused's behalf (torch's own
  argument validation, which the optimizers keep), and ``benchmarks/`` and ``examples/`` scripts.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "accum_fused")
PAGE = os.path.join(ROOT, "docs", "troubleshooting.md")
MIN_KEY, MAX_KEY = 20, 80
_DEPTH = 4  # how many helper calls a message is followed through

# (path relative to the repository, the raised name) -> why its message is keyed elsewhere.
UNRESOLVED_OK = {
    ("accum_fused/nn/batchnorm.py", "problem"):
        "the text of _Record.problem(), i.e. _miscount()'s message, keyed at the raises that call "
        "_miscount() directly (BatchNorm called a different number of times per micro-batch)",
}


@dataclass
class Site:
    path: str
    line: int
    kind: str  # "raise" or "warn"
    keys: list  # one key per message the site can raise (a helper may build several)
    excluded: str = ""  # why it is left out, by rule
    messages: list = None  # each message's literal segments (placeholders between them)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _segments(node: ast.AST, module: "_Module", depth: int) -> list[list[str]] | None:
    """The literal segments of each message ``node`` can evaluate to (several for helpers with
    several returns), or None when it cannot be reduced."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [[node.value]]
    if isinstance(node, ast.JoinedStr):
        parts, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant):
                current += value.value
            else:
                parts.append(current)
                current = ""
        parts.append(current)
        return [parts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _segments(node.left, module, depth), _segments(node.right, module, depth)
        if left is None and right is None:
            return None
        if left is None:
            return [[""] + r for r in right]
        if right is None:
            return [l + [""] for l in left]
        return [l[:-1] + [l[-1] + r[0]] + r[1:] for l in left for r in right]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        inner = _segments(node.left, module, depth)
        return None if inner is None else [re.split(r"%[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]", "".join(s)) for s in inner]
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "format":
            inner = _segments(func.value, module, depth)
            return None if inner is None else [re.split(r"\{[^}]*\}", "".join(s)) for s in inner]
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name is not None and depth > 0:
            return module.returned_messages(name, depth - 1)
    if isinstance(node, ast.IfExp):
        a, b = _segments(node.body, module, depth), _segments(node.orelse, module, depth)
        if a is None or b is None:
            return None
        return a + b
    return None


PLACEHOLDER = "…"  # in a key: any text of at most _GAP characters (the page may name an example value)
_GAP = 60


def _key(segments: list[str]) -> str:
    """The message's leading literal text, at least MIN_KEY and at most about MAX_KEY characters
    of it, placeholders kept as PLACEHOLDER; a placeholder that opens the message is dropped."""
    pieces = [re.sub(r"\s+", " ", s) for s in segments]
    pieces[0] = pieces[0].lstrip()
    while pieces and not pieces[0]:
        pieces.pop(0)  # f"{type(self).__name__} does not ...": the key starts after the name
    key, literal = "", 0
    for i, piece in enumerate(pieces):
        if i:
            key += PLACEHOLDER
        room = MAX_KEY - literal
        if len(piece) > room:
            cut = piece[:room]
            piece = cut[: cut.rfind(" ")] if " " in cut else cut
        key += piece
        literal += len(piece)
        if literal >= MIN_KEY:
            break
    return key.strip().rstrip(PLACEHOLDER).rstrip(" :;,('\"")


def _key_pattern(key: str) -> re.Pattern:
    gap = r"[^\n]{0,%d}?" % _GAP
    return re.compile(gap.join(re.escape(part) for part in key.split(PLACEHOLDER)))


class _Module:
    def __init__(self, path: str):
        self.path = os.path.relpath(path, ROOT)
        with open(path) as f:
            self.tree = ast.parse(f.read(), filename=path)
        self.functions: dict[str, list[ast.AST]] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)

    def returned_messages(self, name: str, depth: int) -> list[list[str]] | None:
        """The messages a helper returns: strings, or exceptions constructed with one."""
        found = []
        for fn in self.functions.get(name, []):
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and node.value is not None:
                    value = node.value
                    if isinstance(value, ast.Constant) and value.value is None:
                        continue
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and \
                            value.func.id.endswith(("Error", "Exception", "Exit")) and value.args:
                        value = value.args[0]
                    segs = _segments(value, self, depth)
                    if segs is None:
                        return None
                    found += segs
        return found or None

    def enclosing_function(self, node: ast.AST):
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def assigned_messages(self, name: str, site: ast.AST) -> list[list[str]] | None:
        fn = self.enclosing_function(site)
        found = []
        for node in ast.walk(fn) if fn is not None else []:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                segs = _segments(node.value, self, _DEPTH)
                if segs is None:
                    return None
                found += segs
        return found or None


def _is_exception_name(func: ast.AST) -> bool:
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith(("Error", "Exception", "Exit", "Warning")) or name in {"StopIteration", "KeyboardInterrupt"}


def _sources() -> list[str]:
    """The package's modules, and setup.py (its build errors are the first a user can meet)."""
    paths = [os.path.join(ROOT, "setup.py")]
    for dirpath, _, files in os.walk(PACKAGE):
        paths += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return paths


def collect_sites() -> list[Site]:
    sites = []
    for path in _sources():
        module = _Module(path)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Raise):
                sites.append(_raise_site(module, node))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("warnings.warn", "warn") and node.args:
                sites.append(_message_site(module, node, node.args[0], "warn"))
    return sorted(sites, key=lambda s: (s.path, s.line))


def _raise_site(module: _Module, node: ast.Raise) -> Site:
    exc = node.exc
    if exc is None:
        return Site(module.path, node.lineno, "raise", [], "bare re-raise")
    if not isinstance(exc, ast.Call):
        return Site(module.path, node.lineno, "raise", [], "re-raise of a caught exception or class without message")
    if _is_exception_name(exc.func):
        if not exc.args:
            return Site(module.path, node.lineno, "raise", [], "no message (abstract method)")
        arg = exc.args[0]
        if isinstance(arg, ast.Call) and ast.unparse(arg.func) == "str":
            return Site(module.path, node.lineno, "raise", [], "re-raises another exception's message (str(exc))")
        return _message_site(module, node, arg, "raise")
    # raise helper(...): a function that returns the exception
    name = exc.func.id if isinstance(exc.func, ast.Name) else getattr(exc.func, "attr", None)
    segs = module.returned_messages(name, _DEPTH) if name else None
    return _site_from_segments(module, node, segs, "raise", name or ast.unparse(exc.func))


def _message_site(module: _Module, node: ast.AST, arg: ast.AST, kind: str) -> Site:
    if isinstance(arg, ast.Name):
        segs = module.assigned_messages(arg.id, node)
        return _site_from_segments(module, node, segs, kind, arg.id)
    return _site_from_segments(module, node, _segments(arg, module, _DEPTH), kind, ast.unparse(arg)[:40])


def _site_from_segments(module, node, segs, kind, label) -> Site:
    if segs is None:
        reason = UNRESOLVED_OK.get((module.path, label))
        if reason is None:
            return Site(module.path, node.lineno, kind, None, f"UNRESOLVED ({label})")
        return Site(module.path, node.lineno, kind, [], f"keyed elsewhere: {reason}")
    return Site(module.path, node.lineno, kind, sorted({_key(s) for s in segs}), messages=segs)


def test_every_raise_is_reduced_to_a_key():
    unresolved = [s for s in collect_sites() if s.keys is None]
    assert not unresolved, (
        "these raises build their message in a way the rules of tests/test_troubleshooting_coverage.py "
        "cannot follow: " + "; ".join(f"{s.where()} {s.excluded}" for s in unresolved)
        + ". Build the message in the raise (or a helper in the same module), or add the site to UNRESOLVED_OK "
        "with the reason")


def test_every_error_message_has_a_troubleshooting_entry():
    assert os.path.exists(PAGE), "docs/troubleshooting.md is missing"
    with open(PAGE) as f:
        page = _normalise(f.read())
    sites = collect_sites()
    missing = [(s, k) for s in sites if s.keys for k in s.keys if not _key_pattern(k).search(page)]
    counted = [s for s in sites if s.keys]
    excluded = [s for s in sites if s.keys is not None and not s.keys]
    print(f"\n{len(counted)} sites ({sum(s.kind == 'warn' for s in counted)} warnings), "
          f"{len({k for s in counted for k in s.keys})} distinct keys; {len(excluded)} left out:")
    for s in excluded:
        print(f"  {s.where()}: {s.excluded}")
    assert not missing, (
        f"{len(missing)} error message(s) have no entry in docs/troubleshooting.md; add each (its text, what it "
        "means, the fix) under the right heading:\n"
        + "\n".join(f"  {s.where()} ({s.kind}): {k!r}" for s, k in missing))


_QUOTE = re.compile(r"\*\*(`+) ?(.+?) ?\1\*\*")  # how the page quotes a message: **`text`** (**`` text ``**)


def _quote_fits(quote: str, segments: list[str]) -> bool:
    """Whether ``quote`` (the page's text of a message) is the message whose literal
    ``segments`` are given, with each placeholder between them standing for an example value
    (at most _GAP characters) and a "…" in the quote for text left out: its text up to its
    first "…" must be the message's (or a beginning of it, where "…" follows), character for
    character. A placeholder that opens the message may be left out (the page quotes from the
    key), and so may a trailing one."""
    head, cut = (quote.split(PLACEHOLDER, 1)[0], True) if PLACEHOLDER in quote else (quote, False)
    head = head.rstrip() if cut else head
    literals = [_normalise(seg) if i in (0, len(segments) - 1) else re.sub(r"\s+", " ", seg)
                for i, seg in enumerate(segments)]

    def match(q: int, i: int, c: int) -> bool:
        # quote position q, segment i, character c in it
        while i < len(literals) and c < len(literals[i]):
            if q == len(head):
                return cut
            if head[q] != literals[i][c]:
                return False
            q, c = q + 1, c + 1
        if i >= len(literals) - 1:
            return q == len(head)
        # a placeholder between segment i and i + 1: any text of at most _GAP characters
        if q == len(head) or (i + 1 == len(literals) - 1 and literals[-1] == ""):
            return True  # (the quote ends at a placeholder, or the message does: any value)
        return any(match(q + n, i + 1, 0) for n in range(0, min(_GAP, len(head) - q) + 1))

    if match(0, 0, 0):
        return True
    # the quote may start after a placeholder that opens the message (a name: `AdamW.run(): …`
    # quoted as `.run(): …` is not done, but a message keyed from its second segment is)
    return len(literals) > 1 and literals[0] == "" and match(0, 1, 0) if literals else False


def test_a_quoted_message_is_the_message_in_full():
    """Where the page quotes a message (**`…`**) that a raise builds, the quote is that
    message's text, not only its leading key (issue 44 row 4: the page quoted
    ``one of ('nearest', …), got 'round'`` where the code said ``one of 'nearest', …``)."""
    with open(PAGE) as f:
        page = f.read()
    quotes = [_normalise(q) for _, q in _QUOTE.findall(page.replace("\n", " "))]
    wrong = []
    for site in collect_sites():
        for segments in site.messages or []:
            key = _key_pattern(_key(segments))
            quoted = [q for q in quotes if key.search(q)]
            if quoted and not any(_quote_fits(q, segments) for q in quoted):
                wrong.append(f"{site.where()}: {''.join(s + PLACEHOLDER for s in segments)[:-1]!r} "
                             f"quoted as {quoted[0]!r}")
    assert not wrong, "the page's quote differs from the message:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("quote, segments, fits", [
    ("bf16_update must be one of ('nearest', 'stochastic', 'kahan'), got 'round'",
     ["bf16_update must be one of ", ", got ", ""], True),
    ("AdamW.run(): a part of one sample still runs out of memory (…); part sizes tried: 8",
     ["", ".run(): a part of one sample still runs out of memory (", "); part sizes tried: ", ""], True),
    ("process_group must be a ProcessGroup or None", ["process_group must be a ProcessGroup"], False),
    ("process_group must be a ProcessGroup or None", ["process_group must be a ", ""], True),
    ("AdamW got DTensor parameters with a 2-D device mesh (HSDP / tensor parallel are not supported yet; FSDP2 "
     "on a 1-D mesh is)", ["", " got DTensor parameters with ", ""], True),
    ("weight must be finite and > 0, got", ["weight must be finite and > 0, got ", ""], True),
    ("weight must be finite and >= 0, got 0", ["weight must be finite and > 0, got ", ""], False),
    ("a message … whatever follows", ["a message that goes on", ""], True),
    ("a messages … whatever follows", ["a message that goes on", ""], False),
])
def test_quote_rule(quote, segments, fits):
    assert _quote_fits(quote, segments) is fits


@pytest.mark.parametrize("segments, key", [
    (["weight must be finite and > 0, got ", ""], "weight must be finite and > 0, got"),
    (["", " does not support sparse gradients (a parameter has one); use torch.optim.SparseAdam or "
          "nn.Embedding(sparse=False)"],
     "does not support sparse gradients (a parameter has one); use"),  # cut at a word, <= MAX_KEY
    (["unknown backend ", ": choose one of ", "; available here: ", ""], "unknown backend …: choose one of"),
    (["not a size: ", " (examples: 100k)"], "not a size: … (examples: 100k)"),
    (["size ", ""], "size"),
])
def test_key_rule(segments, key):
    assert _key(segments) == key


def test_key_pattern_allows_an_example_value_for_a_placeholder():
    page = _normalise("`unknown backend 'cuda': choose one of ('auto', 'torch')`")
    assert _key_pattern("unknown backend …: choose one of").search(page)
    assert not _key_pattern("unknown backend …: choose two of").search(page)
