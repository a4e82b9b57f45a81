"""The diagnostics room (``dpddp.diagnostics``): the rest of the project reaches it through these names only."""

from __future__ import annotations

import ast

from conftest import ROOT

SRC = ROOT / "src" / "dpddp"
INTERFACE = {
    "network": {"choose_interface", "interface_address", "is_local_address", "route_interface"},
    "whereabouts": {"AGREEMENT", "BATCHNORM", "METRIC_SYNC", "Whereabouts", "current", "entering"},
    "allreduce": {"COMM_HOOKS", "AllReduceTimer"},
    "costs": {"Costs", "peak_memory_mib"},
}


def test_the_project_reaches_the_diagnostics_through_one_interface():
    used: dict[str, set[str]] = {name: set() for name in INTERFACE}
    strays = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "diagnostics":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpddp.diagnostics"):
                room = node.module.rpartition(".")[2]
                names = {a.name for a in node.names}
                used.setdefault(room, set()).update(names)
                strays += [f"{path.name}: {room}.{n}" for n in names - INTERFACE.get(room, set())]
            elif isinstance(node, ast.Import):
                strays += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("dpddp.diag")]
    assert strays == []
    assert used == INTERFACE  # each name is used: an unused one leaves the interface
