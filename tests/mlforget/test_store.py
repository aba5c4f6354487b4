"""The ML checkpoint's request store: exactly-once requests under concurrency and real kills, the hash
chain, refusals, forget-all, reads that never write, and `upgrade` of the previous formats."""
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli.mlforget import mlforget_app
from scrubnet.experiments.checkpoints import fingerprint_v1 as _fingerprint_v1, ml_data_loader as _data_loader
from scrubnet.data import DataConfig, load_split
from scrubnet.mlforget import store
from scrubnet.mlforget.model import retrain_user_weights
from tests.hang_guard import HANG_GUARD_S

DATA = '{"num_samples": 1000, "n_train_per_class": 20, "n_test_per_class": 10, "forget_count": 2}'
TRAIN = '{"pretrain_epochs": 2, "max_epochs": 5}'
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml") / "ckpt"
    res = CliRunner().invoke(mlforget_app, ["train", "--out", str(out), "--data-options", DATA, "--train-options",
                                            TRAIN, "--model-options", '{"hidden": 16}'])
    assert res.exit_code == 0, res.output
    return out


def static_of(path):
    con = sqlite3.connect(str(Path(path) / store.DB))
    try:
        return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM checkpoint")}
    finally:
        con.close()


def deletable(path, k=3, skip=0):
    static = static_of(path)
    core = set(static["core_ids"])
    return [i for i in static["user_ids"] if i not in core][skip:skip + k]


def cli_inprocess(*args):
    r = CliRunner().invoke(mlforget_app, [str(a) for a in args])
    return r.exit_code, r.output


def cli_cmd(*args):
    return [sys.executable, "-m", "scrubnet.cli", "mlforget", *map(str, args)]


def cli(*args, env=None):
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, env=env or ENV, timeout=HANG_GUARD_S)


def snapshot(path):
    """Every file's bytes (the WAL side files excluded: SQLite owns them)."""
    return {str(f.relative_to(path)): f.read_bytes() for f in Path(path).rglob("*")
            if f.is_file() and not f.name.endswith(("-wal", "-shm"))}


def record_of(path):
    """(requests without times, state): what must not change when a request is refused."""
    rec = store.verify(path)
    return [{k: v for k, v in r.items() if k not in ("time_utc", "seconds")} for r in rec["requests"]], rec["state"]


def replay(base, reqs, tmp_path):
    """A fresh copy of ``base`` with ``reqs`` (forget requests) applied one after another in this process."""
    ck = tmp_path / "replay"
    shutil.copytree(base, ck)
    for r in reqs:
        rec, applied = store.forget(ck, r["ids"], sigma=r["sigma"], data_loader=_data_loader)
        assert applied
    return store.load(ck)[1]["weights_sha256"]


def check_final(path, id_sets, base, tmp_path):
    rec = store.verify(path)
    assert rec["valid"], rec["problems"]
    forgets = [r for r in rec["requests"] if r["kind"] == "forget"]
    assert len(forgets) == len(id_sets)
    assert sorted(tuple(r["ids"]) for r in forgets) == sorted(tuple(sorted(s)) for s in id_sets)
    assert [r["id"] for r in rec["requests"]] == list(range(len(id_sets) + 1))
    assert sorted(rec["state"]["forgotten_ids"]) == sorted(i for s in id_sets for i in s)
    # the weights are those of applying the requests one after another in the store's order
    assert rec["state"]["weights_sha256"] == replay(base, forgets, tmp_path)
    assert sorted(f.name for f in (path / store.WEIGHTS).iterdir()) == [rec["state"]["weights_sha256"] + ".safetensors"]


