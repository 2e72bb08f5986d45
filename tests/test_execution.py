"""The execution model: workspaces, nodes, tasks, groups, outputs, sessions."""

from __future__ import annotations

import numpy as np
import pytest

from epochal import (
    Cluster,
    LocalSession,
    MissingBlobError,
    Node,
    Task,
    TaskGroup,
    TaskOutput,
    Workspace,
    WorkspaceType,
    final_output,
)
from epochal.sessions import Session


def test_workspace_mapping_and_accessors():
    ws = Workspace()
    ws["b"] = 2
    ws.feed_blob("a", np.arange(3))
    assert ws.blobs == ["a", "b"]
    assert "a" in ws and ws.has_blob("b") and not ws.has_blob("c")
    assert len(ws) == 2
    np.testing.assert_array_equal(ws.fetch_blob("a"), [0, 1, 2])
    del ws["b"]
    assert ws.blobs == ["a"]
    with pytest.raises(MissingBlobError, match="'zz'"):
        ws.fetch_blob("zz")
    with pytest.raises(KeyError):
        del ws["zz"]


def test_child_workspace_resolves_to_parent():
    parent = Workspace()
    parent["acc"] = 1
    child = Workspace(parent=parent)
    assert child["acc"] == 1
    child["acc"] = 5  # goes to the parent
    child["scratch"] = 9  # stays in the child
    assert parent["acc"] == 5
    assert "scratch" not in parent
    assert child.blobs == ["scratch"]
    assert sorted(child) == ["acc", "scratch"]
    del child
    assert parent.blobs == ["acc"]


def test_node_and_cluster_record_names_in_order():
    with Cluster() as c:
        a = Node("trainer_1")
        Node("trainer_0")
        Node("trainer_1")
        assert str(a) == "trainer_1"
    assert c.nodes() == ["trainer_1", "trainer_0"]


def test_task_naming_node_and_group_membership():
    with TaskGroup() as g:
        with Node("n0"):
            t1 = Task(name="x")
            t2 = Task(name="x")
        t3 = Task()
    assert [t.name for t in (t1, t2, t3)] == ["n0/x", "n0/x:1", "local/task"]
    assert g.used_nodes() == ["n0", "local"]
    assert g.tasks() == [t1, t2, t3]
    with pytest.raises(RuntimeError, match="already used TaskGroup"):
        g.add(Task(group=None))


def test_task_as_context_reappends_and_final_output():
    with TaskGroup() as g:
        with Task(name="first") as t1:
            out = final_output("y")
        Task(name="second")
    assert isinstance(out, TaskOutput) and out.names == ["y"]
    assert [t.name.split("/")[1] for t in g.tasks()] == ["first", "second"]
    assert t1.outputs() == [out]
    # final_output with no active task makes a new one
    lone = final_output("z")
    assert lone.task is not None and lone.task.output_names() == ["z"]


def test_used_task_is_frozen():
    g = TaskGroup()
    t = Task(step=lambda ws: None, group=g)
    g.tasks()
    with pytest.raises(RuntimeError, match="already been used"):
        t.add_output("x")
    with pytest.raises(RuntimeError, match="already been used"):
        with t:
            pass


def test_workspace_type_inheritance_and_conflicts():
    g = TaskGroup()
    t = Task(group=g)
    g.tasks()
    assert t.workspace_type == WorkspaceType.PRIVATE and g.workspace_type() == WorkspaceType.PRIVATE
    g2 = TaskGroup(WorkspaceType.GLOBAL)
    t2 = Task(group=g2)
    g2.tasks()
    assert t2.workspace_type == WorkspaceType.GLOBAL
    g3 = TaskGroup(WorkspaceType.GLOBAL)
    Task(group=g3, workspace_type=WorkspaceType.PRIVATE)
    with pytest.raises(ValueError, match="private"):
        g3.tasks()
    g4 = TaskGroup()
    Task(group=g4, workspace_type="global")
    g4.tasks()
    assert g4.workspace_type() == WorkspaceType.GLOBAL


def _set(name, value):
    def step(ws):
        ws[name] = value
    return step


def _inc(name):
    def step(ws):
        ws[name] = ws[name] + 1
    return step


def test_private_vs_global_tasks_in_a_session():
    ws = Workspace()
    ws["acc"] = 0
    with LocalSession(ws) as s:
        with TaskGroup() as g:
            Task(step=[_inc("acc"), _set("scratch", 1)])
        s.run(g)
        s.run(g)  # a compiled group runs again
        assert ws["acc"] == 2 and "scratch" not in ws
        with TaskGroup(WorkspaceType.GLOBAL) as gg:
            Task(step=_set("kept", 3))
        s.run(gg)
        assert ws["kept"] == 3


def test_bare_task_runs_global_and_outputs_precreated():
    ws = Workspace()
    s = LocalSession(ws)
    t = Task(step=_set("made", 1), outputs=["out"])
    s.run(t)
    assert ws.blobs == ["made", "out"] and ws["out"] is None
    # outputs of PRIVATE tasks survive because the session pre-creates them
    with TaskGroup() as g:
        p = Task(step=[_set("out2", 7), _set("tmp", 0)], outputs="out2")
    s.run(g)
    assert p.outputs()[0].fetch() == 7 and "tmp" not in ws


def test_fetch_is_lazy_and_errors_before_run():
    t = Task(step=_set("v", 1), outputs="v")
    with pytest.raises(RuntimeError, match="never ran"):
        t.outputs()[0].fetch()
    ws = Workspace()
    s = LocalSession(ws)
    s.run(t)
    out = t.outputs()[0]
    assert out.fetch() == 1
    ws["v"] = 42
    assert out.fetch() == 42  # the current value, not a snapshot


def test_list_outputs_fetch_as_list_and_rebind_to_last_session():
    t = Task(step=[_set("a", 1), _set("b", 2)], outputs=["a", "b"])
    s1, s2 = LocalSession(), LocalSession()
    s1.run(t)
    assert t.outputs()[0].fetch() == 1 and t.outputs()[1].fetch() == 2
    s2.ws["a"] = 10
    s2.run(t)
    s2.ws["a"] = 11
    assert t.outputs()[0].fetch() == 11


def test_step_errors_propagate_and_lists_run_in_order():
    order = []
    t1 = Task(step=lambda ws: order.append(1))
    t2 = Task(step=lambda ws: order.append(2))
    s = LocalSession()
    s.run([t1, t2])
    assert order == [1, 2]

    def boom(ws):
        raise ZeroDivisionError("inside step")

    with pytest.raises(ZeroDivisionError, match="inside step"):
        s.run(Task(step=boom))


def test_compile_cache_per_class_and_closed_session():
    g = TaskGroup()
    Task(group=g)
    c1 = LocalSession.compile(g)
    assert LocalSession.compile(g) is c1
    assert LocalSession.compile(c1) is c1

    class Other(Session):
        def _run_compiled(self, compiled):
            pass

        def fetch_blob(self, node, name):
            return None

    with pytest.raises(TypeError, match="compiled for LocalSession"):
        Other.compile(c1)
    s = LocalSession()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.run(g)
    with pytest.raises(TypeError, match="not callable"):
        Task(step=5)


def test_current_contexts():
    assert Task.current(required=False) is None
    with pytest.raises(RuntimeError, match="required"):
        TaskGroup.current()
    assert str(Node.current()) == "local"  # default-managed
    with TaskGroup() as g:
        assert TaskGroup.current() is g
