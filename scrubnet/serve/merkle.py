"""An append-only Merkle tree as RFC 9162 (Certificate Transparency v2) defines it: hashes, audit paths and
consistency proofs, and their verification by a client that holds only hashes.

* leaf hash ``SHA-256(0x00 ‖ leaf)``, node hash ``SHA-256(0x01 ‖ left ‖ right)``; the hash of an empty tree is
  ``SHA-256()`` (§2.1.1);
* for n leaves, the left subtree holds the largest power of two k < n leaves (§2.1.1);
* :func:`inclusion_proof` is PATH(m, D[n]) (§2.1.3.1) and :func:`verify_inclusion` the verification of
  §2.1.3.2; :func:`consistency_proof` is PROOF(m, D[n]) (§2.1.4.1) and :func:`verify_consistency` the
  verification of §2.1.4.2.

Everything works on leaf *hashes* (``bytes`` of 32); the leaves themselves are the caller's.
"""
from __future__ import annotations

import hashlib


def leaf_hash(leaf: bytes) -> bytes:
    """SHA-256(0x00 ‖ leaf)."""
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 ‖ left ‖ right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n ≥ 2)."""
    k = 1
    while k << 1 < n:
        k <<= 1
    return k


def root(hashes: list[bytes]) -> bytes:
    """MTH(D[n]) over the leaf hashes ``hashes`` (SHA-256 of the empty string for no leaf).

    Parameters
    ----------
    hashes : list of bytes
        The leaf hashes, in log order.

    Returns
    -------
    bytes
        The tree's root hash.
    """
    if not hashes:
        return hashlib.sha256(b"").digest()
    level = list(hashes)
    # bottom-up with an odd last node carried up unchanged: the same tree as the recursive split of §2.1.1
    while len(level) > 1:
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def inclusion_proof(m: int, hashes: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]): the audit path of leaf ``m`` in the tree of ``hashes`` (n = len(hashes)).

    Parameters
    ----------
    m : int
        The leaf's index, 0 ≤ m < n.
    hashes : list of bytes
        The leaf hashes.

    Returns
    -------
    list of bytes
        The sibling hashes from the leaf up.
    """
    n = len(hashes)
    if not 0 <= m < n:
        raise ValueError(f"leaf {m} is not in a tree of {n}")
    if n == 1:
        return []
    k = _split(n)
    if m < k:
        return inclusion_proof(m, hashes[:k]) + [root(hashes[k:])]
    return inclusion_proof(m - k, hashes[k:]) + [root(hashes[:k])]


def consistency_proof(m: int, hashes: list[bytes]) -> list[bytes]:
    """PROOF(m, D[n]): the hashes that prove the tree of the first ``m`` leaves is a prefix of the tree of
    ``hashes`` (empty for m = n or m = 0).

    Parameters
    ----------
    m : int
        The earlier size, 0 ≤ m ≤ n.
    hashes : list of bytes
        The leaf hashes of the later tree.

    Returns
    -------
    list of bytes
        The proof.
    """
    n = len(hashes)
    if not 0 <= m <= n:
        raise ValueError(f"a tree of {m} is not a prefix of a tree of {n}")
    if m in (0, n):
        return []
    return _subproof(m, hashes, True)


def _subproof(m: int, hashes: list[bytes], complete: bool) -> list[bytes]:
    n = len(hashes)
    if m == n:
        return [] if complete else [root(hashes)]
    k = _split(n)
    if m <= k:
        return _subproof(m, hashes[:k], complete) + [root(hashes[k:])]
    return _subproof(m - k, hashes[k:], False) + [root(hashes[:k])]


def verify_inclusion(index: int, size: int, leaf: bytes, proof: list[bytes], root_hash: bytes) -> bool:
    """Whether ``proof`` shows the leaf hash ``leaf`` at ``index`` in the tree of ``size`` leaves with root
    ``root_hash`` (RFC 9162 §2.1.3.2).

    Parameters
    ----------
    index, size : int
        The leaf's index and the tree's size.
    leaf : bytes
        The leaf's hash.
    proof : list of bytes
        The audit path.
    root_hash : bytes
        The root of the signed tree head.

    Returns
    -------
    bool
        True when the path recomputes the root.
    """
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root_hash


def verify_consistency(size1: int, size2: int, root1: bytes, root2: bytes, proof: list[bytes]) -> bool:
    """Whether ``proof`` shows the tree (``size1``, ``root1``) is a prefix of the tree (``size2``, ``root2``)
    (RFC 9162 §2.1.4.2; equal sizes need equal roots and an empty proof).

    Parameters
    ----------
    size1, size2 : int
        The earlier and the later size.
    root1, root2 : bytes
        Their roots.
    proof : list of bytes
        The consistency proof.

    Returns
    -------
    bool
        True when the proof verifies; False for a later tree smaller than the earlier one.
    """
    if size1 > size2 or size1 < 0:
        return False
    if size1 == size2:
        return not proof and root1 == root2
    if size1 == 0:
        return not proof
    if not proof:
        return False
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # a power of two: the first tree is a complete subtree
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == root1 and sr == root2
