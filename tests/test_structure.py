"""The repository's shape as rules: no import cycle, the control plane free of torch, cupy
and the client free of the core, small files and functions, test modules that stand alone,
and text that never points outside the repository. Read with `ast`; nothing is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.source_tree import (
    HOT_PATH_MARK,
    OUTSIDE_MARKERS,
    PRODUCTION_PACKAGES,
    find_cycle,
    forbidden_imports,
    import_graph,
    imports_of_test_modules,
    line_count,
    long_functions,
    outside_pointers,
    package_modules,
    tracked_files,
)

ROOT = Path(__file__).resolve().parent.parent
SIZED_DIRS = (*PRODUCTION_PACKAGES, "benchmarks", "examples")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_README_LINES = 350


def _sized_files(root: Path) -> list[Path]:
    return [p for d in SIZED_DIRS if (root / d).is_dir() for p in sorted((root / d).rglob("*.py"))]


def _oversized_files(root: Path) -> list[str]:
    return [
        f"{p.relative_to(root)}: {n} lines"
        for p in _sized_files(root)
        if (n := line_count(p)) > MAX_FILE_LINES
    ]


def _overlong_functions(root: Path) -> list[str]:
    return [
        f"{p.relative_to(root)}: {name} {n} lines"
        for p in _sized_files(root)
        for name, n in long_functions(p, MAX_FUNCTION_LINES)
    ]


# --- the rules, on this repository ---------------------------------------------------------


def test_production_packages_import_one_another_without_a_cycle() -> None:
    graph = import_graph(package_modules(ROOT, PRODUCTION_PACKAGES))
    assert len(graph) >= 50  # every package was read, not an empty walk
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or ())


def test_enginecore_never_imports_torch_or_cupy() -> None:
    found = forbidden_imports(package_modules(ROOT, ("enginecore",)), ("torch", "cupy"))
    assert not found, f"enginecore imports the data plane: {found}"


def test_the_launch_client_never_imports_enginecore() -> None:
    found = forbidden_imports(package_modules(ROOT, ("launch.client",)), ("enginecore",))
    assert not found, f"launch/client reaches into the core process: {found}"


def test_no_production_file_is_over_600_lines() -> None:
    found = _oversized_files(ROOT)
    assert not found, "split by concept:\n" + "\n".join(found)


def test_no_production_function_is_over_80_lines_unless_marked_as_a_hot_path() -> None:
    found = _overlong_functions(ROOT)
    assert not found, f"split, or say why above the def ({HOT_PATH_MARK}):\n" + "\n".join(found)


def test_no_test_module_imports_another_test_module() -> None:
    found = [f"{a} imports {b}" for a, bs in imports_of_test_modules(ROOT).items() for b in bs]
    assert not found, "shared code belongs in tests/helpers or conftest:\n" + "\n".join(found)


def test_the_readme_is_at_most_350_lines() -> None:
    assert line_count(ROOT / "README.md") <= MAX_README_LINES


def test_no_tracked_text_points_outside_the_repository() -> None:
    files = tracked_files(ROOT)
    assert any(p.name == "README.md" for p in files)
    found = outside_pointers(files, ROOT)
    assert not found, "the repository must read on its own:\n" + "\n".join(found)


# --- each checker catches what it is for, on a tiny tree -----------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_relative_import_and_a_package_init_is_found(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from .sub import b\nA = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "import pkg\n",
        },
    )
    cycle = find_cycle(import_graph(package_modules(root, ("pkg",))))
    assert cycle == ["pkg", "pkg.a", "pkg.sub.b", "pkg"]


def test_imports_for_type_checking_or_inside_functions_make_no_cycle(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import a\n"
                "def f() -> None:\n    import pkg.a\n"
            ),
        },
    )
    modules = package_modules(root, ("pkg",))
    assert find_cycle(import_graph(modules)) is None
    assert find_cycle(import_graph(modules, module_level=False)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_an_import_inside_a_function_or_try_block_is_still_forbidden(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "core/__init__.py": "try:\n    import numpy\nexcept ImportError:\n    pass\n",
            "core/lazy.py": "def f() -> None:\n    from torch import nn\n",
        },
    )
    found = forbidden_imports(package_modules(root, ("core",)), ("torch", "cupy", "numpy"))
    assert found == {"core": {"numpy"}, "core.lazy": {"torch"}}


def _function(name: str, body_lines: int, indent: str = "") -> str:
    return f"{indent}def {name}() -> None:\n" + f"{indent}    x = 1\n" * body_lines


def test_a_long_file_and_a_long_function_are_reported(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "benchmarks/long.py": "class K:\n" + _function("m", MAX_FUNCTION_LINES, "    "),
            "examples/big.py": "x = 1\n" * (MAX_FILE_LINES + 1),
            "examples/ok.py": _function("f", MAX_FUNCTION_LINES - 1),
        },
    )
    assert _oversized_files(root) == [f"examples/big.py: {MAX_FILE_LINES + 1} lines"]
    assert _overlong_functions(root) == [f"benchmarks/long.py: K.m {MAX_FUNCTION_LINES + 1} lines"]


def test_a_hot_path_comment_above_the_def_or_its_decorator_excuses_length(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "worker/hot.py": (
                f"{HOT_PATH_MARK} one pass per step\n{_function('f', MAX_FUNCTION_LINES)}\n"
                f"{HOT_PATH_MARK} per block\n@staticmethod\n{_function('g', MAX_FUNCTION_LINES)}\n"
                f"# not a hot path\n{_function('h', MAX_FUNCTION_LINES)}"
            ),
        },
    )
    assert long_functions(root / "worker/hot.py", MAX_FUNCTION_LINES) == [
        ("h", MAX_FUNCTION_LINES + 1)
    ]


def test_a_test_module_importing_another_test_module_is_found(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "tests/__init__.py": "",
            "tests/conftest.py": "def fixture() -> None:\n    from tests.x.test_b import y\n",
            "tests/helpers/__init__.py": "",
            "tests/helpers/files.py": "",
            "tests/x/__init__.py": "",
            "tests/x/test_a.py": "from . import test_b\nfrom tests.helpers.files import z\n",
            "tests/x/test_b.py": "from tests.helpers import files\n",
        },
    )
    assert imports_of_test_modules(root) == {
        "tests.conftest": {"tests.x.test_b"},
        "tests.x.test_a": {"tests.x.test_b"},
    }


def test_text_naming_a_file_outside_the_repository_is_found(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "README.md": f"see {OUTSIDE_MARKERS[1]}\n",
            "docs/a.md": "all inside\n",
            "x.py": f"# {OUTSIDE_MARKERS[0]}/notes\n",
            ".venv/site.py": f"# {OUTSIDE_MARKERS[1]}\n",  # not the repository's text
        },
    )
    (root / "blob.bin").write_bytes(b"\0" + OUTSIDE_MARKERS[2].encode())
    found = outside_pointers(tracked_files(root), root)
    assert sorted(found) == [f"README.md: {OUTSIDE_MARKERS[1]}", f"x.py: {OUTSIDE_MARKERS[0]}"]


def test_a_sub_package_is_walked_by_its_dotted_name_and_a_missing_one_is_an_error(
    tmp_path: Path,
) -> None:
    root = _write(
        tmp_path, {"app/__init__.py": "", "app/client/__init__.py": "", "app/client/x.py": ""}
    )
    assert sorted(package_modules(root, ("app.client",))) == ["app.client", "app.client.x"]
    with pytest.raises(FileNotFoundError, match=r"app\.server"):
        package_modules(root, ("app.server",))
