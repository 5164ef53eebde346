"""The judging protocol's names: which of the tests' names are the harness's own imports, and which the program's."""
import importlib
import importlib.util
import math
import sys

# Library names a test may use relying on the solution's import (MBPP writes `assert ... == pi * r * r` after a
# solution's `from math import pi`): a program's own definition of one is judged both ways.
LIBRARY_NAMES = {**{n: ("math", n) for n in dir(math) if not n.startswith("_")},
                 **{n: ("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque", "namedtuple")},
                 "Fraction": ("fractions", "Fraction"), "Decimal": ("decimal", "Decimal")}
TESTS_MODULE = "__tandem_tests__"  # the tests' module name (`__module__` of the classes they define)
MODULE_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "sp": "scipy", "nx": "networkx"}


def harness_import(module_name):
    top = module_name.partition(".")[0]
    try:
        if top.isidentifier() and (top in sys.stdlib_module_names or importlib.util.find_spec(top)):
            return importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - not importable here
        pass
    return None


def static_bindings(source):
    """Names the program binds only by imports, from its source: name -> ("module", module) or ("attr", module,
    name). A name bound any other way (a def, an assignment, a parameter of no function: module scope or `global`)
    is left out: it is the program's."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    imports, defined, stars = {}, set(), []
    declared_global = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}

    def visit(node, top):
        if isinstance(node, ast.Import) and top:
            for a in node.names:
                bound = a.asname or a.name.partition(".")[0]
                imports.setdefault(bound, []).append(("module", a.name if a.asname else bound))
        elif isinstance(node, ast.ImportFrom) and top and node.level == 0 and node.module:
            for a in node.names:
                if a.name == "*":
                    stars.append(node.module)
                else:
                    imports.setdefault(a.asname or a.name, []).append(("attr", node.module, a.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if top or node.name in declared_global:
                defined.add(node.name)
            for child in ast.iter_child_nodes(node):
                visit(child, False)
            return
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if top or node.id in declared_global:
                defined.add(node.id)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name and top:
            defined.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name and top:
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not top:
            for a in node.names:
                name = a.asname or a.name.partition(".")[0]
                if name in declared_global:
                    defined.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child, top and not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                       ast.GeneratorExp)))

    visit(tree, True)
    out = {name: origins[0] for name, origins in imports.items()
           if name not in defined and len(set(origins)) == 1}
    for module_name in stars:
        module = harness_import(module_name)
        public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in public if module is not None else ():
            if type(name) is str and name not in defined and name not in imports:
                out.setdefault(name, ("attr", module_name, name))
    return out


def used_as_module(tests_src):
    import ast

    try:
        nodes = list(ast.walk(ast.parse(tests_src)))
    except (SyntaxError, ValueError):
        return set()
    return {n.value.id for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
