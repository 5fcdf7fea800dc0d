"""
The layering rules of docs/architecture.md, checked on the source: which
of iop's packages may import which, which modules inside the Edge may
import which, that only the wire layer imports the generated protobuf
module, and that no chain of imports (those inside functions included)
leads back to where it started. A violation names the module
and the import, so the arrow that points the wrong way is found at once.
"""

import ast
import pathlib

from twisted.trial.unittest import SynchronousTestCase

import iop

ROOT = pathlib.Path(iop.__file__).parent

#: package -> iop packages it must never import (tests included).
FORBIDDEN = {
    "run": {"protocols", "edge", "node", "adapters", "testing", "config"},
    "protocols": {"edge", "node", "adapters", "testing"},
    "adapters": {"protocols", "edge", "node"},
    "edge": {"adapters", "node"},
    "node": {"edge"},
}

#: (module, iop module) imports that cross those lines on purpose: the
#: Edge's configuration checks the adapters of edge.yaml with the Node's
#: own build (a bad option stops the Edge, not every Node it is sent to).
ALLOWED = {("iop/edge/config.py", "iop.adapters.registry")}


#: The pieces of the Edge that act on its state: they are handed the
#: cluster they belong to as an L{iop.edge.seam.ICluster}, never its
#: implementation, and never the service that wires them.
_EDGE_PIECES = (
    "iop.edge.intake",
    "iop.edge.starter",
    "iop.edge.commands",
    "iop.edge.history",
    "iop.edge.drain",
    "iop.edge.links",
    "iop.edge.connection",
)

#: Edge module prefix -> Edge modules (and everything under them) it must
#: never import: the HTTP surfaces are handed the service; they never reach
#: for its assembly, nor for the cluster behind the seam (a forwarding
#: outcome is the seam's L{iop.edge.seam.Forward}); the seam itself knows
#: no implementation.
EDGE_FORBIDDEN = {
    "iop.edge.http": ("iop.edge.service", "iop.edge.listeners", "iop.edge.tap", "iop.edge.cluster"),
    "iop.edge.seam": ("iop.edge.cluster", "iop.edge.service"),
    **dict.fromkeys(_EDGE_PIECES, ("iop.edge.cluster", "iop.edge.service")),
}


def imported_names(path):
    """
    The dotted C{iop...} names a module imports (at its top or inside a
    function), with their line numbers: for C{from a.b import c}, both
    C{a.b} and C{a.b.c}, since C{c} may be a module.
    """
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("iop."):
                yield name, node.lineno


def iop_imports(path):
    """
    The C{iop.<package>} names a module imports, with the whole name
    imported and its line number.
    """
    for name, line in imported_names(path):
        yield name.split(".")[1], name, line


def allowed(where, name):
    """
    Whether module path C{where} may import C{name} across the layers
    (L{ALLOWED}).
    """
    return any(where == w and (name == a or name.startswith(a + ".")) for w, a in ALLOWED)


def library_modules():
    """
    C{dotted name -> path} of every module of iop but its tests and the
    generated protobuf module.
    """
    modules = {}
    for path in ROOT.rglob("*.py"):
        if "test" in path.relative_to(ROOT).parts or path.name == "iop_pb2.py":
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph():
    """
    C{module -> set of iop modules it imports}, over L{library_modules}.
    """
    modules = library_modules()
    return {
        name: {imported for imported, _ in imported_names(path) if imported in modules and imported != name}
        for name, path in modules.items()
    }


def find_cycle(graph):
    """
    One import cycle of C{graph} as the list of its modules (the first
    repeated at the end), or C{None}: a depth-first walk that meets a
    module still on its path has closed a loop.
    """
    done, path, on_path = set(), [], set()

    def visit(module):
        path.append(module)
        on_path.add(module)
        for imported in sorted(graph[module]):
            if imported in on_path:
                return path[path.index(imported) :] + [imported]
            if imported not in done:
                cycle = visit(imported)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


class LayerTests(SynchronousTestCase):
    def test_arrows_point_one_way(self):
        """
        No module of a package imports a package its layer must not know:
        the Edge and the wire never import back ends (but for the Edge's
        configuration, which checks adapters with their registry:
        L{ALLOWED}), adapters never import
        the wire, the Edge or the Node, the Node never imports the Edge,
        and the run vocabulary imports nothing of iop.
        """
        violations = []
        for package, forbidden in FORBIDDEN.items():
            paths = [ROOT / f"{package}.py"] if (ROOT / f"{package}.py").exists() else (ROOT / package).rglob("*.py")
            for path in paths:
                where = str(path.relative_to(ROOT.parent))
                for imported, name, line in iop_imports(path):
                    if imported in forbidden and not allowed(where, name):
                        violations.append(f"{where}:{line} imports iop.{imported}")
        self.assertEqual(violations, [])

    def test_edge_surfaces_do_not_reach_the_assembly(self):
        """
        Inside the Edge, the HTTP surfaces never import the service, its
        listeners or its twistd plugin, nor the cluster (its C{Forward}
        among it); the pieces the service wires never import it or the
        cluster behind the seam: they are given what they use.
        """
        violations = []
        for name, path in sorted(library_modules().items()):
            for prefix, forbidden in EDGE_FORBIDDEN.items():
                if name == prefix or name.startswith(prefix + "."):
                    violations += [
                        f"{name}:{line} imports {imported}"
                        for imported, line in imported_names(path)
                        if any(imported == f or imported.startswith(f + ".") for f in forbidden)
                    ]
        self.assertEqual(violations, [])

    def test_generated_module_stays_in_the_wire_layer(self):
        """
        Only L{iop.protocols.messages} imports the generated iop_pb2 (and
        the tests that check the generated file against iop.proto and the
        builders' constants against it):
        everything else, the wire layer included, builds messages with it
        and takes the names it reads from there, so the typed builders are
        the one way in.
        """
        protocols = ROOT / "protocols"
        allowed = {
            protocols / "messages.py",
            protocols / "test" / "test_proto.py",
            protocols / "test" / "test_messages.py",
        }
        violations = [
            f"{path.relative_to(ROOT.parent)}:{line} imports {imported}"
            for path in sorted(ROOT.rglob("*.py"))
            if path not in allowed
            for imported, line in imported_names(path)
            if imported == "iop.protocols.iop_pb2"
        ]
        self.assertEqual(violations, [])

    def test_no_import_cycle(self):
        """
        No chain of imports among iop's modules (imports inside functions
        and under C{TYPE_CHECKING} included, since hiding one there does not
        break the loop) leads back to its start: across packages, and
        among the modules of one package (the Edge's pieces) alike.
        """
        self.assertIsNone(find_cycle(import_graph()))

    def test_edge_service_stays_small(self):
        """
        The Edge's top only wires its pieces, as the Node's does: a job
        that grows there belongs in a module of its own (intake, starter,
        commands, history, drain, links).
        """
        lines = (ROOT / "edge" / "service.py").read_text().count("\n")
        self.assertLessEqual(lines, 150)


class CycleFinderTests(SynchronousTestCase):
    def test_finds_a_loop(self):
        """
        The cycle finder reports a loop with its modules in order, and
        nothing for a graph without one.
        """
        self.assertEqual(find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}), ["a", "b", "c", "a"])
        self.assertIsNone(find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}))
