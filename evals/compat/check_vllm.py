"""Check what consensus_spec assumes of vLLM against a release's source, without a GPU.

    python -m evals check-vllm --installed            # the vLLM in this environment
    python -m evals check-vllm --version 0.33.0       # that release's wheel, downloaded once
    python -m evals check-vllm --source PATH          # a wheel file, or a folder holding vllm/

Nothing is imported from the vLLM being checked: its files are parsed
(``ast``) from the installed package, a folder, or the wheel's zip (a
``--version`` wheel is fetched once with ``pip download --no-deps`` into
``--cache``). Each assumption of :mod:`consensus_spec.vllm.assumptions` gets
one line: ``holds``, ``changed`` (file:line and what differs) or ``missing``.
Exit status 0 when every line holds, 1 otherwise, 2 when the source cannot
be had.
"""

from __future__ import annotations

import argparse
import ast
import copy
import glob
import importlib.util
import inspect
import os
import subprocess
import sys
import zipfile

from consensus_spec.vllm.assumptions import ASSUMPTIONS, CHECKED_VERSIONS, Assumption

from ..options import fail

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "consensus_spec", "vllm-wheels")


class Source:
    """The files of one vLLM package: a folder holding ``vllm/``, or a wheel."""

    def __init__(self, path: str, label: str):
        self.label = label
        self._zip = zipfile.ZipFile(path) if os.path.isfile(path) else None
        self._root = None if self._zip else path
        self._trees: dict[str, ast.Module | None] = {}

    def text(self, rel: str) -> str | None:
        """``rel`` (a path inside the vllm package) as text, None if absent."""
        name = f"vllm/{rel}"
        if self._zip is not None:
            try:
                return self._zip.read(name).decode("utf-8")
            except KeyError:
                return None
        try:
            with open(os.path.join(self._root, name), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._trees:
            text = self.text(rel)
            self._trees[rel] = None if text is None else ast.parse(text, filename=rel)
        return self._trees[rel]

    def version(self) -> str:
        """``__version__`` as ``vllm/_version.py`` assigns it ("?" if it cannot be read)."""
        tree = self.tree("_version.py")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return str(node.value.value)
        return "?"


# --- finding things in a parsed file -------------------------------------

def _members(body):
    """Statements of a module or class body, looking into module-level
    ``if``/``try`` blocks (``if TYPE_CHECKING:``) but not into functions."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from _members(node.body + node.orelse + getattr(node, "finalbody", []) +
                                [s for h in getattr(node, "handlers", []) for s in h.body])
        else:
            yield node


def _defines(node, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    return False


def resolve(tree: ast.Module, scope: str):
    """The node ``scope`` names in ``tree`` ("" the module; ``Class.method``,
    a module-level assignment or an imported name), and whether it is a
    method (its first parameter is the instance). None if absent."""
    node, in_class = tree, False
    for part in scope.split(".") if scope else ():
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            return None, False
        found = [n for n in _members(body) if _defines(n, part)]
        if not found:
            return None, False
        in_class, node = isinstance(node, ast.ClassDef), found[-1]  # the last definition wins
    is_method = in_class and not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                     for d in getattr(node, "decorator_list", []))
    return node, is_method


def normal(snippet: str) -> str:
    """Python source as ``ast.unparse`` writes it (quotes, spacing, line breaks)."""
    try:
        return ast.unparse(ast.parse(snippet.strip(), mode="eval").body)  # an expression
    except SyntaxError:
        return ast.unparse(ast.parse(snippet.strip()))  # a statement


def locate(node, text: str):
    """The deepest node under ``node`` whose source contains ``text`` (normalised)."""
    for child in ast.iter_child_nodes(node):
        if hasattr(child, "lineno") and text in ast.unparse(child):
            return locate(child, text) or child
    return None


def params(fn) -> str:
    """``fn``'s parameter list as written, annotations left out."""
    args = copy.deepcopy(fn.args)
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    return f"({ast.unparse(args)})"


def written(signature: str) -> str:
    """A parameter list as :func:`params` writes it: ``"(self, x: int=0)"`` -> ``"(self, x=0)"``."""
    return params(ast.parse(f"def f{signature}: pass").body[0])


def _signature(fn, drop_first: bool) -> inspect.Signature:
    """An ``inspect.Signature`` with ``fn``'s parameter kinds and which have
    defaults (the defaults themselves are not evaluated)."""
    a, P = fn.args, inspect.Parameter
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [P(x.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
             default=None if i >= first_default else P.empty) for i, x in enumerate(positional)]
    if a.vararg:
        out.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    out += [P(x.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
            for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(out[1:] if drop_first and out else out)


def accepts(fn, call: str, is_method: bool) -> bool:
    """Whether ``fn`` binds the call ``call`` (e.g. ``"(a, b, key=1)"``)."""
    c = ast.parse(f"f{call}", mode="eval").body
    try:
        _signature(fn, is_method).bind(*c.args, **{k.arg: k.value for k in c.keywords})
    except TypeError:
        return False
    return True


def still_fits(fn, signature: str) -> bool:
    """Whether every call written for ``signature`` (all its parameters, or
    only the required ones) binds ``fn``'s parameters to the same names."""
    old, new = ast.parse(f"def f{signature}: pass").body[0].args, _signature(fn, False)
    pos = [x.arg for x in old.posonlyargs + old.args]
    kws = [(x.arg, d is None) for x, d in zip(old.kwonlyargs, old.kw_defaults)]
    calls = ((pos, [k for k, _ in kws]), (pos[:len(pos) - len(old.defaults)], [k for k, req in kws if req]))
    for args, keywords in calls:
        try:
            bound = new.bind(*args, **{k: k for k in keywords})
        except TypeError:
            return False
        if any(name != value for name, value in bound.arguments.items()):
            return False
    return True


def _calls_named(node, call: ast.Call) -> list[ast.Call]:
    """Calls under ``node`` to a function of the same final name as ``call``'s."""
    def tail(f):
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    want = tail(call.func)
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and tail(n.func) == want]


def check(a: Assumption, src: Source) -> tuple[str, str, str]:
    """(status, file:line, detail) for one assumption."""
    try:
        tree = src.tree(a.file)
    except SyntaxError as e:  # written for a newer Python than this one
        return "changed", f"{a.file}:{e.lineno}", f"Python {sys.version.split()[0]} cannot parse it: {e.msg}"
    if tree is None:
        return "missing", a.file, "file not found"
    node, is_method = resolve(tree, a.scope)
    if node is None:
        return "missing", a.file, f"no {a.scope}"
    where = f"{a.file}:{getattr(node, 'lineno', 1)}"
    is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    if (a.signature or a.accepts) and not is_def:
        return "changed", where, f"{a.scope} is no longer a function"
    if a.signature and params(node) != written(a.signature):
        fits = "still fit" if still_fits(node, a.signature) else "no longer fit"
        return "changed", where, f"{a.scope}{params(node)}, was {a.signature}; calls written for it {fits}"
    if a.accepts and not accepts(node, a.accepts, is_method):
        return "changed", where, f"{a.scope}{params(node)} does not accept {a.accepts}"
    body = ast.unparse(node)
    for snippet in a.find:
        text = normal(snippet)
        if text in body:
            continue
        detail = f"not in {a.scope or a.file}: {text}"
        expr = ast.parse(text).body[0]
        if isinstance(expr, ast.Expr) and isinstance(expr.value, ast.Call):
            now = _calls_named(node, expr.value)
            if now:  # the calls of that name there now
                where = f"{a.file}:{now[0].lineno}"
                detail += "; there now: " + "; ".join(f"{ast.unparse(c)} (line {c.lineno})"
                                                      for c in now[:3])
        return "changed", where, detail
    for snippet in a.lacks:
        if normal(snippet) in body:
            hit = locate(node, normal(snippet))
            return "changed", f"{a.file}:{getattr(hit, 'lineno', where)}", f"now in {a.scope}: {normal(snippet)}"
    if a.find:
        hit = locate(node, normal(a.find[0]))
        where = f"{a.file}:{getattr(hit, 'lineno', getattr(node, 'lineno', 1))}"
    return "holds", where, ""


# --- where the source comes from ------------------------------------------

def installed() -> str:
    """The folder holding the importable ``vllm`` package (not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no vllm package is installed in this environment")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def wheel(version: str, cache: str) -> str:
    """The vLLM ``version`` wheel in ``cache``, downloaded with pip if not there yet."""
    found = sorted(glob.glob(os.path.join(cache, f"vllm-{version}-*.whl")))
    if not found:
        os.makedirs(cache, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", cache, f"vllm=={version}"]
        print("$", " ".join(cmd), flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise FileNotFoundError(f"pip download failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        found = sorted(glob.glob(os.path.join(cache, f"vllm-{version}-*.whl")))
        if not found:
            raise FileNotFoundError(f"pip download saved no vllm-{version} wheel in {cache}")
    return found[-1]


def report(src: Source) -> tuple[list[str], bool]:
    """The lines to print and whether every assumption holds."""
    version = src.version()
    known = "checked" if version in CHECKED_VERSIONS else "NOT in that list"
    lines = [f"vLLM {version} from {src.label} ({known})",
             f"consensus_spec is checked against vLLM {', '.join(CHECKED_VERSIONS)} "
             f"(consensus_spec.vllm.assumptions.CHECKED_VERSIONS)"]
    counts = {"holds": 0, "changed": 0, "missing": 0}
    width = max(len(a.name) for a in ASSUMPTIONS)
    for a in ASSUMPTIONS:
        status, where, detail = check(a, src)
        counts[status] += 1
        lines.append(f"{status:8s} {a.name:{width}s} {where}" + (f"  {detail}" if detail else ""))
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return lines, counts["holds"] == len(ASSUMPTIONS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals check-vllm", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--installed", action="store_true", help="the vLLM this Python imports")
    which.add_argument("--version", help="a vLLM release on PyPI, e.g. 0.33.0 (its wheel is downloaded)")
    which.add_argument("--source", help="a vLLM wheel file, or a folder holding the vllm package")
    ap.add_argument("--cache", default=CACHE, help=f"where --version wheels are kept (default {CACHE})")
    args = ap.parse_args(argv)
    try:
        if args.installed:
            path = installed()
            src = Source(path, f"installed, {os.path.join(path, 'vllm')}")
        elif args.version:
            path = wheel(args.version, args.cache)
            src = Source(path, os.path.basename(path))
        else:
            if not os.path.exists(args.source):
                raise FileNotFoundError(f"--source {args.source}: no such file or folder")
            src = Source(args.source, args.source)
    except (FileNotFoundError, zipfile.BadZipFile) as e:
        return fail(e)
    lines, ok = report(src)
    print("\n".join(lines))
    return 0 if ok else 1
