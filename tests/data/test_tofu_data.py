"""The synthetic TOFU: a seed fixes it, its splits are TOFU's (by person, nested forget sets, disjoint retain),
perturbed answers are other people's values, and the tokenizer never depends on who has which value."""
from __future__ import annotations

import pytest

from scrubnet.data.tofu import ATTRIBUTES, N_PERTURBED, make_tofu, words

pytest.importorskip("faker")


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = make_tofu(10, 6, seed=3, pool_size=8), make_tofu(10, 6, seed=3, pool_size=8), make_tofu(10, 6, seed=4,
                                                                                                       pool_size=8)
    assert a.qa == b.qa and a.people == b.people and a.splits == b.splits
    assert a.people != c.people


def test_people_attributes_and_questions():
    d = make_tofu(20, 8, seed=0, pool_size=10, world_max=3)
    assert len(d.people) == 28 and len({p["name"] for p in d.people}) == 28
    assert len(ATTRIBUTES) == 10 and all(set(ATTRIBUTES) <= set(p) for p in d.people)
    for person in (0, 19, 27):
        qs = d.questions([person])
        assert len(qs) == 20 and len({q.question for q in qs}) == 20        # TOFU's 20 pairs per person
        probes = d.questions([person], kinds=("paraphrase", "format"))
        assert len(probes) == 20 and not {q.question for q in probes} & {q.question for q in qs}
        for q in qs:
            rec = d.people[person]
            assert q.value == rec[q.attribute] and q.value in q.answer and q.value in q.paraphrased
            assert len(q.perturbed) == N_PERTURBED and len(set(q.perturbed)) == N_PERTURBED
            for p in q.perturbed:       # another value of the same pool, in the paraphrase's words
                assert p != q.paraphrased and not p.endswith(f" {q.value} .")
    world = [q for q in d.qa if q.person == -1]
    assert {"sum", "kind"} == {q.attribute for q in world}
    assert any(q.question == "What is 2 plus 1 ?" and q.answer == "2 plus 1 is 3 ." for q in world)


def test_splits_by_person_nested_and_disjoint():
    d = make_tofu(40, 8, seed=1, pool_size=8)
    f1, f5, f10 = (set(d.splits[k]) for k in ("forget01", "forget05", "forget10"))
    assert (len(f1), len(f5), len(f10)) == (1, 2, 4)
    assert f1 <= f5 <= f10                                       # nested, as TOFU's
    val = set(d.splits["validation"])
    assert len(val) == 4 and not val & f10                       # tuned on other people
    assert set(d.retain("forget10")) == set(range(40)) - f10
    assert all(p < d.n_private for p in f10 | val) and set(d.public) == set(range(40, 48))
    qf = d.questions(d.forget("forget10"))
    qr = d.questions(d.retain("forget10"))
    assert len(qf) == 80 and len(qr) == 36 * 20 and not {q.person for q in qf} & {q.person for q in qr}


def test_vocabulary_covers_every_record_and_ignores_who_has_what():
    d = make_tofu(10, 6, seed=2, pool_size=8, world_max=3)
    vocab = {w for line in d.vocabulary_text() for w in words(line)}
    for q in d.qa:
        assert set(words(q.question + " " + q.answer + " " + q.paraphrased + " " + " ".join(q.perturbed))) <= vocab
    # the vocabulary text is built from templates, pools, names and world facts: reassigning private values does
    # not change it
    before = d.vocabulary_text()
    d.people[0]["birthplace"] = d.pools["birthplace"][-1]
    assert d.vocabulary_text() == before
    # every word of a private name is also a word of a public name (names are combinations of known words)
    pub_words = {w for p in d.public for w in d.people[p]["name"].split()}
    assert all(set(d.people[p]["name"].split()) <= pub_words for p in range(d.n_private))
