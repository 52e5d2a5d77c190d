"""No kog module uses another kog module's private names.

The rule, checked on every source file under python/kog/ with `ast`:

- A private name is an identifier that starts with one underscore and is not a dunder
  (`_x`, `__x`; not `_` alone, not `__x__`).
- It belongs to the modules that define it: as a module-level def, class or assignment, as a
  def or assignment in a class body (dataclass fields included), or as an attribute assigned
  on `self`/`cls` (`self._x = ...`).
- A module violates the rule when it
  1. imports a private name from a kog module (`from kog.x import _y`, `from .x import _y`), or
  2. reads or writes `<anything>._y` where `_y` is one of kog's private names and the module
     itself does not define `_y` (`engine._requests`, `ops._DTYPE_CODE`, `stream._push(...)`).
  Private names of other libraries (`torch._C`, a namedtuple's `_replace`) are not kog's and
  are not checked. `kog._C` is the native extension: a public module with a C++-given name.
  `getattr(obj, "_y")` is not seen (none is written: keep it that way).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

KOG = Path(__file__).resolve().parents[2] / "python" / "kog"
PUBLIC_UNDERSCORE = {"_C"}  # kog._C, the native module

ALLOWED: set[tuple[str, str]] = set()  # (module, private name) exceptions; none today


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    name: str
    how: str  # "import" or "attribute"

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.how} of private name {self.name}"


def is_private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(KOG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join(base + ([node.module] if node.module else []))


def defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines (see the module docstring)."""
    names: set[str] = set()

    def targets(stmt: ast.stmt) -> list[ast.expr]:
        if isinstance(stmt, ast.Assign):
            return stmt.targets
        if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            return [stmt.target]
        return []

    def scope(body: list[ast.stmt]) -> None:  # module or class body
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            for t in targets(stmt):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
            if isinstance(stmt, ast.ClassDef):
                scope(stmt.body)

    scope(tree.body)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {n for n in names if is_private(n)}


def parse_all() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(KOG.rglob("*.py"))}


def find_violations(sources: dict[str, tuple[Path, ast.Module]]) -> list[Violation]:
    own = {m: defined_private_names(tree) for m, (_, tree) in sources.items()}
    kog_private = set().union(*own.values()) - PUBLIC_UNDERSCORE
    found = []
    for module, (path, tree) in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = resolve_from(module, path.name == "__init__.py", node)
                if source != "kog" and not source.startswith("kog."):
                    continue
                for alias in node.names:
                    if is_private(alias.name) and alias.name not in PUBLIC_UNDERSCORE and source != module:
                        found.append(Violation(module, node.lineno, alias.name, "import"))
            elif isinstance(node, ast.Attribute) and node.attr in kog_private and node.attr not in own[module]:
                found.append(Violation(module, node.lineno, node.attr, "attribute"))
    return found


# ---- the checker itself, on small sources -------------------------------------------------------
def check(files: dict[str, str]) -> list[tuple[str, str, str]]:
    sources = {m: (Path(m.replace(".", "/") + ".py"), ast.parse(src)) for m, src in files.items()}
    return [(v.module, v.name, v.how) for v in find_violations(sources)]


def test_checker_flags_private_imports_and_attributes():
    a = "_SECRET = 1\nclass Engine:\n    def _helper(self):\n        self._state = 0\n"
    b = ("from kog.a import _SECRET, Engine\nimport kog.a as a\n"
         "def f(e):\n    return e._helper(), e._state, a._SECRET\n")
    assert sorted(check({"kog.a": a, "kog.b": b})) == [
        ("kog.b", "_SECRET", "attribute"), ("kog.b", "_SECRET", "import"),
        ("kog.b", "_helper", "attribute"), ("kog.b", "_state", "attribute")]


def test_checker_allows_own_names_dunders_other_libraries_and_kog_C():
    a = ("import torch\nfrom kog import _C\nfrom . import _C as native\nclass T:\n"
         "    _cache = None\n    def __eq__(self, o):\n        return o._cache is self._cache\n"
         "def g(t, p):\n    return t._cache, p._replace(x=1), torch._C, _C.f(), t.__dict__\n")
    assert check({"kog.a": a}) == []


def test_checker_resolves_relative_imports():
    assert check({"kog.x.a": "_P = 1\n", "kog.x.b": "from .a import _P\n"}) == [("kog.x.b", "_P", "import")]
    assert check({"kog.x.a": "_P = 1\n", "kog.x": "from .a import _P\n"}) == [("kog.x", "_P", "import")]


# ---- the rule on kog ----------------------------------------------------------------------------
def test_no_module_uses_another_modules_private_names():
    violations = find_violations(parse_all())
    unexpected = [str(v) for v in violations if (v.module, v.name) not in ALLOWED]
    assert not unexpected, "private names used across modules:\n" + "\n".join(unexpected)


def test_allow_list_entries_are_still_violations():
    seen = {(v.module, v.name) for v in find_violations(parse_all())}
    stale = ALLOWED - seen
    if stale:
        pytest.fail(f"remove these ALLOWED entries, the violations are gone: {sorted(stale)}")