def test_concurrent_requests_serialise(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    # four processes race for the lock (each one's start-up is most of its cost; four show the serialisation as
    # well as eight did)
    id_sets = [deletable(ck, 2, skip=2 * k) for k in range(4)]
    procs = [subprocess.Popen(cli_cmd("forget", "--checkpoint", ck, "--ids", json.dumps(s)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for s in id_sets]
    outs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    numbers = sorted(int(o[0].split("#")[1].split(":")[0]) for o in outs)
    assert numbers == list(range(1, 5))  # every process applied its own request, each under its own number
    check_final(ck, id_sets, base_ckpt, tmp_path)


def test_concurrent_requests_with_kills_then_rerun(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    # six processes: one killed at each of the four stages, one at a random moment, one left to finish
    n = 6
    id_sets = [deletable(ck, 2, skip=2 * k) for k in range(n)]
    rng = random.Random(12)
    victims = dict(zip(rng.sample(range(n), 4), ["locked", "weights_partial", "before_commit", "after_commit"]))
    timed_victim = next(k for k in rng.sample(range(n), n) if k not in victims)  # killed at a random moment
    procs = []
    for k, s in enumerate(id_sets):
        env = {**ENV, store.PAUSE_ENV: victims[k]} if k in victims else ENV
        procs.append(subprocess.Popen(cli_cmd("forget", "--checkpoint", ck, "--ids", ",".join(map(str, s))),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))

    def kill_when_paused(p, stage):
        line = p.stdout.readline()
        assert line.strip() == f"PAUSED {stage}", line
        p.kill()  # SIGKILL while it holds the write lock: no cleanup handler runs

    threads = [threading.Thread(target=kill_when_paused, args=(procs[k], st)) for k, st in victims.items()]
    for t in threads:
        t.start()
    threading.Timer(rng.uniform(0.5, 4.0), procs[timed_victim].kill).start()
    for t in threads:
        t.join(timeout=HANG_GUARD_S)
    for p in procs:
        p.communicate(timeout=HANG_GUARD_S)
    killed = set(victims) | {timed_victim}
    assert all(procs[k].returncode == 0 for k in range(n) if k not in killed)
    assert all(procs[k].returncode == -9 for k in victims)
    rec = store.verify(ck)
    assert rec["valid"], rec["problems"]  # whatever was killed where, the record is consistent
    # re-run the killed requests (concurrently again): each is applied exactly once
    reruns = {k: subprocess.Popen(cli_cmd("forget", ck, "--ids", ",".join(map(str, id_sets[k]))),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for k in killed}
    outs = {k: p.communicate(timeout=HANG_GUARD_S) for k, p in reruns.items()}
    assert all(p.returncode == 0 for p in reruns.values()), {k: o[1] for k, o in outs.items()}
    victim_after_commit = next(k for k, st in victims.items() if st == "after_commit")
    assert "already applied" in outs[victim_after_commit][0]
    for k, st in victims.items():
        if st != "after_commit":
            assert "forgot 2 samples" in outs[k][0]
    check_final(ck, id_sets, base_ckpt, tmp_path)


def test_killed_before_commit_leaves_previous_state(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    before = record_of(ck)
    ids = deletable(ck, 3)
    for stage in ("weights_partial", "before_commit"):
        p = subprocess.Popen(cli_cmd("forget", ck, "--ids", ",".join(map(str, ids))), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**ENV, store.PAUSE_ENV: stage})
        assert p.stdout.readline().strip() == f"PAUSED {stage}"
        p.kill()
        p.wait(timeout=HANG_GUARD_S)
        assert record_of(ck) == before
        state, _ = store.load(ck)
        assert len(state.forgotten_ids) == 0


def test_records_refusals_and_forget_all(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    ids = deletable(ck, 3)
    code, out = cli_inprocess("forget", "--checkpoint", ck, "--ids", json.dumps(ids))
    assert code == 0, out
    e = store.requests(ck)[1]
    for k in REQUEST_FIELDS:
        assert k in e
    assert e["solver"]["relative_residual"] < 1e-4 and e["n_ids"] == len(ids) and e["status"] == "applied"
    assert e["time_utc"].endswith("+00:00")
    ref = snapshot(ck)
    static = static_of(ck)
    for args, needle in [(["--ids", ids[0]], "already forgotten"), (["--ids", static["core_ids"][0]], "core data"),
                         (["--ids", "1,x"], "not an integer"), ([], "exactly one of --ids"),
                         (["--ids", "[3.5]"], "not an integer"), (["--ids", "[true]"], "not an integer"),
                         (["--ids", '["7"]'], "not an integer"), (["--ids", "[1e400]"], "not an integer")]:
        code, out = cli_inprocess("forget", ck, *args)
        assert code == 2 and needle in out and out.startswith("error:"), (args, out)
    assert snapshot(ck) == ref  # refused requests change nothing
    code, out = cli_inprocess("forget-all", "--checkpoint", ck)
    assert code == 0, out
    state, meta = store.load(ck)
    assert torch.equal(state.model.delta_flat(), torch.zeros_like(state.model.delta_flat()))
    x = torch.randn(4, 40)
    assert torch.equal(state.model(x), state.model.base(x))
    reqs = store.requests(ck)
    assert [r["kind"] for r in reqs] == ["train", "forget", "forget_all"]
    assert reqs[2]["ids"] == [] and meta["user_weights_dropped"]
    assert not set(meta["forgotten_ids"]) & set(static["core_ids"])  # core samples are not listed as forgotten
    assert set(meta["forgotten_ids"]) == set(static["user_ids"]) - set(static["core_ids"])
    code, out = cli_inprocess("forget-all", ck)
    assert code == 0 and "already applied" in out
    code, out = cli_inprocess("forget", ck, "--ids", deletable(base_ckpt, 1, skip=5)[0])
    assert code == 2 and "forget-all" in out
    code, out = cli_inprocess("show", "--checkpoint", ck, "--json")
    assert code == 0 and json.loads(out)["valid"]


REQUEST_FIELDS = ("id", "kind", "ids", "n_ids", "sigma", "solver", "seconds", "time_utc", "sha256_before",
                  "sha256_after", "status")


def test_show_detects_a_broken_chain(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    assert cli_inprocess("forget", ck, "--ids", deletable(ck, 1)[0])[0] == 0
    code, out = cli_inprocess("show", ck)
    assert code == 0 and "hash chain: valid" in out
    con = sqlite3.connect(str(ck / store.DB))
    con.execute("UPDATE requests SET sha256_before = 'deadbeef' WHERE id = 1")
    con.commit()
    con.close()
    code, out = cli_inprocess("show", ck)
    assert code == 2 and "BROKEN" in out and "request #1: sha256_before" in out


def _to_legacy(src, dst):
    """The previous format (state.json + ledger.jsonl + weights-<seq>.safetensors) of checkpoint ``src``,
    with a torn last ledger line whose request only ``state.json`` records."""
    dst.mkdir()
    static, reqs = static_of(src), store.requests(src)
    st = store.load(src)[1]
    seq = reqs[-1]["id"]
    recs = [{"seq": r["id"], "kind": r["kind"], "key": r["key"], "time": r["time_utc"], "ids": r["ids"],
             "n_ids": r["n_ids"], "n_remaining": r["n_remaining"], "sigma": r["sigma"], "seconds": r["seconds"],
             "sha256_before": r["sha256_before"], "sha256_after": r["sha256_after"], **r["solver"]} for r in reqs]
    wname = f"weights-{seq:06d}.safetensors"
    shutil.copy(src / store.WEIGHTS / f"{st['weights_sha256']}.safetensors", dst / wname)
    # the ledger format's fingerprint covered the forget ids too
    fp_v1 = _fingerprint_v1(load_split(DataConfig.from_dict(static["data"])))
    meta = {**{k: v for k, v in static.items() if k != "format"}, "format": "scrubnet-mlforget/1", "seq": seq,
            "data_fingerprint": fp_v1,
            "weights_file": wname, "weights_sha256": st["weights_sha256"], "forgotten_ids": st["forgotten_ids"],
            "last_request": recs[-1]}
    (dst / "state.json").write_text(json.dumps(meta))
    lines = [json.dumps(r) for r in recs]
    (dst / "ledger.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])


def test_legacy_ledger_checkpoint_is_migrated_by_upgrade_only(base_ckpt, tmp_path):
    ck = tmp_path / "new"
    shutil.copytree(base_ckpt, ck)
    a, b = deletable(ck, 2, skip=0), deletable(ck, 2, skip=2)
    assert cli_inprocess("forget", ck, "--ids", json.dumps(a))[0] == 0
    old = tmp_path / "old"
    _to_legacy(ck, old)
    # reading it, or a request, is refused naming the command; nothing is written
    before = snapshot(old)
    code, out = cli_inprocess("show", old)
    assert code == 2 and f"scrubnet mlforget upgrade {old}" in out, out
    with pytest.raises(store.StoreError, match="scrubnet mlforget upgrade"):
        store.forget(old, b, data_loader=_data_loader)
    assert snapshot(old) == before and not (old / store.DB).exists()
    assert store.upgrade(old) == {"path": str(old), "from": store.LEGACY_FORMAT, "format": store.FORMAT,
                                  "upgraded": True}
    assert store.upgrade(old)["upgraded"] is False  # already current: left as it is
    code, out = cli_inprocess("show", old)
    assert code == 0 and "hash chain: valid" in out, out
    assert [r["kind"] for r in store.requests(old)] == ["train", "forget"]
    assert store.load(old)[1]["forgotten_ids"] == sorted(a)
    # it goes on exactly like the checkpoint it came from
    assert cli_inprocess("forget", old, "--ids", json.dumps(b))[0] == 0
    assert cli_inprocess("forget", ck, "--ids", json.dumps(b))[0] == 0
    assert store.load(old)[1]["weights_sha256"] == store.load(ck)[1]["weights_sha256"]
    broken = tmp_path / "broken"
    _to_legacy(ck, broken)
    (broken / "state.json").write_text((broken / "state.json").read_text().replace('"seq": 2', '"seq": 5'))
    with pytest.raises(store.StoreError, match="restore"):
        store.upgrade(broken)
    assert not (broken / store.DB).exists()


def test_train_refuses_existing_output_and_bad_options(base_ckpt, tmp_path):
    r = CliRunner().invoke(mlforget_app, ["train", "--out", str(base_ckpt)])
    assert r.exit_code == 2 and "already exists" in r.output
    r = CliRunner().invoke(mlforget_app, ["train", "--out", str(tmp_path / "new"), "--ml-options", '{"mu": -1}'])
    assert r.exit_code == 2 and "mu must be positive" in r.output
    assert not (tmp_path / "new").exists()
    r = CliRunner().invoke(mlforget_app, ["forget", str(tmp_path / "nothing"), "--ids", "1"])
    assert r.exit_code == 2 and "not found" in r.output


def test_non_finite_data_changes_nothing(base_ckpt, tmp_path):
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    x, y = _data_loader(static_of(ck))
    x = x.clone()
    x[deletable(ck, 1, skip=7)[0], 3] = float("nan")
    before = snapshot(ck)
    with pytest.raises(store.StoreError, match="non-finite"):
        store.forget(ck, deletable(ck, 2), x_all=x, y_all=y)
    assert snapshot(ck) == before


def _forget_twice(ck, ids_a, ids_b):
    infos = []
    for ids in (ids_a, ids_b):
        rec, applied = store.forget(ck, ids, sigma=0.0, data_loader=_data_loader)
        assert applied
        infos.append(rec["solver"])
    return store.load(ck)[0], infos


def test_persisted_factor_is_loaded_and_matches_a_rebuilt_one(base_ckpt, tmp_path):
    assert (base_ckpt / store.FACTOR).is_file()  # training used the dual and saved its factor
    with_file, without = tmp_path / "with", tmp_path / "without"
    shutil.copytree(base_ckpt, with_file)
    shutil.copytree(base_ckpt, without)
    (without / store.FACTOR).unlink()
    ids_a, ids_b = deletable(base_ckpt, 3), deletable(base_ckpt, 4, skip=3)
    loaded, info_l = _forget_twice(with_file, ids_a, ids_b)
    rebuilt, info_r = _forget_twice(without, ids_a, ids_b)
    for i in info_l:
        assert (i["factor_file"], i["factor_rebuilt"], i["factor_source"]) == ("loaded", "no", "file")
        assert i["factor_build_s"] == 0.0
    assert (info_r[0]["factor_file"], info_r[0]["factor_rebuilt"]) == ("absent", "missing")
    w_l, w_r = loaded.model.delta_flat(), rebuilt.model.delta_flat()
    scale = float(w_r.abs().max())
    torch.testing.assert_close(w_l, w_r, rtol=0, atol=1e-6 * scale)
    # both are the exact retrain on the remaining data (the dense dual from scratch, no factor)
    x, y = _data_loader(static_of(base_ckpt))
    w_hat = retrain_user_weights(loaded, x, y)
    torch.testing.assert_close(w_l, w_hat.to(w_l.dtype), rtol=0, atol=1e-5 * scale)
    assert store.verify(with_file)["valid"]


def test_factor_file_with_a_foreign_key_is_ignored(base_ckpt, tmp_path):
    ck, ref = tmp_path / "ck", tmp_path / "ref"
    shutil.copytree(base_ckpt, ck)
    shutil.copytree(base_ckpt, ref)
    (ref / store.FACTOR).unlink()
    data = (ck / store.FACTOR).read_bytes()
    factor, status, key, problem = store._read_factor(ck)
    assert status == "read" and len(key) == 64 and problem is None
    store._write_factor(ck, factor, "0" * 64)  # same tensors, a key of other weights / data / settings
    ids = deletable(base_ckpt, 3)
    rec, _ = store.forget(ck, ids, sigma=0.0, data_loader=_data_loader)
    assert (rec["solver"]["factor_file"], rec["solver"]["factor_rebuilt"]) == ("key mismatch", "missing")
    assert "key mismatch" in rec["solver"]["factor_file_problem"] and rec["solver"]["factor_file_rewritten"]
    rec_ref, _ = store.forget(ref, ids, sigma=0.0, data_loader=_data_loader)
    assert rec["sha256_after"] == rec_ref["sha256_after"]  # the same rebuild as with no file
    (ck / store.FACTOR).write_bytes(data[:100])  # a truncated file: ignored too
    rec, _ = store.forget(ck, deletable(base_ckpt, 2, skip=3), sigma=0.0, data_loader=_data_loader)
    assert (rec["solver"]["factor_file"], rec["solver"]["factor_rebuilt"]) == ("unreadable", "missing")


# -- the record chain: every field of every row is bound ---------------------------------------------------

def _edit(ck, sql, params=()):
    con = sqlite3.connect(str(ck / store.DB))
    try:
        con.execute(sql, params)
        con.commit()
    finally:
        con.close()


def _show_problems(ck):
    code, out = cli_inprocess("show", ck)
    return code, out


@pytest.fixture(scope="module")
def chained_ckpt(base_ckpt, tmp_path_factory):
    ck = tmp_path_factory.mktemp("chain") / "ckpt"
    shutil.copytree(base_ckpt, ck)
    store.forget(ck, deletable(ck, 2), sigma=1e-3, data_loader=_data_loader)
    return ck


def _altered(value):
    """A different value of the same JSON type."""
    v = json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value
    if isinstance(v, bool):
        return int(not v)
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, list):
        return json.dumps(v + [v[0] + 1000 if v and isinstance(v[0], int) else 1])
    if isinstance(v, dict):
        return json.dumps({**v, "forged": 1})
    if v is None:
        return "forged"
    return v[:-1] + ("0" if v[-1] != "0" else "1")


def test_show_names_an_edit_of_any_request_field(chained_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    assert _show_problems(ck)[0] == 0
    con = sqlite3.connect(str(ck / store.DB))
    rows = {r[0]: r for r in con.execute(f"SELECT {', '.join(store.REQUEST_COLUMNS)} FROM requests")}
    con.close()
    for rid in (0, 1):
        for col, value in zip(store.REQUEST_COLUMNS, rows[rid]):
            if col in ("id", "status"):
                continue  # the key of the row; status: the schema allows only 'applied'
            if col == "kind" and rid == 1:
                new = "forget_all"
            elif col == "kind":
                new = "forget"
            else:
                new = _altered(value)
            _edit(ck, f"UPDATE requests SET {col} = ? WHERE id = ?", (new, rid))
            code, out = _show_problems(ck)
            assert code == 2 and f"request #{rid}: field '{col}' was edited" in out, (rid, col, out)
            _edit(ck, f"UPDATE requests SET {col} = ? WHERE id = ?", (value, rid))
            assert _show_problems(ck)[0] == 0, (rid, col)
    # one figure inside the solver's dict
    solver = json.loads(rows[1][store.REQUEST_COLUMNS.index("solver")])
    _edit(ck, "UPDATE requests SET solver = ? WHERE id = 1",
          (json.dumps({**solver, "relative_residual": 1e-30}),))
    code, out = _show_problems(ck)
    assert code == 2 and "request #1: field 'solver' was edited" in out
    # the id column: renumbering breaks the sequence and the links
    _edit(ck, "UPDATE requests SET solver = ? WHERE id = 1", (rows[1][store.REQUEST_COLUMNS.index("solver")],))
    _edit(ck, "UPDATE state SET request_id = 0")
    _edit(ck, "UPDATE requests SET id = 5 WHERE id = 1")
    code, out = _show_problems(ck)
    assert code == 2 and "request #5: field 'id' was edited" in out and "state: field 'request_id'" in out


def test_show_names_an_edit_of_the_state_and_of_the_static_record(chained_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    con = sqlite3.connect(str(ck / store.DB))
    st = con.execute("SELECT request_id, weights_sha256, forgotten_ids, user_weights_dropped FROM state").fetchone()
    static = dict(con.execute("SELECT key, value FROM checkpoint"))
    con.close()
    for col, value in zip(("request_id", "weights_sha256", "forgotten_ids", "user_weights_dropped"), st):
        _edit(ck, f"UPDATE state SET {col} = ?", (_altered(value),))
        code, out = _show_problems(ck)
        assert code == 2 and f"state: field '{col}' was edited" in out, (col, out)
        _edit(ck, f"UPDATE state SET {col} = ?", (value,))
    assert _show_problems(ck)[0] == 0
    assert {"core_ids", "user_ids", "ml_config", "data_fingerprint", "data", "seed"} <= set(static)
    for key, value in static.items():
        if key == store.SEAL_KEY:
            continue
        v = json.loads(value)
        new = json.dumps(v + [max(v) + 1] if isinstance(v, list) else _altered(v) if not isinstance(v, dict)
                         else {**v, "forged": 1})
        _edit(ck, "UPDATE checkpoint SET value = ? WHERE key = ?", (new, key))
        code, out = _show_problems(ck)
        if key == "format":
            assert code == 2 and "is not a scrubnet-mlforget/3 store" in out
        else:
            assert code == 2 and f"checkpoint record: field '{key}' was edited" in out, (key, out)
        _edit(ck, "UPDATE checkpoint SET value = ? WHERE key = ?", (value, key))
    _edit(ck, "INSERT INTO checkpoint (key, value) VALUES ('extra', '1')")
    code, out = _show_problems(ck)
    assert code == 2 and "checkpoint record: field 'extra' was added" in out
    _edit(ck, "DELETE FROM checkpoint WHERE key = 'extra'")
    # an edit of a stored digest (with the field left alone) breaks the link
    con = sqlite3.connect(str(ck / store.DB))
    d = json.loads(con.execute("SELECT digests FROM requests WHERE id = 1").fetchone()[0])
    con.close()
    _edit(ck, "UPDATE requests SET digests = ? WHERE id = 1", (json.dumps({**d, "sigma": "0" * 64}),))
    code, out = _show_problems(ck)
    assert code == 2 and "request #1: field 'sigma' was edited" in out and "request #1: its chain hash" in out


def test_the_forgery_of_the_issue_is_detected(chained_ckpt, tmp_path):
    """Claiming that request #1 deleted another sample: its ids and the state's forgotten ids edited
    together, consistently, so the old checks (weights chain, union of ids) pass."""
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    other = deletable(ck, 1, skip=10)
    ids = store.requests(ck)[1]["ids"]
    forged = sorted([other[0]] + ids[1:])
    _edit(ck, "UPDATE requests SET ids = ? WHERE id = 1", (json.dumps(forged),))
    _edit(ck, "UPDATE state SET forgotten_ids = ?", (json.dumps(forged),))
    code, out = _show_problems(ck)
    assert code == 2 and "request #1: field 'ids' was edited" in out and "state: field 'forgotten_ids'" in out


def _to_unsealed(ck):
    """The previous store format: the same tables without the chain columns, the seal or the queue."""
    con = sqlite3.connect(str(ck / store.DB))
    for table in ("requests", "state"):
        for col in ("digests", "hash"):
            con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    con.execute("DROP TABLE submissions")
    con.execute("DELETE FROM checkpoint WHERE key = ?", (store.SEAL_KEY,))
    con.execute("UPDATE checkpoint SET value = ? WHERE key = 'format'", (json.dumps(store.FORMAT_UNSEALED),))
    con.commit()
    con.close()


def test_a_store_of_the_previous_format_is_sealed_by_upgrade_only(chained_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    _to_unsealed(ck)
    before = snapshot(ck)
    code, out = _show_problems(ck)
    assert code == 2 and f"scrubnet mlforget upgrade {ck}" in out and "scrubnet-mlforget/2" in out, out
    with pytest.raises(store.StoreError, match="scrubnet mlforget upgrade"):
        store.forget(ck, deletable(ck, 1, skip=12), data_loader=_data_loader)
    assert snapshot(ck) == before and static_of(ck)["format"] == store.FORMAT_UNSEALED
    code, out = cli_inprocess("upgrade", ck)  # the command the refusal names
    assert code == 0 and f"upgraded {ck} from {store.FORMAT_UNSEALED} to {store.FORMAT}" in out, out
    assert "sealed as it stood" in static_of(ck)["sealed_from"]
    code, out = cli_inprocess("upgrade", ck)
    assert code == 0 and "already" in out and "nothing done" in out, out
    sealed = (ck / store.DB).read_bytes()
    assert store.upgrade(ck)["upgraded"] is False and (ck / store.DB).read_bytes() == sealed
    code, out = _show_problems(ck)
    assert code == 0 and "hash chain: valid" in out, out
    assert store.forget(ck, deletable(ck, 1, skip=12), data_loader=_data_loader)[1]
    _edit(ck, "UPDATE requests SET sigma = 5 WHERE id = 1")
    assert "request #1: field 'sigma' was edited" in _show_problems(ck)[1]
    # an inconsistent store of the previous format is refused, not sealed
    bad = tmp_path / "bad"
    shutil.copytree(chained_ckpt, bad)
    _to_unsealed(bad)
    _edit(bad, "UPDATE requests SET sha256_before = 'deadbeef' WHERE id = 1")
    with pytest.raises(store.StoreError, match="cannot be sealed.*request #1: sha256_before"):
        store.upgrade(bad)
    assert static_of(bad)["format"] == store.FORMAT_UNSEALED


def _db_fingerprint(ck):
    """(sha256, mtime in ns) of the database file."""
    db = ck / store.DB
    return hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns


@pytest.mark.parametrize("fmt", ["current", "unsealed"])
def test_verify_and_show_never_write_the_database(chained_ckpt, tmp_path, fmt):
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    if fmt == "unsealed":
        _to_unsealed(ck)
    # an old mtime: a write, however quick, would move it
    os.utime(ck / store.DB, ns=(1_000_000_000 * 10**9, 1_000_000_000 * 10**9))
    before, files = _db_fingerprint(ck), snapshot(ck)
    if fmt == "current":
        assert store.verify(ck)["valid"] and len(store.requests(ck)) == 2 and store.load(ck)[1]["request_id"] == 1
        assert _show_problems(ck)[0] == 0
    else:
        for read in (store.verify, store.requests, store.load, store.state_record):
            with pytest.raises(store.StoreError, match="run `scrubnet mlforget upgrade"):
                read(ck)
        assert _show_problems(ck)[0] == 2
    assert _db_fingerprint(ck) == before and snapshot(ck) == files


def test_upgrade_of_a_current_store_changes_nothing_and_bad_paths_are_refused(chained_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(chained_ckpt, ck)
    before = snapshot(ck)
    assert store.upgrade(ck) == {"path": str(ck), "from": store.FORMAT, "format": store.FORMAT, "upgraded": False}
    assert snapshot(ck) == before
    with pytest.raises(store.StoreError, match="not found"):
        store.upgrade(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(store.StoreError, match="not an ML checkpoint"):
        store.upgrade(tmp_path / "empty")
    _edit(ck, "UPDATE checkpoint SET value = ? WHERE key = 'format'", (json.dumps("scrubnet-mlforget/9"),))
    with pytest.raises(store.StoreError, match="cannot be upgraded"):
        store.upgrade(ck)


def test_primal_factor_is_saved_verified_loaded_and_exact(tmp_path):
    """A head-linearised checkpoint trains in the primal, saves primal.safetensors (content-hashed), and its
    requests load it; a corrupted file is ignored (rebuilt) with the same weights."""
    ck = tmp_path / "primal"
    code, out = cli_inprocess("train", "--out", ck, "--data-options", DATA, "--train-options", TRAIN,
                              "--model-options", '{"hidden": 16}',
                              "--ml-options", '{"linearize": ["head"], "solver": "primal"}')
    assert code == 0, out
    assert (ck / store.PRIMAL).is_file() and not (ck / store.FACTOR).exists()
    assert store.requests(ck)[0]["solver"]["train_solver"] == "primal"
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    data = bytearray((bad / store.PRIMAL).read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the tensors: the content hash no longer matches
    (bad / store.PRIMAL).write_bytes(bytes(data))
    ids = deletable(ck, 3)
    rec, _ = store.forget(ck, ids, sigma=0.0, data_loader=_data_loader)
    assert (rec["solver"]["solver"], rec["solver"]["primal_file"], rec["solver"]["factor_source"]) == \
        ("primal", "loaded", "file")
    assert rec["solver"]["certificate"]["solve_error_bound"] < 1e-8  # float32 rounding excluded
    rec_bad, _ = store.forget(bad, ids, sigma=0.0, data_loader=_data_loader)
    assert (rec_bad["solver"]["primal_file"], rec_bad["solver"]["factor_rebuilt"]) == ("unreadable", "missing")
    state = store.load(ck)[0]
    x, y = _data_loader(static_of(ck))
    w_hat = retrain_user_weights(state, x, y)
    w = state.model.delta_flat()
    torch.testing.assert_close(w.double(), w_hat.double(), rtol=0, atol=1e-5 * float(w_hat.abs().max()))
    torch.testing.assert_close(store.load(bad)[0].model.delta_flat(), w, rtol=0, atol=1e-6 * float(w.abs().max()))


def test_certified_request_through_the_cli_records_its_certificate(base_ckpt, tmp_path):
    """--budget-nats on a CG checkpoint: the request stops at a proven KL bound and the store keeps it."""
    ck = tmp_path / "cg"
    code, out = cli_inprocess("train", "--out", ck, "--data-options", DATA, "--train-options", TRAIN,
                              "--model-options", '{"hidden": 16}',
                              "--ml-options", '{"solver": "cg", "sigma": 0.01, "precond": "none"}')
    assert code == 0, out
    ids = deletable(ck, 2)
    code, out = cli_inprocess("forget", ck, "--ids", ",".join(map(str, ids)), "--budget-nats", "0.1")
    assert code == 0, out
    assert "certificate: KL(scrubbed ‖ retrained) ≤" in out
    cert = store.requests(ck)[-1]["solver"]["certificate"]
    assert cert["within_budget"] and cert["kl_bound_nats"] <= 0.1 and cert["sigma"] == 0.01
    code, out = cli_inprocess("forget", ck, "--ids", str(deletable(ck, 1, skip=5)[0]), "--budget-nats", "-1")
    assert code == 2 and "error: --budget-nats" in out

@pytest.mark.parametrize("damage,reason", [("flip", "hash mismatch"), ("truncate", "truncated"),
                                           ("fill_7f", "hash mismatch")])
def test_damaged_factor_file_is_named_rebuilt_and_rewritten(base_ckpt, tmp_path, damage, reason):
    import corrupt
    ck, ref = tmp_path / "ck", tmp_path / "ref"
    shutil.copytree(base_ckpt, ck)
    shutil.copytree(base_ckpt, ref)
    (ref / store.FACTOR).unlink()
    {"flip": lambda p: corrupt.flip_exponent_bits(p, 2000), "truncate": lambda p: corrupt.truncate(p, 5000),
     "fill_7f": corrupt.fill_7f}[damage](ck / store.FACTOR)
    ids = deletable(base_ckpt, 3)
    code, out = cli_inprocess("forget", ck, "--ids", ",".join(map(str, ids)), "--sigma", "0")
    assert code == 0, out
    assert f"warning: {ck / store.FACTOR}: {reason}" in out and "rebuilt from the data and the file rewritten" in out
    rec = store.requests(ck)[-1]
    assert rec["solver"]["factor_file"] == "unreadable" and rec["solver"]["factor_file_rewritten"] is True
    assert reason in rec["solver"]["factor_file_problem"]
    rec_ref, _ = store.forget(ref, ids, sigma=0.0, data_loader=_data_loader)
    assert rec["sha256_after"] == rec_ref["sha256_after"]  # exactly the rebuild with no file
    assert store._read_factor(ck)[1] == "read"  # the rewritten file verifies, and the next request loads it
    rec2, _ = store.forget(ck, deletable(base_ckpt, 2, skip=3), sigma=0.0, data_loader=_data_loader)
    assert rec2["solver"]["factor_file"] == "loaded" and rec2["solver"]["relative_residual"] < 1e-10


def test_a_verified_factor_that_solves_badly_is_rebuilt(base_ckpt, tmp_path):
    """A factor file whose hash is intact but whose content is wrong (rewritten with a valid hash and key)
    gives a residual above the tolerance: the request rebuilds it instead of committing the bad solve."""
    ck, ref = tmp_path / "ck", tmp_path / "ref"
    shutil.copytree(base_ckpt, ck)
    shutil.copytree(base_ckpt, ref)
    (ref / store.FACTOR).unlink()
    factor, _, key, _ = store._read_factor(ck)
    factor.eigvecs[:, :50] *= 1.5
    store._write_factor(ck, factor, key)
    ids = deletable(base_ckpt, 3)
    rec, _ = store.forget(ck, ids, sigma=0.0, data_loader=_data_loader)
    assert rec["solver"]["factor_file"] == "bad solve" and "exceeds its tolerance" in rec["solver"]["factor_file_problem"]
    assert rec["solver"]["relative_residual"] < store.DUAL_RESIDUAL_TOL
    assert rec["sha256_after"] == store.forget(ref, ids, sigma=0.0, data_loader=_data_loader)[0]["sha256_after"]


def test_a_request_above_its_residual_tolerance_is_never_committed(base_ckpt, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    shutil.copytree(base_ckpt, ck)
    before = snapshot(ck)
    monkeypatch.setattr(store.apply, "DUAL_RESIDUAL_TOL", 0.0)  # no solve can meet it
    with pytest.raises(store.StoreError, match="nothing was committed: the dual solver's relative residual"):
        store.forget(ck, deletable(base_ckpt, 3), sigma=0.0, data_loader=_data_loader)
    assert store.verify(ck)["valid"] and len(store.requests(ck)) == 1
    after = snapshot(ck)
    assert {k: v for k, v in after.items() if k != store.FACTOR} == {k: v for k, v in before.items()
                                                                      if k != store.FACTOR}
    assert store.solver_result_problem({"solver": "cg", "converged": False, "iterations": 9,
                                        "relative_residual": 0.1})
    assert store.solver_result_problem({"solver": "cg", "converged": True, "relative_residual": 1e-9}) is None
