"""The public API documents itself: every name in ``scrubnet.__all__`` and every registered method class has a
numpydoc docstring with Parameters and Returns sections, parsed the way the documentation site parses it
(griffe's numpy parser), and a function's Parameters name every parameter of its signature."""
from __future__ import annotations

import inspect

import pytest
from griffe import Docstring, DocstringSectionKind

import scrubnet
from scrubnet.methods import available_methods, method_class


def sections(obj) -> dict:
    doc = inspect.getdoc(obj)
    assert doc, f"{obj!r} has no docstring"
    parsed = Docstring(doc, parser="numpy").parse()
    return {s.kind: s for s in parsed}


def public_objects():
    objs = [(name, getattr(scrubnet, name)) for name in scrubnet.__all__]
    objs += [(f"method {name}", method_class(name)) for name in available_methods()]
    return objs


@pytest.mark.parametrize("name,obj", public_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_numpydoc_parameters_and_returns(name, obj):
    s = sections(obj)
    assert DocstringSectionKind.parameters in s, f"{name}: no Parameters section"
    assert DocstringSectionKind.returns in s, f"{name}: no Returns section"
    if inspect.isfunction(obj):
        documented = {p.name for p in s[DocstringSectionKind.parameters].value}
        wanted = {p.name for p in inspect.signature(obj).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        assert wanted <= documented, f"{name}: parameters not documented: {sorted(wanted - documented)}"


def test_parser_sees_a_missing_section():
    def f(a):
        """Do a thing.

        Parameters
        ----------
        a : int
            A number.
        """
    s = sections(f)
    assert DocstringSectionKind.parameters in s and DocstringSectionKind.returns not in s
