"""A library package's import graph, read from its source (imports at any level, lazy ones
too): what `tests/accum_keras3/test_layout.py` and
`tests/recompute_keras3/test_recompute_layout.py` check the layouts with."""

import ast
import os


def modules(package, inits=True):
    """dotted module name below `package` -> (the package it sits in, its path); a package's
    `__init__` under the package's own name (left out without `inits`)."""
    folder = os.path.dirname(package.__file__)
    found = {}
    for root, _, files in os.walk(folder):
        inner = os.path.relpath(root, folder).replace(os.sep, ".")
        inner = "" if inner == "." else inner
        for file in files:
            if not file.endswith(".py") or (file == "__init__.py" and not inits):
                continue
            stem = file[:-3]
            name = inner if stem == "__init__" else (f"{inner}.{stem}" if inner else stem)
            found[name] = (inner, os.path.join(root, file))
    return found


def imports(package, inits=True):
    """module -> the modules of `package` it imports (relative imports, at any level)."""
    found = modules(package, inits)

    def resolve(inner, level, module):
        parts = inner.split(".") if inner else []
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    graph = {}
    for name, (inner, path) in found.items():
        names = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = resolve(inner, node.level, node.module)
                for alias in node.names:
                    target = f"{base}.{alias.name}" if base else alias.name
                    names.add(target if target in found else base)
        graph[name] = names - {name}
    return graph


def reachable(graph, start):
    """Every module `start` reaches through `graph`."""
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def cyclic(graph):
    """The modules that reach themselves."""
    return sorted(m for m in graph if m in reachable(graph, m))
