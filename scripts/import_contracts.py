"""Contract types of our own for `lint-imports` (pyproject.toml `contract_types`), which imports this file from the
repository root: `private_names`, no module of a package uses a private name (`_x`) of another of its modules."""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


@dataclass(frozen=True, order=True)
class Use:
    """One use of a private name: `importer` (at `line`) takes `name` from `module`."""

    importer: str
    line: int
    module: str
    name: str

    @property
    def key(self) -> str:
        """How `ignore_imports` names it: `importer -> module.name`."""
        return f"{self.importer} -> {self.module}.{self.name}"


class PrivateNamesContract(Contract):
    """A name whose last part starts with one underscore is its module's own: no other module of `containers`
    imports it (`from m import _x`, those inside functions and under TYPE_CHECKING included) or reads it off the
    module (`m._x`). What two modules share is public, or it belongs in one of them. `ignore_imports` lists uses
    still allowed, as `importer -> module.name`; one that no longer occurs is an error, so the list only shrinks."""

    type_name = "private_names"

    containers = fields.ListField(subfield=fields.StringField())
    ignore_imports = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        ignored = set(self.ignore_imports or [])
        uses = sorted(u for package in self.containers for u in private_uses(package, graph.modules))
        broken = [u for u in uses if u.key not in ignored]
        stale = sorted(ignored - {u.key for u in uses})
        return ContractCheck(kept=not broken and not stale, metadata={"broken": broken, "stale": stale},
                             ignored_import_count=len(ignored) - len(stale))

    def render_broken_contract(self, check: ContractCheck) -> None:
        for use in check.metadata["broken"]:
            output.print_error(f"{use.importer}:{use.line} uses {use.name}, private to {use.module}")
        for key in check.metadata["stale"]:
            output.print_error(f"ignore_imports lists {key}, which no longer occurs: delete the entry")
        output.new_line()


def private_uses(package: str, modules: set[str]) -> list[Use]:
    """Every use, in the modules of `package`, of a private name of another of its modules."""
    spec = importlib.util.find_spec(package)  # a top-level package: found without running any of its code
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"private_names: {package!r} is not a package on the path")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    ours = {m for m in modules if m == package or m.startswith(package + ".")}
    uses = []
    for module in sorted(ours):
        path = root / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        uses += _uses_in(module, path.name == "__init__.py", ast.parse(path.read_text(), str(path)), ours)
    return uses


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _source(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a `from ... import` reads from, its dots resolved against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(parts + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _uses_in(module: str, is_package: bool, tree: ast.Module, ours: set[str]) -> list[Use]:
    """The private names of other modules of `ours` that `tree` (the source of `module`) imports or reads off an
    imported module."""
    uses, aliases = [], {}  # aliases: a local name -> the module of `ours` it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(module, is_package, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in ours:  # a module: its private names are read as attributes
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                if source in ours and source != module and _private(alias.name):
                    uses.append(Use(module, node.lineno, source, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ours:
                    name = alias.asname or alias.name.split(".")[0]
                    aliases[name] = alias.name if alias.asname else name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _dotted(node.value)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            target = aliases.get(head, "") + (f".{rest}" if rest else "")
            if target in ours and target != module:
                uses.append(Use(module, node.lineno, target, node.attr))
    return uses
