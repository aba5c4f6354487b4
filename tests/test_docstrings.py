"""The public API documents itself: every name in ``scrubnet.__all__`` and every registered method class has a
numpydoc docstring with Parameters and Returns sections, parsed the way the documentation site parses it
(griffe's numpy parser), and the Parameters name every parameter of the
signature (a function's, a class's constructor's)."""
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


def signature_params(obj) -> list:
    return list(inspect.signature(obj).parameters.values())


def public_objects():
    objs = [(name, getattr(scrubnet, name)) for name in scrubnet.__all__]
    objs += [(f"method {name}", method_class(name)) for name in available_methods()]
    return objs


@pytest.mark.parametrize("name,obj", public_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_numpydoc_parameters_and_returns(name, obj):
    s = sections(obj)
    if not signature_params(obj):  # nothing to document (e.g. the method ``original``, which takes no options)
        assert DocstringSectionKind.parameters not in s, f"{name}: Parameters section for an empty signature"
    else:
        assert DocstringSectionKind.parameters in s, f"{name}: no Parameters section"
    assert DocstringSectionKind.returns in s, f"{name}: no Returns section"
    if signature_params(obj):  # a function's parameters, a class's constructor's (its options, its fields)
        documented = {p.name for p in s[DocstringSectionKind.parameters].value}
        wanted = {p.name for p in signature_params(obj) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
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
