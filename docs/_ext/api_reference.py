"""Sphinx extension: the API reference of a fedparity package, generated from its ``__all__``.

``.. fedparity-api:: fedparity.mechanisms`` (inside a MyST ``{eval-rst}`` block) writes the
module's docstring, a summary table of the names in its ``__all__`` -- read at build time, so
the page follows the code -- and the autodoc entry of each name, grouped as classes,
exceptions, functions and data. A module without ``__all__`` is an error: the reference lists
what the package exports, nothing else.

A Python cross-reference that names no documented object (an internal helper such as
``fedparity.mechanisms.ldp.planner``, or a type from numpy, Flower or the standard library: there is
no intersphinx, the build is offline) is rendered as code without a link if the name imports to
a real object, and stays a warning (an error under ``-W``) if it does not: a renamed or
misspelt function in a docstring or a page fails the build.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util.docutils import switch_source_input

#: (section title, autodoc directive) in the order the page shows them.
KINDS: tuple[tuple[str, str], ...] = (
    ("Classes", "autoclass"),
    ("Exceptions", "autoexception"),
    ("Functions", "autofunction"),
    ("Data", "autodata"),
)


def exported_names(module_name: str) -> list[str]:
    """The module's ``__all__`` (a lazy package's is its stub's list), sorted."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if not names:
        raise ValueError(f"{module_name} has no __all__: the API reference lists only exports")
    return sorted(names, key=str.lower)


def kind_of(value: Any) -> str:
    """The autodoc directive that documents ``value``."""
    if inspect.isclass(value):
        return "autoexception" if issubclass(value, BaseException) else "autoclass"
    if callable(value):
        return "autofunction"
    return "autodata"


def summary_line(value: Any) -> str:
    """First paragraph of the docstring, on one line (empty if there is none)."""
    doc = inspect.getdoc(value) if not isinstance(value, str | int | float | tuple) else None
    if not doc:
        return ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    # Roles as plain code: the table's context is the package, not the docstring's module.
    return re.sub(
        r":[\w:]+:`~?(?:[^`<]*<)?([^`>]+)>?`", lambda m: f"``{m[1].split('.')[-1]}``", first
    )


def reference_lines(module_name: str) -> list[str]:
    """reStructuredText of the summary table and the autodoc entries."""
    module = importlib.import_module(module_name)
    by_kind: dict[str, list[str]] = {directive: [] for _, directive in KINDS}
    for name in exported_names(module_name):
        by_kind[kind_of(getattr(module, name))].append(name)

    lines = [f".. automodule:: {module_name}", "", ".. list-table::", "   :widths: 30 70", ""]
    for _, directive in KINDS:
        for name in by_kind[directive]:
            role = {"autoclass": "class", "autoexception": "exc", "autofunction": "func"}.get(
                directive, "data"
            )
            lines += [
                f"   * - :py:{role}:`~{module_name}.{name}`",
                f"     - {summary_line(getattr(module, name))}",
            ]
    lines.append("")
    for title, directive in KINDS:
        if not by_kind[directive]:
            continue
        lines += [f".. rubric:: {title}", ""]
        for name in by_kind[directive]:
            lines += [f".. {directive}:: {module_name}.{name}"]
            lines += ["   :members:", ""] if directive in ("autoclass", "autoexception") else [""]
    return lines


class FedparityApi(Directive):
    """``.. fedparity-api:: <module>``: the module's exports, summarised and documented."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        source = f"<fedparity-api {module_name}>"
        content = StringList(reference_lines(module_name), source=source)
        container = nodes.container()
        with switch_source_input(self.state, content):
            self.state.nested_parse(content, 0, container)
        return container.children


def import_object(dotted: str) -> Any:
    """The module or object ``dotted`` names (``a.b.c``: module ``a.b``, attribute c).

    Raises LookupError if it names nothing.
    """
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        except Exception as error:  # a module that fails to import names nothing here
            raise LookupError(dotted) from error
        for attribute in parts[split:]:
            if hasattr(value, attribute):
                value = getattr(value, attribute)
            elif inspect.isclass(value) and any(
                attribute in vars(base).get("__annotations__", {}) for base in value.__mro__
            ):
                value = None  # a dataclass field without a default: declared, not set
            else:
                raise LookupError(dotted)
        return value
    raise LookupError(dotted)


def names_object(dotted: str) -> bool:
    """Whether ``dotted`` names a real module or object."""
    try:
        import_object(dotted)
    except LookupError:
        return False
    return True


def candidate_targets(node: nodes.Element) -> list[str]:
    """Full names a Python reference may mean: as written, or inside the current module or
    class, the documented object, or the module that defines one of them (autodoc documents
    ``fedparity.mechanisms.X`` from ``fedparity.mechanisms.ldp.estimators``, where the docstring's
    short names live)."""
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    scopes = [module, cls, f"{module}.{cls}" if module and cls else None]
    # A name in a class's own signature has no py:class: the enclosing signature names it.
    parent = node.parent
    while parent is not None and not isinstance(parent, addnodes.desc_signature):
        parent = parent.parent
    if parent is not None and parent.get("module") and parent.get("fullname"):
        scopes.append(f"{parent['module']}.{parent['fullname']}")
    source = node.source or ""
    if "docstring of " in source:
        parts = source.rsplit("docstring of ", 1)[1].split(":")[0].split(".")
        scopes += [".".join(parts[:end]) for end in range(len(parts), 1, -1)]
    for scope in [scope for scope in scopes if scope and names_object(scope)]:
        defined_in = getattr(import_object(scope), "__module__", None)
        if isinstance(defined_in, str):
            scopes.append(defined_in)
    return [target] + [f"{scope}.{target}" for scope in scopes if scope]


def resolve_undocumented(
    app: Sphinx, env: Any, node: nodes.Element, contnode: nodes.Element
) -> nodes.Element | None:
    """A Python reference to a real but undocumented object: its text, without a link."""
    if node.get("refdomain") != "py":
        return None
    if any(names_object(name) for name in candidate_targets(node)):
        return contnode
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("fedparity-api", FedparityApi)
    app.connect("missing-reference", resolve_undocumented)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
