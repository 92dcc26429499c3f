"""Reads a source tree with `ast` alone (nothing is imported) for the structure rules in
tests/test_structure.py: the import graph, module and function sizes, and text that points
outside the repository."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

PRODUCTION_PACKAGES = ("enginecore", "protocol", "worker", "pagedkernels", "launch")
HOT_PATH_MARK = "# hot path:"


def package_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of the given packages (dotted names), by dotted name; a package is its
    `__init__` under the package's own name. A package that is not there is an error, so a
    rule never passes on an empty walk."""
    modules: dict[str, Path] = {}
    for package in packages:
        folder = root.joinpath(*package.split("."))
        if not (folder / "__init__.py").is_file():
            raise FileNotFoundError(f"no package {package} under {root}")
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _child_blocks(node: ast.stmt) -> Iterator[list[ast.stmt]]:
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list):
            yield block
    for handler in getattr(node, "handlers", ()):  # try / except
        yield handler.body
    for case in getattr(node, "cases", ()):  # match
        yield case.body


def _import_nodes(
    body: list[ast.stmt], *, module_level: bool
) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements in `body`. With `module_level`, only those run when the module is
    imported: function bodies and `if TYPE_CHECKING:` blocks are left out (class bodies run)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not module_level:
                yield from _import_nodes(node.body, module_level=False)
        elif isinstance(node, ast.If) and module_level and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, module_level=True)
        else:
            for block in _child_blocks(node):
                yield from _import_nodes(block, module_level=module_level)


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_names(path: Path, importer: str, *, module_level: bool) -> set[str]:
    """Dotted names a module imports: `import a.b` gives `a.b`; `from a import b` gives both
    `a` and `a.b` (b may be a module or a name in `a`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in _import_nodes(tree.body, module_level=module_level):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = _resolve_from(node, importer, is_package)
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _deepest_known(name: str, known: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(modules: dict[str, Path], *, module_level: bool = True) -> dict[str, set[str]]:
    """Edges from each module to the modules of `modules` it imports: a name resolves to the
    deepest module that exists, so importing a package counts as importing its `__init__`."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name, module_level=module_level):
            target = _deepest_known(imported, modules)
            if target is not None and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None; depth-first with an explicit stack."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def forbidden_imports(modules: dict[str, Path], forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    """Per module, the forbidden top-level packages it imports anywhere: at module level,
    in a function, or for type checking."""
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        hits = {
            imported.split(".")[0]
            for imported in imported_names(path, name, module_level=False)
            if imported.split(".")[0] in forbidden
        }
        if hits:
            found[name] = hits
    return found


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of each function longer than `limit` lines, from its `def` to
    its last line, unless the line above the def (or its first decorator) is a comment that
    starts with HOT_PATH_MARK."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                above = lines[first - 2].strip() if first >= 2 else ""
                if length > limit and not above.startswith(HOT_PATH_MARK):
                    found.append((name, length))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _is_build_output(part: str) -> bool:
    return part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")


def tracked_files(root: Path) -> list[Path]:
    """The files git tracks under `root` when it is a work tree's top; else every file but
    hidden folders and build outputs."""
    git = ["git", "-C", str(root)]
    try:
        top = subprocess.run(
            [*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if Path(top).resolve() == root.resolve():
            listed = subprocess.run(
                [*git, "ls-files", "-z"], capture_output=True, check=True
            ).stdout.decode()
            return [root / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(map(_is_build_output, p.relative_to(root).parts))
    )


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def imports_of_test_modules(root: Path) -> dict[str, set[str]]:
    """Per module under tests/, the other test modules (`test_*.py`) it imports anywhere."""
    modules = package_modules(root, ("tests",))
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        hits = set()
        for imported in imported_names(path, name, module_level=False):
            target = _deepest_known(imported, modules)
            if target and target != name and target.rsplit(".", 1)[-1].startswith("test_"):
                hits.add(target)
        if hits:
            found[name] = hits
    return found


# Built by parts so this file does not itself hold the markers it looks for.
OUTSIDE_MARKERS = ("../" + "shared", "DESIGN" + ".md", "STYLE" + ".md")


def outside_pointers(files: list[Path], root: Path) -> list[str]:
    """'path: marker' for each text file that names something outside the repository."""
    found = []
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        found.extend(
            f"{path.relative_to(root)}: {marker}" for marker in OUTSIDE_MARKERS if marker in text
        )
    return found
