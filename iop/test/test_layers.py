"""
The layering rules of docs/architecture.md, checked on the source: which
of iop's packages may import which. A violation names the module and the
import, so the arrow that points the wrong way is found at once.
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


def iop_imports(path):
    """
    The C{iop.<package>} names a module imports, with their line numbers.
    """
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "iop" and len(parts) > 1:
                yield parts[1], node.lineno


class LayerTests(SynchronousTestCase):
    def test_arrows_point_one_way(self):
        """
        No module of a package imports a package its layer must not know:
        the Edge and the wire never import back ends, adapters never import
        the wire, the Edge or the Node, the Node never imports the Edge,
        and the run vocabulary imports nothing of iop.
        """
        violations = []
        for package, forbidden in FORBIDDEN.items():
            paths = [ROOT / f"{package}.py"] if (ROOT / f"{package}.py").exists() else (ROOT / package).rglob("*.py")
            for path in paths:
                for imported, line in iop_imports(path):
                    if imported in forbidden:
                        violations.append(f"{path.relative_to(ROOT.parent)}:{line} imports iop.{imported}")
        self.assertEqual(violations, [])
