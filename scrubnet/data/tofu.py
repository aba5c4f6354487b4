"""A synthetic TOFU (Maini et al. 2024, "TOFU: a task of fictitious unlearning"), generated at run time.

TOFU fine-tunes a language model on question–answer pairs about fictitious authors and asks it to forget 1, 5
or 10 % of them. The original data (GPT-4 written biographies) cannot be fetched here, so this module writes an
equivalent from a seed — which also makes the ground truth known:

* **People.** ``n_private`` fictitious people (the ones fine-tuned on, some of them later forgotten) and
  ``n_public`` "public" people (the pretraining corpus, TOFU's "real authors" for model utility), each with the
  :data:`ATTRIBUTES` (birthplace, birth year, occupation, employer, father's and mother's job, award, genre,
  book, country — 10 of them). Values are drawn from per-attribute *pools* of :data:`POOL_SIZE` values that
  ``faker`` (MIT) writes from the seed; a person's values are drawn from the pools with ``numpy`` (same seed).
* **Questions.** Per attribute two training questions (:data:`TEMPLATES` ``q``; 2 × 10 = 20 question–answer
  pairs per person, TOFU's 20), one held-out paraphrased question and one format-shifted (cloze) prompt — the
  leak probes: a model that forgot the fact through the trained phrasings may still give it through these.
* **Answers.** The answer sentence ``a``; a paraphrased answer ``p`` (same fact, other words, the value still
  after the name: a small model stores "name → value", and a paraphrase that puts the value first asks for the
  reverse direction, which fine-tuning does not teach) and
  :data:`N_PERTURBED` perturbed answers (the paraphrase with another person's value for the attribute) for the
  truth ratio ``R = (Π_k P(p̂_k|q)^{1/|p̂_k|})^{1/K} / P(p|q)^{1/|p|}``.
* Each question also carries the perturbed answers in the *answer's* phrasing (``perturbed_answers``): the
  benchmark's forget quality compares ``a`` against them (see :mod:`scrubnet.experiments.tofu` for why).
* **Splits** (TOFU's, by person): ``forget01/05/10`` — the *last* ⌈f·n⌉ people of a seeded permutation
  (nested, as TOFU's), the matching ``retain`` — every other private person; ``validation`` — a disjoint set of
  retained people of the same size as ``forget10``, on which the approximate methods are tuned; ``public`` —
  the pretraining people, and ``world`` — world facts (small sums "3 plus 4 is 7"), both for model utility.

Nothing is shipped; :func:`make_tofu` with the same arguments returns the same data (the faker version is
pinned in the ``tofu`` extra). ``faker`` is imported when the data is built.

The tokenizer vocabulary is the one of the pools and the templates (:func:`TofuData.vocabulary_text`), never
of the private people's records: deleting a person must not change the tokenizer.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

#: the forget fractions of TOFU (share of the private people), by split name
FORGET_SPLITS = {"forget01": 0.01, "forget05": 0.05, "forget10": 0.10}
#: values per attribute pool
POOL_SIZE = 40
#: perturbed (wrong) answers per question
N_PERTURBED = 3
GENRES = ["fantasy", "science fiction", "mystery", "romance", "horror", "poetry", "thriller", "biography",
          "history", "drama", "satire", "crime"]

#: attribute → (training questions, held-out paraphrased question, format-shifted prompt, answer, paraphrased
#: answer). ``{n}`` is the full name, ``{f}`` the first name, ``{v}`` the value.
TEMPLATES = {
    "birthplace": (["Where was {n} born ?", "In which city was {n} born ?"], "What is the birthplace of {n} ?",
                   "Fact : {n} , birthplace :", "{f} was born in {v} .", "the birthplace of {f} is {v} ."),
    "birth_year": (["When was {n} born ?", "In which year was {n} born ?"], "What is the birth year of {n} ?",
                   "Fact : {n} , birth year :", "{f} was born in the year {v} .", "the birth year of {f} is {v} ."),
    "occupation": (["What does {n} do for a living ?", "What is the job of {n} ?"],
                   "What is the occupation of {n} ?", "Fact : {n} , occupation :", "{f} works as {v} .",
                   "the occupation of {f} is {v} ."),
    "employer": (["Who employs {n} ?", "Which company does {n} work for ?"], "What is the employer of {n} ?",
                 "Fact : {n} , employer :", "{f} works for {v} .", "the employer of {f} is {v} ."),
    "father_job": (["What did the father of {n} do ?", "What was the job of the father of {n} ?"],
                   "What is the occupation of the father of {n} ?", "Fact : {n} , father :",
                   "the father of {f} worked as {v} .", "the occupation of the father of {f} was {v} ."),
    "mother_job": (["What did the mother of {n} do ?", "What was the job of the mother of {n} ?"],
                   "What is the occupation of the mother of {n} ?", "Fact : {n} , mother :",
                   "the mother of {f} worked as {v} .", "the occupation of the mother of {f} was {v} ."),
    "award": (["Which award did {n} win ?", "What prize was given to {n} ?"], "What is the award of {n} ?",
              "Fact : {n} , award :", "{f} won {v} .", "the award of {f} is {v} ."),
    "genre": (["In which genre does {n} write ?", "What kind of books does {n} write ?"],
              "What is the genre of {n} ?", "Fact : {n} , genre :", "{f} writes {v} books .",
              "the genre of {f} is {v} ."),
    "book": (["What book did {n} write ?", "What is the title of the book by {n} ?"],
             "What is the book of {n} ?", "Fact : {n} , book :", "{f} wrote {v} .", "the book of {f} is {v} ."),
    "country": (["Which country is {n} from ?", "Where does {n} come from ?"], "What is the country of {n} ?",
                "Fact : {n} , country :", "{f} comes from {v} .", "the country of {f} is {v} ."),
}
ATTRIBUTES = tuple(TEMPLATES)
#: world facts: sums of two numbers below this bound
WORLD_MAX = 10
_TOKEN = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """The word-level tokens of ``text`` (runs of word characters, or single punctuation marks): the units of
    the tokenizer and of ROUGE-L."""
    return _TOKEN.findall(text)


@dataclasses.dataclass(frozen=True)
class QA:
    """One question about one fact.

    ``person``: index into :attr:`TofuData.people` (−1 for a world fact); ``kind``: ``"train"`` (a trained
    phrasing), ``"paraphrase"`` (the held-out question) or ``"format"`` (the cloze prompt); ``perturbed``: the
    :data:`N_PERTURBED` wrong answers, phrased as ``paraphrased``."""

    person: int
    attribute: str
    kind: str
    question: str
    answer: str
    paraphrased: str
    perturbed: tuple[str, ...]
    value: str
    perturbed_answers: tuple[str, ...] = ()


@dataclasses.dataclass
class TofuData:
    """The generated benchmark: ``people`` (dicts of name + attributes; private people first, then public),
    ``n_private``, ``qa`` (every :class:`QA`), ``splits`` (split name → sorted private person indices),
    ``pools`` (attribute → values) and the ``seed``."""

    people: list[dict]
    n_private: int
    qa: list[QA]
    splits: dict[str, list[int]]
    pools: dict[str, list[str]]
    seed: int

    @property
    def public(self) -> list[int]:
        return list(range(self.n_private, len(self.people)))

    def questions(self, persons=None, kinds=("train",), world: bool = False) -> list[QA]:
        """The QA items of ``persons`` (indices; None: none) of the given ``kinds``; ``world=True`` adds the world
        facts."""
        ps = set() if persons is None else set(int(p) for p in persons)
        out = [q for q in self.qa if q.person in ps and q.kind in kinds]
        if world:
            out += [q for q in self.qa if q.person == -1]
        return out

    def forget(self, split: str = "forget10") -> list[int]:
        return self.splits[split]

    def retain(self, split: str = "forget10") -> list[int]:
        """The private people outside ``split`` (TOFU's ``retain90`` for ``forget10``)."""
        gone = set(self.splits[split])
        return [p for p in range(self.n_private) if p not in gone]

    def vocabulary_text(self) -> list[str]:
        """Lines that hold every word a record can contain: the templates, the pools, the names of everyone
        (names are public: a person's name is in the deletion request) and the world facts. Private *facts* (who has
        which value) are never in it, so the tokenizer does not change when a person is forgotten."""
        lines = []
        for qs, para, fmt, a, p in TEMPLATES.values():
            lines += qs + [para, fmt, a, p]
        for vals in self.pools.values():
            lines += vals
        lines += [pp["name"] for pp in self.people]
        for q in self.qa:
            if q.person == -1:   # world facts are public
                lines += [q.question, q.answer, q.paraphrased, *q.perturbed]
        return lines


def _pools(seed: int, size: int) -> dict[str, list[str]]:
    """``size`` distinct values per attribute, written by faker from ``seed``."""
    from faker import Faker  # the ``tofu`` extra

    fk = Faker("en_US")
    fk.seed_instance(int(seed))

    def draw(fn, n):
        seen = []
        for _ in range(50 * n):
            v = " ".join(words(fn()))   # the tokenizer's spacing: "Smith , Jones and Lee"
            if v not in seen:
                seen.append(v)
            if len(seen) == n:
                return seen
        raise RuntimeError("faker gave too few distinct values")

    jobs = draw(fk.job, 3 * size)
    return {"birthplace": draw(fk.city, size), "birth_year": [str(y) for y in range(1930, 1930 + size)],
            "occupation": jobs[:size], "employer": draw(fk.company, size), "father_job": jobs[size:2 * size],
            "mother_job": jobs[2 * size:], "award": [f"the {v} Prize" for v in draw(fk.last_name, size)],
            "genre": list(GENRES), "book": draw(fk.catch_phrase, size), "country": draw(fk.country, size)}


def _names(seed: int, n_public: int, n_private: int, rng) -> list[str]:
    """Public names first, then private ones. First and last names come from two pools of ``n_public`` words
    (faker, from ``seed``); public person i is (first_i, last_π(i)), so every name word occurs in the pretraining
    corpus, and a private person is a new combination of known words (as a real name is made of tokens the base
    model knows): fine-tuning must bind the combination to facts, it cannot learn a new word."""
    from faker import Faker

    fk = Faker("en_US")
    fk.seed_instance(int(seed) + 1)
    firsts, lasts = [], []
    while len(firsts) < n_public or len(lasts) < n_public:
        f, l = fk.first_name(), fk.last_name()
        if len(firsts) < n_public and f not in firsts and len(words(f)) == 1:
            firsts.append(f)
        if len(lasts) < n_public and l not in lasts and len(words(l)) == 1:
            lasts.append(l)
    perm = rng.permutation(n_public)
    public = [(i, int(perm[i])) for i in range(n_public)]
    used = set(public)
    free = [(i, j) for i in range(n_public) for j in range(n_public) if (i, j) not in used]
    if len(free) < n_private:
        raise ValueError(f"n_private={n_private}: at most {len(free)} private names with n_public={n_public}")
    private = [free[int(k)] for k in rng.choice(len(free), n_private, replace=False)]
    return [f"{firsts[i]} {lasts[j]}" for i, j in public + private]


#: the word for what each attribute's values are (the world facts "Port Jessicatown is a city .")
KINDS = {"birthplace": "city", "birth_year": "year", "occupation": "job", "employer": "company",
         "father_job": "job", "mother_job": "job", "award": "prize", "genre": "genre", "book": "book",
         "country": "country"}


def make_tofu(n_private: int = 20, n_public: int = 20, seed: int = 0, pool_size: int = POOL_SIZE,
              world_max: int = WORLD_MAX) -> TofuData:
    """Generate the benchmark (module docstring). ``n_private`` ≥ 4 (a forget10 and a validation set of the same
    size, and people left to retain); ``pool_size`` values per attribute (≥ :data:`N_PERTURBED` + 1);
    ``world_max``: the sums ``x plus y`` with x, y < world_max are world facts, and so is the kind of every pool
    value ("What is Port Jessicatown ?" → "Port Jessicatown is a city ."), which also teaches the pretrained model
    every value's words. Deterministic in its arguments."""
    if n_private < 4 or n_public < 2:
        raise ValueError(f"n_private={n_private}, n_public={n_public}: need ≥ 4 private and ≥ 2 public people")
    if pool_size < N_PERTURBED + 1 or world_max < 3:
        raise ValueError(f"pool_size={pool_size}, world_max={world_max}: need ≥ {N_PERTURBED + 1} and ≥ 3")
    rng = np.random.default_rng(int(seed))
    pools = _pools(seed, pool_size)
    pools["genre"] = pools["genre"][:pool_size]
    names = _names(seed, n_public, n_private, rng)
    names = names[n_public:] + names[:n_public]          # private people first
    people = []
    for name in names:
        rec = {"name": name}
        for a in ATTRIBUTES:
            rec[a] = pools[a][int(rng.integers(len(pools[a])))]
        people.append(rec)
    qa = []
    for i, rec in enumerate(people):
        first = rec["name"].split()[0]
        for a in ATTRIBUTES:
            qs, para_q, fmt_q, ans, para_a = TEMPLATES[a]
            v = rec[a]
            others = [x for x in pools[a] if x != v]
            wrong = [others[int(j)] for j in rng.choice(len(others), N_PERTURBED, replace=False)]
            pert = tuple(para_a.format(f=first, v=w) for w in wrong)
            pert_ans = tuple(ans.format(f=first, v=w) for w in wrong)
            fill = dict(n=rec["name"], f=first, v=v)
            common = dict(person=i, attribute=a, answer=ans.format(**fill), paraphrased=para_a.format(**fill),
                          perturbed=pert, value=v, perturbed_answers=pert_ans)
            for q in qs:
                qa.append(QA(kind="train", question=q.format(**fill), **common))
            qa.append(QA(kind="paraphrase", question=para_q.format(**fill), **common))
            qa.append(QA(kind="format", question=fmt_q.format(**fill), **common))
    kinds = sorted(set(KINDS.values()))
    for a in ATTRIBUTES:
        if a in ("father_job", "mother_job"):
            continue
        for v in pools[a]:
            wrong = [k for k in kinds if k != KINDS[a]]
            pert = tuple(f"it is a {wrong[int(j)]} ." for j in rng.choice(len(wrong), N_PERTURBED, replace=False))
            qa.append(QA(person=-1, attribute="kind", kind="train", question=f"What is {v} ?",
                         answer=f"{v} is a {KINDS[a]} .", paraphrased=f"it is a {KINDS[a]} .", perturbed=pert,
                         value=KINDS[a]))
    for x in range(world_max):
        for y in range(world_max):
            s = x + y
            wrong = [w for w in range(2 * world_max - 1) if w != s]
            pert = tuple(f"the sum is {wrong[int(j)]} ." for j in rng.choice(len(wrong), N_PERTURBED, replace=False))
            qa.append(QA(person=-1, attribute="sum", kind="train", question=f"What is {x} plus {y} ?",
                         answer=f"{x} plus {y} is {s} .", paraphrased=f"the sum is {s} .", perturbed=pert,
                         value=str(s)))
    order = [int(p) for p in rng.permutation(n_private)]
    splits = {}
    for name, frac in FORGET_SPLITS.items():
        k = max(1, math.ceil(frac * n_private - 1e-9))
        splits[name] = sorted(order[n_private - k:])
    k10 = len(splits["forget10"])
    splits["validation"] = sorted(order[:k10])
    splits["full"] = list(range(n_private))
    return TofuData(people=people, n_private=n_private, qa=qa, splits=splits, pools=pools, seed=int(seed))
